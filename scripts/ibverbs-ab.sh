#!/usr/bin/env bash
# Alternating A/B of perftest's latency over two (or more) builds of the libibverbs-compatible
# library, e.g. a plain and a profile-guided one, or over one build on two engines.
#
#   cargo build --release -p tbrdma-ibverbs -p tbrdma-cli      # and: sudo scripts/pgo.sh
#   sudo scripts/ibverbs-ab.sh ROUNDS ITERS SIZE TOOL LIB_A LIB_B [LIB...]
#   sudo scripts/ibverbs-ab.sh 16 10000 8 ib_write_lat target/release/libibverbs.so \
#        target/pgo/release/libibverbs.so
#   sudo scripts/ibverbs-ab.sh 16 10000 8 ib_write_lat target/release/libibverbs.so@sockets \
#        target/release/libibverbs.so@packet
#
# A LIB of the form PATH@ENGINE runs that build with TBRDMA_IBV_ENGINE=ENGINE.
# TOOL is a perftest latency tool (ib_write_lat, ib_send_lat, ib_read_lat) or bandwidth tool
# (ib_write_bw, ...; its average and peak in MB/s take the place of t_typical and t_avg, and
# "faster" means a higher figure), unmodified. It runs
# in a two-namespace lab over one veth cable (server on CPU 1, client on CPU 0), taken down at
# the end. Every round runs TOOL once per build, the builds' order reversed every other round,
# so that the host's drift hits all of them alike. Prints each run (round, build, t_typical and
# t_avg in µs, perftest's one-way figures), then per build the medians over the rounds and the
# median of its per-round ratio to the first build, with the rounds it was faster in. The
# library's environment (TBRDMA_IBV_ENGINE, …; docs/ibverbs.md) is passed through.
set -euo pipefail
cd "$(dirname "$0")/.."
(($# >= 6)) || { sed -n 5,8p "$0" >&2; exit 2; }
rounds=$1 iters=$2 size=$3 tool=$4
shift 4
libs=("$@")
tbrdma=${TBRDMA:-target/release/tbrdma}
[[ $(id -u) == 0 ]] || { echo "ibverbs-ab.sh: needs root (network namespaces)" >&2; exit 1; }
command -v "$tool" >/dev/null || { echo "ibverbs-ab.sh: $tool not found (apt-get install perftest)" >&2; exit 1; }
. scripts/lib/verbs-lab.sh

lab=ibab$$
dirs=()
runs=$(mktemp)
cleanup() {
    "$tbrdma" lab down --name "$lab" >/dev/null 2>&1 || true
    rm -rf "${dirs[@]}" "$runs"
}
trap cleanup EXIT INT TERM
engines=()
for lib in "${libs[@]}"; do
    dirs+=("$(verbs_lib_dir "${lib%@*}")")
    if [[ $lib == *@* ]]; then engines+=("TBRDMA_IBV_ENGINE=${lib##*@}"); else engines+=(""); fi
done
"$tbrdma" lab up 2 --topology pair --name "$lab" >/dev/null
server=$(ip -n "tbl-$lab-r0" -4 -o addr show scope global | awk '{print $4}' | cut -d/ -f1 | head -n 1)
port=19600
bw=0
[[ $tool == *_bw ]] && bw=1
for round in $(seq "$rounds"); do
    order=$(seq 0 $((${#libs[@]} - 1)))
    ((round % 2)) || order=$(tac <<<"$order")
    for b in $order; do
        port=$((port + 1))
        verbs "tbl-$lab-r0" "${dirs[b]}" env ${engines[b]} taskset -c 1 "$tool" -s "$size" \
            -n "$iters" -p "$port" >/dev/null 2>&1 &
        wait_tcp_port "tbl-$lab-r0" "$port"
        # perftest's result row: bytes, iterations, t_min, t_max, t_typical, t_avg, ...
        # (a bandwidth tool's: bytes, iterations, peak, average, message rate)
        figures=$(verbs "tbl-$lab-r1" "${dirs[b]}" env ${engines[b]} taskset -c 0 "$tool" \
            -s "$size" -n "$iters" -p "$port" "$server" 2>&1 |
            awk -v s="$size" -v n="$iters" -v bw="$bw" '$1 == s && $2 == n && $3 ~ /^[0-9.]+$/ {
                if (bw) print $4, $3; else print $5, $6; exit }')
        wait || true
        echo "$round $b ${figures:-failed}" | tee -a "$runs"
    done
done
python3 - "$runs" "$bw" "${libs[@]}" <<'PY'
import collections, statistics, sys
runs, bw, libs = sys.argv[1], sys.argv[2] == "1", sys.argv[3:]
first, second, unit = ("average", "peak", "MB/s") if bw else ("t_typical", "t_avg", "µs")
by_round = collections.defaultdict(dict)
for line in open(runs):
    parts = line.split()
    if len(parts) == 4:
        by_round[int(parts[0])][int(parts[1])] = (float(parts[2]), float(parts[3]))
for b, lib in enumerate(libs):
    rows = [r for r in by_round.values() if b in r and 0 in r]
    if not rows:
        print(f"{lib}: no run completed")
        continue
    ratios = [r[b][0] / r[0][0] for r in rows]
    faster = sum((x > 1) if bw else (x < 1) for x in ratios)
    print(f"{lib}: {first} {statistics.median(r[b][0] for r in rows):.2f} {unit}, "
          f"{second} {statistics.median(r[b][1] for r in rows):.2f} {unit}, ratio to the first "
          f"{statistics.median(ratios):.3f} (faster in {faster} of {len(ratios)} rounds)")
PY
