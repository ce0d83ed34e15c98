#!/usr/bin/env bash
# FlashAttention-4 for the H200, whose image lacks it and has no network: download its wheels here, carry
# them in two device calls (one call carries at most 64 MiB; the CUDA 13 DSL libs wheel alone is 92 MB),
# install them there. The recipe and the wheel set: shared/notes/gpu-peers.md.
#
#   bash scripts/fa4_wheels.sh                   here: download into .fa4/ (git-ignored), split the big
#                                                wheel in two, print the two `run` calls to make
#   bash scripts/fa4_wheels.sh --device-install  on the device, in call 2: reassemble the big wheel, check
#                                                its sha256, pip install everything into $FA4_TMP/site
#
# Environment: PYTHON (default python3), FA4_TMP (default /tmp/fa4: where call 1 leaves the first part;
# /tmp survives between calls only while the machine stays warm).
set -euo pipefail

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
PYTHON=${PYTHON:-python3}
FA4_TMP=${FA4_TMP:-/tmp/fa4}
SITE=$FA4_TMP/site
PART_SIZE=46M  # two parts of the 92 MB wheel, each under one call's 64 MiB with the small wheels
CALL_LIMIT=$((64 * 1024 * 1024))
# flash-attn-4 and what it imports that the H200 image lacks (einops, cuda-bindings, protobuf are there).
WHEELS=(
  flash-attn-4==4.0.0b36
  nvidia-cutlass-dsl==4.8.1
  nvidia-cutlass-dsl-libs-base==4.8.1
  nvidia-cutlass-dsl-libs-core==4.8.1
  nvidia-cutlass-dsl-libs-cu13==4.8.1
  quack-kernels==0.6.5
  apache-tvm-ffi==0.1.15.post2
  torch-c-dlpack-ext==0.1.5
)

die() { echo "fa4_wheels.sh: error: $*" >&2; exit 2; }

download() {
  cd "$ROOT"
  rm -rf .fa4/small .fa4/cu13.part.*
  mkdir -p .fa4/download .fa4/small
  # The H200 image: CPython 3.12 on x86-64 Linux; pure-Python wheels are taken as they are.
  "$PYTHON" -m pip download --quiet --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_24_x86_64 --platform manylinux_2_17_x86_64 \
    --platform manylinux2014_x86_64 -d .fa4/download "${WHEELS[@]}"
  local big
  big=$(ls .fa4/download/nvidia_cutlass_dsl_libs_cu13-4.8.1-*.whl)
  [ "$(echo "$big" | wc -l)" -eq 1 ] || die "expected one cu13 libs wheel in .fa4/download, got: $big"
  for spec in "${WHEELS[@]}"; do  # exactly the pinned set, nothing left from an older download
    local stem=${spec%%==*} version=${spec#*==}
    stem=${stem//-/_}
    local found
    found=$(ls .fa4/download/"${stem}-${version}"-*.whl 2>/dev/null || true)
    [ -n "$found" ] || die "no wheel for $spec in .fa4/download"
    [ "$found" = "$big" ] || cp "$found" .fa4/small/
  done
  split -b "$PART_SIZE" "$big" .fa4/cu13.part.
  [ "$(ls .fa4/cu13.part.* | wc -l)" -eq 2 ] || die "expected 2 parts of $big, got $(ls .fa4/cu13.part.* | wc -l)"
  (cd .fa4/download && sha256sum "$(basename "$big")") > .fa4/small/cu13.sha256
  local call1 call2
  call1=$(stat -c %s .fa4/cu13.part.aa)
  call2=$(( $(stat -c %s .fa4/cu13.part.ab) + $(du -sb .fa4/small | cut -f1) ))
  [ "$call1" -lt "$CALL_LIMIT" ] && [ "$call2" -lt "$CALL_LIMIT" ] \
    || die "a call would carry more than 64 MiB (call 1: $call1 bytes, call 2: $call2 bytes)"
  echo "ready in $ROOT/.fa4: call 1 carries $((call1 / 1000000)) MB, call 2 $((call2 / 1000000)) MB"
  cat <<EOF

Make these two device calls back to back (the machine goes back when idle and /tmp with it; if
call 2 says the first part is missing, start again from call 1):

1. run(carry=[".fa4/cu13.part.aa"],
       command="mkdir -p $FA4_TMP && cp .fa4/cu13.part.aa $FA4_TMP/ && ls -l $FA4_TMP")

2. run(carry=[".fa4/cu13.part.ab", ".fa4/small"],
       command="bash scripts/fa4_wheels.sh --device-install; timeout 560 python3 benchmarks/attention.py --out \$OUT --site-dir $SITE")

   (the benchmark runs even when the install fails: it then records fa4 as "unavailable: <reason>";
   add --quick for the S = 4k rows only; it rewrites attention.json after each section)
EOF
}

device_install() {
  cd "$ROOT"
  mkdir -p "$SITE"  # even on failure: the benchmark's --site-dir then exists and FA4 shows as unavailable
  [ -f .fa4/cu13.part.ab ] && [ -f .fa4/small/cu13.sha256 ] \
    || die "carry .fa4/cu13.part.ab and .fa4/small in this call (made by: bash scripts/fa4_wheels.sh)"
  [ -f "$FA4_TMP/cu13.part.aa" ] \
    || die "$FA4_TMP/cu13.part.aa is missing: make call 1 first (or the machine went back: start again from call 1)"
  local name
  name=$(awk '{print $2}' .fa4/small/cu13.sha256)
  cat "$FA4_TMP/cu13.part.aa" .fa4/cu13.part.ab > "$FA4_TMP/$name"
  (cd "$FA4_TMP" && sha256sum --check --quiet -) < .fa4/small/cu13.sha256 \
    || die "$name reassembled with a wrong sha256: a part is truncated or stale; start again from call 1"
  "$PYTHON" -m pip install --quiet --no-index --no-deps --upgrade --target "$SITE" "$FA4_TMP/$name" .fa4/small/*.whl
  echo "FlashAttention-4 installed into $SITE. The CuTe DSL finds its packages through a .pth file there,"
  echo "which PYTHONPATH does not read: import site; site.addsitedir('$SITE'); from flash_attn.cute import flash_attn_func"
  echo "or: python3 benchmarks/attention.py --out \$OUT --site-dir $SITE"
}

case "${1:-}" in
  "") download ;;
  --device-install) device_install ;;
  *) die "unknown argument '$1' (expected nothing, or --device-install)" ;;
esac
