"""The TP-invariance check: every parallel op, forward and backward, on TP = 1, 2, 4, compared bit for bit.

`run_world_sizes` runs on each launched rank (through launch.spawn_group): it cuts the ranks into
groups of each TP size, builds the same full inputs on every rank from a seed, gives each rank its
slice, runs every case forward and backward, and returns the results as full tensors (sharded
results are all-gathered: a copy). `compare_runs` judges every rank of every TP against TP = 1,
rank 0: any difference, down to one ulp or the sign of a zero, fails.
"""

from __future__ import annotations

import dataclasses
import math

import torch
import torch.distributed as dist

from rl_engine.bits import bitwise_equal
from rl_engine.parallel.canonical import ShardLayout
from rl_engine.parallel.linear import column_parallel_linear, row_parallel_linear
from rl_engine.parallel.vocab_parallel import vocab_parallel_linear_logp, vocab_parallel_logp


@dataclasses.dataclass(frozen=True)
class ProblemSizes:
    batch: int = 2
    seq: int = 3
    hidden: int = 16
    vocab: int = 32
    features_out: int = 12
    seed: int = 0
    # mHC placements: cp_token_sharded deals tokens in blocks of L/CP (L = 64 lanes), so 80 tokens give
    # every rank of CP = 4 some tokens, and rank 0 more than the others (uneven shards are exercised).
    mhc_tokens: int = 80
    mhc_hidden: int = 24


def make_inputs(sizes: ProblemSizes, device: str = "cpu") -> dict:
    """Full (unsharded) inputs, identical on every rank: drawn on the CPU from `sizes.seed`."""
    g = torch.Generator().manual_seed(sizes.seed)
    b, s, h, v, n = sizes.batch, sizes.seq, sizes.hidden, sizes.vocab, sizes.features_out
    t = b * s

    def rand(*shape, scale=1.0):
        return (torch.randn(*shape, generator=g) * scale).to(device)

    return {
        "logits": rand(b, s, v, scale=3.0),
        "target_ids": torch.randint(0, v, (b, s), generator=g).to(device),
        "grad_logp": rand(b, s),
        "hidden": rand(b, s, h),
        "lm_head_weight": rand(v, h, scale=h**-0.5),
        "lm_head_bias": rand(v, scale=0.1),
        "x": rand(t, h),
        "weight_column": rand(n * 4, h, scale=h**-0.5),  # column-parallel: output features split
        "bias_column": rand(n * 4, scale=0.1),
        "weight_row": rand(n, h, scale=h**-0.5),  # row-parallel: K = hidden split
        "bias_row": rand(n, scale=0.1),
        "weight_down": rand(n, n * 4, scale=(n * 4) ** -0.5),  # MLP: row-parallel over the column outputs
        "grad_column": rand(t, n * 4),
        "grad_row": rand(t, n),
    }


def gather_full(local: torch.Tensor, dim: int, layout: ShardLayout) -> torch.Tensor:
    """Concatenate every rank's slice along `dim`, in rank order (a copy: exact)."""
    if not layout.distributed:
        return local
    local = local.contiguous()
    parts = [torch.empty_like(local) for _ in range(layout.world_size)]
    dist.all_gather(parts, local, group=layout.group)
    return torch.cat(parts, dim=dim)


def _leaf(t: torch.Tensor) -> torch.Tensor:
    return t.detach().clone().requires_grad_(True)


def case_logp(layout, inputs) -> dict:
    out = {}
    for dtype in (torch.float32, torch.bfloat16):
        tag = "logp" if dtype == torch.float32 else "logp_bf16"
        logits = _leaf(layout.split(inputs["logits"].to(dtype), 2))
        logp = vocab_parallel_logp(logits, inputs["target_ids"], group=layout.group)
        (logp * inputs["grad_logp"]).sum().backward()
        out[f"{tag}.forward"] = logp.detach()
        out[f"{tag}.grad_logits"] = gather_full(logits.grad, 2, layout)
    return out


def case_linear_logp(layout, inputs) -> dict:
    hidden = _leaf(inputs["hidden"])
    weight = _leaf(layout.split(inputs["lm_head_weight"], 0))
    bias = _leaf(layout.split(inputs["lm_head_bias"], 0))
    logp = vocab_parallel_linear_logp(hidden, weight, inputs["target_ids"], bias=bias, group=layout.group)
    (logp * inputs["grad_logp"]).sum().backward()
    return {
        "linear_logp.forward": logp.detach(),
        "linear_logp.grad_hidden": hidden.grad,
        "linear_logp.grad_weight": gather_full(weight.grad, 0, layout),
        "linear_logp.grad_bias": gather_full(bias.grad, 0, layout),
    }


