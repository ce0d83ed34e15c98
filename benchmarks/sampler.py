"""Token sampler on the GPU: the Triton kernel (one program per row) vs the torch path (a loop over rows).

    python benchmarks/sampler.py --out DIR [--quick] [--sweep]

Qwen3's vocabulary (V = 151936), bf16 logits, batches 1 / 64 / 256, two parameter sets: temperature
only, and temperature + top-k 50 + top-p 0.9 + min-p 0.05 (the kernel's worst case: two bisections).
Each row reports ms per batch (the kernel as called, the kernel replayed from a CUDA graph, the torch
loop) and how many tokens the two paths disagree on (rounding at a boundary only; module docstring of
rl_engine.rollout.sampling). Writes DIR/sampler.json.
"""

from __future__ import annotations

import torch
from common import arg_parser, bench_ms, parse_gpu_args, print_table, write_json

from rl_engine.kernels.ops.triton.sampling.sampler import _sample_kernel, sample_tokens
from rl_engine.rollout.decode_graph import capture_graph
from rl_engine.rollout.sampling import SamplingParams, sample_reference, sampling_tensors

VOCAB = 151936
PARAM_SETS = {
    "temperature": SamplingParams(temperature=0.8, seed=1),
    "top_k_top_p_min_p": SamplingParams(temperature=0.8, top_k=50, top_p=0.9, min_p=0.05, seed=1),
}


def measure_row(name: str, logits, params, ids, positions) -> dict:
    tensors = sampling_tensors(params, ids, positions, "cuda")
    kernel = sample_tokens(logits, *tensors)
    reference = sample_reference(logits, params, ids, positions)
    row = {"params": name, "batch": logits.shape[0],
           "kernel_ms": bench_ms(lambda: sample_tokens(logits, *tensors)),
           "kernel_graph_ms": bench_ms(capture_graph(lambda: sample_tokens(logits, *tensors)).replay),
           "torch_loop_ms": bench_ms(lambda: sample_reference(logits, params, ids, positions), warmup=2, rep=20),
           "tokens_differ": int((kernel != reference).sum())}
    row["speedup"] = row["torch_loop_ms"] / row["kernel_ms"]
    print(row, flush=True)
    return row


def sweep(logits, tensors) -> list[dict]:
    """ms of the kernel at other (BLOCK, num_warps) than the fixed one: to choose that constant."""
    out = torch.empty(logits.shape[0], dtype=torch.int64, device="cuda")
    rows = []
    for block, warps in ((256, 4), (512, 4), (512, 8), (1024, 4), (1024, 8), (2048, 8), (2048, 16)):
        def run(block=block, warps=warps):
            _sample_kernel[(logits.shape[0],)](logits, *tensors, out, out, logits.stride(0), logits.shape[1],
                                               BLOCK=block, WRITE_KEEP=False, num_warps=warps)
        rows.append({"block": block, "num_warps": warps, "batch": logits.shape[0], "ms": bench_ms(run)})
        print(rows[-1], flush=True)
    return rows


def main() -> None:
    parser = arg_parser(__doc__.splitlines()[0])
    parser.add_argument("--sweep", action="store_true", help="also time other (BLOCK, num_warps) configurations")
    args = parse_gpu_args(parser)
    batches = (1, 64) if args.quick else (1, 64, 256)
    gen = torch.Generator(device="cuda").manual_seed(0)
    rows = []
    for name, p in PARAM_SETS.items():
        for b in batches:
            logits = (torch.randn(b, VOCAB, device="cuda", generator=gen) * 3).to(torch.bfloat16)
            params, ids, positions = [p] * b, list(range(b)), [100 + i for i in range(b)]
            rows.append(measure_row(name, logits, params, ids, positions))
    sweeps = []
    if args.sweep:
        for b in batches:
            logits = (torch.randn(b, VOCAB, device="cuda", generator=gen) * 3).to(torch.bfloat16)
            p = PARAM_SETS["top_k_top_p_min_p"]
            sweeps += sweep(logits, sampling_tensors([p] * b, list(range(b)), [0] * b, "cuda"))
    print_table(rows, ["params", "batch", "kernel_ms", "kernel_graph_ms", "torch_loop_ms", "speedup", "tokens_differ"])
    write_json(args.out, "sampler", {"vocab": VOCAB, "dtype": "bfloat16", "rows": rows, "sweep": sweeps})


if __name__ == "__main__":
    main()
