# perftest over the libibverbs-compatible library, in a lab made by `tbrdma lab up` (network
# namespaces whose one global IPv4 interface is their cable). Sourced by scripts/pgo.sh and
# scripts/ibverbs-ab.sh; defines:
#
#   verbs_lib_dir SO                a new temporary folder holding SO as libibverbs.so.1 (printed)
#   verbs NS LIBDIR TOOL ARGS...    TOOL run in NS over the library in LIBDIR, on NS's cable
#                                   (the library's device for it: tbrdma_<interface>)
#   wait_tcp_port NS PORT           returns once something listens on TCP PORT in NS, or after
#                                   10 s (perftest's client does not retry its connect)

verbs_lib_dir() {
    local dir
    dir=$(mktemp -d)
    ln -s "$(realpath "$1")" "$dir/libibverbs.so.1"
    echo "$dir"
}

verbs() {
    local ns=$1 libdir=$2 ifc
    shift 2
    ifc=$(ip -n "$ns" -4 -o addr show scope global | awk '{print $2}' | head -n 1)
    ip netns exec "$ns" env LD_LIBRARY_PATH="$libdir" TBRDMA_IBV_DEVICES="$ifc" \
        timeout 120 "$@" -d "tbrdma_$ifc"
}

wait_tcp_port() {
    local listening tries=200
    listening=$(printf ':%04X 00000000:0000 0A' "$2")
    until ip netns exec "$1" cat /proc/net/tcp | grep -q "$listening"; do
        ((--tries > 0)) || return 0
        sleep 0.05
    done
}
