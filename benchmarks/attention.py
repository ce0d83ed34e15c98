"""Attention on the H200 at Qwen3-8B head geometry (32 query / 8 KV heads, head_dim 128, bf16).

Prefill (causal, B·S = 16k tokens, S = 1k…8k), forward and forward+backward: our Triton kernel
against PyTorch SDPA (flash backend) and flash-attn when importable: ms, TFLOP/s, % of the bf16
GEMM ceiling, ratio to each peer (peer ms / our ms: > 1 means we are faster).
Also: a bitwise consistency spot check (each sequence alone vs packed, chunked by 7, decoded token
by token) at the same geometry, recorded as mismatching token counts (all should be 0).
Decode (one query per row, batch 1…64 × cached 1k…8k tokens): ours against SDPA on the cache and
flash-attn's flash_attn_with_kvcache when importable: ms, GB/s of K/V read, % of the copy ceiling,
ratio to each peer.

    python benchmarks/attention.py --out benchmarks/results [--quick]
"""

from __future__ import annotations

import sys

import torch
from common import (
    add_ratios,
    arg_parser,
    bench_ms,
    copy_ceiling,
    gemm_ceiling,
    measure,
    optional_import,
    parse_gpu_args,
    print_table,
    record_bandwidth,
    save_plot,
    write_json,
)

from rl_engine.kernels.ops.triton.attention import triton_attention, triton_kv_cache_attention

HQ, HKV, D = 32, 8, 128
TOKENS = 16384
DTYPE = torch.bfloat16
DEVICE = "cuda"


def causal_forward_flops(b: int, s: int) -> float:
    # Two products (QKᵀ and PV) of 2·S·S·D flops per head, halved by causality.
    return 4.0 * b * HQ * s * s * D / 2


def sdpa_prefill(q, k, v):
    from torch.nn.attention import SDPBackend, sdpa_kernel

    qt, kt, vt = (t.transpose(1, 2) for t in (q, k, v))
    with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
        return torch.nn.functional.scaled_dot_product_attention(qt, kt, vt, is_causal=True, enable_gqa=True)


def sdpa_decode(q, k_cache, v_cache, lengths):
    # Every cached position is valid (lengths = Smax) and the query is the last token: plain attention.
    qt, kt, vt = (t.transpose(1, 2) for t in (q, k_cache, v_cache))
    return torch.nn.functional.scaled_dot_product_attention(qt, kt, vt, enable_gqa=True)


def timed_forward(fn, args, flops, gemm_tflops):
    ms = bench_ms(lambda: fn(*args))
    tflops = flops / (ms * 1e-3) / 1e12
    return {"ms": ms, "tflop_per_s": tflops, "pct_gemm": 100 * tflops / gemm_tflops}


def timed_forward_backward(fn, args, flops, gemm_tflops):
    leaves = [a.detach().clone().requires_grad_() for a in args]
    grad = torch.randn_like(fn(*leaves))

    def step():
        for leaf in leaves:
            leaf.grad = None
        fn(*leaves).backward(grad)

    ms = bench_ms(step)
    tflops = 3.5 * flops / (ms * 1e-3) / 1e12  # backward = 5 products, 2.5x the forward
    return {"ms": ms, "tflop_per_s": tflops, "pct_gemm": 100 * tflops / gemm_tflops}


def time_call(fn, args):
    return {"ms": bench_ms(lambda: fn(*args))}


