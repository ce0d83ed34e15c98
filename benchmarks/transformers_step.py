"""transformers Qwen3 at Qwen3-8B width, selected logprobs and a train step: unpatched vs rl_engine-patched vs Liger.

Eager and torch.compile; time and peak memory per cell, and the ratios to unpatched transformers (sdpa).

    python benchmarks/transformers_step.py --out benchmarks/results [--quick]
    python benchmarks/transformers_step.py --out DIR --modes eager            # split a run across commands:
    python benchmarks/transformers_step.py --out DIR --modes compiled --append  # rows merge into one JSON
    python benchmarks/transformers_step.py --out DIR --device cpu --compile-backend eager  # toy sizes, smoke

The JSON is rewritten after every cell, so a command ended by a time limit keeps what it measured; the
compiled cells (inductor, then Triton JIT) are the slow part: give them their own command (--append).
--impls/--modes/--tasks/--shapes select cells; --append keeps the earlier rows of DIR's JSON it does not redo.

Model: transformers' Qwen3ForCausalLM built from rl_engine's qwen3-8b config cut to --layers (default 4;
hidden 4096, 32/8 heads of 128, intermediate 12288, vocab 151936, untied lm_head), bf16, loaded with
rl_engine's synthetic weights; one fresh model per implementation, from the same weights.
Token batches: 8x1024 (eight sequences, no padding) and 1x8192, a packed row of sequences of
PACKED_LENGTHS tokens (position_ids restart at 0 for each; transformers' sdpa path derives a block-causal
mask from them, the patched model takes cu_seqlens). Targets are random token ids.
Tasks, each giving fp32 logprobs [B,S] of the targets:
  forward  under torch.no_grad(), model.eval() (a trainer's old-logprob pass)
  train    model.train(), logprobs.sum().backward(), gradients dropped after each step (set to None)
Implementations:
  sdpa       unpatched, attn_implementation="sdpa"; model(...).logits.float().log_softmax(-1).gather(...),
             as trainers write it; the SDPA backend torch picks for that call is recorded
  rl_engine  rl_engine.integrations.transformers.patch(model, "triton_bf16") + its selected_logprobs
             (no logits materialised)
  liger      liger_kernel.transformers.apply_liger_kernel_to_qwen3(model=model) (its defaults: rope, RMSNorm,
             SwiGLU; attention stays sdpa) + LigerFusedLinearCrossEntropyLoss(reduction="none") on the final
             hidden states (-loss = logprobs, no logits materialised); "unavailable" when not importable.
             Liger patches transformers' Qwen3 classes for the whole process, so it runs last.
Modes: eager, and torch.compile(logprob function) with --compile-backend (default inductor); a compile
error is recorded as the cell's error. Per cell: median ms (triton do_bench; wall clock on CPU), peak
memory above the model's weights and inputs (CUDA; train: gradients included), model TFLOP/s and its %
of the bf16 GEMM ceiling measured in the same run, the first call's seconds (compile included), dynamo
graph breaks, max|logp - sdpa eager logp|, and whether compiled logprobs equal eager ones bit for bit.
Ratios rl_engine/sdpa and liger/sdpa per (mode, shape, task); the goals (issue 14): train step <= 1.1x,
forward <= 1.0x, memory <= 1.0x.
"""

from __future__ import annotations

import dataclasses
import gc
import json
import os
import sys
import time

import torch
from common import (
    GB,
    arg_parser,
    bench_ms,
    gemm_ceiling,
    hf_qwen3_model,
    measure,
    module_version,
    optional_import,
    print_table,
    save_plot,
    write_json,
)

if not torch.cuda.is_available():  # Triton reads this when a kernel is decorated: before rl_engine's kernels load
    os.environ.setdefault("TRITON_INTERPRET", "1")

from rl_engine.models.config import ModelConfig  # noqa: E402
from rl_engine.models.families import CONFIGS  # noqa: E402
from rl_engine.models.profiles import PROFILES, get_profile  # noqa: E402
from rl_engine.models.weights import synthetic_weights  # noqa: E402

