"""Attention, bf16, causal, 32 query / 8 KV heads (Qwen3-8B): ours against the fastest peer in the same run.

    python benchmarks/attention.py --out benchmarks/results [--quick] [--site-dir /tmp/fa4/site]

Prefill, B·S = 16k tokens, forward and forward+backward: head_dim 128 at S = 2k, 4k, 8k, head_dim 64
and 256 at S = 4k (--quick: the S = 4k rows). Peers, called as their users call them:
  sdpa        scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True), default backend;
              the backend torch picked is named per row (`sdpa_backend`: cudnn / flash / efficient /
              math, read from the profiler's op and kernel names; "unknown (...)" when they disagree)
  sdpa_flash  the same call inside sdpa_kernel(SDPBackend.FLASH_ATTENTION) (PyTorch's FA2 kernel):
              a weaker peer, kept to compare with older reports
  fa4         FlashAttention-4: flash_attn.cute.flash_attn_func(q, k, v, causal=True), [B,S,H,D], GQA by
              head counts; "unavailable: <reason>" when it cannot be imported. It is not on the H200
              image: scripts/fa4_wheels.sh carries it there and --site-dir adds where it was installed
              (site.addsitedir: the CuTe DSL finds its packages through a .pth file)
Per row: ms, TFLOP/s (forward: 4·B·Hq·S²·D/2 for QKᵀ and PV under the causal mask; forward+backward
3.5x that), % of the bf16 GEMM ceiling measured in the same run, max |ours - peer| of the forward,
ratio_vs_<peer> = peer ms / our ms (> 1: ours is faster), fastest_peer (by those single timings) and
ratio_vs_fastest, ours against it timed again in ABBA pairs (common.paired_ratio, 2 pairs each way: single
timings one after another put FA4 at 634 and 678 TFLOP/s in two runs on one machine while ours moved 0.4%,
docs/evidence/h200_bench_attention_fa4_d829ea3.log), and the goal of issue 16 marked met / missed on it: forward
>= 0.85x the fastest peer at S >= 4k, forward+backward >= 0.75x.
Decode (one query per row, batch 1…64 × cached 1k…8k tokens, head_dim 128): ours against SDPA default
(its backend named): ms, GB/s of K/V read, % of the copy ceiling, ratio; goals: >= 60% of copy at
batch >= 16 with >= 4k cached, and at batch 1 >= 0.6x SDPA's speed (FA4 is not timed in decode:
those goals are against SDPA). Each decode step is also timed replayed from a CUDA graph (GPU time,
the host removed, as rollout engines run decode); the goals are judged on those when captured, at batch 1
on the two graphs timed again in ABBA pairs (graph_ratio_timing; single timings of the 2k step gave 0.66x
in one run where alternating rounds on other machines gave 0.59-0.61x: h200_decode_batch1_ratio_spread.log).
Also: a bitwise consistency spot check (each sequence alone vs packed, chunked by 7, decoded token by
token), recorded as mismatching token counts (all should be 0).

--device cpu (hidden): toy shapes under the Triton interpreter, one wall-clock call per timing, no
ceilings: every other code path, for tests/benchmarks/test_attention_smoke.py.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.metadata
import math
import os
import site
import sys
import time

import torch
import torch.nn.functional as F
import triton
from common import (
    add_ratios,
    arg_parser,
    bench_ms,
    copy_ceiling,
    gemm_ceiling,
    measure,
    paired_ratio,
    print_table,
    record_bandwidth,
    save_plot,
    write_json,
)

DTYPE = torch.bfloat16
PEERS = ("sdpa", "sdpa_flash", "fa4")
DECODE_PEERS = ("sdpa",)
MODES = ("forward", "forward+backward")
FLOP_FACTOR = {"forward": 1.0, "forward+backward": 3.5}  # backward = 5 products, 2.5x the forward
# Issue 16's goals, ours / the fastest peer (speed): (ratio, from sequence length).
PREFILL_GOALS = {"forward": (0.85, 4096), "forward+backward": (0.75, 0)}


@dataclasses.dataclass(frozen=True)
class Shapes:
    q_heads: int
    kv_heads: int
    tokens: int  # B·S of every prefill row
    prefill: tuple[tuple[int, int], ...]  # (S, head_dim)
    quick_prefill: tuple[tuple[int, int], ...]
    decode_head_dim: int
    batches: tuple[int, ...]
    quick_batches: tuple[int, ...]
    cache_lens: tuple[int, ...]
    quick_cache_lens: tuple[int, ...]
    consistency_lengths: tuple[int, ...]
    chunk: int


H200 = Shapes(
    q_heads=32, kv_heads=8, tokens=16384,
    prefill=((2048, 128), (4096, 128), (8192, 128), (4096, 64), (4096, 256)),
    quick_prefill=((4096, 128), (4096, 64), (4096, 256)),
    decode_head_dim=128, batches=(1, 4, 16, 64), quick_batches=(1, 64),
    cache_lens=(1024, 2048, 4096, 8192), quick_cache_lens=(1024, 8192),
    consistency_lengths=(2048, 1000, 333, 1), chunk=7,
)
# The CPU smoke path: small enough for the interpreter; 17 tokens cross the 16-key blocks of small heads,
# and the chunk [14, 17) crosses that boundary.
TOY = Shapes(
    q_heads=4, kv_heads=2, tokens=32, prefill=((32, 16), (16, 32)), quick_prefill=((32, 16), (16, 32)),
    decode_head_dim=16, batches=(1, 2), quick_batches=(1, 2), cache_lens=(20,), quick_cache_lens=(20,),
    consistency_lengths=(17, 6, 1), chunk=7,
)


class Timer:
    """CUDA: triton's do_bench (median ms, L2 flushed). CPU (smoke path): the wall time of one call."""

    def __init__(self, device: str):
        self.cuda = device == "cuda"

    def ms(self, fn) -> float:
        if self.cuda:
            return bench_ms(fn)
        start = time.perf_counter()
        fn()
        return (time.perf_counter() - start) * 1e3

    def graph_ms(self, fn) -> float | None:
        """GPU time per call with the host removed: fn replayed from a CUDA graph (None on the CPU)."""
        if not self.cuda:
            return None
        from triton.testing import do_bench_cudagraph

        return float(do_bench_cudagraph(fn, rep=20, return_mode="median"))


