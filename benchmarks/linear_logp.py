"""Fused linear + selected-token logprob, H=4096, V=151936 bf16: ours vs eager, torch.compile, Liger.

    python benchmarks/linear_logp.py --out benchmarks/results [--quick] [--tile-sweep]

Implementations, side by side in one run:
  triton        TritonLinearLogpOp (never materializes the logits; batch invariant)
  eager_fp32    (hidden @ W^T).float().log_softmax(-1).gather(...)  - what people write
  eager_bf16    (hidden @ W^T).log_softmax(-1).gather(...).float()
  compile_fp32  torch.compile(eager_fp32, dynamic=True)
  liger         LigerFusedLinearCrossEntropyLoss(reduction="none"), logp = -loss ("unavailable" if absent)
Reference lines measured in the same run: the cuBLAS GEMM hidden @ W^T at each shape and
torch.matmul 8192^3. TFLOP/s counts 2*N*H*V for the forward and 6*N*H*V for forward+backward
(the three GEMMs of eager autograd; ours recomputes the logits in backward, so it executes 8*N*H*V).
--tile-sweep times our forward under a few alternative tile configurations (exploration only:
the shipped configuration stays one fixed choice per dtype).
"""

from __future__ import annotations

import torch
from common import (
    GB,
    arg_parser,
    bench_ms,
    copy_ceiling,
    environment,
    gemm_ceiling,
    measure,
    optional_import,
    peak_extra_bytes,
    print_table,
    save_plot,
    write_json,
)

from rl_engine.kernels.ops.pytorch.loss.linear_logp import NativeLinearLogpOp
from rl_engine.kernels.ops.triton.loss import linear_logp as ours

HIDDEN, VOCAB = 4096, 151936
MAIN_TOKENS = 4096
TILE_SWEEP = [
    dict(BLOCK_T=128, BLOCK_V=128, BLOCK_H=64, num_warps=8, num_stages=3),
    dict(BLOCK_T=128, BLOCK_V=256, BLOCK_H=64, num_warps=8, num_stages=3),
    dict(BLOCK_T=128, BLOCK_V=128, BLOCK_H=64, num_warps=4, num_stages=4),
    dict(BLOCK_T=128, BLOCK_V=128, BLOCK_H=128, num_warps=8, num_stages=3),
    dict(BLOCK_T=64, BLOCK_V=256, BLOCK_H=64, num_warps=4, num_stages=4),
]


def eager_fp32(hidden, weight, targets):
    logits = hidden @ weight.t()
    return torch.log_softmax(logits.float(), dim=-1).gather(-1, targets.unsqueeze(-1)).squeeze(-1)


def eager_bf16(hidden, weight, targets):
    logits = hidden @ weight.t()
    return torch.log_softmax(logits, dim=-1).gather(-1, targets.unsqueeze(-1)).squeeze(-1).float()


def implementations() -> dict:
    op = ours.TritonLinearLogpOp()
    impls = {
        "triton": lambda h, w, t: op(hidden=h, lm_head_weight=w, target_ids=t),
        "eager_fp32": eager_fp32,
        "eager_bf16": eager_bf16,
        "compile_fp32": torch.compile(eager_fp32, dynamic=True),
    }
    liger = optional_import("liger_kernel.transformers")
    if liger is not None:
        loss = liger.LigerFusedLinearCrossEntropyLoss(reduction="none")
        impls["liger"] = lambda h, w, t: -loss(w, h.reshape(-1, h.shape[-1]), t.reshape(-1)).reshape(t.shape)
    return impls


def make_inputs(tokens):
    torch.manual_seed(0)
    hidden = torch.randn(1, tokens, HIDDEN, device="cuda").to(torch.bfloat16)
    weight = (torch.randn(VOCAB, HIDDEN, device="cuda") / HIDDEN**0.5).to(torch.bfloat16)
    targets = torch.randint(0, VOCAB, (1, tokens), device="cuda")
    return hidden, weight, targets


def run_one(name, fn, tokens, ref, gemm_ms, warmup, rep) -> dict:
    hidden, weight, targets = make_inputs(tokens)
    flops = 2 * tokens * HIDDEN * VOCAB
    row = {"impl": name, "tokens": tokens}
    row["max_abs_err"] = (fn(hidden, weight, targets).float() - ref).abs().max().item()
    with torch.no_grad():
        row["fwd_ms"] = bench_ms(lambda: fn(hidden, weight, targets), warmup=warmup, rep=rep)
        row["fwd_extra_gb"] = peak_extra_bytes(lambda: fn(hidden, weight, targets)) / GB
    h, w = hidden.requires_grad_(), weight.requires_grad_()
    ones = torch.ones(1, tokens, device="cuda")

    def fwd_bwd():
        return torch.autograd.grad(fn(h, w, targets), (h, w), ones)

    row["fwd_bwd_ms"] = bench_ms(fwd_bwd, warmup=warmup, rep=rep)
    row["fwd_bwd_extra_gb"] = peak_extra_bytes(fwd_bwd) / GB
    # The same minus the two gradient outputs every implementation must return (working memory).
    grad_bytes = h.numel() * h.element_size() + w.numel() * w.element_size()
    row["fwd_bwd_work_gb"] = row["fwd_bwd_extra_gb"] - grad_bytes / GB
    row["fwd_tflop_per_s"] = flops / (row["fwd_ms"] * 1e-3) / 1e12
    row["fwd_bwd_tflop_per_s"] = 3 * flops / (row["fwd_bwd_ms"] * 1e-3) / 1e12
    row["fwd_x_gemm"] = row["fwd_ms"] / gemm_ms
    row["fwd_bwd_x_gemm"] = row["fwd_bwd_ms"] / gemm_ms
    return row


