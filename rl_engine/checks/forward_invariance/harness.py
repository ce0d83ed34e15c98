"""Config invariance and train/infer parity of selected-token logprobs under one backend profile.

For a profile, a model and the workload (rl_engine/workload/manifest.json) the harness runs:
- the configuration matrix (manifest `matrix`; the first cell, packed BN, is canonical): every cell's
  selected logprobs, restored to (sample id, position), must equal the canonical cell's bit for bit;
- accuracy of the canonical cell against the `reference_fp32` profile on the same weights, under the
  tolerance contract's forward_accuracy row for logprobs in the profile's dtype (bf16: baseline-relative,
  max|cand − ref| <= k · max|torch_bf16 − ref| + atol): the model's selected logprobs are judged like
  the logprob ops (`model_accuracy_tolerance`);
- gradient invariance: d(sum of active logprobs)/d(embedding output), per token, across the
  unchunked cells, bit for bit; weight gradients only run to run in the canonical layout (their
  reduction over tokens follows the layout's token order, so across layouts they legitimately differ);
- train/infer parity: train = the canonical teacher-forced packed forward, infer = prompt prefill
  then token-by-token decode with a KV cache, at B1 and BN (right-padded prompts, per-row cache
  lengths), judged by the four aggregates on completion tokens; the goal is bitwise (all four 0);
- provenance of every dispatch (rl_engine.checks.forward_invariance.provenance).
Any exception inside a step fails that step with its message; nothing is skipped silently.
"""

from __future__ import annotations

import math
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass

import torch

from rl_engine.bits import bit_mismatch
from rl_engine.checks.forward_invariance.parity import bitwise_parity, parity_aggregates
from rl_engine.checks.forward_invariance.provenance import node_table, provenance_failures
from rl_engine.checks.operators.tolerance import Tolerance, contract_fingerprint, load_contract, resolve_tolerance
from rl_engine.environment import environment
from rl_engine.models.config import ModelConfig
from rl_engine.models.decoder import DecoderModel, KvCache
from rl_engine.models.profiles import ProfileOps, get_profile
from rl_engine.workload.layouts import Sample, chunk, pack, pad, permute, restore
from rl_engine.workload.manifest import Cell, Workload

# Weight gradients checked for run-to-run determinism (a subset keeps the 8B run cheap).
WEIGHT_GRAD_NAMES = ("model.norm.weight", "lm_head.weight", "model.layers.0.self_attn.q_proj.weight")


def model_accuracy_tolerance(dtype) -> Tolerance:
    """The contract row that judges a model's selected logprobs in `dtype` against the fp32 reference."""
    return resolve_tolerance(load_contract(), judgment="forward_accuracy", op_class="logprob", dtype=dtype)


def build_model(config: ModelConfig, weights: dict, profile_name: str) -> DecoderModel:
    return DecoderModel(config, weights, ProfileOps(get_profile(profile_name)))


def _sync(device):
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()


# -- one cell of the matrix -----------------------------------------------------------------------


def cell_groups(workload: Workload, cell: Cell) -> list[list[Sample]]:
    samples = permute(workload.samples, workload.permutation) if cell.permuted else list(workload.samples)
    return [[s] for s in samples] if cell.batching == "b1" else [samples]


def layout_of(group: list[Sample], cell: Cell, pad_id: int):
    if cell.layout == "packed":
        return pack(group, pad_id)
    return pad(group, "left" if cell.layout == "pad_left" else "right", pad_id)


def _forward_logp(model: DecoderModel, layout, chunk_size: int | None, embeds=None):
    if chunk_size is None:
        hidden = model.forward(
            layout.token_ids,
            layout.positions,
            seq_starts=layout.seq_starts,
            cu_seqlens=layout.cu_seqlens,
            embeds=embeds,
        )
        return model.selected_logprobs(hidden, layout.target_ids)
    b, width = layout.token_ids.shape
    cache = KvCache.empty(model.config, b, width, model.ops.profile.dtype, layout.token_ids.device)
    parts = []
    for piece in chunk(layout, chunk_size):
        end = int(piece.positions.shape[1]) + len(parts) * chunk_size
        seqlens = torch.full((b,), end, dtype=torch.int32, device=layout.token_ids.device)
        hidden = model.forward_cached(piece.token_ids, piece.positions, cache, seqlens)
        parts.append(model.selected_logprobs(hidden, piece.target_ids))
    return torch.cat(parts, dim=1)


