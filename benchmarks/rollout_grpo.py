"""A GRPO-shaped generation workload end to end: RolloutEngine (prefix sharing on, off) vs transformers `generate`.

    python benchmarks/rollout_grpo.py --out DIR                                   # issue 54's workload, full depth
    python benchmarks/rollout_grpo.py --out DIR --prompts 16 --new-tokens 256 --layers 12 --budget-s 90
    python benchmarks/rollout_grpo.py --out DIR --rows hf_generate --merge   # a later call adds transformers' row
    TRITON_INTERPRET=1 python benchmarks/rollout_grpo.py --out DIR --device cpu   # toy sizes (the smoke test)

Workload (issue 54's defaults): 64 prompts of 512 random tokens x 8 samples (a GRPO group = the 8 requests sharing a
prompt), 1,024 new tokens, temperature 1, top-p 0.95, stop token ids; Qwen3-8B's config (--layers cuts depth), bf16,
synthetic weights (benchmarks/rollout.py's model, prompts and pool helpers). Synthetic weights rarely sample any one
id, so the stop ids are the tokens a short greedy probe of the first prompts emits most often (or --stop-ids).
At most --max-batch sequences decode at once in every row.
Rows:
  triton_bf16             RolloutEngine on the triton_bf16 profile, prefix sharing on (a group prefills its prompt once)
  triton_bf16_no_sharing  the same engine settings and pool, prefix sharing off
  hf_generate             transformers generate (do_sample, temperature 1, top_p 0.95, num_return_sequences = samples,
                          eos = the stop ids), max_batch // samples prompts per call; a static cache (transformers
                          compiles its decode step on a GPU) after one untimed call of the same shape, or the default
                          dynamic cache when the static one fails (the row's `cache` says which ran)
Per row: wall time, generated tokens, tokens/s, stopped sequences, peak GPU memory beside weights + KV (the engine's
page pool, transformers' cache for a call) + 2 GiB (the issue's memory goal), the engine's stats. Each engine row
builds a fresh engine and, on a GPU, warms it up on max_batch requests x 2 tokens (kernels compiled, first decode
graphs captured); graphs of other shapes are captured inside the timed run, as in a first RL step.
Checks: sharing on and off must give the same tokens and logprobs for every sequence (exit code 1 if not).
Bits: for the first --bits-groups groups, the rollout's logprobs against the trainer's packed recompute as verl's
rollout_corr/* metrics (rl_engine.metrics, as examples/grpo_step.py): triton_bf16 (the sharing-on row's own
completions) and torch_bf16 (a torch_bf16 engine generating those groups again).
The JSON is rewritten after every row; --budget-s starts no row after that many seconds.
"""

from __future__ import annotations

import argparse
import copy
import gc
import json
import os
import sys
import time
from collections import Counter
from dataclasses import fields

import torch
from common import measure, module_version, print_table, save_plot, write_json
from rollout import SETUPS, WEIGHT_SEED, build_engine_model, hf_model, pool_bytes, pool_pages, prompts

from rl_engine.metrics import rollout_corr_metrics
from rl_engine.models.weights import pack_projections, synthetic_weights
from rl_engine.rollout import EngineStats, Request, RolloutEngine, SamplingParams, tempered_logprobs
from rl_engine.workload.layouts import Sample, pack

NAME = "rollout_grpo"
ENGINE_ROWS = {"triton_bf16": True, "triton_bf16_no_sharing": False}  # peer -> prefix_sharing
HF_ROW = "hf_generate"
ROWS = (*ENGINE_ROWS, HF_ROW, "bits")
GiB = 2**30
MEMORY_SLACK_GIB = 2.0  # issue 54: peak <= weights + pages + 2 GiB
PROBE_TOKENS = 16  # greedy tokens per probe prompt (at most new_tokens)
TRAIN_TOKENS = 4096  # tokens per micro-batch of the trainer's recompute
DEFAULTS = {"cuda": dict(prompts=64, samples=8, prompt_len=512, new_tokens=1024, max_batch=128),
            "cpu": dict(prompts=2, samples=2, prompt_len=5, new_tokens=4, max_batch=4)}


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _reset_peak(device: torch.device) -> None:
    _sync(device)
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)


