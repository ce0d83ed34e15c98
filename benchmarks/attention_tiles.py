"""Which tile configuration should attention use? Times candidate tiles on the GPU, one kernel at a time.

    python benchmarks/attention_tiles.py --out benchmarks/results [--head-dims 128,64,256]

flash.py runs ONE tile configuration per (dtype, head_dim) for every layout (that is what keeps
prefill, packed, chunked and decode bitwise equal), so the choice is made once, here, offline:
bf16, causal, 32 query / 8 KV heads (Qwen3-8B), B·S = 16k tokens at S = 4096. For each head_dim the
forward, the dQ kernel and the dK/dV kernel are timed with each candidate tile while the other two
keep today's tiles; a candidate that does not compile (shared memory, registers) is recorded as such.
SDPA's default backend is timed in the same run for scale. The pick is written to the JSON; moving
it into `attention_config` is a code change that the GPU gate must then pass.
Each candidate runs twice, with K/V (forward, dQ) or Q/dO (dK/dV) read through TMA descriptors in the
unmasked key blocks (what `dispatch.row_descriptors` gives contiguous 16-bit rows) and through pointer
loads, and the forward checks that both give the same bits.
The KV split (`AttentionConfig.kv_split`) is swept the same way: the prefill forward at S = 4096 and
a decode step (one query per sequence, 8192 cached tokens, batch 1 and 16) for each candidate size,
with SDPA's decode beside it.
"""

from __future__ import annotations

import dataclasses
import json
import sys
import time

import torch
from common import arg_parser, bench_ms, parse_gpu_args, write_json

from rl_engine.kernels.ops.triton.attention import contract, dispatch
from rl_engine.kernels.ops.triton.attention.contract import TileConfig

Q_HEADS, KV_HEADS, TOKENS, S = 32, 8, 16384, 4096
CANDIDATES = {  # (block_m, block_n, num_warps, num_stages); `python -m rl_engine.kernels.ops.triton.sm90
    # --registers --tile M,N,W,S` screens spills on the CPU
    "forward": [(64, 64, 4, 3), (64, 64, 4, 4), (128, 64, 8, 3), (128, 128, 8, 2), (128, 128, 8, 3),
                (64, 128, 4, 3), (128, 64, 4, 3)],
    "backward_dq": [(64, 64, 4, 2), (64, 64, 4, 3), (128, 64, 8, 2), (128, 128, 8, 2), (64, 128, 4, 2)],
    "backward_dkdv": [(32, 64, 4, 3), (64, 64, 4, 2), (64, 64, 4, 3), (32, 128, 4, 3), (64, 128, 8, 2),
                      (16, 64, 4, 3)],
}
# Head dims above 128: the 64-wide tiles above overflow shared memory. Screened on the CPU for sm_90a
# (2026-12-01, spill bytes a thread): forward today (64,32,4,2) 2252, (64,32,8,2) 800, (64,64,8,2) 1084;
# dQ today 664, (64,32,8,2) 156; dK/dV today (32,32,4,2) 104 with no wgmma (32-row products take mma.sync),
# (64,32,8,2) 0, (32,64,8,2) 1052 with wgmma.
WIDE_CANDIDATES = {
    "forward": [(64, 32, 4, 2), (64, 32, 8, 2), (64, 64, 8, 2), (128, 32, 8, 2)],
    "backward_dq": [(64, 32, 4, 2), (64, 32, 8, 2), (128, 32, 8, 2), (64, 64, 8, 2)],
    "backward_dkdv": [(32, 32, 4, 2), (64, 32, 8, 2), (32, 64, 8, 2), (32, 32, 4, 3)],
}
TMA_MODES = {"both": (True, False), "on": (True,), "off": (False,)}


KV_SPLITS = (1024, 2048, 4096, 8192)
DECODE_CACHED, DECODE_BATCHES = 8192, (1, 16)


def causal_flops(head_dim: int) -> float:
    batch = TOKENS // S
    return 4.0 * batch * Q_HEADS * S * S * head_dim / 2


