#!/usr/bin/env bash
# Build vLLM's mock engine (rust/src/mock-engine of a pinned vLLM source distribution on
# PyPI) with this project's patches. Usage: tools/mock_engine/build.sh DEST_DIR [VERSION]
# (VERSION: 0.33.0, the default, or 0.34.0). Each release has its own wire format (0.34
# packs prompt token ids as an int32 ndarray), so a front end needs the engine of its
# release.
#
# - The sdist is fetched once with pip and checked against the pinned sha256. pip unpacks it
#   and then builds its metadata (which would install torch as a build dependency), so the
#   archive is taken as soon as its hash matches and that pip process is stopped.
# - The workspace is cut to the three crates the mock engine needs (the others pull git-only
#   crates that cannot be fetched here) and the zmq.rs git revision is replaced by zeromq
#   0.7.0 from crates.io; the checked-in Cargo-VERSION.lock pins every crate (cargo --locked).
# - Every patches/*.patch is applied in name order (paths relative to the sdist's rust/).
set -euo pipefail

DEST=${1:?usage: build.sh DEST_DIR [VERSION]}
VLLM_VERSION=${2:-0.33.0}
case $VLLM_VERSION in
  0.33.0) SDIST_SHA256=f4c33c2503d52bb411146afa9618a4f48bed68912f617e6803ac8d76e4c74112 ;;
  0.34.0) SDIST_SHA256=fcad848b246a9d8652b47e6425af92334dc02492f9802720f54e27b823cf0113 ;;
  *) echo "build.sh: no pinned sdist for vLLM $VLLM_VERSION" >&2; exit 2 ;;
esac
MEMBERS='"src/engine-core-client", "src/metrics", "src/mock-engine"'
ZEROMQ='zeromq = { version = "0.7.0", default-features = false, features = ["tokio-runtime", "all-transport"] }'

HERE=$(cd "$(dirname "$0")" && pwd)
ROOT=$(cd "$HERE/../.." && pwd)
BUILDS=${MOCK_ENGINE_WORK:-$ROOT/.cache/mock-engine-build}
WORK=$BUILDS/$VLLM_VERSION
# One target dir for every release: their crates.io dependencies are mostly the same
# versions, so the second release's build reuses the first one's.
TARGET=$BUILDS/target
PY=${PYTHON:-python3}
SDIST=$WORK/vllm-$VLLM_VERSION.tar.gz

# Quiet: polled while pip is still writing the file, so a mismatch is expected at first.
sha_ok() { [[ -f $1 ]] && echo "$SDIST_SHA256  $1" | sha256sum --quiet -c - >/dev/null 2>&1; }

fetch_sdist() {
  local tmp pid found
  tmp=$(mktemp -d "$WORK/fetch.XXXXXX")
  TMPDIR=$tmp "$PY" -m pip download -q --no-deps --no-binary vllm -d "$tmp/dl" \
    "vllm==$VLLM_VERSION" >"$tmp/pip.log" 2>&1 &
  pid=$!
  for _ in $(seq 1200); do  # up to 10 minutes
    found=$(ls "$tmp"/pip-unpack-*/"vllm-$VLLM_VERSION.tar.gz" 2>/dev/null | head -1 || true)
    if [[ -n $found ]] && sha_ok "$found"; then cp "$found" "$SDIST.part"; break; fi
    kill -0 "$pid" 2>/dev/null || break
    sleep 0.5
  done
  pkill -TERM -P "$pid" 2>/dev/null || true
  kill "$pid" 2>/dev/null || true
  wait "$pid" 2>/dev/null || true
  if ! sha_ok "$SDIST.part"; then
    echo "build.sh: could not fetch vllm-$VLLM_VERSION.tar.gz with sha256 $SDIST_SHA256" >&2
    tail -5 "$tmp/pip.log" >&2 || true
    rm -rf "$tmp" "$SDIST.part"; exit 1
  fi
  mv "$SDIST.part" "$SDIST"
  rm -rf "$tmp"
}

cut_workspace() {  # $1 = Cargo.toml of the workspace
  "$PY" - "$1" "$MEMBERS" "$ZEROMQ" <<'PY'
import re, sys
path, members, zeromq = sys.argv[1:]
s = open(path).read()
s, n1 = re.subn(r"members = \[.*?\]", f"members = [{members}]", s, flags=re.S)
s, n2 = re.subn(r"^(llm-multimodal|openai-harmony) = .*\n", "", s, flags=re.M)
s, n3 = re.subn(r"zeromq = \{ git = .*?\] \}", zeromq, s, flags=re.S)
assert (n1, n2, n3) == (1, 2, 1), f"unexpected workspace Cargo.toml ({n1}, {n2}, {n3})"
open(path, "w").write(s)
PY
}

mkdir -p "$WORK" "$DEST"
sha_ok "$SDIST" || fetch_sdist
WS=$WORK/ws
rm -rf "$WS.new" && mkdir -p "$WS.new"
# --touch: the sources get the extraction time. The releases' workspace crates share names,
# versions and (cargo hashes path crates relative to the workspace) artifact names in the
# shared target dir; with the sdist's older mtimes cargo would take one release's build of
# them for the other's.
tar -xzf "$SDIST" -C "$WS.new" --touch --strip-components=2 "vllm-$VLLM_VERSION/rust"
cut_workspace "$WS.new/Cargo.toml"
cp "$HERE/Cargo-$VLLM_VERSION.lock" "$WS.new/Cargo.lock"
applied=()
for p in "$HERE"/patches/*.patch; do
  [[ -e $p ]] || continue
  patch -d "$WS.new" -p1 --batch --forward --quiet <"$p"
  applied+=("$(basename "$p")")
done
rm -rf "$WS" && mv "$WS.new" "$WS"
# Held until the binary is copied: a build of another release would replace it.
exec 9>"$BUILDS/target.lock"
flock 9
(cd "$WS" && CARGO_TARGET_DIR=$TARGET cargo build --release --locked -p vllm-mock-engine)
install -m 755 "$TARGET/release/vllm-mock-engine" "$DEST/vllm-mock-engine"
exec 9>&-
echo "built $DEST/vllm-mock-engine (vLLM $VLLM_VERSION; patches: ${applied[*]:-none})"
