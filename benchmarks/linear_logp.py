"""Fused linear + selected-token logprob, H=4096, V=151936 bf16: ours vs eager, torch.compile, Liger.

    python benchmarks/linear_logp.py --out benchmarks/results [--quick] [--tile-sweep] [--bwd-sweep]
    python benchmarks/linear_logp.py --out DIR --tile-sweep --bwd-sweep --sweeps-only   # sweeps alone
    python benchmarks/linear_logp.py --out DIR --sampling-sweep --sweeps-only           # the rollout's read

Implementations, side by side in one run:
  triton        TritonLinearLogpOp (never materializes the logits; batch invariant)
  eager_fp32    (hidden @ W^T).float().log_softmax(-1).gather(...)  - what people write
  eager_bf16    (hidden @ W^T).log_softmax(-1).gather(...).float()
  compile_fp32  torch.compile(eager_fp32, dynamic=True)
  liger         LigerFusedLinearCrossEntropyLoss(reduction="none"), logp = -loss ("unavailable" if absent)
Reference lines measured in the same run: the cuBLAS GEMM hidden @ W^T at each shape (the faster of
F.linear's layout and W^T stored [H,V], named in the JSON; each row's "x GEMM" ratios are timed against
it in alternating order, ABBA, so the ratio is not fwd_ms over the reference row's ms) and
torch.matmul 8192^3. TFLOP/s counts 2*N*H*V for the forward and 6*N*H*V for forward+backward
(the three GEMMs of eager autograd; ours recomputes the logits in backward, so it executes 8*N*H*V).
--tile-sweep times our forward and backward under alternative logits-tile configurations (the
backward's logits recompute shares them); --bwd-sweep times, at N=4096, each backward kernel alone
on one vocabulary chunk (dlogits recompute, dH GEMM with accumulation, dW GEMM) per GEMM tile
config next to cuBLAS on the same shapes, then the whole backward under a few complete configs
(GEMM tiles, VOCAB_CHUNK), each checked against the shipped config's gradients and for batch
invariance of the hidden gradient. --sampling-sweep times the rollout's lm_head read (`sampling_logits`: the
fp32 logits and the partials in one kernel) at decode batch sizes under other tiles, each checked bit for bit
against the trainer's tiles' logits and partials, with the weight's copy floor beside it (linear_logp_sampling.json).
Exploration only: the shipped configuration stays one fixed choice per dtype (ours._GPU_CONFIGS,
ours.sampling_config), set by hand from these tables.
Floor for forward+backward without materializing the logits: 4 GEMMs (forward, recompute, dH,
dW), i.e. 4.0x the cuBLAS GEMM at cuBLAS speed; issue 17's goal, 4.3x, is those 4 GEMMs at 93% of
cuBLAS's speed (the forward's goal: 1.10x).
"""

from __future__ import annotations

import torch
from common import (
    GB,
    LM_HEAD_LAYOUTS,
    arg_parser,
    bench_ms,
    copy_ceiling,
    environment,
    gemm_ceiling,
    lm_head_gemm,
    lm_head_product,
    measure,
    optional_import,
    paired_ratio,
    parse_gpu_args,
    peak_extra_bytes,
    print_table,
    save_plot,
    write_json,
)

from rl_engine.kernels.ops.pytorch.loss.linear_logp import NativeLinearLogpOp
from rl_engine.kernels.ops.triton.loss import linear_logp as ours