def make_inputs(head_dim: int):
    gen = torch.Generator(device="cuda").manual_seed(0)
    rows = TOKENS
    q = torch.randn(rows, Q_HEADS, head_dim, device="cuda", dtype=torch.bfloat16, generator=gen)
    k = torch.randn(rows, KV_HEADS, head_dim, device="cuda", dtype=torch.bfloat16, generator=gen)
    v = torch.randn(rows, KV_HEADS, head_dim, device="cuda", dtype=torch.bfloat16, generator=gen)
    do = torch.randn_like(q)
    batch = TOKENS // S
    starts = torch.arange(batch, device="cuda", dtype=torch.int32) * S
    count = torch.full_like(starts, S)
    table = contract.sequence_table(starts, count, torch.zeros_like(starts), starts, count,
                                 max_q_count=S, max_kv_len=S)
    return q, k, v, do, table


def with_config(cfg: contract.AttentionConfig, fn, tma: bool = True, keep: list | None = None) -> dict:
    """{"ms": median time of fn()} while flash runs `cfg` (pointer loads only when not `tma`), or
    {"error": ...}: a configuration that does not compile (shared memory, registers) is a result of the
    sweep, not its end. `keep` receives fn()'s first result."""
    original, descriptors = dispatch.attention_config, dispatch.row_descriptors
    dispatch.attention_config = lambda dtype, head_dim: cfg
    if not tma:
        dispatch.row_descriptors = lambda tensors, block_rows: None
    try:
        result = fn()
        if keep is not None:
            keep.append(result)
        torch.cuda.synchronize()
        return {"ms": bench_ms(fn)}
    except Exception as exc:  # noqa: BLE001
        return {"error": f"{type(exc).__name__}: {str(exc).splitlines()[0][:160]}"}
    finally:
        dispatch.attention_config, dispatch.row_descriptors = original, descriptors


def time_kernel(kind: str, tile: TileConfig, base: contract.AttentionConfig, inputs, scale: float, tma: bool,
                keep: list | None = None) -> dict:
    q, k, v, do, table = inputs
    cfg = dataclasses.replace(base, **{kind: tile})
    if kind == "forward":
        return with_config(cfg, lambda: dispatch.flash_forward(q, k, v, table, causal=True, scale=scale), tma, keep)
    out, lse = dispatch.flash_forward(q, k, v, table, causal=True, scale=scale)  # the backward's inputs
    return with_config(cfg, lambda: dispatch.flash_backward(do, q, k, v, out, lse, table, causal=True, scale=scale),
                       tma, keep)


def kv_split_sweep(head_dim: int, inputs, scale: float) -> list[dict]:
    from rl_engine.kernels.ops.triton.attention import triton_kv_cache_attention

    q, k, v, _, table = inputs
    base = dispatch.attention_config(torch.bfloat16, head_dim)
    gen = torch.Generator(device="cuda").manual_seed(1)
    decode = {}
    for b in DECODE_BATCHES:
        shape = (b, DECODE_CACHED, KV_HEADS, head_dim)
        decode[b] = (torch.randn(b, 1, Q_HEADS, head_dim, device="cuda", dtype=torch.bfloat16, generator=gen),
                     torch.randn(shape, device="cuda", dtype=torch.bfloat16, generator=gen),
                     torch.randn(shape, device="cuda", dtype=torch.bfloat16, generator=gen),
                     torch.full((b,), DECODE_CACHED, device="cuda", dtype=torch.int32))
    rows = []
    for split in KV_SPLITS:
        cfg = dataclasses.replace(base, kv_split=split)
        row = {"kv_split": split, "prefill_forward": with_config(
            cfg, lambda: dispatch.flash_forward(q, k, v, table, causal=True, scale=scale))}
        for b, args in decode.items():
            row[f"decode_b{b}"] = with_config(cfg, lambda args=args: triton_kv_cache_attention(*args))
        rows.append(row)
        print(f"hd {head_dim} kv_split {split}: " + ", ".join(
            f"{name} {r['ms']:.4f} ms" if "ms" in r else f"{name} {r['error']}"
            for name, r in row.items() if isinstance(r, dict)), flush=True)
    for b, (dq, dk, dv, _) in decode.items():
        qt, kt, vt = (t.transpose(1, 2) for t in (dq, dk, dv))
        ms = bench_ms(lambda qt=qt, kt=kt, vt=vt: torch.nn.functional.scaled_dot_product_attention(
            qt, kt, vt, enable_gqa=True))
        rows.append({"sdpa_default_decode": b, "ms": ms})
        print(f"hd {head_dim} sdpa default decode batch {b}: {ms:.4f} ms", flush=True)
    return rows


