#!/usr/bin/env bash
# One batched H200 session: GPU tests, harness reports at Qwen3-8B shapes, benchmarks.
# Usage (on the device machine, repo root): [COMMIT=sha] bash scripts/h200_session.sh STAGE...
# Stages: env gate pytest:FILE[,FILE] bench-<name> (benchmarks/<name>.py) bench-mhc-quick mhc tp
# tp-multi invariance-<profile>.
# Everything lands in $OUT/results.tgz (the device tool returns few, shallow files) plus a summary.
# Give all of a device call's stages to one invocation: each invocation starts by clearing the last one's
# results (a second invocation in one call lost the gate's files at 37f1ecc).
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

run_stage() {
  case "$1" in
    env)
      stage env 60 bash -c 'nvidia-smi; python3 -c "import torch, triton, numpy; print(torch.__version__, triton.__version__, numpy.__version__, torch.cuda.get_device_name())"; python3 -c "import liger_kernel; print(\"liger ok\")"' ;;
    gate)  # the GPU gate: the whole gpu-marked suite + check-op for every op at Qwen3-8B geometry (534 s on an
      # H100 at 3e9462c: give it a call of its own)
      # xdist workers by cores (Triton compiles are CPU-bound); COMMIT labels the tree (the copy's .git is stale:
      # pass the sha literally, not $(git rev-parse HEAD) there); the log's tree= digest names the code either way.
      stage gate 590 python3 scripts/gpu_gate.py --out "$R/evidence/gate" --workers $(( $(nproc) / 3 )) \
        ${COMMIT:+--commit "$COMMIT"} ;;
    pytest:*)  # pytest:FILE[,FILE...]: the gpu tests of those files only (a probe, never the gate)
      local files=${1#pytest:}
      stage "pytest-$(basename "${files%%,*}" .py)" 300 python3 -m pytest -o addopts= -m gpu -q --timeout 300 -p no:cacheprovider ${files//,/ } ;;
    bench-mhc)  # DeepSeek-V4 geometry: hidden 4096 and 7168, T = 4096 … 32768 (about 200 s on the H200)
      stage "$1" 360 python3 benchmarks/mhc.py --out "$R/bench" ;;
    bench-mhc-quick)
      stage "$1" 240 python3 benchmarks/mhc.py --out "$R/bench" --quick ;;
    bench-*)  # bench-NAME or bench-NAME:ARG,ARG (e.g. bench-rollout:--contexts,1024,--budget-s,480);
      # an argument that is itself a comma list: quote the stage, words split on spaces instead
      # ("bench-transformers_step:--impls sdpa,rl_engine --modes compiled")
      local spec=${1#bench-} name args
      name=${spec%%:*}; args=""; [ "$spec" != "$name" ] && args=${spec#*:}
      [[ "$args" == *" "* ]] || args=${args//,/ }
      local log=$name n=2
      while [ -e "$R/$log.log" ]; do log=$name-$n; n=$((n + 1)); done  # a benchmark run twice keeps both logs
      stage "$log" 570 python3 "benchmarks/$name.py" --out "$R/bench" $args
      if [ "$name" = matmul_small_m ] && [[ "$args" == *--apply* ]]; then  # what --apply wrote comes back too
        cp rl_engine/kernels/ops/triton/linear/matmul.py "$R/bench/matmul_applied.py"
        tar czf "$OUT/results.tgz" -C "$R" .
      fi ;;
    mhc)
      stage mhc-cuda-check 300 python3 scripts/mhc_cuda_check.py --out "$R/evidence" ;;
    tp)
      stage tp-nccl-1 300 python3 -m rl_engine.cli check-tp --backend nccl --device cuda --world-sizes 1 \
        --preset large --json "$R/evidence/tp_invariance_nccl_1gpu.json" ;;
    tp-multi)  # needs a machine with several GPUs: TP = 1, 2 (and 4 where there are 4)
      local n; n=$(python3 -c "import torch; print(torch.cuda.device_count())")
      local sizes=1,2; [ "$n" -ge 4 ] && sizes=1,2,4
      stage "tp-nccl-$n-gpus" 400 python3 -m rl_engine.cli check-tp --backend nccl --device cuda \
        --world-sizes "$sizes" --preset large --json "$R/evidence/tp_invariance_nccl_${n}gpu.json" ;;
    invariance-*)  # invariance-triton_bf16, invariance-torch_bf16: the qwen3-8b config, synthetic weights
      local p=${1#invariance-}
      stage "$1" 240 python3 -m rl_engine.cli check-invariance --profile "$p" --model qwen3-8b \
        --device cuda --json "$R/evidence/invariance_qwen3-8b_$p.json" ;;
    *) echo "unknown stage $1" | tee -a "$SUMMARY" ;;
  esac
}

for s in "$@"; do run_stage "$s"; done
cat "$SUMMARY"