# --------------------------------------------------------------------------------------------------
# implementations: every one takes and returns [B,S,H,D]


def sdpa(q, k, v, causal: bool = True):
    qt, kt, vt = (t.transpose(1, 2) for t in (q, k, v))
    return F.scaled_dot_product_attention(qt, kt, vt, is_causal=causal, enable_gqa=True).transpose(1, 2)


def sdpa_flash(q, k, v):
    from torch.nn.attention import SDPBackend, sdpa_kernel

    with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
        return sdpa(q, k, v)


def sdpa_decode(q, k_cache, v_cache, lengths):
    # Every cached position is valid (lengths = Smax) and the query is the last token: no mask.
    return sdpa(q, k_cache, v_cache, causal=False)


def load_fa4(site_dir: str | None = None) -> tuple[object, str]:
    """(flash_attn_func, version), or (None, "unavailable: <reason>") when it cannot be imported.

    site_dir is added with site.addsitedir first: the CuTe DSL finds its packages through a .pth file
    there, which PYTHONPATH alone does not read."""
    if site_dir:
        site.addsitedir(os.path.abspath(site_dir))
    try:
        from flash_attn.cute import flash_attn_func
    except Exception as exc:  # noqa: BLE001 - any import failure means "unavailable"
        first = str(exc).splitlines()[0] if str(exc) else ""
        return None, f"unavailable: {type(exc).__name__}: {first}"[:300]
    try:
        version = importlib.metadata.version("flash-attn-4")
    except importlib.metadata.PackageNotFoundError:
        version = "unknown"
    return flash_attn_func, f"flash-attn-4 {version}"


def fa4_peer(flash_attn_func):
    def fa4(q, k, v):
        out = flash_attn_func(q, k, v, causal=True)
        return out[0] if isinstance(out, tuple) else out  # 4.0.0b36 returns (out, lse)
    return fa4


