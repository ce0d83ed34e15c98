"""One mHC site (DeepSeek-V4 form), forward and forward+backward, on the H200.

    python benchmarks/mhc.py --out DIR [--quick] [--oracle-max-tokens N]

Compares, at hidden 4096 and 7168 and T = 4096 … 32768 tokens:
  triton   - TritonProvider (strict-fp32-v1, bitwise equal to the oracle);
  oracle   - the strict-fp32 oracle run through torch on CUDA (only up to --oracle-max-tokens: its
             controller GEMM materialises a [T, 24, 4C] fp32 product, 11 GB at T = 4096, C = 7168);
  compiled - torch.compile of the plain, non-strict formulas (matmul, rsqrt, sigmoid, softmax, a
             Sinkhorn loop, einsum), autograd for the backward.
Every path runs the same site: controller, Sinkhorn, mhc_pre, RMSNorm, the sublayer stand-in
o = bf16(y · scale), mhc_post; the backward produces the stream, φ, α, bias and γ gradients.
Byte floor (what any implementation must move): forward reads X and writes X' (16·C·T bytes, bf16);
the backward also reads X and dX' and writes dX (24·C·T). % of copy = floor ÷ time ÷ copy bandwidth.
Goal: triton within 1.5× of compiled.
"""

from __future__ import annotations

import sys
import time
from functools import partial

import torch
from common import (  # noqa: I001 - common puts the repository root on sys.path
    arg_parser,
    bench_ms,
    copy_ceiling,
    environment,
    measure,
    parse_gpu_args,
    print_table,
    save_plot,
    write_json,
)

from rl_engine.mhc import oracle
from rl_engine.mhc.contract import LayerContract
from rl_engine.mhc.triton_provider import TritonProvider

F32, BF16 = torch.float32, torch.bfloat16


def make_inputs(tokens: int, hidden: int, device="cuda"):
    gen = torch.Generator(device=device).manual_seed(tokens + hidden)
    k = 4 * hidden
    return {
        "x": torch.randn(tokens, 4, hidden, device=device, generator=gen).to(BF16),
        "grad": (torch.randn(tokens, 4, hidden, device=device, generator=gen) * 0.5).to(BF16),
        "phi": torch.randn(24, k, device=device, generator=gen) / k ** 0.5,
        "alpha": torch.tensor([0.8, 0.6, 1.5], device=device),
        "bias": 0.5 * torch.randn(24, device=device, generator=gen),
        "gamma": 1.0 + 0.1 * torch.randn(hidden, device=device, generator=gen),
        "scale": 0.5 * torch.randn(hidden, device=device, generator=gen),
    }


def strict_site(ops, inp: dict, c: LayerContract, backward: bool):
    """oracle.mhc_site's call sequence without its input validation (a host sync per check)."""
    x = inp["x"]
    p, r = ops.fp32_gemm_rms_fwd(x, inp["phi"], c)
    h = ops.controller_affine_fwd(p, r, inp["alpha"], inp["bias"], c)
    h_pre, h_post, h_res = ops.hc_split_sinkhorn_fwd(h, c)
    u = ops.mhc_pre_fwd(x, h_pre, c)
    y, _ = ops.rmsnorm_residual_fwd(u, inp["gamma"], None, c)
    o = oracle.sublayer_standin_fwd(y, inp["scale"])
    out = ops.mhc_post_fwd(x, o, h_post, h_res, c)
    if not backward:
        return out
    d_o, d_x_post, d_h_post, d_h_res = ops.mhc_post_bwd(x, o, h_post, h_res, inp["grad"], c)
    d_y = oracle.sublayer_standin_bwd(d_o, inp["scale"])
    d_u, d_gamma = ops.rmsnorm_residual_bwd(u, inp["gamma"], d_y, None, c)
    d_x_pre, d_h_pre = ops.mhc_pre_bwd(x, h_pre, d_u, c)
    d_h = ops.hc_split_sinkhorn_bwd(h, d_h_pre, d_h_post, d_h_res, c)
    d_p, d_r, d_alpha, d_bias = ops.controller_affine_bwd(p, r, inp["alpha"], d_h, c)
    d_x_ctrl, d_phi = ops.fp32_gemm_rms_bwd(x, inp["phi"], r, d_p, d_r, c)
    return ((d_x_post + d_x_pre) + d_x_ctrl).to(BF16), d_phi, d_alpha, d_bias, d_gamma


def plain_site(x, phi, alpha, bias, gamma, scale, eps: float = 1e-6, iters: int = 20):
    """The plain (non-strict) formulas of one site, for torch.compile."""
    t, n, c = x.shape
    xf = x.reshape(t, n * c).float()
    p = xf @ phi.t()
    r = torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    a = torch.cat([alpha[0:1].expand(4), alpha[1:2].expand(4), alpha[2:3].expand(16)])
    h = (r * p) * a + bias
    h_pre = torch.sigmoid(h[:, :4]) + eps
    h_post = 2.0 * torch.sigmoid(h[:, 4:8])
    m = torch.softmax(h[:, 8:].reshape(t, 4, 4), dim=-1) + eps
    m = m / (m.sum(-2, keepdim=True) + eps)
    for _ in range(iters - 1):
        m = m / (m.sum(-1, keepdim=True) + eps)
        m = m / (m.sum(-2, keepdim=True) + eps)
    u = torch.einsum("ti,tic->tc", h_pre, x.float()).to(BF16)
    uf = u.float()
    y = (uf * torch.rsqrt(uf.pow(2).mean(-1, keepdim=True) + eps) * gamma).to(BF16)
    o = (y.float() * scale).to(BF16)
    out = h_post[:, :, None] * o.float()[:, None, :] + torch.einsum("tij,tic->tjc", m, x.float())
    return out.to(BF16)