def consistency_check(lengths=(2048, 1000, 333, 1), chunk=7) -> dict:
    """Mismatching tokens (bitwise) of packed / chunked / decode outputs against each sequence alone."""
    gen = torch.Generator(device=DEVICE).manual_seed(0)
    seqs = [[torch.randn(n, h, D, device=DEVICE, dtype=DTYPE, generator=gen) for h in (HQ, HKV, HKV)]
            for n in lengths]
    alone = [triton_attention(q[None], k[None], v[None])[0] for q, k, v in seqs]
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32, device=DEVICE)
    packed = triton_attention(*[torch.cat([s[i] for s in seqs]) for i in range(3)], cu_seqlens=cu)
    smax = max(lengths)
    k_cache, v_cache = (torch.zeros(len(seqs), smax, HKV, D, device=DEVICE, dtype=DTYPE) for _ in range(2))
    for b, (_, k, v) in enumerate(seqs):
        k_cache[b, : len(k)], v_cache[b, : len(v)] = k, v
    chunked = [torch.cat([
        triton_kv_cache_attention(q[None, a: a + chunk], k_cache[b: b + 1], v_cache[b: b + 1],
                                  torch.tensor([min(a + chunk, len(q))], device=DEVICE))[0]
        for a in range(0, len(q), chunk)]) for b, (q, _, _) in enumerate(seqs)]
    steps = []
    for t in range(smax):  # all rows decode together; a finished row repeats its last token
        pos = torch.tensor([min(t, n - 1) for n in lengths], device=DEVICE)
        q = torch.stack([s[0][p] for s, p in zip(seqs, pos.tolist())])[:, None]
        steps.append(triton_kv_cache_attention(q, k_cache, v_cache, pos + 1)[:, 0])
    decoded = [torch.stack([steps[t][b] for t in range(n)]) for b, n in enumerate(lengths)]
    forms = {"packed": [packed[cu[b]: cu[b + 1]] for b in range(len(seqs))], f"chunked_{chunk}": chunked,
             "decode": decoded}
    result = {"lengths": list(lengths), "tokens": sum(lengths)}
    for name, outs in forms.items():
        result[f"{name}_mismatching_tokens"] = sum(
            int((o != a).any(dim=(1, 2)).sum()) for o, a in zip(outs, alone)
        )
    return result


def max_abs_diff(peer, args):
    ours, theirs = triton_attention(*args), peer(*args).transpose(1, 2)
    return {"max_abs_diff": (ours.float() - theirs.float()).abs().max().item()}


