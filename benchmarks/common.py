"""Shared helpers for the GPU benchmarks in this folder (one script per op family).

A benchmark script is run as `python benchmarks/<name>.py --out DIR [--quick]` on the H200 and
writes `DIR/<name>.json` plus `DIR/<name>.png`. Scripts import this module as `from common import ...`
(the script's folder is on sys.path); importing it also puts the repository root on sys.path, so
`rl_engine` imports without an install. The API, all small:

    args = parse_gpu_args(arg_parser("what this measures"))  # exits 2 without CUDA
    env = environment()                      # date, GPU, torch/Triton/Python/CUDA, Liger version
    copy = copy_ceiling()                    # {"ms", "gb_per_s"}: device-to-device copy, read+write
    gemm = gemm_ceiling()                    # {"ms", "tflop_per_s", "shape"}: bf16 torch.matmul 8192^3
    ms = bench_ms(fn)                        # median ms of fn() (triton.testing.do_bench)
    ms, x = paired_ratio(fn, reference)      # fn's ms, and over reference's: timed ABBA (order bias cancels)
    gemm = lm_head_gemm(n, v, h)             # {"ms", "layout", ...}: the faster cuBLAS form of hidden @ W^T
    extra = peak_extra_bytes(fn)             # peak bytes allocated by fn() above what was live before
    row = measure("label", run, *args)      # row = run(*args); on error -> {"error": "..."}, printed
    record_bandwidth(row, name, result, moved_bytes, copy_gbps); add_ratios(row, names)  # table cells
    t = time_mode("backward", fn, inputs, [0])  # {"ms", "peak_extra_bytes"}; modes: common.MODES
    g = time_mode_graphed("forward", fn, inputs, [0])  # {"ms"}: GPU time only (CUDA graph replay)
    rows = host_overhead(impls, inputs, [0], {mode: sweep_row})  # as called vs CUDA graph, per impl
    liger = optional_import("liger_kernel.transformers")   # None when absent (record "unavailable")
    write_json(args.out, "name", payload)    # payload + env, indent 2
    save_plot(args.out, "name", panels)      # panels: [{"title","xlabel","ylabel","x","series",...}]
    print_table(rows, columns)               # fixed-width table of dicts

Ceilings are measured in the same run as the kernels they judge (DESIGN.md: 4.28 TB/s copy and
680 TFLOP/s bf16 GEMM on the H200 were one such measurement, not constants to hard-code).
Every measurement is wrapped so that one failure (OOM, missing peer) does not lose the others.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import statistics
import sys
import traceback
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

GB = 1e9


def arg_parser(description: str) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--out", required=True, help="directory for the JSON and PNG results")
    parser.add_argument("--quick", action="store_true", help="fewer shapes and repetitions (smoke run)")
    return parser


def parse_gpu_args(parser: argparse.ArgumentParser) -> argparse.Namespace:
    """Parse the command line; without CUDA, one line on stderr and exit code 2 (a configuration error)."""
    args = parser.parse_args()
    if not torch.cuda.is_available():
        parser.exit(2, f"{parser.prog}: error: needs CUDA; the benchmarks run on the GPU machine\n")
    return args


def optional_import(module: str):
    """The module, or None when it (or one of its dependencies) cannot be imported."""
    try:
        return importlib.import_module(module)
    except Exception:  # noqa: BLE001 - any import failure means "unavailable"
        return None


def module_version(module: str) -> str:
    """`module.__version__`, or "unavailable" when it cannot be imported."""
    mod = optional_import(module)
    return getattr(mod, "__version__", "unknown") if mod is not None else "unavailable"


def environment() -> dict:
    """What the numbers were measured on."""
    from rl_engine.environment import environment as record

    env = record()
    try:
        from importlib.metadata import version

        env["liger_kernel"] = version("liger-kernel")
    except Exception:  # noqa: BLE001
        env["liger_kernel"] = "unavailable"
    return env


def bench_ms(fn: Callable[[], object], *, warmup: int = 25, rep: int = 100) -> float:
    """Median wall time of fn() in milliseconds (do_bench flushes L2 between calls)."""
    from triton.testing import do_bench

    return float(do_bench(fn, warmup=warmup, rep=rep, return_mode="median"))


def peak_extra_bytes(fn: Callable[[], object]) -> int:
    """Peak CUDA bytes allocated while fn() runs, above what was allocated before it.

    Outputs fn() returns count while alive; they are dropped before returning.
    """
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    before = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    result = fn()
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated()
    del result
    return int(peak - before)


def copy_ceiling(nbytes: int = 1 << 30) -> dict:
    """Device-to-device copy bandwidth: (read + write) bytes / median time."""
    src = torch.empty(nbytes // 4, dtype=torch.float32, device="cuda").uniform_()
    dst = torch.empty_like(src)
    ms = bench_ms(lambda: dst.copy_(src))
    return {"ms": ms, "bytes": 2 * nbytes, "gb_per_s": 2 * nbytes / (ms * 1e-3) / GB}


def gemm_ceiling(m: int = 8192, n: int = 8192, k: int = 8192, dtype=torch.bfloat16) -> dict:
    """cuBLAS GEMM rate via torch.matmul of [m,k] @ [k,n]."""
    a = torch.randn(m, k, dtype=dtype, device="cuda")
    b = torch.randn(k, n, dtype=dtype, device="cuda")
    ms = bench_ms(lambda: a @ b)
    return {"ms": ms, "shape": [m, n, k], "dtype": str(dtype), "tflop_per_s": 2 * m * n * k / (ms * 1e-3) / 1e12}


LM_HEAD_LAYOUTS = ("hidden @ W.t() (F.linear)", "hidden @ W^T stored [H,V]")


def lm_head_product(tokens: int, vocab: int, hidden: int, layout: str, dtype=torch.bfloat16) -> Callable[[], object]:
    """fn() computing logits = hidden [N,H] @ W^T with cuBLAS in one of LM_HEAD_LAYOUTS (random operands)."""
    h = torch.randn(tokens, hidden, dtype=dtype, device="cuda")
    if layout == LM_HEAD_LAYOUTS[0]:
        w = torch.randn(vocab, hidden, dtype=dtype, device="cuda")
        return lambda: h @ w.t()
    w_t = torch.randn(hidden, vocab, dtype=dtype, device="cuda")
    return lambda: h @ w_t


def lm_head_gemm(tokens: int, vocab: int, hidden: int, dtype=torch.bfloat16) -> dict:
    """The faster cuBLAS form of logits = hidden [N,H] @ W^T: F.linear's (W [V,H] row-major, read
    transposed) or W^T stored [H,V]. The reference of "x a GEMM" ratios; the layout that ran is named
    (H200, 2026-12-01: at N = 1024 the [H,V] form took 1.72-1.92 ms, F.linear's 1.58-1.64)."""
    timed = {layout: bench_ms(lm_head_product(tokens, vocab, hidden, layout, dtype)) for layout in LM_HEAD_LAYOUTS}
    layout = min(timed, key=timed.get)
    ms = timed[layout]
    return {"ms": ms, "layout": layout, "ms_by_layout": timed, "shape": [tokens, vocab, hidden], "dtype": str(dtype),
            "tflop_per_s": 2 * tokens * vocab * hidden / (ms * 1e-3) / 1e12}


def paired_ratio(fn: Callable[[], object], reference: Callable[[], object], *, pairs: int = 2,
                 warmup: int = 25, rep: int = 100,
                 timer: Callable[[Callable[[], object]], float] | None = None) -> tuple[float, float]:
    """(fn's median ms, fn's time over reference's): the two timed back to back in alternating order
    (ABBA), `pairs` times each way, the ratio the median of the per-pair ratios. On the H200 the second
    of two back-to-back timings of one configuration ran ~3% slower (2026-12-01), so a reference timed
    once, before everything it judges, biases every ratio against it by about as much as a goal's margin.
    timer(callable) -> ms replaces bench_ms (e.g. CUDA-graph replays)."""
    timer = timer or (lambda f: bench_ms(f, warmup=warmup, rep=rep))
    times, ratios = [], []
    for i in range(2 * pairs):
        if i % 2 == 0:
            a = timer(fn)
            b = timer(reference)
        else:
            b = timer(reference)
            a = timer(fn)
        times.append(a)
        ratios.append(a / b)
    return statistics.median(times), statistics.median(ratios)


def measure(label: str, run: Callable[..., dict], *args, **kwargs) -> dict:
    """run(*args, **kwargs), printing progress; its dict, or {"error": ...} when it raised."""
    print(f"  {label} ...", flush=True)
    try:
        row = run(*args, **kwargs)
    except Exception as exc:  # noqa: BLE001 - one failure must not lose the other measurements
        traceback.print_exc(limit=2)
        row = {"error": f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"[:300]}
    finally:
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    return row


def record_bandwidth(row: dict, name: str, result: dict, moved_bytes: int, copy_gbps: float) -> None:
    """Put one implementation's timing into a table row: ms, GB/s, % of copy, peak MB (or its error)."""
    if "error" in result:
        row[f"{name}_error"] = result["error"]
        return
    gbps = moved_bytes / (result["ms"] * 1e-3) / GB
    row.update({f"{name}_ms": result["ms"], f"{name}_gb_per_s": gbps, f"{name}_pct_copy": 100 * gbps / copy_gbps})
    if "peak_extra_bytes" in result:
        row[f"{name}_peak_mb"] = result["peak_extra_bytes"] / 1e6


def add_ratios(row: dict, names) -> None:
    """ratio_vs_<peer> = peer ms / triton ms (> 1: ours is faster), for every peer timed in the row."""
    for name in names:
        if name != "triton" and row.get("triton_ms") and row.get(f"{name}_ms"):
            row[f"ratio_vs_{name}"] = row[f"{name}_ms"] / row["triton_ms"]


MODES = ("forward", "backward", "forward+backward")


def _mode_runner(mode: str, fn: Callable[..., torch.Tensor], inputs: list, differentiable: list[int]):
    """The zero-argument callable that time_mode times for `mode` (see time_mode)."""
    if mode == "forward":
        def run():
            with torch.no_grad():
                return fn(*inputs)
        return run
    leaves = [x.detach().requires_grad_() if i in differentiable else x for i, x in enumerate(inputs)]
    wrt = [leaves[i] for i in differentiable]
    out = fn(*leaves)
    grad = torch.randn_like(out)
    if mode == "backward":
        def run():
            return torch.autograd.grad(out, wrt, grad, retain_graph=True)
    else:
        def run():
            return torch.autograd.grad(fn(*leaves), wrt, grad)
    return run


def time_mode(mode: str, fn: Callable[..., torch.Tensor], inputs: list, differentiable: list[int]) -> dict:
    """{"ms", "peak_extra_bytes"} of one mode of fn(*inputs) (memory-bound ops: norms, activations, ...).

    forward: fn(*inputs) under no_grad; backward: torch.autograd.grad through a graph built once and
    retained (the backward alone); forward+backward: both. `differentiable` lists the indices of the
    inputs that get gradients; the output gradient is random with the output's shape and dtype.
    The time is wall time per call with L2 flushed before each call: the GPU idles while the host
    prepares the call, so host work beyond the flush's ~0.07 ms (Python, autograd) is included.
    """
    run = _mode_runner(mode, fn, inputs, differentiable)
    ms = bench_ms(run)
    return {"ms": ms, "peak_extra_bytes": peak_extra_bytes(run)}


def time_mode_graphed(mode: str, fn: Callable[..., torch.Tensor], inputs: list, differentiable: list[int]) -> dict:
    """{"ms"}: GPU time of one mode of fn(*inputs), host work removed (calls replayed from a CUDA graph).

    For "forward" and "forward+backward" (the backward alone reuses a graph built outside the capture).
    Set against time_mode's figure, the difference is the host cost per call (Python, autograd
    engine, launches) that the GPU waits for when nothing else is queued. No L2 flush between calls.
    """
    from triton.testing import do_bench_cudagraph

    if mode == "backward":
        raise ValueError("mode: expected 'forward' or 'forward+backward' for a CUDA graph timing")
    run = _mode_runner(mode, fn, inputs, differentiable)
    return {"ms": float(do_bench_cudagraph(run, rep=20, return_mode="median"))}


def host_overhead(impls: dict, inputs: list, differentiable: list[int], called: dict[str, dict]) -> list[dict]:
    """Per implementation and mode (forward, forward+backward): the as-called ms (called[mode] is a
    sweep row holding "<impl>_ms", measured by time_mode on the same shape), the GPU-only ms
    (time_mode_graphed) and their difference, host_ms. Prints progress; errors are recorded."""
    rows = []
    for mode in ("forward", "forward+backward"):
        for name, fn in impls.items():
            graphed = measure(f"CUDA graph {mode} {name}", time_mode_graphed, mode, fn,
                              [t.clone() for t in inputs], differentiable)
            row = {"impl": name, "mode": mode, "called_ms": called.get(mode, {}).get(f"{name}_ms"),
                   "graph_ms": graphed.get("ms"), "error": graphed.get("error")}
            if row["called_ms"] and row["graph_ms"]:
                row["host_ms"] = row["called_ms"] - row["graph_ms"]
            rows.append(row)
    return rows


HOST_OVERHEAD_COLUMNS = ["impl", "mode", "called_ms", "graph_ms", "host_ms", "error"]


def write_json(out_dir: str, name: str, payload: dict) -> str:
    os.makedirs(out_dir, exist_ok=True)
    path = os.path.join(out_dir, f"{name}.json")
    with open(path, "w") as f:
        json.dump({"benchmark": name, "environment": environment(), **payload}, f, indent=2, default=str)
    print(f"wrote {path}")
    return path


def save_plot(out_dir: str, name: str, panels: list[dict]) -> str | None:
    """One PNG with a subplot per panel.

    panel = {"title", "xlabel", "ylabel", "x": [...], "series": {label: [y or None, ...]},
             "kind": "line" (default) or "bar", "logy": bool, "hline": (y, label) or a list of them, optional}
    """
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except Exception:  # noqa: BLE001
        print("matplotlib unavailable: no plot")
        return None
    os.makedirs(out_dir, exist_ok=True)
    fig, axes = plt.subplots(1, len(panels), figsize=(6 * len(panels), 4.5), squeeze=False)
    for ax, panel in zip(axes[0], panels):
        x, series = panel["x"], panel["series"]
        if panel.get("kind", "line") == "bar":
            width = 0.8 / max(len(series), 1)
            for i, (label, ys) in enumerate(series.items()):
                pos = [j + i * width for j in range(len(x))]
                ax.bar(pos, [y if y is not None else 0 for y in ys], width, label=label)
            ax.set_xticks([j + 0.4 - width / 2 for j in range(len(x))], [str(v) for v in x])
        else:
            for label, ys in series.items():
                pts = [(a, b) for a, b in zip(x, ys) if b is not None]
                if pts:
                    ax.plot(*zip(*pts), marker="o", label=label)
        lines = panel.get("hline") or []
        if lines and not isinstance(lines[0], (list, tuple)):
            lines = [lines]
        for style, (y, label) in zip(("--", ":", "-."), lines):
            ax.axhline(y, linestyle=style, color="gray", label=label)
        if panel.get("logy"):
            ax.set_yscale("log")
        ax.set_title(panel.get("title", ""))
        ax.set_xlabel(panel.get("xlabel", ""))
        ax.set_ylabel(panel.get("ylabel", ""))
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    path = os.path.join(out_dir, f"{name}.png")
    fig.savefig(path, dpi=120)
    plt.close(fig)
    print(f"wrote {path}")
    return path


def _cell(value) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:.3g}" if abs(value) < 1e4 else f"{value:.0f}"
    return str(value)


def print_table(rows: list[dict], columns: list[str]) -> None:
    """Fixed-width table; missing keys print as '-'."""
    cells = [[_cell(row.get(c)) for c in columns] for row in rows]
    widths = [max([len(c)] + [len(r[i]) for r in cells]) for i, c in enumerate(columns)]
    print("  ".join(c.ljust(w) for c, w in zip(columns, widths)))
    for r in cells:
        print("  ".join(v.ljust(w) for v, w in zip(r, widths)))


def hf_qwen3_model(config, weights: dict, device):
    """transformers' Qwen3ForCausalLM for an rl_engine `config`, holding `weights` (HF names), bf16
    parameters, attn_implementation sdpa. Built in bf16 rather than converted after, so the rotary
    inv_freq buffer stays fp32, as from_pretrained(dtype=bf16) leaves it."""
    import transformers

    kwargs = dict(
        vocab_size=config.vocab_size, hidden_size=config.hidden_size, intermediate_size=config.intermediate_size,
        num_hidden_layers=config.num_layers, num_attention_heads=config.num_heads,
        num_key_value_heads=config.num_kv_heads, head_dim=config.head_dim, rms_norm_eps=config.rms_norm_eps,
        tie_word_embeddings=config.tie_word_embeddings, max_position_embeddings=40960, attn_implementation="sdpa",
    )
    if int(transformers.__version__.split(".")[0]) >= 5:
        kwargs["rope_parameters"] = {"rope_type": "default", "rope_theta": config.rope_theta}
    else:
        kwargs["rope_theta"] = config.rope_theta
    default = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        with torch.device(device):
            model = transformers.Qwen3ForCausalLM(transformers.Qwen3Config(**kwargs))
    finally:
        torch.set_default_dtype(default)
    missing, unexpected = model.load_state_dict(weights, strict=False)
    if unexpected or set(missing) - ({"lm_head.weight"} if config.tie_word_embeddings else set()):
        raise RuntimeError(f"weights do not fit the model: missing {missing}, unexpected {unexpected}")
    return model
