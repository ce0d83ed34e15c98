"""Decode attention over a paged KV cache read through its block table vs the contiguous cache (issue #54).

    python benchmarks/paged_decode.py                 # H200: Qwen3-8B heads (32/8 x 128, bf16), page 16
    python benchmarks/paged_decode.py --no-timing     # the bitwise checks only
    TRITON_INTERPRET=1 python benchmarks/paged_decode.py --smoke   # CPU: tiny shapes, the script's own check

For each (batch, context) it builds a pool of pages in shuffled order (spare pages between them) and the contiguous
cache those pages make, and checks bitwise: paged == contiguous as `kv_cache_attention` routes it (the Gluon decode on
the H200) and == contiguous through flash.py's kernel; paged runs flash.py's kernel (gluon_decode.PAGED off, the
default) and, as `paged_gluon`, the Gluon decode's page copies (PAGED on). Timings (CUDA graphs, median ms, GPU
time): contiguous (default route), contiguous through flash.py, paged, paged_gluon, and gather + contiguous (what the
rollout's paged cache did before: one copy of the batch's pages per layer). Prints one JSON line per row and exits 1
if any bits differ.
"""

from __future__ import annotations

import argparse
import json
import sys

import torch


def build(batch: int, context: int, page: int, hq: int, hkv: int, d: int, device: str, seed: int = 0):
    """q [B,1,Hq,D], pools, block table (shuffled pages among spare ones), lengths (context minus a row-dependent
    few, so rows end in different blocks), and the contiguous caches the pages make."""
    from rl_engine.kernels.ops.pytorch.attention.kv_cache_attention import paged_cache_view

    gen = torch.Generator(device=device).manual_seed(seed)
    width = -(-context // page)
    num_blocks = batch * width + max(batch * width // 8, 4)
    pools = [torch.randn(num_blocks, page, hkv, d, generator=gen, device=device, dtype=torch.bfloat16)
             for _ in range(2)]
    perm = torch.randperm(num_blocks, generator=gen, device=device)[: batch * width]
    table = perm.view(batch, width).to(torch.int32).contiguous()
    lengths = (context - (torch.arange(batch, device=device) * 37) % min(200, context)).to(torch.int32)
    q = torch.randn(batch, 1, hq, d, generator=gen, device=device, dtype=torch.bfloat16)
    caches = [paged_cache_view(p, table) for p in pools]
    return q, pools, table, lengths, caches


def _flash_only():
    """A context that sends contiguous calls to flash.py's kernel (the Gluon decode off)."""
    import contextlib
    from unittest import mock

    from rl_engine.kernels.ops.triton.attention import gluon_decode

    return mock.patch.object(gluon_decode, "covers", lambda *a: False) if torch.cuda.is_available() \
        else contextlib.nullcontext()


def _gluon_paged(on: bool):
    """A context that sets gluon_decode.PAGED (paged calls through the Gluon decode's page copies, on the H200)."""
    from unittest import mock

    from rl_engine.kernels.ops.triton.attention import gluon_decode

    return mock.patch.object(gluon_decode, "PAGED", on)


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and torch.equal(a.view(torch.int16), b.view(torch.int16))


def graph_ms(fn) -> float:
    from triton.testing import do_bench_cudagraph

    return float(do_bench_cudagraph(fn, rep=50, return_mode="median"))


def row(batch: int, context: int, page: int, hq: int, hkv: int, d: int, device: str, timing: bool) -> dict:
    from rl_engine.kernels.ops.pytorch.attention.kv_cache_attention import paged_cache_view
    from rl_engine.kernels.ops.triton.attention import triton_kv_cache_attention as attend

    q, (kp, vp), table, lengths, (kc, vc) = build(batch, context, page, hq, hkv, d, device)
    with _gluon_paged(False):
        paged = attend(q, kp, vp, lengths, block_table=table)
    with _gluon_paged(True):
        paged_gluon = attend(q, kp, vp, lengths, block_table=table)
    contiguous = attend(q, kc, vc, lengths)
    with _flash_only():
        flash_tiles = attend(q, kc, vc, lengths)
    out = {"batch": batch, "context": context, "page": page, "heads": f"{hq}/{hkv}x{d}",
           "finite": bool(torch.isfinite(paged).all()),
           "paged_eq_contiguous": _same(paged, contiguous), "paged_eq_contiguous_flash": _same(paged, flash_tiles),
           "paged_gluon_eq_contiguous": _same(paged_gluon, contiguous)}
    if timing and device == "cuda":
        out["ms_contiguous"] = graph_ms(lambda: attend(q, kc, vc, lengths))
        with _flash_only():
            out["ms_contiguous_flash"] = graph_ms(lambda: attend(q, kc, vc, lengths))
        with _gluon_paged(False):
            out["ms_paged"] = graph_ms(lambda: attend(q, kp, vp, lengths, block_table=table))
        with _gluon_paged(True):
            out["ms_paged_gluon"] = graph_ms(lambda: attend(q, kp, vp, lengths, block_table=table))
        out["ms_gather_then_contiguous"] = graph_ms(
            lambda: attend(q, paged_cache_view(kp, table), paged_cache_view(vp, table), lengths))
        kv_bytes = 2 * int(lengths.sum()) * hkv * d * 2
        out["paged_GBps"] = kv_bytes / out["ms_paged"] / 1e6
    return out


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batches", default="1,16,64", help="comma-separated batch sizes")
    parser.add_argument("--contexts", default="1024,4096", help="comma-separated cached lengths")
    parser.add_argument("--page", type=int, default=16, help="page_block_size")
    parser.add_argument("--no-timing", action="store_true", help="the bitwise checks only")
    parser.add_argument("--smoke", action="store_true", help="tiny shapes (CPU, Triton interpreter)")
    args = parser.parse_args(argv)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cpu" and not args.smoke:
        parser.exit(2, "paged_decode: no CUDA device; pass --smoke for the CPU check at tiny shapes\n")
    hq, hkv, d = (4, 2, 16) if args.smoke else (32, 8, 128)
    batches = [1, 3] if args.smoke else [int(x) for x in args.batches.split(",")]
    contexts = [37] if args.smoke else [int(x) for x in args.contexts.split(",")]
    page = 3 if args.smoke else args.page
    bad = 0
    for b in batches:
        for n in contexts:
            r = row(b, n, page, hq, hkv, d, device, not args.no_timing)
            bad += not all(r[key] for key in ("finite", "paged_eq_contiguous", "paged_eq_contiguous_flash",
                                              "paged_gluon_eq_contiguous"))
            print(json.dumps(r), flush=True)
    print(f"paged_decode: {'BITS DIFFER in ' + str(bad) + ' rows' if bad else 'paged == contiguous bitwise'}")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
