#!/usr/bin/env bash
# perftest over the libibverbs-compatible library against tbrdma's own tools, in the same run,
# between two network namespaces joined by a veth pair (MTU 65520).
#
#   cargo build --release -p tbrdma-ibverbs -p tbrdma-cli
#   sudo scripts/ibverbs-bench.sh [ROUNDS] [LAT_ITERS] [BW_ITERS]
#
# A bandwidth run moves at least BW_MIN_BYTES (default 400 MiB): at 4 KiB, 20000 messages
# last about 0.15 s, which the start of a run and the 2-core machine's scheduling dominate
# (per-run ratios 0.5-1.2 at 20000, steadier from 100000).
#
# Per size and round: ib_write_lat, ib_send_lat and ib_write_bw (Debian's perftest,
# unmodified, over target/release/libibverbs.so) against `tbrdma pingpong` / `tbrdma bw` with
# the same operation and engine (ENGINE, default `packet`, the library's; or `sockets`), in
# both of tbrdma's progress modes: its default
# (caller: the measuring thread runs the engine) and `--progress thread` (an engine thread per
# process, as the library always has). Rounds interleave the systems so that the machine's
# drift hits all of them. Prints one line per measurement and, per size, the median over the
# rounds of the ratio library / tbrdma tool, for each mode. The library's environment
# (TBRDMA_IBV_ASSIST, TBRDMA_IBV_SPIN_US; docs/ibverbs.md) is passed through.
set -euo pipefail
cd "$(dirname "$0")/.."
ROUNDS=${1:-3}
LAT_ITERS=${2:-2000}
BW_ITERS=${3:-2000}
BW_MIN_BYTES=${BW_MIN_BYTES:-$((400 << 20))}
ENGINE=${ENGINE:-packet}
LIB_SO=target/release/libibverbs.so
TBRDMA=target/release/tbrdma
for f in "$LIB_SO" "$TBRDMA"; do
    [[ -x $f || -f $f ]] || { echo "build first: cargo build --release -p tbrdma-ibverbs -p tbrdma-cli ($f)"; exit 1; }
done
command -v ib_write_lat >/dev/null || { echo "perftest is not installed (apt-get install perftest)"; exit 1; }

A=ibvbench-a-$$ B=ibvbench-b-$$ IFA=ibvba$$ IFB=ibvbb$$
IFA=${IFA:0:15} IFB=${IFB:0:15}
LIB=$(mktemp -d)
cleanup() { ip netns del "$A" 2>/dev/null || true; ip netns del "$B" 2>/dev/null || true; rm -rf "$LIB"; }
trap cleanup EXIT INT TERM
ln -s "$PWD/$LIB_SO" "$LIB/libibverbs.so.1"
ip netns add "$A"; ip netns add "$B"
ip link add "$IFA" type veth peer name "$IFB"
ip link set "$IFA" netns "$A"; ip link set "$IFB" netns "$B"
ip -n "$A" addr add 10.99.0.1/30 dev "$IFA"; ip -n "$B" addr add 10.99.0.2/30 dev "$IFB"
for ns in "$A" "$B"; do ip -n "$ns" link set lo up; done
ip -n "$A" link set "$IFA" mtu 65520 up; ip -n "$B" link set "$IFB" mtu 65520 up

PORT=19000
verbs() { # ns interface tool args...
    local ns=$1 ifc=$2; shift 2
    ip netns exec "$ns" env LD_LIBRARY_PATH="$LIB" TBRDMA_IBV_DEVICES="$ifc" TBRDMA_IBV_ENGINE="$ENGINE" \
        timeout 300 "$@" -d "tbrdma_$ifc"
}
wait_port() { # ns port
    local hex; hex=$(printf ':%04X 00000000:0000 0A' "$1")
    until ip netns exec "$2" cat /proc/net/tcp | grep -q "$hex"; do sleep 0.02; done
}
# field N (0-based) of the result row whose first two fields are SIZE ITERS
row_field() { awk -v s="$1" -v n="$2" -v f="$3" '$1==s && $2==n && $3 ~ /^[0-9.]+$/ {print $(f+1); exit}'; }

run_perftest() { # tool size iters field
    PORT=$((PORT + 1))
    verbs "$A" "$IFA" "$1" -s "$2" -n "$3" -p "$PORT" >/dev/null 2>&1 &
    local srv=$!
    wait_port "$PORT" "$A"
    verbs "$B" "$IFB" "$1" -s "$2" -n "$3" -p "$PORT" 10.99.0.1 2>&1 | row_field "$2" "$3" "$4"
    wait "$srv"
}
run_tbrdma() { # pingpong|bw op size iters field progress
    PORT=$((PORT + 1))
    ip netns exec "$A" timeout 300 "$TBRDMA" "$1" --op "$2" --size "$3" --iters "$4" \
        --port "$PORT" --engine "$ENGINE" --progress "$6" >/dev/null 2>&1 &
    local srv=$!
    wait_port "$PORT" "$A"
    ip netns exec "$B" timeout 300 "$TBRDMA" "$1" 10.99.0.1 --op "$2" --size "$3" --iters "$4" \
        --port "$PORT" --engine "$ENGINE" --progress "$6" 2>&1 | row_field "$3" "$4" "$5"
    wait "$srv"
}
ratio() { awk -v a="$1" -v b="$2" 'BEGIN{ if (a > 0 && b > 0) printf "%.3f ", a/b }'; }

echo "engine $ENGINE; load average before: $(cut -d' ' -f1-3 /proc/loadavg)"
declare -A ratios
for round in $(seq "$ROUNDS"); do
    for op in write send; do
        for size in 2 64 4096 65536; do
            a=$(run_perftest "ib_${op}_lat" "$size" "$LAT_ITERS" 4)
            c=$(run_tbrdma pingpong "$op" "$size" "$LAT_ITERS" 4 caller)
            t=$(run_tbrdma pingpong "$op" "$size" "$LAT_ITERS" 4 thread)
            echo "round $round lat $op $size B: ib_${op}_lat t_typical $a us, tbrdma pingpong $c us (caller), $t us (thread)"
            ratios[lat-$op-$size-caller]+=$(ratio "$a" "$c")
            ratios[lat-$op-$size-thread]+=$(ratio "$a" "$t")
        done
    done
    for size in 4096 65536 1048576; do
        n=$(( BW_MIN_BYTES / size > BW_ITERS ? BW_MIN_BYTES / size : BW_ITERS ))
        a=$(run_perftest ib_write_bw "$size" "$n" 3)
        c=$(run_tbrdma bw write "$size" "$n" 3 caller)
        t=$(run_tbrdma bw write "$size" "$n" 3 thread)
        echo "round $round bw write $size B ($n messages): ib_write_bw avg $a MB/s, tbrdma bw $c MiB/s (caller), $t MiB/s (thread)"
        ratios[bw-write-$size-caller]+=$(ratio "$a" "$c")
        ratios[bw-write-$size-thread]+=$(ratio "$a" "$t")
    done
done
echo "load average after: $(cut -d' ' -f1-3 /proc/loadavg)"
# (of an even count, the mean of the middle two)
median() { tr ' ' '\n' | grep . | sort -g | awk '{v[NR]=$1} END{m=int((NR+1)/2); if (NR % 2) print v[m]; else printf "%.3f\n", (v[m]+v[m+1])/2}'; }
for k in $(printf '%s\n' "${!ratios[@]}" | sort -t- -k1,1 -k2,2 -k3,3n -k4,4); do
    echo "median ratio $k (library / tbrdma tool): $(echo "${ratios[$k]}" | median)   [${ratios[$k]}]"
done