# --------------------------------------------------------------------------------------------------
# which SDPA backend ran

# aten ops SDPA dispatches to (forward; the backward is the same name + "_backward").
SDPA_OPS = {
    "_scaled_dot_product_cudnn_attention": "cudnn",
    "_scaled_dot_product_flash_attention": "flash",
    "_scaled_dot_product_flash_attention_for_cpu": "flash_cpu",
    "_scaled_dot_product_efficient_attention": "efficient",
    "_scaled_dot_product_fused_attention_overrideable": "overrideable",
    "_scaled_dot_product_attention_math": "math",
}
# CUDA kernel name fragments, checked in this order (cuDNN's SDPA kernels also say "flash_fprop").
SDPA_KERNELS = (("cudnn", "cudnn"), ("flash_fwd", "flash"), ("flash_bwd", "flash"), ("fmha_cutlass", "efficient"))


def sdpa_backend_from_names(names) -> str:
    """The SDPA backend that profiler event `names` show; "unknown (...)" unless the evidence agrees.

    The aten op decides; kernels (GPU) may only confirm it. Math runs plain GEMMs, so no kernel names it.
    """
    ops, kernels = set(), set()
    for name in names:
        base = name.removeprefix("aten::").removesuffix("_backward")
        if base in SDPA_OPS:
            ops.add(SDPA_OPS[base])
            continue
        low = name.lower()
        kernels.update(next(([b] for frag, b in SDPA_KERNELS if frag in low), []))
    if len(ops) == 1 and kernels <= ops:
        return next(iter(ops))
    if not ops and len(kernels) == 1:
        return next(iter(kernels))
    return f"unknown (ops {sorted(ops)}, kernels {sorted(kernels)})"


def sdpa_backend(step, cuda: bool) -> str:
    """The backend that one call of step() ran, from torch.profiler (see sdpa_backend_from_names)."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    try:
        with profile(activities=activities) as prof:
            step()
            if cuda:
                torch.cuda.synchronize()
        names = {e.name for e in prof.events()}
    except Exception as exc:  # noqa: BLE001 - a profiler problem must not lose the timing
        return f"unknown (profiler: {type(exc).__name__}: {exc})"[:200]
    return sdpa_backend_from_names(names)


def path_from_names(names) -> str:
    """Which of our paths CUDA kernel `names` show: "gluon" when a Gluon kernel ran (the backward's delta pass is
    flash.py's in both paths), "flash.py" when only flash.py's kernels did, else "unknown (...)"."""
    low = [n.lower() for n in names]
    if any("gluon" in n for n in low):
        return "gluon"
    if any(n.startswith(("_flash_", "_split_combine")) for n in low):
        return "flash.py"
    return f"unknown (no attention kernel among {len(low)} names)"


def ours_path(step, cuda: bool) -> str:
    """The path one call of ours ran, from torch.profiler's kernel names; off a GPU only flash.py runs (the
    interpreter)."""
    if not cuda:
        return "flash.py (interpreter)"
    from torch.profiler import ProfilerActivity, profile

    try:
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            step()
            torch.cuda.synchronize()
        names = {e.name for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA}
    except Exception as exc:  # noqa: BLE001 - a profiler problem must not lose the timing
        return f"unknown (profiler: {type(exc).__name__}: {exc})"[:200]
    return path_from_names(names)


# --------------------------------------------------------------------------------------------------
# prefill


def causal_forward_flops(b: int, s: int, heads: int, d: int) -> float:
    # Two products (QKᵀ and PV) of 2·S·S·D flops per head, halved by causality.
    return 4.0 * b * heads * s * s * d / 2


def make_step(mode: str, fn, args):
    """The zero-argument callable timed for `mode`: fn(*args), or fn then backward into q, k, v."""
    if mode == "forward":
        return lambda: fn(*args)
    leaves = [a.detach().clone().requires_grad_() for a in args]
    grad = torch.randn_like(fn(*leaves))

    def step():
        for leaf in leaves:
            leaf.grad = None
        fn(*leaves).backward(grad)

    return step


def run_prefill(name, fn, mode, args, flops, gemm_tflops, timer) -> dict:
    step = make_step(mode, fn, args)
    ms = timer.ms(step)
    tflops = flops / (ms * 1e-3) / 1e12
    result = {"ms": ms, "tflop_per_s": tflops, "pct_gemm": 100 * tflops / gemm_tflops if gemm_tflops else None}
    if name.startswith("sdpa"):
        result["backend"] = sdpa_backend(step, timer.cuda)
    if name == "triton":
        result["path"] = ours_path(step, timer.cuda)
    return result


def max_abs_diff(ours, peer, args) -> dict:
    with torch.no_grad():
        return {"max_abs_diff": (ours(*args).float() - peer(*args).float()).abs().max().item()}


def prefill_goal(mode: str, s: int, ratio: float | None) -> tuple[str | None, str]:
    target, min_s = PREFILL_GOALS[mode]
    if s < min_s:
        return None, "n/a"
    goal = f">= {target}x fastest peer"
    if ratio is None:
        return goal, "not measured"
    return goal, "met" if ratio >= target else "missed"


def judge_prefill(row: dict, peer_names, paired=None) -> None:
    """ratio_vs_<peer>, the fastest peer (with its backend), ours / it (from paired(peer name), our speed over its
    in ABBA pairs, when given; else from the single timings), and the goal's status."""
    add_ratios(row, peer_names)
    times = {p: row[f"{p}_ms"] for p in peer_names if row.get(f"{p}_ms")}
    if times and row.get("triton_ms"):
        fastest = min(times, key=times.get)
        backend = row.get(f"{fastest}_backend")
        row["fastest_peer"] = f"{fastest} ({backend})" if backend else fastest
        if paired:
            row["ratio_vs_fastest"], row["ratio_vs_fastest_timing"] = paired(fastest), "ABBA pairs"
        else:
            row["ratio_vs_fastest"], row["ratio_vs_fastest_timing"] = times[fastest] / row["triton_ms"], "single calls"
    row["goal"], row["goal_status"] = prefill_goal(row["mode"], row["S"], row.get("ratio_vs_fastest"))


