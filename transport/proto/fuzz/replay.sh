#!/usr/bin/env bash
# Replays the committed corpus (corpus/<target>/) through both cargo-fuzz targets; exits non-zero
# if any input fails. Works on the stable toolchain: `--sanitizer none` avoids the nightly-only
# `-Zsanitizer=address` (the core has no `unsafe`, so AddressSanitizer would add little).
#
#   transport/proto/fuzz/replay.sh            replay the corpus (what CI runs)
#   FUZZ_SECONDS=120 transport/proto/fuzz/replay.sh   then fuzz each target that long
#
# New inputs found while fuzzing go to a scratch directory, not into the committed corpus;
# crashes go to artifacts/<target>/ (minimise with `cargo fuzz tmin`, then commit them to
# corpus/<target>/ as crash-<what>).
set -euo pipefail
cd "$(dirname "$0")"

if ! command -v cargo-fuzz >/dev/null; then
    # About 70 s on a 2-core machine.
    cargo install cargo-fuzz --locked
fi

flags=(--sanitizer none --release --debug-assertions)
for target in decode endpoint; do
    echo "== replaying corpus/$target through fuzz target $target"
    cargo fuzz run "${flags[@]}" "$target" "corpus/$target" -- -runs=0
done

if [[ -n "${FUZZ_SECONDS:-}" ]]; then
    for target in decode endpoint; do
        scratch="$(mktemp -d)"
        echo "== fuzzing $target for $FUZZ_SECONDS s (new inputs in $scratch)"
        cargo fuzz run "${flags[@]}" "$target" "$scratch" "corpus/$target" -- \
            -max_total_time="$FUZZ_SECONDS"
    done
fi

# The targets outside the protocol core (side channels, hostfiles, discovery, packet frames).
../../../fuzz/replay.sh
