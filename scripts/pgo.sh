#!/usr/bin/env bash
# Profile-guided release build of everything users run: the tbrdma CLI, the C API, the NCCL/RCCL
# plugin, the libibverbs-compatible library, and the benchmarks that measure them (linkbench,
# collbench, pluginbench), into target/pgo/release/ (PGO_TARGET_DIR moves it).
#
#   rustup component add llvm-tools      # once: llvm-profdata of this toolchain
#   sudo scripts/pgo.sh                  # about 8 minutes on 2 cores (two fat-LTO builds)
#   sudo target/pgo/release/linkbench    # the figures a release build gives
#
# Three steps. (1) An instrumented release build (-Cprofile-generate) in target/pgo/gen. (2) It
# runs what users run, in a lab of two network namespaces joined by one veth cable (hence root),
# taken down at the end: `tbrdma pingpong --paired-with floor` (WRITE and SEND, packet and
# sockets engines, 8 B to 64 KiB, each beside its floor), `tbrdma bw`, and perftest's
# `ib_write_lat` and `ib_send_lat` over the library when perftest is installed; then, in labs
# of their own, collbench (`tbrdma allreduce` on two and four ranks with its baselines),
# linkbench (every engine with its floors) and pluginbench (the plugin between two processes).
# (3) The counts, merged by llvm-profdata, steer the real build (-Cprofile-use): which branches
# fall through, what is inlined, which code sits together. The path of a message is fetched
# afresh on every message, and the steered build takes 60 % fewer jumps and calls on it
# (docs/performance.md, "Code layout without a profile"): on the lab's veth the ping-pongs'
# ratios to their floors fell by about a tenth (docs/performance.md, issue 16).
#
# Code the training never ran is not optimised for size (-pgso=false), so a
# path it missed is no slower than in a plain release build. The profile belongs to the
# toolchain and the source it was made with: the script makes a new one every time.
set -euo pipefail
cd "$(dirname "$0")/.."
[[ $(id -u) == 0 ]] || { echo "pgo.sh: trains in a lab of network namespaces: run it as root" >&2; exit 1; }
sysroot=$(rustc --print sysroot)
host=$(rustc -vV | sed -n 's/^host: //p')
profdata=$sysroot/lib/rustlib/$host/bin/llvm-profdata
[[ -x $profdata ]] || { echo "pgo.sh: needs $profdata: rustup component add llvm-tools" >&2; exit 1; }

out=$(realpath -m "${PGO_TARGET_DIR:-target/pgo}")
gen=$out/gen
profiles=$out/profiles
packages=(-p tbrdma-cli -p tbrdma-capi -p tbrdma-nccl -p tbrdma-ibverbs -p tbrdma-benches)
base_flags=${RUSTFLAGS:-}

echo "pgo.sh: 1/3 instrumented build in $gen" >&2
rm -rf "$profiles"
mkdir -p "$profiles"
RUSTFLAGS="$base_flags -Cprofile-generate=$profiles" CARGO_TARGET_DIR=$gen \
    cargo build --release --locked "${packages[@]}"

echo "pgo.sh: 2/3 training in a lab" >&2
bin=$gen/release
lab=pgo$$
trap '"$bin/tbrdma" lab down --name "$lab" >/dev/null 2>&1 || true' EXIT
"$bin/tbrdma" lab up 2 --topology pair --name "$lab" >/dev/null
server=$(ip -n "tbl-$lab-r0" -4 -o addr show scope global | awk '{print $4}' | cut -d/ -f1 | head -n 1)
port=19700
# Server in rank 0 on CPU 1, client in rank 1 on CPU 0, as the benchmarks run them; the
# client's options are the server's (the tools refuse a mismatch).
pair() {
    local tool=$1
    shift
    port=$((port + 1))
    ip netns exec "tbl-$lab-r0" taskset -c 1 "$bin/tbrdma" "$tool" --bind "$server" -p "$port" "$@" >/dev/null &
    sleep 0.3
    ip netns exec "tbl-$lab-r1" taskset -c 0 "$bin/tbrdma" "$tool" "$server" -p "$port" "$@" >/dev/null
    wait
}
for engine in packet sockets; do
    for op in write send; do
        # (With its floor beside it, as users see the ratio: the floor's code is trained too.)
        pair pingpong --engine "$engine" --op "$op" -s 8 -s 4096 -s 16384 -s 65536 -n 3000 \
            --paired-with floor
    done
done
pair bw --op write --size 1048576 --duration 1
# The libibverbs-compatible library as perftest drives it (its default engine, sockets, and its
# engine thread), when perftest is installed: without it the library is built unsteered.
if command -v ib_write_lat >/dev/null; then
    . scripts/lib/verbs-lab.sh
    libdir=$(verbs_lib_dir "$bin/libibverbs.so")
    for tool in ib_write_lat ib_send_lat; do
        for size in 8 16384; do
            port=$((port + 1))
            verbs "tbl-$lab-r0" "$libdir" "$tool" -s "$size" -n 3000 -p "$port" >/dev/null 2>&1 &
            wait_tcp_port "tbl-$lab-r0" "$port"
            verbs "tbl-$lab-r1" "$libdir" "$tool" -s "$size" -n 3000 -p "$port" "$server" \
                >/dev/null 2>&1 || true
            wait || true
        done
    done
    rm -rf "$libdir"
fi
"$bin/tbrdma" lab down --name "$lab" >/dev/null
trap - EXIT
# The benchmarks train the baselines they judge tbrdma against too (the UDP and raw-frame
# floors, the UDP exchange, the TCP ring): code the training never ran is laid out as cold, and
# a baseline slowed that way would flatter every ratio. (collbench and pluginbench exit 1 when
# a target is missed, as the instrumented build's slower code may: only its counts matter here.)
"$bin/collbench" --rounds 1 --ranks 2 --sizes 16K,256K >/dev/null || true
"$bin/collbench" --rounds 1 --ranks 4 --sizes 16K --dtypes f32 >/dev/null || true
"$bin/linkbench" --rounds 1 --iters 2000 --warmup 200 --seconds 0.5 >/dev/null
"$bin/pluginbench" --rounds 1 --iters 2000 >/dev/null || true

echo "pgo.sh: 3/3 build steered by the profile into $out/release" >&2
rm -f "$out"/merged*.profdata
"$profdata" merge -o "$out/merged.profdata" "$profiles"
# Cargo sees the flag that names a profile, not the profile's contents: named by its hash, a new
# profile rebuilds every crate (else a crate whose source did not change would keep the code an
# older profile steered).
merged=$out/merged-$(sha256sum "$out/merged.profdata" | cut -c1-16).profdata
mv "$out/merged.profdata" "$merged"
RUSTFLAGS="$base_flags -Cprofile-use=$merged -Cllvm-args=-pgo-warn-missing-function=false -Cllvm-args=-pgso=false" \
    CARGO_TARGET_DIR=$out cargo build --release --locked "${packages[@]}"
echo "pgo.sh: done: $out/release (profile $merged)" >&2