def run_cell(model: DecoderModel, workload: Workload, cell: Cell, device) -> dict[int, torch.Tensor]:
    """sample id -> fp32 logprobs [L-1] on the CPU; entry p is log P(token p+1 | tokens <= p)."""
    pieces = []
    with torch.no_grad():
        for group in cell_groups(workload, cell):
            layout = layout_of(group, cell, workload.pad_id).to(device)
            logp = _forward_logp(model, layout, workload.chunk_size if cell.chunked else None)
            pieces.append((layout.keys, logp.detach().float().cpu()))
    restored = restore(pieces, workload.lengths())
    return {sid: v[:-1] for sid, v in restored.items()}


def _max(values) -> float:
    """The largest value, NaN if any is NaN (Python's max() keeps or drops a NaN depending on its position)."""
    values = list(values)
    return math.nan if any(math.isnan(v) for v in values) else max(values, default=0.0)


def _non_finite(result: dict, candidate: dict, canonical: dict, per_token) -> dict:
    """A cell whose values are not all finite fails, whatever its bits: NaN == NaN bitwise is no result."""
    bad = {who: sum(int(per_token(~torch.isfinite(v)).sum()) for v in values.values())
           for who, values in (("candidate", candidate), ("canonical", canonical))}
    if any(bad.values()):
        result.update(bitwise=False, non_finite_tokens=bad,
                      error=f"non-finite values (NaN/inf): {bad['candidate']} tokens in this cell, "
                            f"{bad['canonical']} in the canonical cell")
    return result


def compare(candidate: dict, canonical: dict) -> dict:
    """Bitwise comparison per token of two restored logprob sets; non-finite values fail the cell."""
    mismatched = total = 0
    diffs = []
    for sid, ref in canonical.items():
        got = candidate[sid]
        mismatched += bit_mismatch(got, ref)[0]
        total += ref.numel()
        diffs.append(float((got.double() - ref.double()).abs().max()) if ref.numel() else 0.0)
    result = {"bitwise": mismatched == 0, "mismatched_tokens": mismatched, "tokens": total, "max_abs_diff": _max(diffs)}
    return _non_finite(result, {s: candidate[s] for s in canonical}, canonical, lambda t: t)


# -- gradients ------------------------------------------------------------------------------------


def active_mask(keys: torch.Tensor, workload: Workload) -> torch.Tensor:
    """1 where the slot predicts a completion token (target position in [prompt_len, length))."""
    prompt = {s.sample_id: s.prompt_len for s in workload.samples}
    lengths = workload.lengths()
    mask = torch.zeros(keys.shape[:2], dtype=torch.float32)
    for (b, s), (sid, pos) in zip(
        torch.cartesian_prod(*map(torch.arange, keys.shape[:2])).tolist(), keys.reshape(-1, 2).tolist()
    ):
        if sid >= 0 and prompt[sid] <= pos + 1 < lengths[sid]:
            mask[b, s] = 1.0
    return mask


def input_gradients(model: DecoderModel, workload: Workload, cell: Cell, device) -> dict[int, torch.Tensor]:
    """sample id -> d(sum of active logprobs)/d(embedding output), [L, H] in the activation dtype."""
    if cell.chunked:
        raise ValueError(f"cell {cell.name}: input gradients are taken on unchunked cells only")
    pieces = []
    for group in cell_groups(workload, cell):
        layout = layout_of(group, cell, workload.pad_id).to(device)
        with torch.no_grad():
            embeds = model.embed(layout.token_ids)
        embeds.requires_grad_(True)
        logp = _forward_logp(model, layout, None, embeds=embeds)
        (logp * active_mask(layout.keys.cpu(), workload).to(device)).sum().backward()
        pieces.append((layout.keys, embeds.grad.detach().cpu()))
    return restore(pieces, workload.lengths())


