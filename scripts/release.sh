#!/bin/sh
# Builds dist/tbrdma-<version>-x86_64-linux.tar.gz: the layout `tbrdma install` writes (bin/,
# lib/ with the plugin under both NCCL and RCCL names, include/, lib/pkgconfig/, share/tbrdma/),
# staged for the prefix /opt/tbrdma-<version>-x86_64-linux, plus share/tbrdma/GLIBC naming the
# oldest glibc the binaries run on (the newest GLIBC_x.y symbol version they need).
#
#   scripts/release.sh            # from anywhere inside the repository
#   sudo scripts/release.sh --pgo # the same from a profile-guided build (scripts/pgo.sh: root,
#                                 # llvm-tools; about a tenth less per message, docs/performance.md)
#   sudo tar -C /opt -xzf dist/tbrdma-0.1.0-x86_64-linux.tar.gz
#   . /opt/tbrdma-0.1.0-x86_64-linux/share/tbrdma/env.sh
#
# Unpacked elsewhere: set TBRDMA_PREFIX to the unpacked folder before sourcing env.sh, or run
# its bin/tbrdma install --prefix DIR.
set -eu

cd "$(dirname "$0")/.."
version=$(sed -n 's/^version = "\(.*\)"/\1/p' Cargo.toml | head -n 1)
[ -n "$version" ] || { echo "release.sh: no version in Cargo.toml" >&2; exit 1; }
arch=$(uname -m)
[ "$arch" = x86_64 ] || echo "release.sh: warning: building on $arch; the archive is named for it" >&2
name="tbrdma-$version-$arch-linux"
target=${CARGO_TARGET_DIR:-target}

case "${1:-}" in
  --pgo)
    scripts/pgo.sh
    target=${PGO_TARGET_DIR:-target/pgo}
    ;;
  "") cargo build --release --locked -p tbrdma-cli -p tbrdma-capi -p tbrdma-nccl ;;
  *) echo "usage: scripts/release.sh [--pgo]" >&2; exit 2 ;;
esac

stage=$(mktemp -d)
trap 'rm -rf "$stage"' EXIT
prefix="/opt/$name"
"$target/release/tbrdma" install --prefix "$prefix" --destdir "$stage" --from "$target/release" >/dev/null
root="$stage$prefix"
# The release profile keeps debug info for profiling; the archive does not need it.
if command -v strip >/dev/null; then
  strip --strip-debug "$root/bin/tbrdma" "$root"/lib/*.so
fi

# The newest GLIBC_ symbol version any binary needs is the oldest glibc it runs on.
glibc=$(for f in "$root/bin/tbrdma" "$root"/lib/*.so; do
          objdump -T "$f" | sed -n 's/.*GLIBC_\([0-9][0-9.]*\).*/\1/p'
        done | sort -uV | tail -n 1)
[ -n "$glibc" ] || { echo "release.sh: no GLIBC_ versions found (objdump missing?)" >&2; exit 1; }
printf 'glibc %s or newer (x86_64); built on %s with %s\n' \
  "$glibc" "$(ldd --version | head -n 1)" "$(rustc --version)" > "$root/share/tbrdma/GLIBC"
echo "$prefix/share/tbrdma/GLIBC" >> "$root/share/tbrdma/install-manifest.txt"

mkdir -p dist
tar -C "$stage/opt" -czf "dist/$name.tar.gz" "$name"
echo "dist/$name.tar.gz: needs glibc $glibc or newer"