def time_forward(hidden, weight, targets, warmup, rep) -> dict:
    return {"fwd_ms": bench_ms(lambda: ours.linear_logp(hidden, weight, targets), warmup=warmup, rep=rep)}


def tile_sweep(tokens, warmup, rep) -> list[dict]:
    hidden, weight, targets = make_inputs(tokens)
    shipped = dict(ours._GPU_CONFIGS["16bit"])
    results = []
    try:
        for tiles in TILE_SWEEP:
            ours._GPU_CONFIGS["16bit"] = {**shipped, **tiles}

            row = measure(f"tiles {tiles}", time_forward, hidden, weight, targets, warmup, rep)
            results.append({**tiles, **row})
    finally:
        ours._GPU_CONFIGS["16bit"] = shipped
    return results


def main() -> int:
    parser = arg_parser(__doc__.splitlines()[0])
    parser.add_argument("--tile-sweep", action="store_true", help="also time alternative forward tile configs")
    args = parser.parse_args()
    token_sweep = [MAIN_TOKENS] if args.quick else [1024, 2048, MAIN_TOKENS, 8192]
    warmup, rep = (5, 30) if args.quick else (10, 60)
    print(environment())
    copy = measure("copy ceiling", copy_ceiling)
    gemm = measure("bf16 GEMM 8192^3", gemm_ceiling)
    print(f"ceilings: copy {copy.get('gb_per_s', float('nan')):.0f} GB/s, "
          f"bf16 GEMM {gemm.get('tflop_per_s', float('nan')):.0f} TFLOP/s")
    impls = implementations()
    rows, gemm_at = [], {}
    for tokens in token_sweep:
        shape_gemm = measure(f"cuBLAS GEMM tokens={tokens}", gemm_ceiling, tokens, VOCAB, HIDDEN)
        gemm_at[tokens] = shape_gemm
        gemm_ms = shape_gemm.get("ms", float("nan"))
        rows.append({"impl": "cublas_gemm", "tokens": tokens, "fwd_ms": gemm_ms,
                     "fwd_tflop_per_s": shape_gemm.get("tflop_per_s"), "fwd_x_gemm": 1.0})
        hidden, weight, targets = make_inputs(tokens)
        ref = NativeLinearLogpOp()(hidden=hidden, lm_head_weight=weight, target_ids=targets)  # fp32, TF32 off
        del hidden, weight, targets
        for name, fn in impls.items():
            row = measure(f"{name} tokens={tokens}", run_one, name, fn, tokens, ref, gemm_ms, warmup, rep)
            rows.append({"impl": name, "tokens": tokens, **row})
        del ref
    if "liger" not in impls:
        rows.append({"impl": "liger", "error": "unavailable"})
    tiles = tile_sweep(MAIN_TOKENS, warmup, rep) if args.tile_sweep else []

    columns = ["impl", "tokens", "fwd_ms", "fwd_x_gemm", "fwd_tflop_per_s", "fwd_bwd_ms", "fwd_bwd_x_gemm",
               "fwd_extra_gb", "fwd_bwd_extra_gb", "fwd_bwd_work_gb", "max_abs_err", "error"]
    print_table(rows, columns)
    if tiles:
        print_table(tiles, ["BLOCK_T", "BLOCK_V", "BLOCK_H", "num_warps", "num_stages", "fwd_ms", "error"])
    names = ["cublas_gemm", *impls]

    def series(key, impl_names):
        return {
            n: [next((r.get(key) for r in rows if r["impl"] == n and r.get("tokens") == t), None) for t in token_sweep]
            for n in impl_names
        }

    write_json(args.out, "linear_logp", {
        "hidden": HIDDEN, "vocab": VOCAB, "dtype": "bfloat16", "main_tokens": MAIN_TOKENS,
        "ceilings": {"copy": copy, "gemm_8192": gemm, "gemm_at_shape": gemm_at},
        "flop_model": "fwd 2*N*H*V; fwd+bwd 6*N*H*V (ours executes 8*N*H*V: logits recomputed)",
        "shipped_config": ours._GPU_CONFIGS, "rows": rows, "tile_sweep": tiles,
    })
    save_plot(args.out, "linear_logp", [
        {"title": f"linear+logp forward, H={HIDDEN} V={VOCAB} bf16", "xlabel": "tokens",
         "ylabel": "ms / cuBLAS GEMM ms",
         "x": token_sweep, "series": series("fwd_x_gemm", names), "hline": (1.15, "goal 1.15x")},
        {"title": "forward + backward", "xlabel": "tokens", "ylabel": "ms / cuBLAS GEMM ms",
         "x": token_sweep, "series": series("fwd_bwd_x_gemm", list(impls)), "hline": (3.5, "goal 3.5x")},
        {"title": "peak memory beyond inputs and grads, fwd + bwd", "xlabel": "tokens", "ylabel": "GB",
         "x": token_sweep, "series": series("fwd_bwd_work_gb", list(impls)), "logy": True},
    ])
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