def compare_gradients(candidate: dict, canonical: dict) -> dict:
    mismatched = total = 0
    diffs = []
    for sid, ref in canonical.items():
        got = candidate[sid]
        neq = (got.float() != ref.float()).any(dim=-1)  # a token mismatches if any of its H entries does
        mismatched += int(neq.sum())
        total += ref.shape[0]
        diffs.append(float((got.double() - ref.double()).abs().max()) if ref.numel() else 0.0)
    result = {"bitwise": mismatched == 0, "mismatched_tokens": mismatched, "tokens": total, "max_abs_diff": _max(diffs)}
    return _non_finite(result, {s: candidate[s] for s in canonical}, canonical, lambda t: t.any(dim=-1))


def weight_gradients(model: DecoderModel, workload: Workload, device) -> dict[str, torch.Tensor]:
    cell = workload.canonical
    names = [n for n in WEIGHT_GRAD_NAMES if n in model.w]
    for n in names:
        model.w[n] = model.w[n].detach().requires_grad_(True)
    try:
        layout = layout_of(workload.samples, cell, workload.pad_id).to(device)
        logp = _forward_logp(model, layout, None)
        grads = torch.autograd.grad(
            (logp * active_mask(layout.keys.cpu(), workload).to(device)).sum(), [model.w[n] for n in names]
        )
    finally:
        for n in names:
            model.w[n] = model.w[n].detach()
    return {n: g.detach() for n, g in zip(names, grads)}


# -- train/infer parity ---------------------------------------------------------------------------


def run_infer(model: DecoderModel, workload: Workload, batching: str, device) -> dict[int, torch.Tensor]:
    """sample id -> fp32 logprobs of its completion tokens (positions prompt_len .. L-1), by decode."""
    groups = [[s] for s in workload.samples] if batching == "b1" else [list(workload.samples)]
    out: dict[int, list] = {}
    pad_id = workload.pad_id
    with torch.no_grad():
        for group in groups:
            b = len(group)
            prompt = torch.tensor([s.prompt_len for s in group], device=device)
            length = torch.tensor([s.length for s in group], device=device)
            steps = int((length - 1 - prompt).max())
            width = int((prompt + steps + 1).max())
            tokens = torch.full((b, width + 1), pad_id, dtype=torch.int64)
            for row, s in enumerate(group):
                tokens[row, : s.length] = torch.tensor(s.token_ids)
            tokens = tokens.to(device)
            rows = torch.arange(b, device=device)
            cache = KvCache.empty(model.config, b, width, model.ops.profile.dtype, device)
            prompts = pad([Sample(s.sample_id, s.token_ids[: s.prompt_len], s.prompt_len) for s in group])
            prompts = prompts.to(device)
            hidden = model.forward(prompts.token_ids, prompts.positions, cache=cache)
            last = hidden[rows, prompt - 1].unsqueeze(1)
            logps = [model.selected_logprobs(last, tokens[rows, prompt].unsqueeze(1))[:, 0]]
            for t in range(steps):
                pos = prompt + t
                hidden = model.forward_cached(tokens[rows, pos][:, None], pos[:, None], cache, (pos + 1).int())
                logps.append(model.selected_logprobs(hidden, tokens[rows, pos + 1][:, None])[:, 0])
            logps = torch.stack(logps, dim=1).float().cpu()  # [b, steps+1]: targets prompt .. prompt+steps
            for row, s in enumerate(group):
                out[s.sample_id] = logps[row, : s.length - s.prompt_len]
    return out


def train_completion(train: dict, workload: Workload) -> dict[int, torch.Tensor]:
    """Completion entries of restored teacher-forced logprobs (entry p predicts token p+1)."""
    return {s.sample_id: train[s.sample_id][s.prompt_len - 1 :] for s in workload.samples}


def flat(values: dict, workload: Workload) -> torch.Tensor:
    return torch.cat([values[s.sample_id] for s in workload.samples])


# -- the whole run --------------------------------------------------------------------------------


@dataclass
class Step:
    name: str
    run: Callable[[], None]