def prefill_rows(shapes: Shapes, configs, ours, peers: dict, timer: Timer, gemm_tflops, device: str) -> list[dict]:
    """peers: name -> callable, or the string saying why it is unavailable."""
    rows = []
    available = {n: fn for n, fn in peers.items() if callable(fn)}
    for s, d in configs:
        b = max(shapes.tokens // s, 1)
        gen = torch.Generator(device=device).manual_seed(s * 1000 + d)
        q = torch.randn(b, s, shapes.q_heads, d, device=device, dtype=DTYPE, generator=gen)
        k, v = (torch.randn(b, s, shapes.kv_heads, d, device=device, dtype=DTYPE, generator=gen) for _ in range(2))
        flops = causal_forward_flops(b, s, shapes.q_heads, d)
        for mode in MODES:
            row = {"S": s, "head_dim": d, "B": b, "mode": mode, "triton_version": triton.__version__}
            for name, fn in {"triton": ours, **peers}.items():
                if not callable(fn):
                    row[f"{name}_error"] = fn
                    continue
                result = measure(f"prefill S={s} D={d} {mode} {name}", run_prefill, name, fn, mode, (q, k, v),
                                 FLOP_FACTOR[mode] * flops, gemm_tflops, timer)
                for key in ("ms", "tflop_per_s", "pct_gemm", "backend", "path", "error"):
                    if result.get(key) is not None:
                        row[f"{name}_{key}"] = result[key]
            if mode == "forward":
                for name, fn in available.items():
                    diff = measure(f"prefill S={s} D={d} max |triton - {name}|", max_abs_diff, ours, fn, (q, k, v))
                    row[f"max_abs_diff_vs_{name}"] = diff.get("max_abs_diff")
            args = (q, k, v)
            # CUDA: ours against the fastest peer again in ABBA pairs; the CPU's wall-clock calls would add nothing
            paired = (lambda peer, mode=mode, args=args: 1.0 / paired_ratio(
                make_step(mode, ours, args), make_step(mode, peers[peer], args), pairs=2)[1]) if timer.cuda else None
            judge_prefill(row, list(peers), paired)
            print(f"    -> fastest {row.get('fastest_peer')}, ours/fastest {row.get('ratio_vs_fastest')}, "
                  f"goal {row['goal_status']}", flush=True)
            rows.append(row)
        del q, k, v, args, paired
    return rows


# --------------------------------------------------------------------------------------------------
# decode


def run_decode(name, fn, args, timer) -> dict:
    step = lambda: fn(*args)  # noqa: E731
    result = {"ms": timer.ms(step)}
    if name.startswith("sdpa"):
        result["backend"] = sdpa_backend(step, timer.cuda)
    if name == "triton":
        result["path"] = ours_path(step, timer.cuda)
    try:
        result["graph_ms"] = timer.graph_ms(step)
    except Exception as exc:  # noqa: BLE001 - a step that cannot be captured is a finding, not a crash
        result["graph_error"] = f"{type(exc).__name__}: {str(exc).strip().splitlines()[-1][:200]}"
    return result


def graph_ratio_in_pairs(ours, peer, args, timer) -> dict:
    """{"ratio": peer's time over ours}, both replayed from CUDA graphs in ABBA pairs (common.paired_ratio)."""
    return {"ratio": 1.0 / paired_ratio(lambda: ours(*args), lambda: peer(*args), pairs=2, timer=timer.graph_ms)[1]}


def decode_goal(row: dict) -> tuple[str | None, str]:
    if row["batch"] >= 16 and row["cached"] >= 4096 and row.get("triton_graph_pct_copy") is not None:
        # Eager steps of ~0.1 ms are host-bound (0.28-0.49 ms measured at batch 16); judged as batch 1 is.
        goal, value, target = ">= 60% of copy (replayed from a CUDA graph)", row["triton_graph_pct_copy"], 60.0
    elif row["batch"] >= 16 and row["cached"] >= 4096:
        goal, value, target = ">= 60% of copy", row.get("triton_pct_copy"), 60.0
    elif row["batch"] == 1 and row.get("graph_ratio_vs_sdpa") is not None:
        # A batch-1 step is a few microseconds of GPU work behind tens of host launch overhead; rollout
        # engines (ours included) replay decode from CUDA graphs, so both sides are judged that way.
        goal, value, target = ">= 0.6x SDPA's speed (both replayed from CUDA graphs)", row["graph_ratio_vs_sdpa"], 0.6
    elif row["batch"] == 1:
        goal, value, target = ">= 0.6x SDPA's speed", row.get("ratio_vs_sdpa"), 0.6
    else:
        return None, "n/a"
    if value is None or not math.isfinite(value):
        return goal, "not measured"
    return goal, "met" if value >= target else "missed"


def decode_rows(shapes: Shapes, batches, cache_lens, ours, peers: dict, timer: Timer, copy_gbps, device) -> list:
    rows, d = [], shapes.decode_head_dim
    for b in batches:
        for n in cache_lens:
            row = {"batch": b, "cached": n, "triton_version": triton.__version__}
            try:
                q = torch.randn(b, 1, shapes.q_heads, d, device=device, dtype=DTYPE)
                k_cache, v_cache = (torch.randn(b, n, shapes.kv_heads, d, device=device, dtype=DTYPE) for _ in "kv")
                lengths = torch.full((b,), n, device=device, dtype=torch.int32)
            except torch.OutOfMemoryError as exc:
                rows.append({**row, "error": str(exc)[:200]})
                continue
            kv_bytes = 2 * b * n * shapes.kv_heads * d * k_cache.element_size()
            fns = {"triton": ours, **peers}
            for name, fn in fns.items():
                result = measure(f"decode B={b} cached={n} {name}", run_decode, name, fn,
                                 (q, k_cache, v_cache, lengths), timer)
                record_bandwidth(row, name, result, kv_bytes, copy_gbps)
                for key in ("backend", "path"):
                    if result.get(key):
                        row[f"{name}_{key}"] = result[key]
                for key in ("graph_ms", "graph_error"):
                    if result.get(key) is not None:
                        row[f"{name}_{key}"] = result[key]
            add_ratios(row, fns)
            if row.get("triton_graph_ms") and row.get("sdpa_graph_ms"):
                row["graph_ratio_vs_sdpa"] = row["sdpa_graph_ms"] / row["triton_graph_ms"]
                if b == 1:  # the goal's ratio: the two graphs timed again in ABBA pairs (single timings move it)
                    paired = measure(f"decode B={b} cached={n} triton / sdpa in ABBA pairs", graph_ratio_in_pairs,
                                     ours, peers["sdpa"], (q, k_cache, v_cache, lengths), timer)
                    if "ratio" in paired:
                        row["graph_ratio_vs_sdpa"], row["graph_ratio_timing"] = paired["ratio"], "ABBA pairs"
            if row.get("triton_graph_ms") and copy_gbps:
                row["triton_graph_pct_copy"] = 100 * kv_bytes / (row["triton_graph_ms"] * 1e6) / copy_gbps
            if "sdpa" in peers:
                diff = measure(f"decode B={b} cached={n} max |triton - sdpa|", max_abs_diff, ours, peers["sdpa"],
                               (q, k_cache, v_cache, lengths))
                row["max_abs_diff_vs_sdpa"] = diff.get("max_abs_diff")
            row["goal"], row["goal_status"] = decode_goal(row)
            rows.append(row)
            del q, k_cache, v_cache
    return rows


# --------------------------------------------------------------------------------------------------
# consistency


def consistency_check(shapes: Shapes, attention, kv_cache_attention, device: str) -> dict:
    """Mismatching tokens (bitwise) of packed / chunked / decode outputs against each sequence alone."""
    lengths, chunk, d = shapes.consistency_lengths, shapes.chunk, shapes.decode_head_dim
    gen = torch.Generator(device=device).manual_seed(0)
    seqs = [[torch.randn(n, h, d, device=device, dtype=DTYPE, generator=gen)
             for h in (shapes.q_heads, shapes.kv_heads, shapes.kv_heads)] for n in lengths]
    alone = [attention(q[None], k[None], v[None])[0] for q, k, v in seqs]
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32, device=device)
    packed = attention(*[torch.cat([s[i] for s in seqs]) for i in range(3)], cu_seqlens=cu)
    smax = max(lengths)
    k_cache, v_cache = (torch.zeros(len(seqs), smax, shapes.kv_heads, d, device=device, dtype=DTYPE) for _ in "kv")
    for b, (_, k, v) in enumerate(seqs):
        k_cache[b, : len(k)], v_cache[b, : len(v)] = k, v
    chunked = [torch.cat([
        kv_cache_attention(q[None, a: a + chunk], k_cache[b: b + 1], v_cache[b: b + 1],
                           torch.tensor([min(a + chunk, len(q))], device=device))[0]
        for a in range(0, len(q), chunk)]) for b, (q, _, _) in enumerate(seqs)]
    steps = []
    for t in range(smax):  # all rows decode together; a finished row repeats its last token
        pos = torch.tensor([min(t, n - 1) for n in lengths], device=device)
        q = torch.stack([s[0][p] for s, p in zip(seqs, pos.tolist())])[:, None]
        steps.append(kv_cache_attention(q, k_cache, v_cache, pos + 1)[:, 0])
    decoded = [torch.stack([steps[t][b] for t in range(n)]) for b, n in enumerate(lengths)]
    forms = {"packed": [packed[cu[b]: cu[b + 1]] for b in range(len(seqs))], f"chunked_{chunk}": chunked,
             "decode": decoded}
    result = {"lengths": list(lengths), "tokens": sum(lengths), "head_dim": d}
    for name, outs in forms.items():
        result[f"{name}_mismatching_tokens"] = sum(
            int((o != a).any(dim=(1, 2)).sum()) for o, a in zip(outs, alone)
        )
    return result