def sdpa_ms(inputs, backward: bool) -> float:
    q, k, v, do, _ = inputs
    batch = TOKENS // S
    qt, kt, vt = (t.view(batch, S, t.shape[1], t.shape[2]).transpose(1, 2).detach().requires_grad_(backward)
                  for t in (q, k, v))
    dot = do.view(batch, S, Q_HEADS, -1).transpose(1, 2)

    def step():
        out = torch.nn.functional.scaled_dot_product_attention(qt, kt, vt, is_causal=True, enable_gqa=True)
        if backward:
            out.backward(dot)
        return out

    return bench_ms(step)


def sweep(head_dim: int, tma_modes=(True, False), kv_split: bool = True) -> dict:
    inputs = make_inputs(head_dim)
    scale = head_dim ** -0.5
    base = dispatch.attention_config(torch.bfloat16, head_dim)
    result = {"head_dim": head_dim, "today": dataclasses.asdict(base), "kernels": {}}
    fwd_flops = causal_flops(head_dim)
    bwd_flops = 2.5 * fwd_flops
    for kind in CANDIDATES:
        candidates = (WIDE_CANDIDATES if head_dim > 128 else CANDIDATES)[kind]
        rows = []
        for bm, bn, warps, stages in candidates:
            outputs = []
            for tma in tma_modes:
                t0 = time.perf_counter()
                row = {"tile": [bm, bn, warps, stages], "tma": tma,
                       **time_kernel(kind, TileConfig(bm, bn, warps, stages), base, inputs, scale, tma, outputs)}
                if "ms" in row:
                    flops = fwd_flops if kind == "forward" else bwd_flops
                    row["tflops"] = flops / (row["ms"] * 1e-3) / 1e12
                if len(outputs) == 2:  # the same tile through TMA and through pointers: the same bits?
                    row["bits_equal_to_tma"] = all(torch.equal(a, b) for a, b in zip(*outputs))
                rows.append(row)
                print(f"hd {head_dim} {kind:14s} {str(row['tile']):18s} tma={tma!s:5s} "
                      + (f"{row['ms']:.3f} ms {row['tflops']:.0f} TFLOP/s" if "ms" in row else row["error"])
                      + (f" bits equal to tma: {row['bits_equal_to_tma']}" if "bits_equal_to_tma" in row else "")
                      + f"  ({time.perf_counter() - t0:.1f} s)", flush=True)
        timed = [r for r in rows if "ms" in r]
        best = min(timed, key=lambda r: r["ms"]) if timed else None
        result["kernels"][kind] = {"rows": rows, "best": best and {"tile": best["tile"], "tma": best["tma"]}}
    if kv_split:
        result["kv_split"] = kv_split_sweep(head_dim, inputs, scale)
    fwd = sdpa_ms(inputs, backward=False)
    both = sdpa_ms(inputs, backward=True)
    result["sdpa_default"] = {"forward_ms": fwd, "forward_tflops": fwd_flops / (fwd * 1e-3) / 1e12,
                              "forward+backward_ms": both}
    print(f"hd {head_dim} sdpa default: forward {fwd:.3f} ms, forward+backward {both:.3f} ms", flush=True)
    return result


def main() -> int:
    parser = arg_parser(__doc__)
    parser.add_argument("--head-dims", default="128,64", help="comma-separated head sizes (default 128,64)")
    parser.add_argument("--tma", choices=sorted(TMA_MODES), default="both",
                        help="time each tile with TMA loads, pointer loads, or both (default)")
    parser.add_argument("--kinds", default=",".join(CANDIDATES), help="kernels to sweep (default: all three)")
    parser.add_argument("--no-kv-split", action="store_true", help="skip the KV-split sweep")
    args = parse_gpu_args(parser)
    kinds = args.kinds.split(",")
    unknown = sorted(set(kinds) - set(CANDIDATES))
    if unknown:
        parser.error(f"--kinds: unknown {', '.join(unknown)} (known: {', '.join(CANDIDATES)})")
    for kind in set(CANDIDATES) - set(kinds):
        del CANDIDATES[kind]
    report = {"shape": {"q_heads": Q_HEADS, "kv_heads": KV_HEADS, "tokens": TOKENS, "S": S, "dtype": "bfloat16"},
              "sweeps": [sweep(int(h), TMA_MODES[args.tma], not args.no_kv_split)
                         for h in args.head_dims.split(",")]}
    write_json(args.out, "attention_tiles", report)
    print(json.dumps({s["head_dim"]: {k: v["best"] for k, v in s["kernels"].items()} for s in report["sweeps"]}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