def _memory(device: torch.device, weight_bytes: int, kv_bytes: int) -> dict:
    """Peak GPU memory of the row beside the issue's goal (None on a CPU)."""
    goal = (weight_bytes + kv_bytes) / GiB + MEMORY_SLACK_GIB
    peak = torch.cuda.max_memory_allocated(device) / GiB if device.type == "cuda" else None
    return {"peak_gib": peak, "weights_gib": weight_bytes / GiB, "kv_gib": kv_bytes / GiB, "memory_goal_gib": goal,
            "memory_goal_met": None if peak is None else bool(peak <= goal)}


def params(args, stops: tuple[int, ...], new_tokens: int | None = None, temperature: float = 1.0) -> SamplingParams:
    return SamplingParams(temperature=temperature, top_p=args.top_p if temperature else 1.0,
                          max_new_tokens=new_tokens or args.new_tokens, stop_token_ids=stops, seed=WEIGHT_SEED)


def grpo_requests(ids: torch.Tensor, samples: int, p: SamplingParams) -> list[Request]:
    """Request g * samples + j is sample j of prompt g: a group's members share prompt_ids."""
    return [Request(g * samples + j, tuple(row), p) for g, row in enumerate(ids.tolist()) for j in range(samples)]


def new_engine(model, args, setup, num_pages: int, sharing: bool = True) -> RolloutEngine:
    # cuda_graphs=True: captured on a GPU; on the CPU the same padded path runs eagerly (the smoke test covers it)
    return RolloutEngine(model, max_batch_size=args.max_batch, chunk_size=setup["chunk_size"],
                         page_size=setup["page_size"], num_pages=num_pages, cuda_graphs=True, prefix_sharing=sharing)


def probe_stops(model, ids: torch.Tensor, args, setup) -> list[int]:
    """The args.stops ids a greedy continuation of the first prompts emits most often (first seen first on ties)."""
    rows = ids[: min(4, len(ids))]
    tokens = min(PROBE_TOKENS, args.new_tokens)
    pages = pool_pages(len(rows), args.prompt_len, tokens, setup["page_size"])
    engine = RolloutEngine(model, max_batch_size=len(rows), chunk_size=setup["chunk_size"],
                           page_size=setup["page_size"], num_pages=pages, cuda_graphs=False)
    greedy = params(args, (), tokens, temperature=0.0)
    out = engine.generate([Request(i, tuple(r), greedy) for i, r in enumerate(rows.tolist())])
    emitted = [t for i in sorted(out) for t in out[i].token_ids]
    return [t for t, _ in Counter(emitted).most_common(args.stops)]


