"""Expert parallelism whose bits do not depend on the EP size: see docs/moe.md.

The experts of a sparse layer are cut into EP contiguous blocks: rank r holds experts
r*E/EP .. (r+1)*E/EP - 1. Every rank routes its own tokens (rl_engine.models.moe: routing is per
token), so its permuted rows are already grouped by expert, hence by owner. One all-to-all sends each
rank's rows to their owners; the owner runs each of its experts, in index order, on the rows it
received for that expert sorted by (source rank, row), which is the global token order when ranks hold
consecutive token slices; a second all-to-all brings the outputs back, and the home rank combines a
token's k outputs in slot order, exactly as on one rank.

Why EP = 1, 2, 4 give the same bits: an all-to-all is a copy; the expert GEMMs are row invariant
(the `matmul` op of the triton profile), so a row's output cannot depend on which rows share its
expert's GEMM; and the combine is per token. Backward exchanges the gradients through the same
all-to-all with the splits swapped; the expert weight gradients reduce over the expert's rows in
the same (global token) order as on one rank. gloo (CPU) and NCCL both implement all_to_all_single.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from rl_engine.bits import bitwise_equal
from rl_engine.models.moe import local_experts


def expert_range(num_experts: int, ep_size: int, ep_rank: int) -> range:
    """The experts rank `ep_rank` of `ep_size` holds: a contiguous block, in index order."""
    if num_experts % ep_size:
        raise ValueError(f"ep_size: {ep_size} does not divide the {num_experts} experts")
    per = num_experts // ep_size
    return range(ep_rank * per, (ep_rank + 1) * per)


class _AllToAll(torch.autograd.Function):
    """rows split by `send` among the ranks -> rows received, split by `recv`; backward swaps them."""

    @staticmethod
    def forward(ctx, rows, send, recv, group):
        ctx.send, ctx.recv, ctx.group = send, recv, group
        return _exchange(rows, send, recv, group)

    @staticmethod
    def backward(ctx, grad):
        return _exchange(grad.contiguous(), ctx.recv, ctx.send, ctx.group), None, None, None


def _exchange(rows: torch.Tensor, send: list[int], recv: list[int], group) -> torch.Tensor:
    out = rows.new_empty((sum(recv), *rows.shape[1:]))
    dist.all_to_all_single(out, rows.contiguous(), output_split_sizes=recv, input_split_sizes=send, group=group)
    return out


def expert_parallel_experts(ops, node: str, gate: torch.Tensor, up: torch.Tensor, down: torch.Tensor,
                            num_experts: int, group=None):
    """The expert step of moe_block over an EP group: run(rows [N,H] grouped by expert, counts [E]) -> [N,H].

    gate, up [E/EP,I,H] and down [E/EP,H,I]: the stacked weights of the experts this rank holds
    (expert_range), a slice of the model's stacks.
    """
    ep, me = dist.get_world_size(group), dist.get_rank(group)
    per = len(expert_range(num_experts, ep, me))
    compute = local_experts(ops, node, gate, up, down)

    def run(rows: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        # Per-expert counts to each expert's owner: from_source[s, e] rows of my expert e come from rank s.
        from_source = torch.empty_like(counts)
        dist.all_to_all_single(from_source, counts, group=group)
        # The layer's one read-back: the all-to-all's split sizes are host ints.
        host = torch.stack((counts, from_source)).view(2, ep, per).sum(-1).tolist()
        send, recv = host[0], host[1]
        got = _AllToAll.apply(rows, send, recv, group)
        # Received rows are source-major then expert; each expert's rows go (source, row) in order:
        # segment (s, e) starts at its exclusive cumsum in source-major order, and is taken expert-major.
        sizes = from_source.view(ep, per)
        seg_start = (sizes.reshape(-1).cumsum(0) - sizes.reshape(-1)).view(ep, per).t().reshape(-1)
        seg_size = sizes.t().reshape(-1)
        seg = torch.repeat_interleave(torch.arange(ep * per, device=rows.device), seg_size, output_size=sum(recv))
        within = torch.arange(sum(recv), device=rows.device) - (seg_size.cumsum(0) - seg_size)[seg]
        order = seg_start[seg] + within
        out_sorted = compute(got[order], sizes.sum(0))
        out = torch.empty_like(out_sorted).index_copy(0, order, out_sorted)  # back to the received order
        return _AllToAll.apply(out, recv, send, group)

    return run


# -- the EP-invariance check (spawned through rl_engine.parallel.launch.spawn_group) --------------


@dataclass(frozen=True)
class EpSizes:
    tokens: int = 10  # split over the EP group's ranks in consecutive slices, unevenly for EP = 4
    hidden: int = 32
    experts: int = 4
    top_k: int = 2
    intermediate: int = 16
    seed: int = 0


def _problem(sizes: EpSizes, dtype, device) -> dict:
    """Every tensor of the problem, identical on every rank: drawn on the CPU from `sizes.seed`."""
    g = torch.Generator().manual_seed(sizes.seed)
    h, i = sizes.hidden, sizes.intermediate

    def rand(*shape, scale=1.0):
        return (torch.randn(*shape, generator=g) * scale).to(dtype).to(device)

    return {
        "x": rand(sizes.tokens, h),
        "grad_out": rand(sizes.tokens, h),
        "router": rand(sizes.experts, h, scale=h**-0.5),
        # Stacked as a model holds them: gate, up [E,I,H], down [E,H,I] (drawn expert by expert).
        "experts": [torch.stack(ws) for ws in zip(*((rand(i, h, scale=h**-0.5), rand(i, h, scale=h**-0.5),
                                                      rand(h, i, scale=i**-0.5)) for _ in range(sizes.experts)))],
    }


def token_slice(tokens: int, ep_size: int, ep_rank: int) -> slice:
    """Consecutive token slices, the first `tokens % ep_size` ranks one token longer."""
    base, extra = divmod(tokens, ep_size)
    start = ep_rank * base + min(ep_rank, extra)
    return slice(start, start + base + (ep_rank < extra))


def run_ep_sizes(rank: int, world_size: int, device: str, sizes: EpSizes, ep_sizes=(1, 2, 4),
                 profile: str = "triton_bf16") -> dict:
    """One MoE block forward and backward for each EP size, on ranks 0 .. EP-1 (the others wait).

    Returns {str(ep): {"out"/"grad_x": this rank's token slice, "grad_expert.<e>.<gate|up|down>": for
    the experts it holds, "tokens": [start, stop]}} for each EP size this rank took part in.
    """
    from rl_engine.models.config import MoeConfig
    from rl_engine.models.moe import moe_block
    from rl_engine.models.profiles import ProfileOps, get_profile

    ops = ProfileOps(get_profile(profile))
    problem = _problem(sizes, ops.profile.dtype, device)
    moe = MoeConfig(sizes.experts, sizes.top_k, sizes.intermediate, norm_topk_prob=True)
    results = {}
    for ep in ep_sizes:
        if ep > world_size:
            raise ValueError(f"ep_sizes: {ep} is more than the {world_size} launched ranks")
        group = dist.new_group(list(range(ep)))  # every rank creates every group (torch.distributed requires it)
        if rank >= ep:
            continue
        held = expert_range(sizes.experts, ep, rank)
        weights = [w[held.start:held.stop].detach().clone().requires_grad_(True) for w in problem["experts"]]
        part = token_slice(sizes.tokens, ep, rank)
        x = problem["x"][part].detach().clone().requires_grad_(True)
        run = expert_parallel_experts(ops, "moe", *weights, sizes.experts, group)
        out = moe_block(ops, "moe", x, problem["router"], moe, run)
        (out.float() * problem["grad_out"][part].float()).sum().backward()
        result = {"out": out.detach(), "grad_x": x.grad, "tokens": [part.start, part.stop]}
        for n, w in zip(("gate", "up", "down"), weights):  # an expert no token chose has a zero gradient
            result.update({f"grad_expert.{e}.{n}": w.grad[j] for j, e in enumerate(held)})
        results[str(ep)] = result
    return results


def compare_ep(rank_results: list, sizes: EpSizes) -> dict:
    """Every EP size against EP = 1 (rank 0), bit for bit: per-token outputs and input gradients, and
    every expert's weight gradients from the rank that holds it. {str(ep): [names that differ]}."""
    reference = rank_results[0]["1"]
    report = {}
    for ep in rank_results[0]:
        differing = set()
        for ranks in rank_results[: int(ep)]:
            got = ranks[ep]
            start, stop = got["tokens"]
            for name in ("out", "grad_x"):
                if not bitwise_equal(got[name], reference[name][start:stop]):
                    differing.add(name)
            for name, grad in got.items():
                if name.startswith("grad_expert.") and not bitwise_equal(grad, reference[name]):
                    differing.add(name)
        report[ep] = sorted(differing)
    return report
