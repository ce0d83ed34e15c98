"""The TP-invariance check: every parallel op, forward and backward, on TP = 1, 2, 4, compared bit for bit.

The ops are the Triton kernels' tensor-parallel forms (rl_engine.parallel.tp_kernels: a split reduction
continued rank to rank) and the tensor-parallel decoder; TP = 1 without a process group runs the
single-GPU ops themselves. The mHC placements reduce in the strict-fp32 oracle's lane tree (canonical).
The kernels are imported inside the cases: the CLI imports this module to build its parser, and a
kernel import can refuse (Triton's interpreter with a numpy it cannot run) with its own one-line error.

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


@dataclasses.dataclass(frozen=True)
class ProblemSizes:
    """Every split must be whole kernel steps at TP = 4: hidden / 4 and features_out of the matmul's K
    step (16 under the interpreter, 64 on the GPU) and the vocabulary of linear_logp's chunk (32; 4096)."""

    batch: int = 2
    seq: int = 3
    hidden: int = 64
    vocab: int = 128
    features_out: int = 16
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
        "target_ids": torch.randint(0, v, (b, s), generator=g).to(device),
        "grad_logp": rand(b, s),
        "hidden": rand(b, s, h),
        "lm_head_weight": rand(v, h, scale=h**-0.5),
        "x": rand(t, h),
        "weight_column": rand(n * 4, h, scale=h**-0.5),  # column-parallel: output features split
        "weight_row": rand(n, h, scale=h**-0.5),  # row-parallel: K = hidden split
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


def _rows_of(t: torch.Tensor, layout: ShardLayout, dim: int = 0) -> torch.Tensor:
    """This rank's even slice of `t` along `dim` (its own contiguous tensor)."""
    part = t.shape[dim] // layout.world_size
    return t.narrow(dim, layout.rank * part, part).contiguous()


def _vocab_rows(t: torch.Tensor, layout: ShardLayout) -> tuple[torch.Tensor, list[int]]:
    from rl_engine.parallel import tp_kernels

    bounds = tp_kernels.vocab_bounds(t.shape[0], layout.world_size, tp_kernels.vocab_align(t.dtype))
    return t[bounds[layout.rank]:bounds[layout.rank + 1]].contiguous(), bounds


def _gather_vocab(local: torch.Tensor, bounds: list[int], layout: ShardLayout) -> torch.Tensor:
    """Every rank's vocabulary rows (uneven runs) in order, as one tensor (copies: exact)."""
    if not layout.distributed:
        return local
    widest = max(b - a for a, b in zip(bounds, bounds[1:]))
    padded = local.new_zeros(widest, *local.shape[1:])
    padded[: local.shape[0]] = local
    return torch.cat([p[: b - a] for p, a, b in zip(gather_full(padded, 0, layout).split(widest), bounds,
                                                    bounds[1:])])


DTYPES = {"": torch.bfloat16, "_fp32": torch.float32}  # fp32: no rounding hides an order change


def case_linear_logp(layout, inputs) -> dict:
    """The vocab-parallel linear + logp of the Triton kernels (bf16), forward and backward."""
    from rl_engine.parallel import tp_kernels

    hidden = _leaf(inputs["hidden"].bfloat16())
    local, bounds = _vocab_rows(inputs["lm_head_weight"].bfloat16(), layout)
    weight = _leaf(local)
    vocab = inputs["lm_head_weight"].shape[0]
    logp = tp_kernels.vocab_parallel_linear_logp(hidden, weight, inputs["target_ids"], layout.group, vocab)
    (logp * inputs["grad_logp"]).sum().backward()
    return {
        "linear_logp.forward": logp.detach(),
        "linear_logp.grad_hidden": hidden.grad,
        "linear_logp.grad_weight": _gather_vocab(weight.grad, bounds, layout),
    }