def _timed_canonical(model, workload, device, warmup: bool = False) -> tuple[dict, float]:
    """The canonical cell's logprobs and its wall time (after one untimed run when `warmup`)."""
    if warmup and torch.device(device).type == "cuda":
        run_cell(model, workload, workload.canonical, device)
    _sync(device)
    start = time.perf_counter()
    logp = run_cell(model, workload, workload.canonical, device)
    _sync(device)
    return logp, time.perf_counter() - start


def run_harness(
    config: ModelConfig,
    weights: dict,
    workload: Workload,
    profile_name: str,
    device="cpu",
    *,
    gradients: bool = True,
    progress: Callable | None = None,
    model: DecoderModel | None = None,
) -> dict:
    """Run every check for one profile; returns the report (JSON-ready, plus `_tokens` for plots)."""
    model = model if model is not None else build_model(config, weights, profile_name)
    report = {
        "profile": profile_name,
        "model": config.name,
        "family": config.family,
        "config_fingerprint": config.fingerprint(),
        "fixture_hash": workload.fixture_hash,
        "contract_fingerprint": contract_fingerprint(load_contract()),
        **environment(device),
    }
    errors: dict[str, str] = {}
    results: dict = {}

    def guarded(name, fn):
        def run():
            try:
                fn()
            except Exception as exc:  # fail closed: the step fails with its message and where it arose
                frame = traceback.extract_tb(exc.__traceback__)[-1]
                errors[name] = f"{type(exc).__name__}: {exc} (at {frame.filename}:{frame.lineno})"

        return Step(name, run)

    cell_logp: dict = {}

    def canonical_cell():
        cell_logp[workload.canonical.name], results["forward_s"] = _timed_canonical(model, workload, device)

    steps = [guarded(f"cell {workload.canonical.name}", canonical_cell)]
    steps += [
        guarded(f"cell {c.name}", lambda c=c: cell_logp.__setitem__(c.name, run_cell(model, workload, c, device)))
        for c in workload.cells[1:]
    ]
    infer: dict = {}
    steps += [
        guarded(f"infer {b}", lambda b=b: infer.__setitem__(b, run_infer(model, workload, b, device)))
        for b in workload.parity
    ]
    grads: dict = {}
    grad_cells = [c for c in workload.cells if not c.chunked]
    if gradients:
        steps += [
            guarded(
                f"gradient {c.name}", lambda c=c: grads.__setitem__(c.name, input_gradients(model, workload, c, device))
            )
            for c in grad_cells
        ]
        wgrads: list = []
        steps += [
            guarded(f"weight gradient run {i}", lambda: wgrads.append(weight_gradients(model, workload, device)))
            for i in range(2)
        ]

    def accuracy():
        if torch.device(device).type == "cuda":  # the first canonical run included compilation
            _, results["forward_s"] = _timed_canonical(model, workload, device)
        timings = {profile_name: results["forward_s"]}
        refs = {}
        for other in ("reference_fp32", "torch_bf16"):
            if other == profile_name:
                refs[other] = cell_logp[workload.canonical.name]
                continue
            other_model = build_model(config, weights, other)
            refs[other], timings[other] = _timed_canonical(other_model, workload, device, warmup=True)
            fails = provenance_failures(
                other_model.ops.recorder.records,
                other_model.ops.profile,
                other_model.required_nodes(),
                other_model.known_nodes(),
            )
            if fails:
                raise RuntimeError(f"{other} provenance: " + "; ".join(fails))
        results["timings"] = timings
        results["refs"] = refs

    steps.append(guarded("accuracy", accuracy))

    for step in progress(steps) if progress else steps:
        step.run()

    canonical_name = workload.canonical.name
    canonical = cell_logp.get(canonical_name)

    # Forward invariance.
    cells = {}
    for c in workload.cells:
        if f"cell {c.name}" in errors:
            cells[c.name] = {"bitwise": False, "error": errors[f"cell {c.name}"]}
        elif canonical is None:
            cells[c.name] = {"bitwise": False, "error": f"canonical cell {canonical_name} failed"}
        else:
            cells[c.name] = compare(cell_logp[c.name], canonical)
    report["forward_invariance"] = {
        "passed": all(v["bitwise"] for v in cells.values()),
        "canonical": canonical_name,
        "cells": cells,
    }

    # Accuracy against the reference profile.
    if "accuracy" in errors or canonical is None:
        report["accuracy"] = {"passed": False, "error": errors.get("accuracy", "canonical cell failed")}
    else:
        ref, base = results["refs"]["reference_fp32"], results["refs"]["torch_bf16"]
        cand_err = _max(float((canonical[s] - ref[s]).abs().max()) for s in ref)
        base_err = _max(float((base[s] - ref[s]).abs().max()) for s in ref)
        tol = model_accuracy_tolerance(get_profile(profile_name).dtype)
        ref_scale = max(float(ref[s].abs().max()) for s in ref)
        report["accuracy"] = {
            "passed": cand_err <= tol.max_abs_bound(base_err, ref_scale),
            "rule": f"contract {tol.judgment}/{tol.op_class}/{tol.dtype}: {tol.describe()} "
                    "(baseline: torch_bf16 vs reference_fp32)",
            "max_abs_vs_reference": cand_err,
            "mean_abs_vs_reference": float(flat({s: (canonical[s] - ref[s]).abs() for s in ref}, workload).mean()),
            "baseline_max_abs_vs_reference": base_err,
        }
        report["timing_s"] = {"canonical_forward": results["timings"]}

    # Gradient invariance.
    if gradients:
        gcells = {}
        gcanon = grads.get(canonical_name)
        for c in grad_cells:
            err = errors.get(f"gradient {c.name}")
            if err or gcanon is None:
                gcells[c.name] = {"bitwise": False, "error": err or f"canonical cell {canonical_name} failed"}
            else:
                gcells[c.name] = compare_gradients(grads[c.name], gcanon)
        werr = errors.get("weight gradient run 0") or errors.get("weight gradient run 1")
        if werr:
            wdet = {"deterministic": False, "error": werr}
        else:
            differing = [n for n in wgrads[0] if not torch.equal(wgrads[0][n], wgrads[1][n])]
            wdet = {"deterministic": not differing, "weights": sorted(wgrads[0]), "differing": differing}
        report["gradient_invariance"] = {
            "passed": all(v["bitwise"] for v in gcells.values()) and wdet["deterministic"],
            "input_gradients": gcells,
            "weight_gradient_determinism": wdet,
        }

    # Train/infer parity.
    parity = {}
    per_token = {}
    for b in workload.parity:
        err = errors.get(f"infer {b}")
        if err or canonical is None:
            parity[b] = {"bitwise": False, "error": err or f"canonical cell {canonical_name} failed"}
            continue
        train = flat(train_completion(canonical, workload), workload)
        got = flat(infer[b], workload)
        try:
            aggs = parity_aggregates(train, got)
            parity[b] = {**aggs, "bitwise": bitwise_parity(aggs)}
            per_token[b] = (train - got).tolist()
        except ValueError as exc:
            parity[b] = {"bitwise": False, "error": str(exc)}
    report["parity"] = {"passed": all(v["bitwise"] for v in parity.values()), "infer": parity}

    # Provenance of every dispatch this profile's model made.
    fails = provenance_failures(
        model.ops.recorder.records, model.ops.profile, model.required_nodes(), model.known_nodes()
    )
    report["provenance"] = {
        "passed": not fails,
        "failures": fails,
        "nodes": len(node_table(model.ops.recorder.records)),
        "dispatches": len(model.ops.recorder.records),
    }

    checks = ["forward_invariance", "accuracy", "parity", "provenance"] + (["gradient_invariance"] if gradients else [])
    report["passed"] = all(report[k]["passed"] for k in checks)
    report["errors"] = errors
    if canonical is not None:
        report["_tokens"] = {
            "dlogp": per_token,
            "invariance_abs_diff": {
                c: flat(
                    {s: (cell_logp[c][s].double() - canonical[s].double()).abs() for s in canonical}, workload
                ).tolist()
                for c in cell_logp
            },
        }
    return report
