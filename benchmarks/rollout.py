"""Decode throughput of rl_engine's RolloutEngine (triton_bf16, torch_bf16) against transformers `generate`.

    python benchmarks/rollout.py --out benchmarks/results [--quick]
    python benchmarks/rollout.py --out DIR --contexts 1024 --budget-s 480          # a part of the grid ...
    python benchmarks/rollout.py --out DIR --contexts 4096 --budget-s 480 --merge  # ... the rest, same JSON
    python benchmarks/rollout.py --out DIR --device cpu               # toy sizes on the CPU (the smoke test)

Model: Qwen3-8B (config `qwen3-8b`, bf16, all 36 layers unless --layers), synthetic weights drawn on the GPU; the
same weights go into transformers' Qwen3ForCausalLM (attn_implementation="sdpa"). Workload per cell:
B sequences of `context` random prompt tokens, each generating exactly `new_tokens` tokens (no stop
token; transformers gets min_new_tokens = max_new_tokens), greedy unless --temperature > 0.
Peers, side by side in one run (cells ordered by context, then batch; each cell runs every peer, the
models built once and kept: ~4 GB of weights for the engine's two profiles, ~4 GB for transformers):
  triton_bf16   RolloutEngine on the triton_bf16 profile (paged cache, chunked prefill, fp32 logprobs),
                decode steps replayed from CUDA graphs (the engine's default on a GPU)
  triton_bf16_eager  the same without CUDA graphs (cuda_graphs=False): what the graphs save
  torch_bf16    the engine on the torch_bf16 profile (cuBLAS, SDPA with a mask), with CUDA graphs
  hf_static     generate(cache_implementation="static"); transformers compiles the decode step itself
                (torch.compile, mode reduce-overhead) on a GPU; its row says whether it did
  hf_dynamic    generate() with the default dynamic cache, eager
Per cell: prefill (prompt in -> first token out), decode steps (the other new_tokens - 1), tokens/s
during decode (B / mean step), end-to-end tokens/s, peak memory, and, for the engine, where a decode
step's time goes (EngineStats: GPU time between CUDA events around each phase, the engine never waiting
to time one): decode_graph = the one-graph step (forward incl. paged attention, lm_head, sampler, raw and
tempered logprobs, the copies in and out); for the eager engine forward, sample (lm_head + sampler) and
logprobs; other = the rest of the step period, in which the GPU waits for the host. A decode step's period
is the spacing of CUDA events recorded as each step is launched (no sync: the engine overlaps step t's
bookkeeping with step t+1 on the GPU); overlapped_steps counts the steps launched that way. The engine computes
fp32 logprobs of every token (under a Triton profile the raw ones come from the lm_head read that gives the
sampler its fp32 logits; the tempered ones, at a temperature, read the lm_head once more);
transformers' greedy `generate` returns none. cell_s: the whole cell's wall time, warm-up included.
Launch overhead: the last few decode steps run under torch.profiler; GPU time per step = the union of
the kernel (and copy) intervals it recorded (kernels overlap under programmatic dependent launch);
overhead = 1 - GPU time / wall time of an unprofiled step (median): the share of the step in which the
GPU idles on the host. The top kernels are kept, each with its share of that union (an instant credited to the
earliest-started kernel then running: a PDL dependent's wait is its predecessor's time)
(for transformers they name the SDPA backend that ran: flash, cuDNN or memory-efficient).
Byte floor per cell: a decode step reads every weight but the embedding table (B rows of it) and the batch's
cached keys and values (at the mean context of the decode steps); floor = those bytes / the device copy bandwidth
measured at the start of the same run (read + write bytes per second). floor_x = median decode step / floor.
Goals (issue 54): decode step <= 1.25x the floor; >= 1.5x the faster transformers peer's tokens/s at batch >= 64
and not slower at batch 1-16.
Cells whose page pool cannot fit in free memory are skipped; any failure (OOM) is recorded per cell.
The JSON is rewritten after every cell, so a run stopped by a time limit keeps what it measured;
--budget-s stops starting cells in time for the table and the plot.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from collections import defaultdict
from functools import partial

import torch
from common import GB, copy_ceiling, hf_qwen3_model, measure, module_version, print_table, save_plot, write_json

from rl_engine.models.config import ModelConfig
from rl_engine.models.decoder import DecoderModel
from rl_engine.models.families import get_config
from rl_engine.models.profiles import ProfileOps, get_profile
from rl_engine.models.weights import pack_projections, synthetic_weights
from rl_engine.rollout import EngineStats, Request, RolloutEngine, SamplingParams

NAME = "rollout"
ENGINE_PEERS = ("triton_bf16", "triton_bf16_eager", "torch_bf16")
HF_PEERS = ("hf_static", "hf_dynamic")
PEERS = ENGINE_PEERS + HF_PEERS
GOALS = {"floor_x": 1.25, "speedup_vs_hf": 1.5, "min_batch": 64, "small_batch_speedup_vs_hf": 1.0,
         "launch_overhead_pct": 5.0}
PROFILED_STEPS = 3  # decode steps run under the profiler, at the end of each generation
ATTENTION_NAMES = ("attention", "attn", "fmha", "flash", "sdpa", "cudnn")  # kernel names kept per row
WEIGHT_SEED = 0
# Per device: model, grid, quick grid, new tokens, engine chunk and page sizes. The CPU sizes are a toy that
# runs every code path (two prefill chunks, several pages per sequence) in seconds under the interpreter.
SETUPS = {
    "cuda": dict(model=lambda: get_config("qwen3-8b"), batches=(1, 16, 64, 256), contexts=(1024, 4096),
                 quick_batches=(1, 16), quick_contexts=(1024,), new_tokens=64, chunk_size=256, page_size=16),
    "cpu": dict(model=lambda: ModelConfig("rollout-toy", "qwen3", 64, 32, 64, 1, 2, 1, 16), batches=(1, 2),
                contexts=(6,), quick_batches=(1,), quick_contexts=(6,), new_tokens=3, chunk_size=4, page_size=4),
}


# -- timing helpers ------------------------------------------------------------------------------------
def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class _Probe:
    """torch.profiler over the last decode steps: GPU kernel time per step and the kernels that take it."""

    def __init__(self, device: torch.device, steps: int):
        self.device, self.steps, self.prof, self.error = device, steps, None, None

    def start(self) -> None:
        activities = [torch.profiler.ProfilerActivity.CPU]
        if self.device.type == "cuda":
            activities.append(torch.profiler.ProfilerActivity.CUDA)
        try:  # a profiler that cannot start must not lose the cell's timings
            self.prof = torch.profiler.profile(activities=activities)
            self.prof.start()
        except Exception as exc:  # noqa: BLE001
            self.prof, self.error = None, f"{type(exc).__name__}: {exc}"[:200]

    def stop(self) -> None:
        if self.prof is not None:
            try:
                self.prof.stop()
            except Exception as exc:  # noqa: BLE001
                self.prof, self.error = None, f"{type(exc).__name__}: {exc}"[:200]

    def summary(self) -> dict:
        """gpu_ms_per_step (None on a CPU, or when the profiler saw no kernel) and the top 6 kernels, ms/step.

        On a CPU the "kernels" are the ops by self CPU time: the same code path, no GPU figure."""
        if self.prof is None:
            return {"gpu_ms_per_step": None, "top_kernels": [], "probe_error": self.error or "never started"}
        from torch.autograd import DeviceType

        on_gpu = self.device.type == "cuda"
        per_name = defaultdict(float)
        spans = []
        for e in self.prof.events():
            if on_gpu and e.device_type == DeviceType.CUDA:
                spans.append((e.time_range.start, e.time_range.end, e.name))
            elif not on_gpu and e.device_type == DeviceType.CPU:
                per_name[e.name] += e.self_cpu_time_total
        if on_gpu:
            per_name = busy_by_name(spans)
        total_ms = sum(per_name.values()) / 1e3 / self.steps
        top = sorted(per_name.items(), key=lambda kv: -kv[1])[:6]
        attention = sorted(n[:120] for n in per_name if any(k in n.lower() for k in ATTENTION_NAMES))
        return {"gpu_ms_per_step": total_ms if on_gpu and total_ms > 0 else None,
                "top_kernels": [{"name": n[:120], "ms_per_step": us / 1e3 / self.steps} for n, us in top],
                "attention_kernels": attention}


def busy_by_name(spans: list[tuple[float, float, str]]) -> dict[str, float]:
    """Each kernel name's share (us) of the union of kernel intervals (start, end, name): time in which some kernel
    ran, each instant credited to the earliest-started kernel then running. Under programmatic dependent launch a
    dependent starts, and waits, while the kernel before it runs: its own duration would count that wait (and the
    durations' sum would count those stretches twice)."""
    busy, end = defaultdict(float), float("-inf")
    for start, stop, name in sorted(spans):
        if stop > end:
            busy[name] += stop - max(start, end)
            end = stop
    return dict(busy)


def _sdpa_backend(kernels: list[str]) -> str:
    """Which SDPA backend transformers' attention ran, read off the kernel names (none seen: 'unknown')."""
    names = " ".join(k.lower() for k in kernels)
    for needle, backend in (("cudnn", "cudnn"), ("flash", "flash"), ("fmha", "efficient"), ("efficient", "efficient")):
        if needle in names:
            return backend
    return "unknown"


def _decode_figures(batch: int, prefill_s: float, steps_s: list[float], new_tokens: int) -> dict:
    """The row's throughput cells from the prefill time and the unprofiled decode step times."""
    mean = statistics.fmean(steps_s)
    return {
        "prefill_ms": 1e3 * prefill_s,
        "decode_step_ms": 1e3 * mean,
        "decode_step_ms_median": 1e3 * statistics.median(steps_s),
        "decode_step_ms_max": 1e3 * max(steps_s),
        "decode_tok_s": batch / mean,
        # what one generate() call yields without the profiler: prefill + every decode step at the mean
        "e2e_tok_s": batch * new_tokens / (prefill_s + (new_tokens - 1) * mean),
    }


def _memory(device: torch.device, before: int) -> dict:
    if device.type != "cuda":
        return {"peak_gib": None, "peak_extra_gib": None}
    peak = torch.cuda.max_memory_allocated(device)
    return {"peak_gib": peak / 2**30, "peak_extra_gib": (peak - before) / 2**30}


def _reset_memory(device: torch.device) -> int:
    _sync(device)
    if device.type != "cuda":
        return 0
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats(device)
    return torch.cuda.memory_allocated(device)


def _profiled(new_tokens: int) -> int:
    """Decode steps profiled: PROFILED_STEPS, leaving at least as many unprofiled (new_tokens >= 3)."""
    return min(PROFILED_STEPS, (new_tokens - 1) // 2)


# -- workload ----------------------------------------------------------------------------------------------
def prompts(config: ModelConfig, batch: int, context: int) -> torch.Tensor:
    """int64 [B, context] on the CPU: the same prompts for every peer (token 0 left out)."""
    gen = torch.Generator().manual_seed(1000 * batch + context)
    return torch.randint(1, config.vocab_size, (batch, context), generator=gen)


def engine_requests(ids: torch.Tensor, new_tokens: int, temperature: float) -> list[Request]:
    params = SamplingParams(temperature=temperature, max_new_tokens=new_tokens, seed=WEIGHT_SEED)
    return [Request(i, tuple(row), params) for i, row in enumerate(ids.tolist())]


def pool_pages(batch: int, context: int, new_tokens: int, page_size: int) -> int:
    """Pages for every sequence's prompt + new tokens, plus the null page."""
    return batch * -(-(context + new_tokens) // page_size) + 1


def pool_bytes(config: ModelConfig, num_pages: int, page_size: int) -> int:
    return 2 * config.num_layers * num_pages * page_size * config.num_kv_heads * config.head_dim * 2  # k+v, bf16


def step_bytes(config: ModelConfig, weights: dict, batch: int, context: int, new_tokens: int) -> int:
    """Bytes one decode step must read: every weight but the embedding table (its B rows), and the batch's keys and
    values at the decode steps' mean context."""
    embed = [n for n in weights if "embed" in n]
    read = sum(t.numel() * t.element_size() for n, t in weights.items() if n not in embed)
    read += sum(batch * weights[n].shape[1] * weights[n].element_size() for n in embed)
    kv_per_token = 2 * config.num_layers * config.num_kv_heads * config.head_dim * 2  # k + v, bf16
    return read + batch * (context + new_tokens // 2) * kv_per_token


# -- the engine ------------------------------------------------------------------------------------------
def run_engine(model: DecoderModel, cuda_graphs: bool, setup: dict, batch: int, context: int, new_tokens: int,
               temperature: float,
               device: torch.device) -> dict:
    config, page = model.config, setup["page_size"]
    num_pages = pool_pages(batch, context, new_tokens, page)
    need = pool_bytes(config, num_pages, page)
    if device.type == "cuda":
        free = torch.cuda.mem_get_info(device)[0]
        if need > 0.9 * free:
            return {"skipped": f"page pool needs {need / 2**30:.1f} GiB, {free / 2**30:.1f} GiB free"}
    ids = prompts(config, batch, context)
    before = _reset_memory(device)
    engine = RolloutEngine(model, max_batch_size=batch, chunk_size=setup["chunk_size"], page_size=page,
                           num_pages=num_pages, cuda_graphs=cuda_graphs)
    # warm-up: the same batch and prompts, 2 tokens (a prefill and a decode step compile every Triton kernel
    # the timed run meets, and capture its decode graph: page tables of the same power-of-two width)
    engine.generate(engine_requests(ids, 2, temperature))
    engine.stats = EngineStats()
    model.ops.recorder.records.clear()

    total_prompt = batch * context
    marks: list = []  # (a point in time, EngineStats.seconds) at each decode step's launch
    profiled = _profiled(new_tokens)
    first_profiled = new_tokens - 1 - profiled
    probe = _Probe(device, profiled)
    # A decode step's start: a CUDA event recorded on the stream as the step is launched (no wait: with decode
    # graphs the engine launches step t+1 before it reads step t, and a sync here would undo that overlap), so the
    # spacing of the marks is the GPU timeline's step period, idle gaps included. On a CPU, the wall clock.
    hook_name = "_launch" if engine.graphs is not None else "_step"
    hooked = getattr(engine, hook_name)

    def mark():
        if device.type != "cuda":
            return time.perf_counter()
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def timed(*args):
        if engine.stats.prefill_tokens == total_prompt:  # every prompt is in the cache: a decode step
            # the phase totals so far: read (a wait) only before the first decode step, outside the timed spacing
            marks.append((mark(), None if marks else engine.stats.seconds))
            if len(marks) == first_profiled + 1:
                probe.start()
        return hooked(*args)

    setattr(engine, hook_name, timed)  # instance attribute: the engine's own method stays untouched
    requests = engine_requests(ids, new_tokens, temperature)
    _sync(device)
    start = mark()
    t0 = time.perf_counter()
    try:
        out = engine.generate(requests)
        _sync(device)
    finally:
        probe.stop()
        delattr(engine, hook_name)
    if len(marks) != new_tokens - 1:
        raise RuntimeError(f"engine: expected {new_tokens - 1} decode steps, timed {len(marks)}")
    if any(len(c.token_ids) != new_tokens or c.finish_reason != "length" for c in out.values()):
        raise RuntimeError(f"engine: a sequence did not generate exactly {new_tokens} tokens")
    if device.type == "cuda":
        times = [start.elapsed_time(e) / 1e3 for e, _ in marks]
        prefill_s = times[0]
    else:
        times = [t for t, _ in marks]
        prefill_s = times[0] - t0
    steps_s = [b - a for a, b in zip(times[:first_profiled], times[1 : first_profiled + 1])]
    row = _decode_figures(batch, prefill_s, steps_s, new_tokens)
    row.update(_memory(device, before))
    # where a decode step's time goes, per step: GPU time between events around each phase, summed over every decode
    # step (the profiled ones included) and read after the run
    start_totals, end_totals = marks[0][1], engine.stats.seconds
    parts = {k: 1e3 * (end_totals[k] - start_totals[k]) / len(marks)
             for k in ("decode_graph", "forward", "sample", "logprobs")}
    row.update({f"{k}_ms": v for k, v in parts.items()})
    row["other_ms"] = row["decode_step_ms"] - sum(parts.values())
    row["overlapped_steps"] = engine.stats.overlapped_steps
    row.update(probe.summary())
    if row["gpu_ms_per_step"] is not None:
        row["launch_overhead_pct"] = 100 * (1 - row["gpu_ms_per_step"] / row["decode_step_ms_median"])
    row["cuda_graphs"] = sorted(engine.graphs.steps) if engine.graphs else None  # (rows, width) captured
    row["pool"] = {"num_pages": num_pages, "page_size": page, "gib": need / 2**30, "chunk_size": setup["chunk_size"]}
    row["ran"] = sorted({f"{r.op}:{r.target}" for r in model.ops.recorder.records})
    row["stacked_products"] = sorted({r.node.rsplit(".", 1)[-1] for r in model.ops.recorder.records if "+" in r.node})
    if temperature == 0:  # greedy: the peers' first tokens should mostly agree (a wiring check)
        row["first_tokens"] = [out[i].token_ids[0] for i in range(batch)]
    return row


def build_engine_model(config: ModelConfig, weights: dict, profile: str) -> DecoderModel:
    return DecoderModel(config, weights, ProfileOps(get_profile(profile)))


# -- transformers ------------------------------------------------------------------------------------------
def hf_model(config: ModelConfig, weights: dict, device: torch.device):
    return hf_qwen3_model(config, weights, device).eval()


class _StepClock:
    """A `generate` streamer: the wall time of each put (the prompt, then every new token); starts the probe."""

    def __init__(self, device: torch.device, probe: _Probe, start_at: int):
        self.device, self.probe, self.start_at, self.marks = device, probe, start_at, []

    def put(self, value) -> None:
        _sync(self.device)
        self.marks.append(time.perf_counter())
        if len(self.marks) == self.start_at:
            self.probe.start()

    def end(self) -> None:
        pass


def run_hf(hf, peer: str, batch: int, context: int, new_tokens: int, temperature: float,
           device: torch.device, config: ModelConfig, warm_prompt: int) -> dict:
    ids = prompts(config, batch, context).to(device)
    sampling = ({"do_sample": True, "temperature": temperature, "top_k": 0, "top_p": 1.0} if temperature > 0
                else {"do_sample": False})
    cache = {"cache_implementation": "static"} if peer == "hf_static" else {}

    def generate(streamer=None):
        with torch.no_grad():
            return hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens,
                               min_new_tokens=new_tokens, pad_token_id=0, streamer=streamer, **sampling, **cache)

    # warm-up. Static cache: the identical call (the cache's shape is the call's prompt + new tokens and
    # transformers compiles the decode step for it on a GPU: anything shorter would compile again in the
    # timed run). Dynamic cache: as the engine's warm-up (a prompt of one engine chunk or less, 2 tokens).
    if peer == "hf_static":
        generate()
    else:
        with torch.no_grad():
            short = ids[:, :warm_prompt]
            hf.generate(short, attention_mask=torch.ones_like(short), max_new_tokens=2, min_new_tokens=2,
                        pad_token_id=0, **sampling)
    before = _reset_memory(device)
    profiled = _profiled(new_tokens)
    first_profiled = new_tokens - 1 - profiled
    probe = _Probe(device, profiled)
    # puts: [0] the prompt, [1] the first token (prefill done), [1 + k] after decode step k
    clock = _StepClock(device, probe, start_at=2 + first_profiled)
    _sync(device)
    t0 = time.perf_counter()
    try:
        out = generate(clock)
        _sync(device)
    finally:
        probe.stop()
    if tuple(out.shape) != (batch, context + new_tokens):
        raise RuntimeError(f"{peer}: expected output [{batch}, {context + new_tokens}], got {list(out.shape)}")
    marks = clock.marks
    if len(marks) != new_tokens + 1:
        raise RuntimeError(f"{peer}: expected {new_tokens + 1} streamer calls, got {len(marks)}")
    steps_s = [b - a for a, b in zip(marks[1 : 1 + first_profiled], marks[2 : 2 + first_profiled])]
    row = _decode_figures(batch, marks[1] - t0, steps_s, new_tokens)
    row.update(_memory(device, before))
    row.update(probe.summary())
    if row["gpu_ms_per_step"] is not None:
        row["launch_overhead_pct"] = 100 * (1 - row["gpu_ms_per_step"] / row["decode_step_ms_median"])
    row["attn_implementation"] = hf.config._attn_implementation
    row["sdpa_backend"] = _sdpa_backend(row["attention_kernels"]) if device.type == "cuda" else "cpu"
    row["cache"] = "static" if peer == "hf_static" else "dynamic"
    row["compiled"] = peer == "hf_static" and hasattr(hf, "_compiled_call")  # generate compiled the decode step
    if temperature == 0:
        row["first_tokens"] = out[:, context].tolist()
    return row


# -- the grid ----------------------------------------------------------------------------------------------
def _key(row: dict) -> tuple:
    return row["peer"], row["batch"], row["context"]


def add_comparisons(rows: list[dict]) -> None:
    """Per row: the byte floor's multiple; per engine row: speedup (tokens/s ratio) vs each transformers peer and vs
    the faster one, the goals;
    per row: the share of first tokens equal to the other peers' (same prompts, greedy: a wiring check)."""
    by_cell = defaultdict(dict)
    for r in rows:
        by_cell[(r["batch"], r["context"])][r["peer"]] = r
    for r in rows:
        if r.get("floor_ms") and r.get("decode_step_ms_median"):
            r["floor_x"] = r["decode_step_ms_median"] / r["floor_ms"]
    for cell in by_cell.values():
        hf = {p: cell[p]["decode_tok_s"] for p in HF_PEERS if cell.get(p, {}).get("decode_tok_s")}
        for peer in ENGINE_PEERS:
            r = cell.get(peer, {})
            if not r.get("decode_tok_s") or not hf:
                continue
            for p, tok_s in hf.items():
                r[f"speedup_vs_{p}"] = r["decode_tok_s"] / tok_s
            r["speedup_vs_hf"] = r["decode_tok_s"] / max(hf.values())
            need = GOALS["speedup_vs_hf"] if r["batch"] >= GOALS["min_batch"] else GOALS["small_batch_speedup_vs_hf"]
            r["speedup_goal_met"] = bool(r["speedup_vs_hf"] >= need)
        for r in cell.values():
            if r.get("floor_x") is not None and r["peer"] in ENGINE_PEERS:
                r["floor_goal_met"] = bool(r["floor_x"] <= GOALS["floor_x"])
        with_tokens = {p: r["first_tokens"] for p, r in cell.items() if r.get("first_tokens")}
        for p, tokens in with_tokens.items():
            agree = {q: sum(a == b for a, b in zip(tokens, other)) / len(tokens)
                     for q, other in with_tokens.items() if q != p}
            if agree:
                cell[p]["first_token_agree"] = agree


def _failed(row: dict, batch: int, context: int) -> dict:
    """The row of a cell whose model could not be built."""
    return dict(row)


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, help="directory for rollout.json and rollout.png")
    parser.add_argument("--quick", action="store_true", help="fewer cells (batch 1, 16; context 1024 on a GPU)")
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda",
                        help="cpu: a toy model at toy sizes, every code path but the GPU figures (the smoke test)")
    parser.add_argument("--batches", type=int, nargs="+", help="batch sizes (default: the device's grid)")
    parser.add_argument("--contexts", type=int, nargs="+", help="prompt lengths (default: the device's grid)")
    parser.add_argument("--new-tokens", type=int, help="tokens generated per sequence (default 64 on a GPU)")
    parser.add_argument("--layers", type=int, help="decoder layers (default: the model's own, 36 for Qwen3-8B)")
    parser.add_argument("--peers", nargs="+", choices=PEERS, default=list(PEERS), help="what to time")
    parser.add_argument("--temperature", type=float, default=0.0, help="0: greedy (default); > 0: sampling")
    parser.add_argument("--budget-s", type=float,
                        help="start no cell after this many seconds (its rows say skipped): finish inside a time limit")
    parser.add_argument("--merge", action="store_true",
                        help="keep the rows of an existing DIR/rollout.json that this run does not measure again")
    args = parser.parse_args(argv)
    setup = SETUPS[args.device]
    args.batches = args.batches or list(setup["quick_batches" if args.quick else "batches"])
    args.contexts = args.contexts or list(setup["quick_contexts" if args.quick else "contexts"])
    args.new_tokens = args.new_tokens or setup["new_tokens"]
    bad = ([f"--batches {b}" for b in args.batches if b < 1] + [f"--contexts {c}" for c in args.contexts if c < 1]
           + ([f"--new-tokens {args.new_tokens} (needs >= 3)"] if args.new_tokens < 3 else [])
           + ([f"--temperature {args.temperature}"] if not args.temperature >= 0 else [])
           + ([f"--layers {args.layers} (the model has {setup['model']().num_layers})"]
              if args.layers is not None and not 1 <= args.layers <= setup["model"]().num_layers else []))
    if bad:
        parser.exit(2, f"{parser.prog}: error: invalid {', '.join(bad)}\n")
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.exit(2, f"{parser.prog}: error: needs CUDA (or --device cpu for the toy run)\n")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    device = torch.device(args.device)
    setup = SETUPS[args.device]
    config = setup["model"]()
    if args.layers is not None:
        config = config.with_layers(args.layers)
    copy = copy_ceiling() if device.type == "cuda" else None
    if copy is not None:
        print(f"device copy bandwidth {copy['gb_per_s']:.0f} GB/s (read + write)", flush=True)
    cells = sorted((c, b) for c in args.contexts for b in args.batches)  # a static cache only grows: short first
    path = os.path.join(args.out, f"{NAME}.json")
    kept = []
    if args.merge and os.path.exists(path):
        with open(path) as f:
            previous = json.load(f)
        ours = (config.name, args.new_tokens, args.temperature)
        theirs = tuple(previous.get(k) for k in ("model", "new_tokens", "temperature"))
        if theirs != ours:
            print(f"{path}: measured (model, new tokens, temperature) {theirs}, this run {ours}: not merged",
                  file=sys.stderr)
            return 2
        kept = previous["rows"]
    rows: list[dict] = []

    def payload(complete: bool) -> dict:
        fresh = {_key(r) for r in rows}
        merged = [r for r in kept if _key(r) not in fresh] + rows
        add_comparisons(merged)
        public = [{k: v for k, v in r.items() if k != "first_tokens"} for r in merged]
        return {"complete": complete, "model": config.name, "dtype": "bfloat16", "new_tokens": args.new_tokens,
                "temperature": args.temperature, "profiled_steps": PROFILED_STEPS, "goals": GOALS,
                "engine": {"chunk_size": setup["chunk_size"], "page_size": setup["page_size"]},
                "transformers": module_version("transformers"), "layers": config.num_layers,
                "copy_gb_per_s": copy["gb_per_s"] if copy else None,
                "rows": public}

    print(f"{config.name} on {device}: cells (context, batch) {cells}, {args.new_tokens} new tokens, "
          f"peers {args.peers}", flush=True)
    started = time.perf_counter()
    # Every model is built once and kept (the two engine profiles share the weights; transformers holds a
    # copy: 2 x 4.2 GB at this width) so that each cell runs all peers back to back: a run cut short
    # (--budget-s, the device's time limit) still has whole cells to compare.
    # as a rollout model holds them: q/k/v and gate/up stacked, one product each (DecoderModel._projections)
    weights = pack_projections(synthetic_weights(config, WEIGHT_SEED, device=device), config)
    floor_bytes = {(b, c): step_bytes(config, weights, b, c, args.new_tokens) for c, b in cells}
    runners, models = {}, {}
    for peer in [p for p in ENGINE_PEERS if p in args.peers]:
        profile = peer.removesuffix("_eager")
        if profile not in models:
            models[profile] = build_engine_model(config, weights, profile)
        runners[peer] = partial(run_engine, models[profile], not peer.endswith("_eager"), setup,
                                new_tokens=args.new_tokens, temperature=args.temperature, device=device)
    models.clear()
    if any(p in args.peers for p in HF_PEERS):
        hf = measure("transformers model", hf_model, config, weights, device)  # the model, or {"error": ...}
        for peer in [p for p in HF_PEERS if p in args.peers]:
            runners[peer] = (partial(_failed, hf) if isinstance(hf, dict) else
                             partial(run_hf, hf, peer, new_tokens=args.new_tokens, temperature=args.temperature,
                                     device=device, config=config, warm_prompt=setup["chunk_size"]))
    del weights
    for context, batch in cells:
        over = args.budget_s is not None and time.perf_counter() - started > args.budget_s
        for peer, run in runners.items():
            t0 = time.perf_counter()
            row = ({"skipped": f"time budget of {args.budget_s} s spent"} if over
                   else measure(f"{peer} batch={batch} context={context}", run, batch, context))
            floor = None if copy is None else 1e3 * floor_bytes[(batch, context)] / (copy["gb_per_s"] * GB)
            rows.append({"peer": peer, "batch": batch, "context": context, **row, "floor_ms": floor,
                         "cell_s": None if over else time.perf_counter() - t0})
            if not over:
                print(f"    {rows[-1]['cell_s']:.1f} s", flush=True)
                write_json(args.out, NAME, payload(complete=False))  # a run cut short keeps what it measured
    runners.clear()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    result = payload(complete=True)
    write_json(args.out, NAME, result)
    table = sorted(result["rows"], key=lambda r: (r["context"], r["batch"], PEERS.index(r["peer"])))
    print_table(table, ["peer", "batch", "context", "decode_tok_s", "decode_step_ms_median", "floor_ms", "floor_x",
                        "floor_goal_met", "prefill_ms", "e2e_tok_s", "peak_gib", "gpu_ms_per_step",
                        "launch_overhead_pct", "speedup_vs_hf", "speedup_goal_met",
                        "forward_ms", "sample_ms", "logprobs_ms", "other_ms", "cell_s", "skipped", "error"])
    plot(args.out, table)
    return 0


def plot(out: str, rows: list[dict]) -> None:
    if not any(r.get("decode_tok_s") for r in rows):
        print("no cell measured: no plot")
        return
    batches = sorted({r["batch"] for r in rows})
    contexts = sorted({r["context"] for r in rows})

    def series(key, peers):
        cells = {f"{p} ctx={c}": [next((r.get(key) for r in rows if _key(r) == (p, b, c)), None) for b in batches]
                 for p in peers for c in contexts}
        return {label: ys for label, ys in cells.items() if any(y is not None for y in ys)}

    bars = {"kind": "bar", "xlabel": "batch", "x": batches}  # 1 to 256 on a linear axis would hide the small ones
    save_plot(out, NAME, [
        {**bars, "title": "decode throughput", "ylabel": "generated tokens/s", "series": series("decode_tok_s", PEERS),
         "logy": True},
        {**bars, "title": "decode step over its byte floor", "ylabel": "x the floor",
         "series": series("floor_x", PEERS), "hline": (GOALS["floor_x"], "goal")},
        {**bars, "title": "engine tokens/s over the faster transformers peer", "ylabel": "x",
         "series": series("speedup_vs_hf", ENGINE_PEERS), "hline": (GOALS["speedup_vs_hf"], "goal")},
        {**bars, "title": "decode step: GPU idle on the host", "ylabel": "% of the step",
         "series": series("launch_overhead_pct", PEERS), "hline": (GOALS["launch_overhead_pct"], "goal")},
    ])


if __name__ == "__main__":
    raise SystemExit(main())