def prefill_rows(seq_lens, peers, gemm_tflops):
    rows = []
    for s in seq_lens:
        b = max(TOKENS // s, 1)
        q = torch.randn(b, s, HQ, D, device=DEVICE, dtype=DTYPE)
        k, v = (torch.randn(b, s, HKV, D, device=DEVICE, dtype=DTYPE) for _ in range(2))
        flops = causal_forward_flops(b, s)
        for mode, timer in (("forward", timed_forward), ("forward+backward", timed_forward_backward)):
            row = {"S": s, "B": b, "mode": mode}
            for name, fn in {"triton": triton_attention, **peers}.items():
                result = measure(f"prefill S={s} {mode} {name}", timer, fn, (q, k, v), flops, gemm_tflops)
                row[f"{name}_ms"] = result.get("ms")
                row[f"{name}_tflop_per_s"] = result.get("tflop_per_s")
                row[f"{name}_pct_gemm"] = result.get("pct_gemm")
                if "error" in result:
                    row[f"{name}_error"] = result["error"]
            if mode == "forward" and "sdpa" in peers:
                diff = measure(f"prefill S={s} max |triton - sdpa|", max_abs_diff, peers["sdpa"], (q, k, v))
                row["max_abs_diff_vs_sdpa"] = diff.get("max_abs_diff")
            for name in peers:
                if row.get("triton_ms") and row.get(f"{name}_ms"):
                    row[f"ratio_vs_{name}"] = row[f"{name}_ms"] / row["triton_ms"]
            rows.append(row)
        del q, k, v
    return rows


def decode_rows(batches, cache_lens, peers, copy_gbps):
    rows = []
    for b in batches:
        for n in cache_lens:
            row = {"batch": b, "cached": n}
            try:
                q = torch.randn(b, 1, HQ, D, device=DEVICE, dtype=DTYPE)
                k_cache, v_cache = (torch.randn(b, n, HKV, D, device=DEVICE, dtype=DTYPE) for _ in range(2))
                lengths = torch.full((b,), n, device=DEVICE, dtype=torch.int32)
            except torch.OutOfMemoryError as exc:
                rows.append({**row, "error": str(exc)[:200]})
                continue
            kv_bytes = 2 * b * n * HKV * D * k_cache.element_size()
            fns = {"triton": triton_kv_cache_attention, **peers}
            for name, fn in fns.items():
                result = measure(f"decode B={b} cached={n} {name}", time_call, fn, (q, k_cache, v_cache, lengths))
                record_bandwidth(row, name, result, kv_bytes, copy_gbps)
            add_ratios(row, fns)
            rows.append(row)
            del q, k_cache, v_cache
    return rows


def main() -> int:
    args = parse_gpu_args(arg_parser(__doc__.splitlines()[0]))
    seq_lens = [1024, 4096] if args.quick else [1024, 2048, 4096, 8192]
    batches = [1, 64] if args.quick else [1, 4, 16, 64]
    cache_lens = [1024, 8192] if args.quick else [1024, 2048, 4096, 8192]

    flash_attn = optional_import("flash_attn")
    print(f"flash-attn: {getattr(flash_attn, '__version__', 'unavailable')}")
    gemm = measure("bf16 GEMM ceiling", gemm_ceiling)
    copy = measure("copy ceiling", copy_ceiling)
    gemm_tflops, copy_gbps = gemm.get("tflop_per_s", float("nan")), copy.get("gb_per_s", float("nan"))

    prefill_peers = {"sdpa": sdpa_prefill}
    if flash_attn is not None:
        prefill_peers["flash_attn"] = lambda q, k, v: flash_attn.flash_attn_func(q, k, v, causal=True)
    prefill = prefill_rows(seq_lens, prefill_peers, gemm_tflops)
    decode_peers = {"sdpa": sdpa_decode}
    if flash_attn is not None:
        decode_peers["flash_attn"] = lambda q, k, v, lengths: flash_attn.flash_attn_with_kvcache(
            q, k, v, cache_seqlens=lengths
        )
    decode = decode_rows(batches, cache_lens, decode_peers, copy_gbps)

    consistency = measure("bitwise consistency: prefill vs packed / chunked / decode", consistency_check)
    print(f"consistency: {consistency}")

    peer_names = list(prefill_peers)
    print("\nprefill (causal, B*S = 16k tokens); ratio = peer ms / triton ms")
    columns = ["S", "B", "mode", "triton_ms", "triton_tflop_per_s", "triton_pct_gemm", "max_abs_diff_vs_sdpa"]
    print_table(prefill, columns
                + [c for p in peer_names for c in (f"{p}_ms", f"{p}_tflop_per_s", f"ratio_vs_{p}")])
    print("\ndecode (1 query per row); GB/s of K/V read; ratio = peer ms / triton ms")
    print_table(decode, ["batch", "cached", "triton_ms", "triton_gb_per_s", "triton_pct_copy"]
                + [c for p in peer_names for c in (f"{p}_ms", f"{p}_gb_per_s", f"ratio_vs_{p}")])

    write_json(args.out, "attention", {
        "geometry": {"q_heads": HQ, "kv_heads": HKV, "head_dim": D, "dtype": str(DTYPE), "tokens": TOKENS},
        "flash_attn": getattr(flash_attn, "__version__", "unavailable"),
        "ceilings": {"gemm": gemm, "copy": copy},
        "consistency": consistency,
        "prefill": prefill,
        "decode": decode,
    })
    panels = []
    for mode in ("forward", "forward+backward"):
        rows = [r for r in prefill if r["mode"] == mode]
        panels.append({
            "title": f"prefill {mode}", "xlabel": "S (B*S = 16k)", "ylabel": "TFLOP/s",
            "x": [r["S"] for r in rows],
            "series": {n: [r.get(f"{n}_tflop_per_s") for r in rows] for n in ["triton", *peer_names]},
            "hline": (gemm_tflops, "bf16 GEMM"),
        })
    largest = max(batches)
    rows = [r for r in decode if r["batch"] == largest]
    panels.append({
        "title": f"decode, batch {largest}", "xlabel": "cached tokens", "ylabel": "GB/s of K/V read",
        "x": [r["cached"] for r in rows],
        "series": {n: [r.get(f"{n}_gb_per_s") for r in rows] for n in ["triton", *decode_peers]},
        "hline": (copy_gbps, "device copy"),
    })
    panels.append({
        "title": "decode: ratio to SDPA (peer ms / ours)", "xlabel": "cached tokens", "ylabel": "ratio",
        "x": cache_lens,
        "series": {f"batch {b}": [next((r.get("ratio_vs_sdpa") for r in decode
                                        if r["batch"] == b and r["cached"] == n), None) for n in cache_lens]
                   for b in batches},
        "hline": (1.0, "parity"),
    })
    save_plot(args.out, "attention", panels)
    return 0


if __name__ == "__main__":
    sys.exit(main())