NAME = "transformers_step"
IMPLS = ("sdpa", "rl_engine", "liger")  # liger last: its patch changes transformers' classes for the process
MODES = ("eager", "compiled")
TASKS = ("forward", "train")
GOALS = {"forward": 1.0, "train": 1.1, "peak_gb": 1.0}  # rl_engine / sdpa, issue 14
WEIGHT_SEED = 1234
# (batch, seq, packed sequence lengths or None) per shape name
GPU_SHAPES = {"8x1024": (8, 1024, None), "1x8192": (1, 8192, (3072, 2048, 1024, 1024, 512, 512))}
CPU_SHAPES = {"2x8": (2, 8, None), "1x16": (1, 16, (7, 5, 4))}
# Toy Qwen3 for --device cpu: small enough that the Triton interpreter runs a patched step in ~2 s.
CPU_CONFIG = ModelConfig("cpu-smoke", "qwen3", 64, 32, 32, 2, 2, 1, 16)
KEY = ("impl", "mode", "shape", "task")


class Unavailable(Exception):
    pass


# ---------------------------------------------------------------- model and inputs


def build_model(config, weights, device):
    return hf_qwen3_model(config, weights, device)


def make_inputs(config, batch, seq, lengths, device):
    """(input_ids, target_ids, position_ids, cu_seqlens or None), the same for every implementation."""
    gen = torch.Generator(device="cpu").manual_seed(0)
    ids = torch.randint(0, config.vocab_size, (batch, seq), generator=gen)
    targets = torch.randint(0, config.vocab_size, (batch, seq), generator=gen)
    if lengths is None:
        pos, cu = torch.arange(seq).expand(batch, seq).contiguous(), None
    else:
        assert batch == 1 and sum(lengths) == seq, (batch, seq, lengths)
        pos = torch.cat([torch.arange(n) for n in lengths])[None]
        cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32, device=device)
    return ids.to(device), targets.to(device), pos.to(device), cu


def forward_flops(config, batch, seq, lengths) -> float:
    """Matmul FLOPs of one forward: projections, MLP, lm_head, causal attention (QK^T and PV, half the square)."""
    c = config
    tokens = batch * seq
    qkvo = c.hidden_size * c.head_dim * (2 * c.num_heads + 2 * c.num_kv_heads)
    per_token = c.num_layers * (qkvo + 3 * c.hidden_size * c.intermediate_size) + c.hidden_size * c.vocab_size
    squares = batch * seq * seq if lengths is None else sum(n * n for n in lengths)
    attention = c.num_layers * c.num_heads * 2 * c.head_dim * squares  # 4*n^2*d per head, halved by causality
    return 2.0 * tokens * per_token + attention


# ---------------------------------------------------------------- implementations


