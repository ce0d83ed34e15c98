#!/usr/bin/env bash
# Triton 3.7.1 (what `pip install torch==2.13.0` brings) for the H200, whose image has Triton 3.6 and no network:
# the cp312 wheel (about 189 MiB, 122 of them libtriton.so) is split here into 48 MiB parts, carried one part a
# device call (one call carries at most 64 MiB), reassembled, checked and installed there into a folder that
# PYTHONPATH puts before the image's Triton. The recipe is FA4's (shared/notes/gpu-peers.md, scripts/fa4_wheels.sh).
#
#   bash scripts/triton_wheel.sh                   here: download into .whl/triton/ (git-ignored), split, print the
#                                                  calls to make
#   bash scripts/triton_wheel.sh --stage           on the device: copy the parts carried in this call to $TRITON_TMP
#   bash scripts/triton_wheel.sh --device-install  on the device, in the last call: reassemble, check the sha256,
#                                                  pip install into $TRITON_TMP/site
#
# Environment: PYTHON (default python3), TRITON_VERSION (default 3.7.1), TRITON_TMP (default /tmp/triton:
# /tmp survives between calls only while the machine stays warm).
set -euo pipefail

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
PYTHON=${PYTHON:-python3}
VERSION=${TRITON_VERSION:-3.7.1}
TRITON_TMP=${TRITON_TMP:-/tmp/triton}
SITE=$TRITON_TMP/site
DIR=.whl/triton
PART_SIZE=48M  # with the working tree, under one call's 64 MiB
CALL_LIMIT=$((64 * 1024 * 1024))

die() { echo "triton_wheel.sh: error: $*" >&2; exit 2; }

download() {
  cd "$ROOT"
  rm -rf "$DIR"
  mkdir -p "$DIR/download"
  # The H200 image: CPython 3.12 on x86-64 Linux.
  "$PYTHON" -m pip download --quiet --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 -d "$DIR/download" "triton==$VERSION"
  local wheel
  wheel=$(ls "$DIR"/download/triton-"$VERSION"-*.whl)
  [ "$(echo "$wheel" | wc -l)" -eq 1 ] || die "expected one triton $VERSION wheel in $DIR/download, got: $wheel"
  (cd "$DIR/download" && sha256sum "$(basename "$wheel")") > "$DIR/triton.sha256"
  split -b "$PART_SIZE" "$wheel" "$DIR/part."
  rm -rf "$DIR/download"
  local parts=("$DIR"/part.*) n=0
  for p in "${parts[@]}"; do
    [ "$(stat -c %s "$p")" -lt "$CALL_LIMIT" ] || die "$p is over 64 MiB"
  done
  echo "ready in $ROOT/$DIR: ${#parts[@]} parts of $(basename "$wheel")"
  echo
  echo "Make these ${#parts[@]} device calls back to back (the machine goes back when idle and /tmp with it; if the"
  echo "last call says a part is missing, start again from call 1):"
  for p in "${parts[@]}"; do
    n=$((n + 1))
    if [ "$n" -lt "${#parts[@]}" ]; then
      echo "$n. run(carry=[\"$p\"], command=\"bash scripts/triton_wheel.sh --stage\")"
    else
      echo "$n. run(carry=[\"$p\", \"$DIR/triton.sha256\"], command=\"bash scripts/triton_wheel.sh --stage &&"
      echo "   bash scripts/triton_wheel.sh --device-install && PYTHONPATH=$SITE python3 -c 'import triton;"
      echo "   print(triton.__version__)' && PYTHONPATH=$SITE python3 scripts/gpu_gate.py ...\")"
    fi
  done
}

stage() {
  cd "$ROOT"
  mkdir -p "$TRITON_TMP"
  local carried=("$DIR"/part.*)
  [ -f "${carried[0]}" ] || die "carry a part of $DIR in this call (made by: bash scripts/triton_wheel.sh)"
  cp "${carried[@]}" "$TRITON_TMP/"
  ls -l "$TRITON_TMP"
}

device_install() {
  cd "$ROOT"
  [ -f "$DIR/triton.sha256" ] || die "carry $DIR/triton.sha256 in the last call"
  local name
  name=$(awk '{print $2}' "$DIR/triton.sha256")
  cat "$TRITON_TMP"/part.* > "$TRITON_TMP/$name"
  (cd "$TRITON_TMP" && sha256sum --check --quiet -) < "$DIR/triton.sha256" \
    || die "$name reassembled with a wrong sha256: a part is missing or stale; start again from call 1"
  "$PYTHON" -m pip install --quiet --no-index --no-deps --upgrade --target "$SITE" "$TRITON_TMP/$name"
  echo "Triton installed into $SITE: PYTHONPATH=$SITE python3 ... runs it instead of the image's"
}

case "${1:-}" in
  "") download ;;
  --stage) stage ;;
  --device-install) device_install ;;
  *) die "unknown argument '$1' (expected nothing, --stage or --device-install)" ;;
esac