HIDDEN, VOCAB = 4096, 151936
MAIN_TOKENS = 4096
# Logits tiles (forward partials + backward recompute). ptxas, sm_90: 128x128 119 regs, 96 KB smem
# (2 CTAs/SM); 128x256 and 256x128 ~235 regs, 144 KB (s3) / 192 KB (s4) smem, no spills (1 CTA/SM).
TILE_SWEEP = [
    dict(BLOCK_T=128, BLOCK_V=128, BLOCK_H=64, num_warps=8, num_stages=3),
    dict(BLOCK_T=128, BLOCK_V=256, BLOCK_H=64, num_warps=8, num_stages=3),
    dict(BLOCK_T=128, BLOCK_V=256, BLOCK_H=64, num_warps=8, num_stages=4),
    dict(BLOCK_T=256, BLOCK_V=128, BLOCK_H=64, num_warps=8, num_stages=3),
    dict(BLOCK_T=256, BLOCK_V=128, BLOCK_H=64, num_warps=8, num_stages=4),
    dict(BLOCK_T=128, BLOCK_V=128, BLOCK_H=64, num_warps=4, num_stages=4),
    dict(BLOCK_T=128, BLOCK_V=128, BLOCK_H=128, num_warps=8, num_stages=3),
]
# Gradient-GEMM tiles (BLOCK_M, BLOCK_N, BLOCK_K, num_warps, num_stages) for dH and dW, timed alone.
GEMM_SWEEP = [(128, 128, 64, 8, 3), (128, 256, 64, 8, 3), (128, 256, 64, 8, 4), (256, 128, 64, 8, 3),
              (128, 128, 64, 4, 4), (128, 128, 64, 8, 4)]