# --------------------------------------------------------------------------------------------------


def parse_args(argv=None) -> argparse.Namespace:
    parser = arg_parser(__doc__.splitlines()[0])
    parser.add_argument("--site-dir", help="add this folder with site.addsitedir before importing FlashAttention-4 "
                                           "(where scripts/fa4_wheels.sh --device-install put it)")
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.site_dir is not None and not os.path.isdir(args.site_dir):
        parser.exit(2, f"{parser.prog}: error: --site-dir: no such folder: {args.site_dir}\n")
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.exit(2, f"{parser.prog}: error: needs CUDA; the benchmarks run on the GPU machine\n")
    return args


def _bar_panel(rows, title, ylabel, series_keys, hline=None) -> dict:
    panel = {"title": title, "xlabel": "S / head_dim", "ylabel": ylabel, "kind": "bar",
             "x": [f"{r['S']}/{r['head_dim']}" for r in rows],
             "series": {label: [r.get(key) for r in rows] for label, key in series_keys.items()}}
    if hline:
        panel["hline"] = hline
    return panel


def main(argv=None) -> int:
    args = parse_args(argv)
    device = args.device
    if device == "cpu":
        # Read when a kernel module is imported: rl_engine's kernels are imported only after this line.
        os.environ.setdefault("TRITON_INTERPRET", "1")
    from rl_engine.kernels.ops.triton.attention import triton_attention, triton_kv_cache_attention

    shapes = H200 if device == "cuda" else TOY
    configs = shapes.quick_prefill if args.quick else shapes.prefill
    batches = shapes.quick_batches if args.quick else shapes.batches
    cache_lens = shapes.quick_cache_lens if args.quick else shapes.cache_lens
    timer = Timer(device)

    fa4_func, fa4_status = load_fa4(args.site_dir)
    print(f"device {device}, shapes {dataclasses.asdict(shapes)}; FlashAttention-4: {fa4_status}", flush=True)
    if device == "cuda":
        gemm = measure("bf16 GEMM ceiling", gemm_ceiling)
        copy = measure("copy ceiling", copy_ceiling)
    else:
        gemm = copy = {"error": "not measured on cpu"}
    gemm_tflops, copy_gbps = gemm.get("tflop_per_s"), copy.get("gb_per_s", float("nan"))

    peers = {"sdpa": sdpa, "sdpa_flash": sdpa_flash, "fa4": fa4_peer(fa4_func) if fa4_func else fa4_status}
    payload = {
        "device": device,
        "geometry": {"q_heads": shapes.q_heads, "kv_heads": shapes.kv_heads, "dtype": str(DTYPE),
                     "prefill_tokens": shapes.tokens, "prefill": [list(c) for c in configs],
                     "decode_head_dim": shapes.decode_head_dim},
        "peers": {"sdpa": "scaled_dot_product_attention(is_causal=True, enable_gqa=True), default backend",
                  "sdpa_flash": "the same inside sdpa_kernel(SDPBackend.FLASH_ATTENTION)",
                  "fa4": fa4_status},
        "goals": {"prefill_forward": ">= 0.85x the fastest peer at S >= 4096",
                  "prefill_forward+backward": ">= 0.75x the fastest peer",
                  "decode": ">= 60% of copy at batch >= 16 with >= 4096 cached; batch 1 >= 0.6x SDPA's speed"},
        "ceilings": {"gemm": gemm, "copy": copy},
        "sections_done": [],
    }

    def save(section: str, rows) -> None:
        # Written after every section: a run cut short by the device's time limit keeps what it measured.
        payload[section] = rows
        payload["sections_done"].append(section)
        write_json(args.out, "attention", payload)

    print("prefill", flush=True)
    prefill = prefill_rows(shapes, configs, triton_attention, peers, timer, gemm_tflops, device)
    save("prefill", prefill)
    print("decode", flush=True)
    decode_peers = {"sdpa": sdpa_decode}
    decode = decode_rows(shapes, batches, cache_lens, triton_kv_cache_attention, decode_peers, timer, copy_gbps,
                         device)
    save("decode", decode)
    consistency = measure("bitwise consistency: prefill vs packed / chunked / decode", consistency_check, shapes,
                          triton_attention, triton_kv_cache_attention, device)
    print(f"consistency: {consistency}")
    save("consistency", consistency)

    print(f"\nprefill (causal, B*S = {shapes.tokens} tokens); ratio = peer ms / triton ms")
    print_table(prefill, ["S", "head_dim", "B", "mode", "triton_path", "triton_version", "triton_ms",
                          "triton_tflop_per_s", "triton_pct_gemm"]
                + [c for p in PEERS for c in (f"{p}_tflop_per_s", f"ratio_vs_{p}")]
                + ["sdpa_backend", "fastest_peer", "ratio_vs_fastest", "goal", "goal_status"])
    print("\ndecode (1 query per row); GB/s of K/V read; ratio = peer ms / triton ms")
    print_table(decode, ["batch", "cached", "triton_path", "triton_version", "triton_ms", "triton_gb_per_s",
                         "triton_pct_copy", "sdpa_ms",
                         "sdpa_gb_per_s", "sdpa_backend", "ratio_vs_sdpa", "triton_graph_ms", "sdpa_graph_ms",
                         "triton_graph_pct_copy", "graph_ratio_vs_sdpa", "goal", "goal_status"])

    plot(args.out, prefill, decode, gemm_tflops, copy_gbps)
    return 0