def sdpa_backend(model, ids, pos) -> str:
    """The SDPA backend(s) torch picks for the attention calls of one forward (torch._fused_sdp_choice)."""
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend
    from torch.overrides import TorchFunctionMode

    seen = set()

    class Probe(TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            kwargs = kwargs or {}
            if func is F.scaled_dot_product_attention:
                masked = kwargs.get("attn_mask", args[3] if len(args) > 3 else None) is not None
                try:
                    name = SDPBackend(torch._fused_sdp_choice(*args, **kwargs)).name
                except Exception as exc:  # noqa: BLE001 - a private API: say so rather than fail the cell
                    name = f"unknown ({type(exc).__name__})"
                seen.add(f"{name} ({'attn_mask' if masked else 'no mask'})")
            return func(*args, **kwargs)

    with torch.no_grad(), Probe():
        model.model(input_ids=ids, position_ids=pos, use_cache=False)
    return ",".join(sorted(seen)) or "none called"


def prepare(impl: str, model, liger, profile: str):
    """(logprob fn(ids, targets, pos, cu) -> fp32 [B,S], description); patches `model` in place as needed."""
    if impl == "sdpa":
        def fn(ids, targets, pos, cu):
            logits = model(input_ids=ids, position_ids=pos, use_cache=False).logits
            return logits.float().log_softmax(-1).gather(-1, targets.unsqueeze(-1)).squeeze(-1)

        return fn, {"attn_implementation": model.config._attn_implementation,
                    "logprobs": "logits.float().log_softmax(-1).gather"}
    if impl == "rl_engine":
        from rl_engine.integrations.transformers import patch, selected_logprobs

        patch(model, profile)

        def fn(ids, targets, pos, cu):
            return selected_logprobs(model, ids, target_ids=targets, cu_seqlens=cu)

        declared = get_profile(profile).declared
        return fn, {"attn_implementation": model.config._attn_implementation, "profile": profile,
                    "logprobs": "rl_engine selected_logprobs (linear_logp)",
                    "ops": {op: f"{d.backend}:{d.target}" for op, d in declared.items()}}
    if impl == "liger":
        if liger is None:
            raise Unavailable("liger_kernel.transformers is not importable")
        liger.apply_liger_kernel_to_qwen3(model=model)
        flce = liger.LigerFusedLinearCrossEntropyLoss(reduction="none")

        def fn(ids, targets, pos, cu):
            hidden = model.model(input_ids=ids, position_ids=pos, use_cache=False).last_hidden_state
            loss = flce(model.lm_head.weight, hidden.reshape(-1, hidden.shape[-1]), targets.reshape(-1))
            return -loss.float().view(targets.shape)

        return fn, {"attn_implementation": model.config._attn_implementation,
                    "kernels": "apply_liger_kernel_to_qwen3 defaults (rope, rms_norm, swiglu)",
                    "logprobs": "-LigerFusedLinearCrossEntropyLoss(reduction='none')"}
    raise ValueError(f"impl: expected one of {IMPLS}, got {impl!r}")


# ---------------------------------------------------------------- timing


class Timer:
    """CUDA: do_bench median ms and peak bytes above what was allocated before; CPU: one call's wall clock."""

    def __init__(self, device: str, quick: bool):
        self.cuda = device == "cuda"
        self.warmup, self.rep = (25, 150) if quick else (100, 600)  # do_bench budgets, ms

    def sync(self):
        if self.cuda:
            torch.cuda.synchronize()

    def ms(self, step) -> float:
        if self.cuda:
            return bench_ms(step, warmup=self.warmup, rep=self.rep)
        t0 = time.perf_counter()  # one call: the CPU run checks the code paths, its times mean little
        step()
        return 1e3 * (time.perf_counter() - t0)

    def peak_gb(self, step) -> float | None:
        if not self.cuda:
            return None
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        before = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        step()
        torch.cuda.synchronize()
        return (torch.cuda.max_memory_allocated() - before) / GB


def graph_breaks() -> int:
    from torch._dynamo.utils import counters

    return int(sum(counters["graph_break"].values()))


def run_cell(task, model, fn, eager_fn, inputs, timer, flops, gemm_tflops, ref):
    """One (impl, mode, shape, task) cell: {"ms", "peak_gb", ...}. `eager_fn` is fn's uncompiled form (None when
    fn is eager); `ref` the sdpa eager logprobs of this shape, when measured in this run."""
    ids, targets, pos, cu = inputs

    def logprobs(f):
        if task == "forward":
            with torch.no_grad():
                return f(ids, targets, pos, cu)
        lp = f(ids, targets, pos, cu)
        lp.sum().backward()
        model.zero_grad(set_to_none=True)  # every step starts from the same memory: weights, no gradients
        return lp.detach()

    model.train(task == "train")
    model.zero_grad(set_to_none=True)
    breaks = graph_breaks()
    t0 = time.perf_counter()
    lp = logprobs(fn)
    timer.sync()
    row = {"first_call_s": time.perf_counter() - t0, "graph_breaks": graph_breaks() - breaks}
    if not torch.isfinite(lp).all():
        raise RuntimeError("non-finite logprobs")
    if ref is not None:
        row["max_abs_dlogp_vs_sdpa"] = float((lp - ref).abs().max())
    if eager_fn is not None:
        row["bitwise_vs_eager"] = bool(torch.equal(lp, logprobs(eager_fn)))
    row["ms"] = timer.ms(lambda: logprobs(fn))
    row["peak_gb"] = timer.peak_gb(lambda: logprobs(fn))
    work = flops * (3 if task == "train" else 1)  # backward: twice the forward's matmuls
    row["tflop_per_s"] = work / (row["ms"] * 1e-3) / 1e12
    if gemm_tflops:
        row["pct_gemm"] = 100 * row["tflop_per_s"] / gemm_tflops
    row["_lp"] = lp  # taken out by the caller: the sdpa reference for the other implementations
    return row


# ---------------------------------------------------------------- the run


def free(device):
    gc.collect()
    torch._dynamo.reset()
    if device == "cuda":
        torch.cuda.empty_cache()


def run_impl(impl, args, config, weights, shapes, inputs, timer, gemm_tflops, liger, refs, rows, save):
    """All cells of one implementation on a fresh model, appended to `rows` and saved one by one; returns its
    description. Fills `refs` when impl is sdpa."""
    model = build_model(config, weights, args.device)
    fn, described = prepare(impl, model, liger, args.profile)
    if described["attn_implementation"] == "sdpa":
        described["sdpa_backend"] = {s: measure(f"{impl} sdpa backend {s}", lambda i=i: {
            "backend": sdpa_backend(model, i[0], i[2])}).get("backend", "error") for s, i in inputs.items()}
    for mode in args.modes:
        f = fn if mode == "eager" else torch.compile(fn, backend=args.compile_backend, dynamic=False)
        for s, (batch, seq, lengths) in shapes.items():
            flops = forward_flops(config, batch, seq, lengths)
            for task in args.tasks:
                ref = refs.get((s, task)) if (impl, mode) != ("sdpa", "eager") else None
                row = measure(f"{impl} {mode} {s} {task}", run_cell, task, model, f,
                              None if mode == "eager" else fn, inputs[s], timer, flops, gemm_tflops, ref)
                lp = row.pop("_lp", None)
                if (impl, mode) == ("sdpa", "eager") and lp is not None:
                    refs[(s, task)] = lp
                rows.append({"impl": impl, "mode": mode, "shape": s, "task": task, **row})
                print(f"    {_brief(rows[-1])}", flush=True)
                save()
    return described


def run(args, save) -> dict:
    """Every cell asked for; save(payload so far) after each cell, so a run cut short keeps what it measured."""
    device = args.device
    config = (CONFIGS["qwen3-8b"] if device == "cuda" else CPU_CONFIG).with_layers(args.layers)
    all_shapes = GPU_SHAPES if device == "cuda" else CPU_SHAPES
    shapes = {s: all_shapes[s] for s in args.shapes} if args.shapes else all_shapes
    if args.quick and not args.shapes:
        shapes = dict(list(shapes.items())[:1])
    timer = Timer(device, args.quick)
    # Compiled cells of one implementation share a code object: room for every (shape, task, train flag).
    for knob in ("recompile_limit", "cache_size_limit"):
        if hasattr(torch._dynamo.config, knob):
            setattr(torch._dynamo.config, knob, 64)
    gemm = measure("bf16 GEMM 8192^3", gemm_ceiling) if device == "cuda" else {"skipped": "cpu"}
    weights = synthetic_weights(config, WEIGHT_SEED, device=device)
    inputs = {s: make_inputs(config, *shape, device) for s, shape in shapes.items()}
    liger = optional_import("liger_kernel.transformers")
    rows, impls, refs = [], {}, {}
    payload = {"config": dataclasses.asdict(config), "transformers": module_version("transformers"),
               "profile": args.profile,
               "shapes": {s: {"batch": b, "seq": q, "packed_lengths": ln} for s, (b, q, ln) in shapes.items()},
               "compile_backend": args.compile_backend, "ceilings": {"gemm_8192": gemm}, "implementations": impls,
               "rows": rows}
    for impl in args.impls:
        print(f"{impl}:", flush=True)
        t0 = time.perf_counter()
        try:
            impls[impl] = run_impl(impl, args, config, weights, shapes, inputs, timer, gemm.get("tflop_per_s"),
                                   liger, refs, rows, lambda: save(payload))
        except Exception as exc:  # noqa: BLE001 - one implementation failing (or absent) must not lose the others
            error = str(exc) if isinstance(exc, Unavailable) else f"{type(exc).__name__}: {exc}"
            error = (error.splitlines() or [""])[0][:300]
            print(f"  {impl}: {error}", flush=True)
            impls[impl] = {"error": error}
            done = {tuple(r[k] for k in KEY) for r in rows}
            rows += [{"impl": impl, "mode": m, "shape": s, "task": t, "error": error}
                     for m in args.modes for s in shapes for t in args.tasks if (impl, m, s, t) not in done]
        try:
            free(device)  # the model, its compiled graphs and cached blocks, before the next implementation
        except Exception as exc:  # noqa: BLE001 - a CUDA fault (illegal address) poisons the context for good
            print(f"  {impl}: the device is unusable after it ({type(exc).__name__}); the run stops here", flush=True)
            save(payload)
            break
        print(f"  {impl}: {time.perf_counter() - t0:.0f} s", flush=True)
        save(payload)
    return payload


def _brief(row) -> str:
    if "error" in row:
        return f"error: {row['error']}"
    peak = row.get("peak_gb")
    return f"{row['ms']:.3f} ms" + (f", peak {peak:.2f} GB" if peak is not None else "")


def ratios(rows) -> list[dict]:
    """<impl>/sdpa per (mode, shape, task): time and peak memory, with the goals for rl_engine."""
    by = {tuple(r[k] for k in KEY): r for r in rows}
    out = []
    for (impl, mode, shape, task), row in by.items():
        base = by.get(("sdpa", mode, shape, task))
        if impl == "sdpa" or base is None:
            continue
        r = {"impl": impl, "mode": mode, "shape": shape, "task": task}
        if row.get("ms") and base.get("ms"):
            r["time_ratio"] = row["ms"] / base["ms"]
        if row.get("peak_gb") and base.get("peak_gb"):
            r["memory_ratio"] = row["peak_gb"] / base["peak_gb"]
        if impl == "rl_engine":
            r["time_goal"] = GOALS[task]
            if "time_ratio" in r:
                r["time_goal_met"] = r["time_ratio"] <= GOALS[task]
            if "memory_ratio" in r:
                r["memory_goal_met"] = r["memory_ratio"] <= GOALS["peak_gb"]
        out.append(r)
    return out


def finish(payload: dict, previous: dict | None) -> dict:
    """This run's payload, merged into an earlier run's (--append), with the ratios and goals."""
    out = dict(payload)
    if previous:
        out["rows"] = merge(previous.get("rows", []), payload["rows"])
        for key in ("implementations", "shapes"):
            out[key] = {**previous.get(key, {}), **payload[key]}
    out["ratios"] = ratios(out["rows"])
    out["goals"] = {"rl_engine_over_sdpa": GOALS}
    return out


def merge(previous: list[dict], rows: list[dict]) -> list[dict]:
    """Rows of an earlier run (--append) that this run did not measure again, then this run's rows."""
    done = {tuple(r.get(k) for k in KEY) for r in rows}
    return [r for r in previous if tuple(r.get(k) for k in KEY) not in done] + rows


def plot(out_dir, rows, ratio_rows):
    cells = sorted({(r["mode"], r["shape"], r["task"]) for r in rows}, key=lambda c: (c[0], c[1], c[2]))
    x = [f"{m}\n{s}\n{t}" for m, s, t in cells]
    by = {tuple(r[k] for k in KEY): r for r in rows}

    def series(key, names, table):
        return {n: [table.get((n, *c), {}).get(key) for c in cells] for n in names}

    rby = {tuple(r[k] for k in KEY): r for r in ratio_rows}
    save_plot(out_dir, NAME, [
        {"title": "median ms per call", "xlabel": "mode shape task", "ylabel": "ms", "x": x, "kind": "bar",
         "series": series("ms", IMPLS, by)},
        {"title": "peak memory above the weights", "xlabel": "mode shape task", "ylabel": "GB", "x": x,
         "kind": "bar", "series": series("peak_gb", IMPLS, by)},
        {"title": "time / sdpa (goal: train <= 1.1, forward <= 1.0)", "xlabel": "mode shape task",
         "ylabel": "ratio", "x": x, "kind": "bar", "series": series("time_ratio", IMPLS[1:], rby),
         "hline": (1.0, "sdpa")},
    ])


def main(argv=None) -> int:
    parser = arg_parser(__doc__.splitlines()[0])
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda",
                        help="cpu: toy sizes (tiny qwen3, 1 layer), wall-clock times, no memory: a smoke run")
    parser.add_argument("--layers", type=int, default=None, help="decoder layers (default 4 on cuda, 1 on cpu)")
    parser.add_argument("--impls", type=lambda s: s.split(","), default=list(IMPLS), help="comma list of " +
                        ",".join(IMPLS))
    parser.add_argument("--modes", type=lambda s: s.split(","), default=list(MODES), help="eager,compiled")
    parser.add_argument("--tasks", type=lambda s: s.split(","), default=list(TASKS), help="forward,train")
    parser.add_argument("--shapes", type=lambda s: s.split(","), default=None,
                        help=f"comma list of {','.join(GPU_SHAPES)} (cpu: {','.join(CPU_SHAPES)}); default all")
    parser.add_argument("--profile", default="triton_bf16", choices=sorted(PROFILES),
                        help="rl_engine profile the patched model runs (default triton_bf16)")
    parser.add_argument("--compile-backend", default="inductor", help="torch.compile backend (default inductor)")
    parser.add_argument("--append", action="store_true",
                        help="keep the rows of an earlier run in --out that this run does not measure again")
    args = parser.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.exit(2, f"{parser.prog}: error: needs CUDA (or --device cpu for a smoke run at toy sizes)\n")
    shapes = GPU_SHAPES if args.device == "cuda" else CPU_SHAPES
    for name, values, allowed in (("impls", args.impls, IMPLS), ("modes", args.modes, MODES),
                                  ("tasks", args.tasks, TASKS), ("shapes", args.shapes or [], shapes)):
        bad = [v for v in values if v not in allowed]
        if bad:
            parser.exit(2, f"{parser.prog}: error: --{name}: unknown {bad}, expected from {list(allowed)}\n")
    args.impls = [i for i in IMPLS if i in args.impls]  # liger last, whatever the order asked
    args.tasks = [t for t in TASKS if t in args.tasks]
    full = CONFIGS["qwen3-8b"] if args.device == "cuda" else CPU_CONFIG
    if args.layers is None:
        args.layers = 4 if args.device == "cuda" else 1
    if not 1 <= args.layers <= full.num_layers:
        parser.exit(2, f"{parser.prog}: error: --layers: expected 1..{full.num_layers}, got {args.layers}\n")
    path = os.path.join(args.out, f"{NAME}.json")
    previous = None
    if args.append and os.path.exists(path):
        with open(path) as f:
            previous = json.load(f)
    print(f"{NAME}: {args.device}, {args.layers} layers, impls {args.impls}, modes {args.modes}, tasks {args.tasks}",
          flush=True)
    payload = finish(run(args, lambda p: write_json(args.out, NAME, finish(p, previous))), previous)
    print_table(payload["rows"], [*KEY, "ms", "peak_gb", "tflop_per_s", "pct_gemm", "first_call_s", "graph_breaks",
                                  "max_abs_dlogp_vs_sdpa", "bitwise_vs_eager", "error"])
    print_table(payload["ratios"], [*KEY, "time_ratio", "time_goal", "time_goal_met", "memory_ratio",
                                    "memory_goal_met"])
    write_json(args.out, NAME, payload)
    plot(args.out, payload["rows"], payload["ratios"])
    return 0


if __name__ == "__main__":
    sys.exit(main())
