#!/usr/bin/env bash
# One batched H200 session: GPU tests, harness reports at Qwen3-8B shapes, benchmarks.
# Usage (on the device machine, repo root): bash scripts/h200_session.sh STAGE...
# Stages: env gpu-tests pytest:FILE[,FILE] check-ops bench-<name> (benchmarks/<name>.py) bench-mhc-quick mhc tp
# tp-multi invariance-<profile>.
# Everything lands in $OUT/results.tgz (the device tool returns few, shallow files) plus a summary.
set -u
OUT=${OUT:-/tmp/h200_out}
R=/tmp/h200_results
rm -rf "$R"; mkdir -p "$R/evidence" "$R/bench" "$OUT"
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    && export PYTHONPATH=/tmp/site
fi
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
SUMMARY="$OUT/summary.txt"; : > "$SUMMARY"

stage() {  # stage NAME TIMEOUT_S CMD...: run, log, record rc; never stop the session
  local name=$1 limit=$2; shift 2
  local t0=$SECONDS
  timeout "$limit" "$@" > "$R/$name.log" 2>&1
  local rc=$?
  printf '%-34s rc=%-3s %4ss\n' "$name" "$rc" "$((SECONDS - t0))" | tee -a "$SUMMARY"
  tail -n 4 "$R/$name.log" | sed 's/^/    /' >> "$SUMMARY"
  tar czf "$OUT/results.tgz" -C "$R" .  # after every stage: a call cut short still returns what ran
}

OPS="logp linear_logp rms_norm silu swiglu rope embedding matmul lm_head attention kv_cache_attention"
run_stage() {
  case "$1" in
    env)
      stage env 60 bash -c 'nvidia-smi; python3 -c "import torch, triton, numpy; print(torch.__version__, triton.__version__, numpy.__version__, torch.cuda.get_device_name())"; python3 -c "import liger_kernel; print(\"liger ok\")"' ;;
    gpu-tests)
      stage gpu-tests 480 python3 -m pytest -o addopts= -m gpu -q --timeout 300 -p no:cacheprovider tests ;;
    pytest:*)  # pytest:FILE[,FILE...]: the gpu tests of those files only
      local files=${1#pytest:}
      stage "pytest-$(basename "${files%%,*}" .py)" 300 python3 -m pytest -o addopts= -m gpu -q --timeout 300 -p no:cacheprovider ${files//,/ } ;;
    check-ops)  # every Triton candidate at Qwen3-8B geometry, bf16 and fp32, in one process (one import)
      stage check-ops 420 python3 - "$R/evidence" $OPS <<'PY'
import argparse, sys
from rl_engine.kernels.gtest import check_op
out, ops = sys.argv[1], sys.argv[2:]
for op in ops:
    for dtype in ("bf16", "fp32"):
        parser = argparse.ArgumentParser()
        check_op.add_arguments(parser)
        argv = ["--op", op, "--candidate", "triton", "--device", "cuda", "--dtype", dtype, "--arch-key", "sm90",
                "--qwen3-8b", "--seq", "1024", "--check-invariance", "--json-out", f"{out}/check_op_{op}_{dtype}.json"]
        if op != "kv_cache_attention":  # an inference op: forward only
            argv.append("--check-grad")
        try:
            rc = check_op.run(parser.parse_args(argv))
        except Exception as exc:  # keep going: one op's failure must not hide the others
            rc = f"error {type(exc).__name__}: {exc}"
        print(f"check-op {op} {dtype} -> {rc}", flush=True)
PY
      ;;
    bench-mhc-quick)
      stage "$1" 240 python3 benchmarks/mhc.py --out "$R/bench" --quick ;;
    bench-*)
      stage "$1" 150 python3 "benchmarks/${1#bench-}.py" --out "$R/bench" ;;
    mhc)
      stage mhc-cuda-check 300 python3 scripts/mhc_cuda_check.py --out "$R/evidence" ;;
    tp)
      stage tp-nccl-1 300 python3 scripts/check_tp_invariance.py --backend nccl --device cuda --world-sizes 1 \
        --preset large --json "$R/evidence/tp_invariance_nccl_1gpu.json" ;;
    tp-multi)  # needs a machine with several GPUs: TP = 1, 2 (and 4 where there are 4)
      local n; n=$(python3 -c "import torch; print(torch.cuda.device_count())")
      local sizes=1,2; [ "$n" -ge 4 ] && sizes=1,2,4
      stage "tp-nccl-$n-gpus" 400 python3 scripts/check_tp_invariance.py --backend nccl --device cuda \
        --world-sizes "$sizes" --preset large --json "$R/evidence/tp_invariance_nccl_${n}gpu.json" ;;
    invariance-*)  # invariance-triton_bf16, invariance-torch_bf16: the qwen3-8b config, synthetic weights
      local p=${1#invariance-}
      stage "$1" 240 python3 scripts/check_forward_invariance.py --profile "$p" --model qwen3-8b \
        --device cuda --json "$R/evidence/invariance_qwen3-8b_$p.json" ;;
    *) echo "unknown stage $1" | tee -a "$SUMMARY" ;;
  esac
}

for s in "$@"; do run_stage "$s"; done
cat "$SUMMARY"