# The rollout's read at decode batch sizes. A row's logits are the same m64n256k16 wgmma chain over BLOCK_H steps with
# BLOCK_T = 64 on one warpgroup as with 128 on two, and its partials reduce the same 256 columns within a warp, so these
# may keep the bits (the sweep checks); fewer padded rows leave shared memory for a deeper pipeline beside the stored
# fp32 tile (64 KB at 64 x 256).
SAMPLING_SWEEP = [
    dict(BLOCK_T=64, num_warps=4, num_stages=2),
    dict(BLOCK_T=64, num_warps=4, num_stages=3),
    dict(BLOCK_T=64, num_warps=4, num_stages=4),
]
SAMPLING_TOKENS = (1, 16, 64, 256)
# Complete backward configs: overrides of the shipped 16-bit config.
BWD_SWEEP = [
    {},
    dict(VOCAB_CHUNK=8192),
    dict(DH=ours._gemm(128, 256, 64, 8, 3), DW=ours._gemm(128, 256, 64, 8, 3)),
    dict(DH=ours._gemm(128, 256, 64, 8, 3), DW=ours._gemm(128, 256, 64, 8, 3), VOCAB_CHUNK=8192),
    dict(BLOCK_T=128, BLOCK_V=256, DH=ours._gemm(128, 256, 64, 8, 3), DW=ours._gemm(128, 256, 64, 8, 3),
         VOCAB_CHUNK=8192),
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


def run_one(name, fn, tokens, ref, reference, warmup, rep) -> dict:
    """One implementation's row; its "x GEMM" ratios are timed ABBA against `reference` (the shape's
    cuBLAS logits product), not divided by a reference timed once before every implementation."""
    hidden, weight, targets = make_inputs(tokens)
    flops = 2 * tokens * HIDDEN * VOCAB
    row = {"impl": name, "tokens": tokens}
    row["max_abs_err"] = (fn(hidden, weight, targets).float() - ref).abs().max().item()
    with torch.no_grad():
        row["fwd_ms"], row["fwd_x_gemm"] = paired_ratio(lambda: fn(hidden, weight, targets), reference,
                                                        warmup=warmup, rep=rep)
        row["fwd_extra_gb"] = peak_extra_bytes(lambda: fn(hidden, weight, targets)) / GB
    h, w = hidden.requires_grad_(), weight.requires_grad_()
    ones = torch.ones(1, tokens, device="cuda")

    def fwd_bwd():
        return torch.autograd.grad(fn(h, w, targets), (h, w), ones)

    row["fwd_bwd_ms"], row["fwd_bwd_x_gemm"] = paired_ratio(fwd_bwd, reference, warmup=warmup, rep=rep)
    row["fwd_bwd_extra_gb"] = peak_extra_bytes(fwd_bwd) / GB
    # The same minus the two gradient outputs every implementation must return (working memory).
    grad_bytes = h.numel() * h.element_size() + w.numel() * w.element_size()
    row["fwd_bwd_work_gb"] = row["fwd_bwd_extra_gb"] - grad_bytes / GB
    row["fwd_tflop_per_s"] = flops / (row["fwd_ms"] * 1e-3) / 1e12
    row["fwd_bwd_tflop_per_s"] = 3 * flops / (row["fwd_bwd_ms"] * 1e-3) / 1e12
    return row


def time_forward_backward(hidden, weight, targets, gemm_ms, warmup, rep, reference=None) -> dict:
    """Forward and backward (alone, graph retained) ms of the current config; optional gradient check."""
    with torch.no_grad():
        row = {"fwd_ms": bench_ms(lambda: ours.linear_logp(hidden, weight, targets), warmup=warmup, rep=rep)}
    h, w = hidden.detach().requires_grad_(), weight.detach().requires_grad_()
    out = ours.linear_logp(h, w, targets)
    ones = torch.ones_like(out)
    row["bwd_ms"] = bench_ms(lambda: torch.autograd.grad(out, (h, w), ones, retain_graph=True), warmup=warmup, rep=rep)
    row["fwd_bwd_ms"] = row["fwd_ms"] + row["bwd_ms"]
    row["fwd_x_gemm"], row["fwd_bwd_x_gemm"] = row["fwd_ms"] / gemm_ms, row["fwd_bwd_ms"] / gemm_ms
    row["bwd_extra_gb"] = peak_extra_bytes(lambda: torch.autograd.grad(out, (h, w), ones, retain_graph=True)) / GB
    grads = torch.autograd.grad(out, (h, w), ones)
    if reference is not None:
        ref_out, ref_dh, ref_dw = reference
        row["logp_bitwise_vs_shipped"] = torch.equal(out.detach(), ref_out)
        row["dh_max_diff_vs_shipped"] = (grads[0].float() - ref_dh.float()).abs().max().item()
        row["dw_max_diff_vs_shipped"] = (grads[1].float() - ref_dw.float()).abs().max().item()
    # Batch invariance: tokens 300..304 alone give the bits they have in the full batch.
    sub_h = hidden[:, 300:305].detach().requires_grad_()
    sub_out = ours.linear_logp(sub_h, weight, targets[:, 300:305])
    (sub_dh,) = torch.autograd.grad(sub_out, sub_h, torch.ones_like(sub_out))
    row["invariant"] = torch.equal(sub_out, out.detach()[:, 300:305]) and torch.equal(sub_dh, grads[0][:, 300:305])
    return row, (out.detach(), *grads)


def _with_config(overrides: dict, fn, *args):
    shipped = ours._GPU_CONFIGS["16bit"]
    ours._GPU_CONFIGS["16bit"] = {**shipped, **overrides}
    try:
        return fn(*args)
    finally:
        ours._GPU_CONFIGS["16bit"] = shipped


def _gemm_ms(tokens) -> float:
    return lm_head_gemm(tokens, VOCAB, HIDDEN)["ms"]


def tile_sweep(tokens, warmup, rep) -> list[dict]:
    hidden, weight, targets = make_inputs(tokens)
    gemm_ms = _gemm_ms(tokens)
    results, reference = [], None
    for tiles in TILE_SWEEP:
        def run(tiles=tiles):
            nonlocal reference
            row, grads = _with_config(tiles, time_forward_backward, hidden, weight, targets, gemm_ms, warmup, rep,
                                      reference)
            reference = reference or grads  # the first entry is the shipped tiles
            return row
        results.append({**tiles, **measure(f"tiles {tiles}", run)})
    return results


def _label(overrides: dict) -> str:
    parts = []
    for key, value in overrides.items():
        if isinstance(value, dict):
            value = "x".join(str(value[k]) for k in ("BLOCK_M", "BLOCK_N", "BLOCK_K")) + \
                f"/w{value['num_warps']}s{value['num_stages']}"
        parts.append(f"{key}={value}")
    return ", ".join(parts) or "shipped"


def bwd_kernel_sweep(tokens, warmup, rep) -> list[dict]:
    """Each backward kernel alone on one vocabulary chunk, next to cuBLAS on the same GEMM shape."""
    hidden, weight, targets = make_inputs(tokens)
    rows2d, n = hidden.reshape(tokens, HIDDEN), tokens
    cfg = ours.config(torch.bfloat16)
    chunk = cfg["VOCAB_CHUNK"]
    lse = torch.randn(n, device="cuda") + 12
    grad_out = torch.ones(n, device="cuda")
    targets1d = targets.reshape(-1).contiguous()
    d = torch.randn(n, chunk, device="cuda").to(torch.bfloat16) * 1e-3
    w_chunk = weight[chunk:2 * chunk]
    flops = 2 * n * HIDDEN * chunk
    results = []

    def add(kernel, tiles, fn):
        def run():
            ms = bench_ms(fn, warmup=warmup, rep=rep)
            return {"ms": ms, "tflop_per_s": flops / (ms * 1e-3) / 1e12}
        results.append({"kernel": kernel, "tiles": tiles, **measure(f"{kernel} {tiles}", run)})

    add("cublas d@W (dH shape)", "-", lambda: d @ w_chunk)
    add("cublas d^T@h (dW shape)", "-", lambda: d.t() @ rows2d)
    add("cublas h@W^T (recompute)", "-", lambda: rows2d @ w_chunk.t())
    for tiles in TILE_SWEEP:
        t = {**cfg, **tiles}
        label = f"{t['BLOCK_T']}x{t['BLOCK_V']}x{t['BLOCK_H']}/w{t['num_warps']}s{t['num_stages']}"
        add("dlogits recompute", label,
            lambda t=t: ours._dlogits(ours.logits_descriptors(rows2d, weight, t), rows2d, weight, None, targets1d,
                                      lse, grad_out, d, chunk, 2 * chunk, t))
    grad_hidden = torch.zeros(n, HIDDEN, device="cuda")
    w_out = torch.empty(chunk, HIDDEN, dtype=torch.bfloat16, device="cuda")
    for bm, bn, bk, nw, ns in GEMM_SWEEP:
        gemm = ours._gemm(bm, bn, bk, nw, ns)
        label = f"{bm}x{bn}x{bk}/w{nw}s{ns}"
        add("dH += d @ W[chunk]", label, lambda g=gemm: ours._matmul(d, w_chunk, grad_hidden, accumulate=True, gemm=g))
        add("dW[chunk] = d^T @ h", label, lambda g=gemm: ours._matmul(d.t(), rows2d, w_out, gemm=g))
    return results


def bwd_sweep(tokens, warmup, rep) -> list[dict]:
    hidden, weight, targets = make_inputs(tokens)
    gemm_ms = _gemm_ms(tokens)
    results, reference = [], None
    for overrides in BWD_SWEEP:
        def run(overrides=overrides):
            nonlocal reference
            row, grads = _with_config(overrides, time_forward_backward, hidden, weight, targets, gemm_ms, warmup,
                                      rep, reference)
            reference = reference or grads  # the first entry is the shipped config
            return row
        results.append({"config": _label(overrides), **measure(f"backward {_label(overrides)}", run)})
    return results


def sampling_sweep(tokens_list, weight, candidates: list[dict], copy_gb_per_s: float, time_ms) -> list[dict]:
    """Per N and candidate tiles (candidates[0]: the reference, the trainer's tiles): ms of `sampling_logits`
    (time_ms(fn)), the weight's read rate against copy, and whether the logits and both partials equal the reference's
    bit for bit. `shipped` marks `sampling_config`'s tiles. hidden ~ N(0, 1) rows of weight's dtype."""
    rows = []
    weight_bytes = weight.numel() * weight.element_size()
    shipped_cfg = ours.sampling_config(weight.dtype)
    gen = torch.Generator().manual_seed(0)
    for n in tokens_list:
        hidden = torch.randn(n, weight.shape[1], generator=gen).to(weight.dtype).to(weight.device)
        reference = None
        for cfg in candidates:
            label = f"{cfg['BLOCK_T']}x{cfg['BLOCK_V']}x{cfg['BLOCK_H']}/w{cfg['num_warps']}s{cfg['num_stages']}"

            def run(cfg=cfg, hidden=hidden):
                nonlocal reference
                logits, parts = ours.sampling_logits(hidden, weight, cfg)
                got = (logits, *parts)
                if cfg is candidates[0]:
                    reference = got
                ms = time_ms(lambda: ours.sampling_logits(hidden, weight, cfg))
                gb_per_s = weight_bytes / (ms * 1e-3) / GB
                same = None if reference is None else all(torch.equal(a, b) for a, b in zip(got, reference))
                return {"ms": ms, "weight_gb_per_s": gb_per_s, "pct_of_copy": 100 * gb_per_s / copy_gb_per_s,
                        "floor_ms": weight_bytes / (copy_gb_per_s * GB) * 1e3, "bitwise_vs_reference": same}
            rows.append({"tokens": n, "tiles": label, "reference": cfg is candidates[0], "shipped": cfg == shipped_cfg,
                         **measure(f"sampling_logits N={n} {label}", run)})
    return rows


SWEEP_COLUMNS = ["fwd_ms", "bwd_ms", "fwd_x_gemm", "fwd_bwd_x_gemm", "bwd_extra_gb", "logp_bitwise_vs_shipped",
                 "dh_max_diff_vs_shipped", "dw_max_diff_vs_shipped", "invariant", "error"]


def print_sweeps(tiles, bwd_kernels, bwd_configs) -> None:
    if tiles:
        print_table(tiles, ["BLOCK_T", "BLOCK_V", "BLOCK_H", "num_warps", "num_stages",
                            *SWEEP_COLUMNS])
    if bwd_kernels:
        print_table(bwd_kernels, ["kernel", "tiles", "ms", "tflop_per_s", "error"])
    if bwd_configs:
        print_table(bwd_configs, ["config", *SWEEP_COLUMNS])


def sampling_sweeps(args, warmup, rep) -> None:
    copy = measure("copy ceiling", copy_ceiling)
    weight = (torch.randn(VOCAB, HIDDEN, device="cuda") * HIDDEN ** -0.5).to(torch.bfloat16)
    trainer = ours.trainer_read_config(torch.bfloat16)
    rows = sampling_sweep(SAMPLING_TOKENS, weight, [trainer, *({**trainer, **c} for c in SAMPLING_SWEEP)],
                          copy.get("gb_per_s", float("nan")), lambda fn: bench_ms(fn, warmup=warmup, rep=rep))
    print(f"copy {copy.get('gb_per_s', float('nan')):.0f} GB/s; the lm_head weight {VOCAB} x {HIDDEN} bf16")
    print_table(rows, ["tokens", "tiles", "reference", "shipped", "ms", "floor_ms", "pct_of_copy",
                       "bitwise_vs_reference", "error"])
    write_json(args.out, "linear_logp_sampling", {
        "hidden": HIDDEN, "vocab": VOCAB, "copy": copy, "reference_config": trainer,
        "shipped_config": ours.sampling_config(torch.bfloat16), "rows": rows})


def sweeps(args) -> int:
    warmup, rep = (5, 30) if args.quick else (10, 60)
    print(environment())
    if args.sampling_sweep:
        sampling_sweeps(args, warmup, rep)
        if not (args.tile_sweep or args.bwd_sweep):
            return 0
    tiles = tile_sweep(MAIN_TOKENS, warmup, rep) if args.tile_sweep else []
    bwd_kernels = bwd_kernel_sweep(MAIN_TOKENS, warmup, rep) if args.bwd_sweep else []
    bwd_configs = bwd_sweep(MAIN_TOKENS, warmup, rep) if args.bwd_sweep else []
    print_sweeps(tiles, bwd_kernels, bwd_configs)
    write_json(args.out, "linear_logp_sweeps", {
        "hidden": HIDDEN, "vocab": VOCAB, "tokens": MAIN_TOKENS, "shipped_config": ours._GPU_CONFIGS,
        "tile_sweep": tiles, "bwd_kernel_sweep": bwd_kernels, "bwd_sweep": bwd_configs,
    })
    return 0


def main() -> int:
    parser = arg_parser(__doc__.splitlines()[0])
    parser.add_argument("--tile-sweep", action="store_true", help="also time alternative logits-tile configs")
    parser.add_argument("--bwd-sweep", action="store_true", help="also time backward kernels and configs")
    parser.add_argument("--sampling-sweep", action="store_true",
                        help="also time the rollout's lm_head read (sampling_logits) at N = 1..256 under other tiles")
    parser.add_argument("--sweeps-only", action="store_true", help="skip the comparison with the peers")
    args = parse_gpu_args(parser)
    if args.sweeps_only:
        return sweeps(args)
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
        shape_gemm = measure(f"cuBLAS GEMM tokens={tokens}", lm_head_gemm, tokens, VOCAB, HIDDEN)
        gemm_at[tokens] = shape_gemm
        gemm_ms = shape_gemm.get("ms", float("nan"))
        rows.append({"impl": "cublas_gemm", "tokens": tokens, "fwd_ms": gemm_ms,
                     "fwd_tflop_per_s": shape_gemm.get("tflop_per_s"), "fwd_x_gemm": 1.0,
                     "gemm_layout": shape_gemm.get("layout")})
        hidden, weight, targets = make_inputs(tokens)
        ref = NativeLinearLogpOp()(hidden=hidden, lm_head_weight=weight, target_ids=targets)  # fp32, TF32 off
        del hidden, weight, targets
        reference = lm_head_product(tokens, VOCAB, HIDDEN, shape_gemm.get("layout", LM_HEAD_LAYOUTS[0]))
        for name, fn in impls.items():
            row = measure(f"{name} tokens={tokens}", run_one, name, fn, tokens, ref, reference, warmup, rep)
            rows.append({"impl": name, "tokens": tokens, **row})
        del ref, reference
    if "liger" not in impls:
        rows.append({"impl": "liger", "error": "unavailable"})
    tiles = tile_sweep(MAIN_TOKENS, warmup, rep) if args.tile_sweep else []
    bwd_kernels = bwd_kernel_sweep(MAIN_TOKENS, warmup, rep) if args.bwd_sweep else []
    bwd_configs = bwd_sweep(MAIN_TOKENS, warmup, rep) if args.bwd_sweep else []

    columns = ["impl", "tokens", "fwd_ms", "fwd_x_gemm", "fwd_tflop_per_s", "fwd_bwd_ms", "fwd_bwd_x_gemm",
               "fwd_extra_gb", "fwd_bwd_extra_gb", "fwd_bwd_work_gb", "max_abs_err", "error"]
    print_table(rows, columns)
    print_sweeps(tiles, bwd_kernels, bwd_configs)
    if args.sampling_sweep:
        sampling_sweeps(args, warmup, rep)
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
        "bwd_kernel_sweep": bwd_kernels, "bwd_sweep": bwd_configs,
    })
    save_plot(args.out, "linear_logp", [
        {"title": f"linear+logp forward, H={HIDDEN} V={VOCAB} bf16", "xlabel": "tokens",
         "ylabel": "ms / cuBLAS GEMM ms",
         "x": token_sweep, "series": series("fwd_x_gemm", names), "hline": (1.10, "goal 1.10x")},
        {"title": "forward + backward", "xlabel": "tokens", "ylabel": "ms / cuBLAS GEMM ms",
         "x": token_sweep, "series": series("fwd_bwd_x_gemm", list(impls)), "hline": (4.3, "goal 4.3x")},
        {"title": "peak memory beyond inputs and grads, fwd + bwd", "xlabel": "tokens", "ylabel": "GB",
         "x": token_sweep, "series": series("fwd_bwd_work_gb", list(impls)), "logy": True},
    ])
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