_compiled = None


def compiled_site(inp: dict, backward: bool):
    global _compiled
    if _compiled is None:
        _compiled = torch.compile(plain_site, dynamic=True)
    if not backward:
        with torch.no_grad():
            return _compiled(inp["x"], inp["phi"], inp["alpha"], inp["bias"], inp["gamma"], inp["scale"])
    leaves = [inp[k].detach().requires_grad_() for k in ("x", "phi", "alpha", "bias", "gamma")]
    out = _compiled(*leaves, inp["scale"])
    return torch.autograd.grad(out, leaves, inp["grad"])


def time_it(fn, slow_ok: bool) -> dict:
    """Median ms via do_bench; a path slower than 1 s per call is timed once (do_bench would take minutes)."""
    torch.cuda.synchronize()
    start = time.perf_counter()
    fn()
    torch.cuda.synchronize()
    once = (time.perf_counter() - start) * 1e3
    if slow_ok and once > 1000:
        start = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        return {"ms": (time.perf_counter() - start) * 1e3, "timing": "single call (slow path)"}
    return {"ms": bench_ms(fn, warmup=10, rep=60), "timing": "do_bench median"}


def main() -> int:
    parser = arg_parser("one mHC site: strict Triton provider vs oracle on CUDA vs torch.compile (plain)")
    parser.add_argument("--oracle-max-tokens", type=int, default=4096,
                        help="run the oracle path only up to this many tokens (default 4096)")
    args = parse_gpu_args(parser)
    torch.backends.cuda.matmul.allow_tf32 = False
    env = environment()
    print(f"{env['device_name']}  torch {env['torch']}  triton {env['triton']}", flush=True)
    copy = measure("copy ceiling", copy_ceiling)
    copy_bw = copy.get("gb_per_s")
    tokens_list = [4096, 16384] if args.quick else [4096, 8192, 16384, 32768]
    hiddens = [4096] if args.quick else [4096, 7168]
    provider = TritonProvider()
    rows, skipped = [], []
    for hidden in hiddens:
        contract = LayerContract(hidden=hidden)
        for tokens in tokens_list:
            inp = make_inputs(tokens, hidden)
            for mode, backward in (("forward", False), ("forward+backward", True)):
                floor = (16 if not backward else 40) * hidden * tokens
                paths = {"triton": partial(strict_site, provider, inp, contract, backward),
                         "compiled": partial(compiled_site, inp, backward)}
                if tokens <= args.oracle_max_tokens:
                    paths["oracle"] = partial(strict_site, oracle, inp, contract, backward)
                else:
                    skipped.append({"path": "oracle", "tokens": tokens, "hidden": hidden, "mode": mode,
                                    "reason": f"tokens > --oracle-max-tokens {args.oracle_max_tokens} "
                                              "(memory of the [T, 24, 4C] product, and minutes per call)"})
                row = {"hidden": hidden, "tokens": tokens, "mode": mode, "floor_bytes": floor}
                for name, fn in paths.items():
                    res = measure(f"{name} C={hidden} T={tokens} {mode}", time_it, fn, name == "oracle")
                    row[f"{name}_ms"] = res.get("ms")
                    if "error" in res:
                        row[f"{name}_error"] = res["error"]
                    elif copy_bw:
                        row[f"{name}_pct_copy"] = 100 * floor / (res["ms"] * 1e-3) / 1e9 / copy_bw
                if row.get("triton_ms") and row.get("compiled_ms"):
                    row["triton_over_compiled"] = row["triton_ms"] / row["compiled_ms"]
                    row["within_goal_1.5x"] = row["triton_over_compiled"] <= 1.5
                rows.append(row)
            inp = paths = None  # free before the next size
            torch.cuda.empty_cache()
    print_table(rows, ["hidden", "tokens", "mode", "triton_ms", "compiled_ms", "oracle_ms", "triton_over_compiled",
                       "triton_pct_copy", "compiled_pct_copy"])
    write_json(args.out, "mhc", {"copy_ceiling": copy, "rows": rows, "skipped": skipped,
                                 "byte_floor": "forward 16·C·T bytes (read X, write X'), forward+backward "
                                               "40·C·T (also read X and dX', write dX), bf16",
                                 "goal": "triton_ms ≤ 1.5 × compiled_ms"})
    panels = []
    for hidden in hiddens:
        for mode in ("forward", "forward+backward"):
            sel = [r for r in rows if r["hidden"] == hidden and r["mode"] == mode]
            panels.append({"title": f"mHC site C={hidden} {mode}", "xlabel": "tokens", "ylabel": "ms", "logy": True,
                           "x": [r["tokens"] for r in sel],
                           "series": {n: [r.get(f"{n}_ms") for r in sel] for n in ("triton", "compiled", "oracle")}})
    save_plot(args.out, "mhc", panels)
    return 0


if __name__ == "__main__":
    sys.exit(main())