def case_column_parallel(layout, inputs) -> dict:
    from rl_engine.parallel import tp_kernels

    out = {}
    for tag, dtype in DTYPES.items():
        x = _leaf(inputs["x"].to(dtype))
        weight = _leaf(_rows_of(inputs["weight_column"].to(dtype), layout))
        y = tp_kernels.column_parallel_matmul(x, weight, layout.group)
        (y.float() * _rows_of(inputs["grad_column"], layout, 1)).sum().backward()
        out.update({f"column_parallel{tag}.forward": gather_full(y.detach(), 1, layout),
                    f"column_parallel{tag}.grad_x": x.grad,
                    f"column_parallel{tag}.grad_weight": gather_full(weight.grad, 0, layout)})
    return out


def case_row_parallel(layout, inputs) -> dict:
    from rl_engine.parallel import tp_kernels

    out = {}
    for tag, dtype in DTYPES.items():
        x = _leaf(_rows_of(inputs["x"].to(dtype), layout, 1))
        weight = _leaf(_rows_of(inputs["weight_row"].to(dtype), layout, 1))
        y = tp_kernels.row_parallel_matmul(x, weight, layout.group)
        (y.float() * inputs["grad_row"]).sum().backward()
        out.update({f"row_parallel{tag}.forward": y.detach(),
                    f"row_parallel{tag}.grad_x": gather_full(x.grad, 1, layout),
                    f"row_parallel{tag}.grad_weight": gather_full(weight.grad, 1, layout)})
    return out


def case_parallel_mlp(layout, inputs) -> dict:
    """Column-parallel (output stays sharded) into row-parallel: the Megatron MLP pattern (bf16)."""
    from rl_engine.parallel import tp_kernels

    x = _leaf(inputs["x"].bfloat16())
    w_up = _leaf(_rows_of(inputs["weight_column"].bfloat16(), layout))
    w_down = _leaf(_rows_of(inputs["weight_down"].bfloat16(), layout, 1))
    h = torch.relu(tp_kernels.column_parallel_matmul(x, w_up, layout.group))
    y = tp_kernels.row_parallel_matmul(h, w_down, layout.group)
    (y.float() * inputs["grad_row"]).sum().backward()
    return {
        "parallel_mlp.forward": y.detach(),
        "parallel_mlp.grad_x": x.grad,
        "parallel_mlp.grad_w_up": gather_full(w_up.grad, 0, layout),
        "parallel_mlp.grad_w_down": gather_full(w_down.grad, 1, layout),
    }


def decoder_config(sizes: ProblemSizes):
    """A one-layer Qwen3 at the problem's width: 8 query and 4 key/value heads of hidden/4 lanes."""
    from rl_engine.models.config import ModelConfig

    return ModelConfig("tp_check", "qwen3", sizes.vocab, sizes.hidden, 4 * sizes.features_out, 1, 8, 4,
                       sizes.hidden // 4)


def case_decoder(layout, inputs) -> dict:
    """The tensor-parallel decoder (triton_bf16): selected logprobs and their input-embedding gradient."""
    from rl_engine.models.weights import synthetic_weights
    from rl_engine.parallel.tp_decoder import TensorParallelDecoder

    sizes, device = inputs["sizes"], inputs["device"]
    config = decoder_config(sizes)
    model = TensorParallelDecoder(config, synthetic_weights(config, sizes.seed, device=device), layout.group)
    ids, targets = inputs["target_ids"], inputs["target_ids"].roll(-1, 1)
    embeds = model.embed(ids).detach().requires_grad_()
    positions = torch.arange(sizes.seq, device=ids.device).expand(sizes.batch, sizes.seq)
    logp = model.selected_logprobs(model.forward(None, positions, embeds=embeds), targets)
    (logp * inputs["grad_logp"]).sum().backward()
    return {"decoder.logp": logp.detach(), "decoder.grad_embeds": embeds.grad}


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


CASES = (case_linear_logp, case_column_parallel, case_row_parallel, case_parallel_mlp, case_decoder,
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