def plot(out_dir, prefill, decode, gemm_tflops, copy_gbps) -> None:
    """attention.png: prefill TFLOP/s and ratios to the fastest peer; decode as its goals judge it, replayed
    from CUDA graphs (eager figures where no graph ran, e.g. on the CPU)."""
    names = {n: f"{n}_tflop_per_s" for n in ("triton", *PEERS)}
    forward = [r for r in prefill if r["mode"] == "forward"]
    both = [r for r in prefill if r["mode"] == "forward+backward"]
    panels = [
        _bar_panel(forward, "prefill forward", "TFLOP/s", names, (gemm_tflops, "bf16 GEMM") if gemm_tflops else None),
        _bar_panel(both, "prefill forward+backward", "TFLOP/s", names),
        _bar_panel(forward, "ours / fastest peer (goals: fwd 0.85, fwd+bwd 0.75)", "ratio",
                   {"forward": "ratio_vs_fastest"}, [(0.85, "forward goal"), (0.75, "forward+backward goal")]),
    ]
    panels[-1]["series"]["forward+backward"] = [r.get("ratio_vs_fastest") for r in both]
    batches = sorted({r["batch"] for r in decode})
    cache_lens = sorted({r["cached"] for r in decode})

    def graphed(row, name, eager_key):  # GB/s or ratio from the graph replay when there is one
        eager, ms, graph_ms = row.get(eager_key), row.get(f"{name}_ms"), row.get(f"{name}_graph_ms")
        return eager * ms / graph_ms if eager is not None and ms and graph_ms else eager

    def at(b, n):
        return next((r for r in decode if r["batch"] == b and r["cached"] == n), {})

    largest = max(batches, default=0)
    panels.append({
        "title": f"decode, batch {largest} (CUDA graphs)", "xlabel": "cached tokens", "ylabel": "GB/s of K/V read",
        "x": cache_lens,
        "series": {n: [graphed(at(largest, c), n, f"{n}_gb_per_s") for c in cache_lens] for n in ("triton", "sdpa")},
        "hline": (copy_gbps, "device copy") if copy_gbps and math.isfinite(copy_gbps) else None,
    })
    panels.append({
        "title": "decode: SDPA ms / ours (CUDA graphs; batch-1 goal 0.6)", "xlabel": "cached tokens",
        "ylabel": "ratio", "x": cache_lens,
        "series": {f"batch {b}": [at(b, c).get("graph_ratio_vs_sdpa", at(b, c).get("ratio_vs_sdpa"))
                                  for c in cache_lens] for b in batches},
        "hline": (0.6, "batch-1 goal"),
    })
    save_plot(out_dir, "attention", panels)


if __name__ == "__main__":
    sys.exit(main())