def case_column_parallel(layout, inputs) -> dict:
    x = _leaf(inputs["x"])
    weight = _leaf(layout.split(inputs["weight_column"], 0))
    bias = _leaf(layout.split(inputs["bias_column"], 0))
    y = column_parallel_linear(x, weight, bias, group=layout.group, gather_output=True)
    (y * inputs["grad_column"]).sum().backward()
    return {
        "column_parallel.forward": y.detach(),
        "column_parallel.grad_x": x.grad,
        "column_parallel.grad_weight": gather_full(weight.grad, 0, layout),
        "column_parallel.grad_bias": gather_full(bias.grad, 0, layout),
    }


def case_row_parallel(layout, inputs) -> dict:
    x = _leaf(layout.split(inputs["x"], 1))
    weight = _leaf(layout.split(inputs["weight_row"], 1))
    bias = _leaf(inputs["bias_row"])
    y = row_parallel_linear(x, weight, bias, group=layout.group)
    (y * inputs["grad_row"]).sum().backward()
    return {
        "row_parallel.forward": y.detach(),
        "row_parallel.grad_x": gather_full(x.grad, 1, layout),
        "row_parallel.grad_weight": gather_full(weight.grad, 1, layout),
        "row_parallel.grad_bias": bias.grad,
    }


def case_parallel_mlp(layout, inputs) -> dict:
    """Column-parallel (output stays sharded) into row-parallel: the Megatron MLP pattern."""
    x = _leaf(inputs["x"])
    w_up = _leaf(layout.split(inputs["weight_column"], 0))
    w_down = _leaf(layout.split(inputs["weight_down"], 1))
    h = torch.relu(column_parallel_linear(x, w_up, group=layout.group))
    y = row_parallel_linear(h, w_down, group=layout.group)
    (y * inputs["grad_row"]).sum().backward()
    return {
        "parallel_mlp.forward": y.detach(),
        "parallel_mlp.grad_x": x.grad,
        "parallel_mlp.grad_w_up": gather_full(w_up.grad, 0, layout),
        "parallel_mlp.grad_w_down": gather_full(w_down.grad, 1, layout),
    }


def mhc_cases(sizes: ProblemSizes) -> tuple:
    """The mHC contracts exercised: the canonical one, eps outside + fused_pre_norm with a zero row, frozen mixer."""
    from rl_engine.mhc.fixtures import Case

    t, c, seed = sizes.mhc_tokens, sizes.mhc_hidden, sizes.seed + 700
    return (
        Case("inside_unfused", tokens=t, hidden=c, seed=seed),
        Case("outside_fused", tokens=t, hidden=c, seed=seed + 1, rms_eps_placement="outside",
             fusion_mode="fused_pre_norm", zero_rows=(2,)),
        Case("mixer_frozen", tokens=t, hidden=c, seed=seed + 2, trainability="mixer_frozen"),
    )


def case_mhc_tp_sharded(layout, inputs) -> dict:
    from rl_engine.mhc.fixtures import build_inputs
    from rl_engine.parallel.mhc_placements import tp_sharded_site

    out = {}
    for case in mhc_cases(inputs["sizes"]):
        contract, batch, controller, norm = build_inputs(case, inputs["device"])
        site = tp_sharded_site(batch, controller, norm, contract, group=layout.group)
        out.update({f"mhc_tp_sharded.{case.name}.{k}": v for k, v in site.items()})
    return out


def case_mhc_cp_token_sharded(layout, inputs) -> dict:
    from rl_engine.mhc.contract import ResidualBatch
    from rl_engine.mhc.fixtures import build_inputs
    from rl_engine.mhc.trace import BOUNDARIES
    from rl_engine.parallel.mhc_placements import cp_token_sharded_site, gather_axis, token_indices

    per_token = {b.name for b in BOUNDARIES if b.per_token}
    out = {}
    for case in mhc_cases(inputs["sizes"]):
        contract, batch, controller, norm = build_inputs(case, inputs["device"])
        rows = token_indices(case.tokens, contract, group=layout.group).to(batch.streams.device)
        local = ResidualBatch(batch.streams.index_select(0, rows), batch.grad_out.index_select(0, rows))
        site = cp_token_sharded_site(local, case.tokens, controller, norm, contract, group=layout.group)
        for k, v in site.items():
            if k in per_token:  # this rank's rows: reassembled in token order (copies) to compare
                v = gather_axis(v, case.tokens, contract.lanes, layout, dim=0)
            out[f"mhc_cp_token_sharded.{case.name}.{k}"] = v
    return out


CASES = (case_logp, case_linear_logp, case_column_parallel, case_row_parallel, case_parallel_mlp,
         case_mhc_tp_sharded, case_mhc_cp_token_sharded)


def run_cases(layout: ShardLayout, sizes: ProblemSizes, device: str, cases=CASES) -> dict:
    """Every case on this rank of `layout`, results as full tensors."""
    inputs = make_inputs(sizes, device)
    inputs.update(sizes=sizes, device=device)
    results = {}
    for case in cases:
        results.update(case(layout, inputs))
    return results