# -- rows ----------------------------------------------------------------------------------------------------
def _progress(engine: RolloutEngine, total: int, t0: float) -> None:
    """Print as each quarter of the sequences finishes (host side, no sync): a full-size row runs for minutes."""
    retire, marks = engine._retire, {total * q // 4 for q in (1, 2, 3)}

    def counted(running, done):
        before = len(done)
        retire(running, done)
        if any(before < m <= len(done) for m in marks):
            print(f"    {len(done)}/{total} sequences done, {time.perf_counter() - t0:.0f} s", flush=True)

    engine._retire = counted  # an instance attribute: the engine's own method stays untouched


def run_engine(model, sharing: bool, requests: list[Request], args, setup, num_pages: int, weight_bytes: int,
               device: torch.device) -> tuple[dict, dict]:
    """(row, completions by request id) of one generate() over every request."""
    engine = new_engine(model, args, setup, num_pages, sharing)
    if device.type == "cuda":  # (a CPU has nothing to compile or capture: the toy run skips it)
        warm = params(args, requests[0].params.stop_token_ids, 2)
        engine.generate([Request(r.request_id, r.prompt_ids, warm) for r in requests[: args.max_batch]])
    engine.stats = EngineStats()
    _reset_peak(device)
    t0 = time.perf_counter()
    _progress(engine, len(requests), t0)
    out = engine.generate(requests)
    _sync(device)
    wall = time.perf_counter() - t0
    generated = sum(len(c.token_ids) for c in out.values())
    stats = {f.name: getattr(engine.stats, f.name) for f in fields(engine.stats) if not f.name.startswith("_")}
    row = {"wall_s": wall, "generated_tokens": generated, "tok_s": generated / wall, "sequences": len(out),
           "stopped": sum(c.finish_reason == "stop" for c in out.values()), **stats,
           "phase_s": engine.stats.seconds, "graphs_captured": len(engine.graphs.steps),
           "pool": {"num_pages": num_pages, "page_size": setup["page_size"], "chunk_size": setup["chunk_size"]},
           **_memory(device, weight_bytes, pool_bytes(model.config, num_pages, setup["page_size"]))}
    return row, out


def run_hf(hf, config, ids: torch.Tensor, args, stops: list[int], cache: str, device: torch.device) -> dict:
    per_call = max(1, args.max_batch // args.samples)  # prompts per generate call
    sampling = dict(do_sample=True, temperature=1.0, top_p=args.top_p, top_k=0, num_return_sequences=args.samples,
                    max_new_tokens=args.new_tokens, eos_token_id=list(stops), pad_token_id=stops[0])
    if cache == "static":
        sampling["cache_implementation"] = "static"
    calls = [ids[i : i + per_call].to(device) for i in range(0, len(ids), per_call)]

    def generate(batch, **kw):
        with torch.no_grad():
            return hf.generate(batch, attention_mask=torch.ones_like(batch), **{**sampling, **kw})

    # warm-up: a static cache is shaped by the call (batch, prompt + new tokens): the identical call compiles it
    if cache == "static":
        generate(calls[0])
    else:
        generate(calls[0][:, : min(args.prompt_len, 16)], max_new_tokens=2)
    _reset_peak(device)
    stop_ids = torch.tensor(stops, device=device)
    generated = stopped = 0
    t0 = time.perf_counter()
    for i, batch in enumerate(calls):
        new = generate(batch)[:, batch.shape[1] :]
        hit = torch.isin(new, stop_ids)
        ended = hit.any(1)  # a sequence's tokens end at its first stop id (the rest is padding)
        generated += int(torch.where(ended, hit.int().argmax(1) + 1, new.shape[1]).sum())
        stopped += int(ended.sum())
        print(f"    call {i + 1}/{len(calls)}: {time.perf_counter() - t0:.1f} s", flush=True)
    _sync(device)
    wall = time.perf_counter() - t0
    weight_bytes = sum(t.numel() * t.element_size() for t in [*hf.parameters(), *hf.buffers()])
    kv = pool_bytes(config, per_call * args.samples * (args.prompt_len + args.new_tokens), 1)  # a call's cache
    return {"wall_s": wall, "generated_tokens": generated, "tok_s": generated / wall,
            "sequences": len(ids) * args.samples, "stopped": stopped, "calls": len(calls),
            "prompts_per_call": per_call, "cache": cache,
            "compiled": hasattr(hf, "_compiled_call"), "attn_implementation": hf.config._attn_implementation,
            **_memory(device, weight_bytes, kv)}


# -- checks and bits -------------------------------------------------------------------------------------------
def compare(a: dict, b: dict) -> dict:
    """Request ids whose tokens (or logprobs, bitwise) differ between two runs of the same requests."""
    tokens = sorted(i for i in a if i not in b or a[i].token_ids != b[i].token_ids)
    logprobs = sorted(i for i in a if i not in tokens and not torch.equal(a[i].logprobs, b[i].logprobs))
    return {"same_tokens": not tokens and set(a) == set(b), "same_logprobs": not tokens and not logprobs,
            "token_mismatches": tokens[:20], "logprob_mismatches": logprobs[:20]}


def trainer_metrics(model, completions: list, temperature: float, device: torch.device) -> dict:
    """rollout_corr/* of the completions' rollout logprobs against the trainer's packed teacher-forced recompute, in
    micro-batches of about TRAIN_TOKENS (a torch_bf16 forward builds a T x T mask and T x V fp32 logits)."""
    trainer = copy.copy(model)
    trainer.stack_projections = False  # a trainer's q/k/v and gate/up are separate parameters: one product each
    samples = [Sample(i, c.prompt_ids + tuple(c.token_ids), len(c.prompt_ids)) for i, c in enumerate(completions)]
    width = max(len(c.token_ids) for c in completions)
    train_rows, rollout_rows, mask = (torch.zeros(len(samples), width, device=device) for _ in range(3))
    micro: list[Sample] = []
    for k, sample in enumerate(samples):
        micro.append(sample)
        if k + 1 < len(samples) and sum(s.length for s in micro) + samples[k + 1].length <= TRAIN_TOKENS:
            continue
        layout = pack(micro).to(device)
        with torch.no_grad():
            hidden = trainer.forward(layout.token_ids, layout.positions, cu_seqlens=layout.cu_seqlens)[0]
            train = tempered_logprobs(trainer, hidden[None], layout.target_ids[0][None], temperature)[0]
        for s, start in zip(micro, layout.cu_seqlens.tolist()):
            i, n = s.sample_id, s.length - s.prompt_len
            train_rows[i, :n] = train[start + s.prompt_len - 1 : start + s.length - 1]  # the slots predicting it
            rollout_rows[i, :n] = completions[i].logprobs.to(device)
            mask[i, :n] = 1.0
        micro = []
    metrics = {k: float(v) for k, v in rollout_corr_metrics(train_rows, rollout_rows, mask).items()}
    active = mask.bool()
    return {"sequences": len(samples), "tokens": int(mask.sum()),
            "bitwise_equal": bool(torch.equal(train_rows[active], rollout_rows[active])), "metrics": metrics}


def previous_run(args, config, workload: dict) -> dict:
    """--merge: DIR's earlier result, which must be of this workload (else exit 2 with the difference)."""
    path = os.path.join(args.out, f"{NAME}.json")
    try:
        with open(path) as f:
            kept = json.load(f)
        theirs = (kept["workload"], kept["layers"], kept["model"])
    except (OSError, ValueError, KeyError, TypeError) as e:
        _usage_error(f"--merge needs a readable {path} from an earlier run ({e})")
    if theirs != (workload, config.num_layers, config.name):
        _usage_error(f"--merge: {path} is another workload: {theirs} vs this run's "
                     f"{(workload, config.num_layers, config.name)}")
    return kept


def _usage_error(message: str) -> None:
    print(f"{NAME}: error: {message}", file=sys.stderr)
    sys.exit(2)


# -- main ------------------------------------------------------------------------------------------------------
def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, help="directory for rollout_grpo.json and rollout_grpo.png")
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda",
                        help="cpu: a toy model at toy sizes (the smoke test)")
    parser.add_argument("--prompts", type=int, help="prompts (GRPO groups); default 64")
    parser.add_argument("--samples", type=int, help="samples per prompt (group size); default 8")
    parser.add_argument("--prompt-len", type=int, help="prompt tokens; default 512")
    parser.add_argument("--new-tokens", type=int, help="max new tokens per sequence; default 1024")
    parser.add_argument("--max-batch", type=int, help="most sequences decoding at once, every row; default 128")
    parser.add_argument("--layers", type=int, help="decoder layers (default: the model's own, 36 for Qwen3-8B)")
    parser.add_argument("--top-p", type=float, default=0.95)
    parser.add_argument("--stops", type=int, default=4, help="stop ids to take from the greedy probe")
    parser.add_argument("--stop-ids", type=int, nargs="+", help="stop ids to use instead of the probe's")
    parser.add_argument("--bits-groups", type=int, default=2, help="groups whose logprobs the trainer recomputes")
    parser.add_argument("--rows", nargs="+", choices=ROWS, default=list(ROWS),
                        help="what to run (default: all; bits needs triton_bf16 in the same run)")
    parser.add_argument("--merge", action="store_true",
                        help=f"keep what an existing DIR/{NAME}.json of the same workload measured and this run "
                        "does not (its stop ids are reused): a full-size run split over device calls")
    parser.add_argument("--budget-s", type=float, help="start no row after this many seconds")
    args = parser.parse_args(argv)
    for key, value in DEFAULTS[args.device].items():
        setattr(args, key, value if getattr(args, key) is None else getattr(args, key))
    bad = [f"--{k.replace('_', '-')} {getattr(args, k)}" for k in (*DEFAULTS["cpu"], "stops", "layers")
           if getattr(args, k) is not None and getattr(args, k) < 1]
    bad += [f"--top-p {args.top_p}"] if not 0 < args.top_p <= 1 else []
    bad += [f"--bits-groups {args.bits_groups}"] if args.bits_groups < 0 else []
    bad += ["--rows bits without triton_bf16 (the bits are the triton_bf16 row's)"] if (
        "bits" in args.rows and "triton_bf16" not in args.rows) else []
    if bad:
        parser.exit(2, f"{parser.prog}: error: invalid {', '.join(bad)}\n")
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.exit(2, f"{parser.prog}: error: needs CUDA (or --device cpu for the toy run)\n")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    device, setup = torch.device(args.device), SETUPS[args.device]
    config = setup["model"]()
    config = config.with_layers(args.layers) if args.layers else config
    started = time.perf_counter()
    rows, bits, result = {}, {}, {}

    def over() -> bool:
        return args.budget_s is not None and time.perf_counter() - started > args.budget_s

    def workload() -> dict:
        return {k: getattr(args, k) for k in (*DEFAULTS["cpu"], "top_p")} | {"temperature": 1.0}

    if args.merge:
        kept = previous_run(args, config, workload())
        rows.update({r["peer"]: {k: v for k, v in r.items() if k != "peer"} for r in kept["rows"]
                     if r["peer"] not in args.rows})
        bits.update({} if "bits" in args.rows else kept.get("bits") or {})
        if not set(ENGINE_ROWS) & set(args.rows):
            result["checks"] = kept.get("checks")
        if not args.stop_ids:  # the same stop ids as the rows kept
            result["stops"], result["stops_from"] = kept.get("stop_ids"), kept.get("stop_ids_from")

    def save(complete: bool) -> None:
        on, off, hf = (rows.get(k, {}).get("tok_s") for k in (*ENGINE_ROWS, HF_ROW))
        ratios = {"sharing_on_over_off": on / off if on and off else None,
                  "sharing_on_over_hf": on / hf if on and hf else None,
                  "sharing_off_over_hf": off / hf if off and hf else None}
        write_json(args.out, NAME, {
            "complete": complete, "model": config.name, "layers": config.num_layers, "dtype": "bfloat16",
            "workload": workload(),
            "stop_ids": result.get("stops"), "stop_ids_from": result.get("stops_from"),
            "engine": {"chunk_size": setup["chunk_size"], "page_size": setup["page_size"]},
            "transformers": module_version("transformers"), "elapsed_s": time.perf_counter() - started,
            "rows": [{"peer": k, **v} for k, v in rows.items()], "ratios": ratios,
            "checks": result.get("checks"), "bits": bits})

    ids = prompts(config, args.prompts, args.prompt_len)
    # as a rollout model holds them: q/k/v and gate/up stacked, one product each (DecoderModel._projections)
    weights = pack_projections(synthetic_weights(config, WEIGHT_SEED, device=device), config)
    weight_bytes = sum(t.numel() * t.element_size() for t in weights.values())
    model = build_engine_model(config, weights, "triton_bf16")
    print(f"{config.name} ({config.num_layers} layers) on {device}: {args.prompts} prompts x {args.samples} samples, "
          f"{args.prompt_len} prompt + {args.new_tokens} new tokens, max batch {args.max_batch}", flush=True)
    if args.stop_ids:
        result["stops"], result["stops_from"] = list(args.stop_ids), "--stop-ids"
    elif not result.get("stops"):
        result["stops"], result["stops_from"] = probe_stops(model, ids, args, setup), "greedy probe"
    stops = tuple(result["stops"])
    print(f"  stop ids {list(stops)} ({result['stops_from']})", flush=True)
    requests = grpo_requests(ids, args.samples, params(args, stops))

    # one pool for both engine rows: every running sequence at full length without sharing (no eviction needed)
    num_pages = pool_pages(args.max_batch, args.prompt_len, args.new_tokens, setup["page_size"])
    if device.type == "cuda":  # capped by free memory: the engine evicts (preemptions) when it runs short
        free = torch.cuda.mem_get_info(device)[0] - 2 * GiB
        num_pages = min(num_pages, int(free // pool_bytes(config, 1, setup["page_size"])))
    done = {}
    for peer, sharing in ENGINE_ROWS.items():
        if peer not in args.rows:
            continue
        if over():
            rows[peer] = {"skipped": f"time budget of {args.budget_s} s spent"}
            continue
        got = measure(f"{peer} (prefix sharing {'on' if sharing else 'off'})", run_engine, model, sharing, requests,
                      args, setup, num_pages, weight_bytes, device)
        rows[peer], done[peer] = (got, None) if isinstance(got, dict) else got
        if done[peer] is not None:
            print(f"    {rows[peer]['wall_s']:.1f} s, {rows[peer]['tok_s']:.0f} tok/s, "
                  f"{rows[peer]['stopped']}/{len(requests)} stopped", flush=True)
        save(complete=False)
    if all(done.get(p) is not None for p in ENGINE_ROWS):  # both ran in this run
        result["checks"] = {"sharing_on_vs_off": compare(*(done[p] for p in ENGINE_ROWS))}
        print(f"  sharing on vs off: {result['checks']['sharing_on_vs_off']}", flush=True)

    subset = [r for r in requests if r.request_id < args.bits_groups * args.samples and "bits" in args.rows]
    for profile in ("triton_bf16", "torch_bf16") if subset else ():
        if over():
            bits[profile] = {"skipped": f"time budget of {args.budget_s} s spent"}
            continue

        def run_bits(profile=profile):
            if profile == "triton_bf16":  # the rollout row's own completions
                if done.get("triton_bf16") is None:
                    raise RuntimeError("the triton_bf16 row did not run")
                bits_model, out = model, done["triton_bf16"]
            else:  # the same requests through an engine on this profile
                bits_model = build_engine_model(config, weights, profile)
                pages = pool_pages(len(subset), args.prompt_len, args.new_tokens, setup["page_size"])
                out = new_engine(bits_model, args, setup, pages).generate(subset)
            return trainer_metrics(bits_model, [out[r.request_id] for r in subset], 1.0, device)

        bits[profile] = measure(f"bits {profile}: {len(subset)} sequences vs the trainer's packed recompute", run_bits)
        save(complete=False)
    model, done = None, {}  # the engine's pools and completions go before transformers' model is built

    if HF_ROW in args.rows:
        if over():
            rows[HF_ROW] = {"skipped": f"time budget of {args.budget_s} s spent"}
        else:
            hf = measure("transformers model", hf_model, config, weights, device)
            weights = None  # transformers holds its own copy
            if isinstance(hf, dict):
                rows[HF_ROW] = hf
            else:
                rows[HF_ROW] = measure(f"{HF_ROW} (static cache)", run_hf, hf, config, ids, args, list(stops), "static",
                                         device)
                if "error" in rows[HF_ROW]:  # sampling on a static cache failed: the default cache instead
                    static_error = rows[HF_ROW]["error"]
                    rows[HF_ROW] = measure(f"{HF_ROW} (dynamic cache)", run_hf, hf, config, ids, args, list(stops),
                                           "dynamic", device)
                    rows[HF_ROW]["static_error"] = static_error
                if "tok_s" in rows[HF_ROW]:
                    print(f"    {rows[HF_ROW]['wall_s']:.1f} s, {rows[HF_ROW]['tok_s']:.0f} tok/s", flush=True)
            hf = None
    save(complete=True)
    table = [{"peer": k, **v} for k, v in rows.items()]
    print_table(table, ["peer", "wall_s", "generated_tokens", "tok_s", "stopped", "peak_gib", "memory_goal_gib",
                        "preemptions", "graph_steps", "overlapped_steps", "dropped_rows", "cache", "skipped", "error"])
    for profile, b in bits.items():
        m = b.get("metrics", {})
        print(f"bits {profile}: bitwise_equal={b.get('bitwise_equal')} kl={m.get('rollout_corr/kl')} "
              f"max_abs_dlogp={m.get('rollout_corr/max_abs_dlogp')} {b.get('error') or b.get('skipped') or ''}")
    measured = [r for r in table if r.get("tok_s")]
    if measured:
        save_plot(args.out, NAME, [{"kind": "bar", "title": "GRPO rollout throughput", "xlabel": "peer",
                                    "ylabel": "generated tokens/s", "x": ["all"],
                                    "series": {r["peer"]: [r["tok_s"]] for r in measured}}])
    same = (result.get("checks") or {}).get("sharing_on_vs_off", {})
    return 1 if same and not (same["same_tokens"] and same["same_logprobs"]) else 0


if __name__ == "__main__":
    raise SystemExit(main())
