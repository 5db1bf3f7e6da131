#!/usr/bin/env bash
# User-space instructions one side of `tbrdma pingpong` executes per round trip, counted by
# callgrind: exact where this project's 2-vCPU hosts cannot resolve a few percent of wall clock.
#
#   cargo build --release -p tbrdma-cli
#   sudo scripts/instructions-per-round-trip.sh [ENGINE] [SIZE] [client|server] [TBRDMA]
#
# ENGINE sockets (default) or packet, SIZE in bytes (default 8), the side measured (default
# client) and the binary (default target/release/tbrdma; pass another build to compare). The
# measured side runs under callgrind, its peer natively, in a two-namespace lab over one veth
# cable (server on CPU 1, client on CPU 0), taken down at the end. One run of 5000 round trips
# and three of 15000: the figure is (I(15000) - I(5000)) / 10000, the least of the three, since
# the polls that spin while a reply is on its way only add (they vary ±150 between runs).
#
# Environment: OP=write|send picks pingpong's operation (default: the CLI's); CACHE_SIM=1 runs
# callgrind's cache simulation (this host's L1 sizes) and also prints the L1 instruction-cache
# misses per round trip of the same runs (docs/performance.md, "the hot path does not stay in
# the instruction cache").
set -euo pipefail
ENGINE=${1:-sockets}
SIZE=${2:-8}
SIDE=${3:-client}
cd "$(dirname "$0")/.."
TBRDMA=$(realpath "${4:-target/release/tbrdma}")
command -v valgrind >/dev/null || { echo "needs valgrind (apt-get install valgrind)"; exit 1; }
[[ -x $TBRDMA ]] || { echo "build first: cargo build --release -p tbrdma-cli"; exit 1; }
LAB=ipr$$
WORK=$(mktemp -d)
trap '"$TBRDMA" lab down --name "$LAB" >/dev/null 2>&1 || true; rm -rf "$WORK"' EXIT
"$TBRDMA" lab up 2 --topology pair --name "$LAB" >/dev/null
SERVER_IP=$(ip -n "tbl-$LAB-r0" -4 -o addr show scope global | awk '{print $4}' | cut -d/ -f1 | head -1)

# Instructions of the measured side for N round trips.
count() {
    local n=$1 out=$WORK/cg.$1.$RANDOM
    local grind=(valgrind --tool=callgrind --callgrind-out-file="$out")
    [[ ${CACHE_SIM:-0} == 1 ]] && grind+=(--cache-sim=yes)
    local common=(pingpong --engine "$ENGINE" -s "$SIZE" -n "$n" --warmup 100)
    [[ -n ${OP:-} ]] && common+=(--op "$OP")
    if [[ $SIDE == client ]]; then
        ip netns exec "tbl-$LAB-r0" taskset -c 1 "$TBRDMA" "${common[@]}" --bind "$SERVER_IP" >/dev/null 2>&1 &
        sleep 0.3
        ip netns exec "tbl-$LAB-r1" taskset -c 0 "${grind[@]}" "$TBRDMA" "${common[@]}" "$SERVER_IP" >/dev/null 2>&1
    else
        ip netns exec "tbl-$LAB-r0" taskset -c 1 "${grind[@]}" "$TBRDMA" "${common[@]}" --bind "$SERVER_IP" >/dev/null 2>&1 &
        sleep 2
        ip netns exec "tbl-$LAB-r1" taskset -c 0 "$TBRDMA" "${common[@]}" "$SERVER_IP" >/dev/null 2>&1
    fi
    wait
    # Instructions, then (with the cache simulation) L1 instruction-cache misses: fields 2
    # and 5 of the totals (Ir Dr Dw I1mr …).
    awk '/^(summary|totals):/ {print $2, ($5 == "" ? 0 : $5); exit}' "$out"
}

read -r short short_misses < <(count 5000)
best=
runs=()
for _ in 1 2 3; do
    read -r long long_misses < <(count 15000)
    per=$(((long - short) / 10000))
    runs+=("$per")
    if [[ -z $best || $per -lt $best ]]; then
        best=$per
        best_misses=$(((long_misses - short_misses) / 10000))
    fi
done
echo "$ENGINE $SIZE B $SIDE${OP:+ $OP}: $best instructions per round trip (runs: ${runs[*]}; $TBRDMA)"
if [[ ${CACHE_SIM:-0} == 1 ]]; then
    echo "  L1 instruction-cache misses per round trip in that run: $best_misses"
fi