def run_world_sizes(rank: int, world_size: int, device: str, sizes: ProblemSizes, tp_sizes=(1, 2, 4),
                    cases=CASES) -> dict:
    """The spawn_group entry: one launch of `world_size` ranks runs every TP size in `tp_sizes`.

    The ranks are cut into groups of each TP size (TP = 2 on 4 ranks: {0, 1} and {2, 3}); every group
    runs every case. Returns {str(tp): results}; every rank of every group must give the same bits.
    """
    results = {}
    for tp in tp_sizes:
        if world_size % tp:
            raise ValueError(f"tp_sizes: {tp} does not divide the {world_size} launched ranks")
        # Every rank creates every group, in the same order (torch.distributed requires it).
        groups = [dist.new_group(list(range(g * tp, (g + 1) * tp))) for g in range(world_size // tp)]
        layout = ShardLayout.from_group(groups[rank // tp])
        results[str(tp)] = run_cases(layout, sizes, device, cases)
    return results


def runs_by_tp(rank_results: list) -> dict:
    """spawn_group's per-rank {tp: results} -> {tp: [results of every rank]}."""
    return {tp: [r[tp] for r in rank_results] for tp in rank_results[0]}


def max_abs_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    if a.shape != b.shape:
        return math.inf
    # Results may come from different devices (CUDA ranks vs the CPU oracle): compare on the CPU.
    return float((a.detach().cpu().double() - b.detach().cpu().double()).abs().max()) if a.numel() else 0.0


def compare_runs(runs: dict) -> dict:
    """runs: {tp: [rank results]} -> per result and TP, the verdict against TP = 1 ("1"), rank 0."""
    if "1" not in runs:
        raise ValueError("runs: the TP = 1 run is the reference and must be present")
    reference = runs["1"][0]
    verdicts = {}
    for name, ref in reference.items():
        per_tp = {}
        for tp, ranks in runs.items():
            outputs = [r.get(name) for r in ranks]
            missing = any(o is None for o in outputs)
            per_tp[tp] = {
                "bitwise_equal_to_tp1": not missing and all(bitwise_equal(o, ref) for o in outputs),
                "ranks_agree": not missing and all(bitwise_equal(o, outputs[0]) for o in outputs),
                "max_abs_diff_to_tp1": math.inf if missing else max(max_abs_diff(o, ref) for o in outputs),
            }
        verdicts[name] = per_tp
    passed = all(v["bitwise_equal_to_tp1"] and v["ranks_agree"] for per_tp in verdicts.values()
                 for v in per_tp.values())
    return {"passed": passed, "results": verdicts}


def gold_comparison(sizes: ProblemSizes, tp1: dict, device: str = "cpu") -> dict:
    """How far the canonical path lies from the plain gold ops (one logsumexp over V) on `device`:
    fp32 rounding (a different summation order), not bitwise."""
    from rl_engine.kernels.ops.pytorch.loss.linear_logp import NativeLinearLogpOp
    from rl_engine.kernels.ops.pytorch.loss.logp import NativeLogpOp

    inputs = make_inputs(sizes, device)
    gold = {
        "logp.forward": NativeLogpOp()(logits=inputs["logits"], target_ids=inputs["target_ids"]),
        "linear_logp.forward": NativeLinearLogpOp()(
            hidden=inputs["hidden"], lm_head_weight=inputs["lm_head_weight"],
            target_ids=inputs["target_ids"], bias=inputs["lm_head_bias"],
        ),
    }
    out = {}
    for name, ref in gold.items():
        if name not in tp1:
            continue
        ours, ref = tp1[name].cpu(), ref.cpu()
        out[name] = {
            "bitwise_equal": bitwise_equal(ours, ref),
            "max_abs_diff": max_abs_diff(ours, ref),
            "max_rel_diff": float(((ours.double() - ref.double()).abs() / ref.double().abs().clamp_min(1e-30)).max()),
        }
    return out


def oracle_comparison(sizes: ProblemSizes, tp1: dict) -> dict:
    """The mHC placements' TP = 1 results against the replicated strict-fp32 oracle: bitwise, every boundary."""
    from rl_engine.mhc.fixtures import build_inputs
    from rl_engine.mhc.oracle import mhc_site

    out = {}
    for case in mhc_cases(sizes):
        contract, batch, controller, norm = build_inputs(case)
        reference = mhc_site(batch, controller, norm, contract)
        for placement in ("mhc_tp_sharded", "mhc_cp_token_sharded"):
            ours = {k: tp1.get(f"{placement}.{case.name}.{k}") for k in reference}
            if all(v is None for v in ours.values()):
                continue
            differing = [k for k, v in ours.items() if v is None or not bitwise_equal(v, reference[k])]
            out[f"{placement}.{case.name}"] = {
                "boundaries": len(reference),
                "bitwise_equal_to_oracle": not differing,
                "differing": differing,
            }
    return out
