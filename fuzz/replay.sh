#!/usr/bin/env bash
# Replays the committed corpus (corpus/<target>/) through every cargo-fuzz target of this crate
# (side channels, authentication, hostfiles and discovery, the packet engine's frames, the NCCL
# plugin's control messages); exits non-zero if any input fails. Stable toolchain: `--sanitizer none`, as transport/proto/fuzz
# does (the parsers fuzzed here are safe code; the packet frame parser is a safe function).
# transport/proto/fuzz/replay.sh, which CI runs, calls this script after its own targets.
#
#   fuzz/replay.sh                              replay the corpus (what CI runs)
#   FUZZ_SECONDS=600 fuzz/replay.sh             then fuzz each target that long, one at a time
#   FUZZ_TARGETS="cm_frame auth" fuzz/replay.sh only these targets
#
# New inputs found while fuzzing go to a scratch directory, not into the committed corpus;
# crashes go to artifacts/<target>/ (minimise with `cargo fuzz tmin`, fix, then commit the input
# to corpus/<target>/ as crash-<what> so the replay keeps checking it).
set -euo pipefail
cd "$(dirname "$0")"

if ! command -v cargo-fuzz >/dev/null; then
    cargo install cargo-fuzz --locked
fi

targets=(${FUZZ_TARGETS:-hostfile cm_frame auth rendezvous discovery packet_frame nccl_control})
flags=(--sanitizer none --release --debug-assertions)
for target in "${targets[@]}"; do
    echo "== replaying fuzz/corpus/$target through fuzz target $target"
    cargo fuzz run "${flags[@]}" "$target" "corpus/$target" -- -runs=0
done

if [[ -n "${FUZZ_SECONDS:-}" ]]; then
    for target in "${targets[@]}"; do
        scratch="$(mktemp -d)"
        echo "== fuzzing $target for $FUZZ_SECONDS s (new inputs in $scratch)"
        cargo fuzz run "${flags[@]}" "$target" "$scratch" "corpus/$target" -- \
            -max_total_time="$FUZZ_SECONDS" -timeout=10 -rss_limit_mb=2048
    done
fi
