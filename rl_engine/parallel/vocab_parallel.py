"""Vocab-parallel selected-token logp and linear + logp, bitwise equal for TP = 1, 2 and 4.

Each rank holds a slice of the vocabulary (logits columns, or lm_head rows) made of whole canonical
shards (canonical.py). Per canonical shard, in fp32: the max m_i, the sum of exp(x - m_i) s_i, and
the target's logit if the target lies in the shard (else 0). The 4 shard partials are all-gathered
and merged on every rank in the fixed tree ((c0 + c1) + (c2 + c3)) with
(m, s) + (m', s') = (M, s * exp(m - M) + s' * exp(m' - M)), M = max(m, m'); lse = M + log(S).
The target logit is selected (not summed) from the shard that holds it. A single rank runs the same
per-shard code over all 4 shards, so TP = 1 is the same bits as TP = 2 and 4.

Backward: d logp / d x_v = [v = target] - exp(x_v - lse) is local to each shard given the global lse
(kept from forward). linear_logp recomputes each shard's logits rather than keeping [T, V]; its
hidden gradient sums the shards' contributions, so those are gathered and summed in the same tree.
Against the plain gold op (NativeLogpOp: one logsumexp over all V) the result differs by fp32
rounding only — a different summation order, not a different function.
"""

from __future__ import annotations

import torch

from rl_engine.kernels.ops.pytorch.base import expect_ids_in_range, expect_rank, expect_shape, tf32_off
from rl_engine.parallel.canonical import ShardLayout, gather_shards, local_shard, sum_shards, tree_reduce

_MAX, _SUMEXP, _PICKED = 0, 1, 2


def _finite_or_zero(m: torch.Tensor) -> torch.Tensor:
    # A shard (or merge) whose max is -inf (all logits -inf) must not give exp(-inf - -inf) = NaN.
    return torch.where(torch.isfinite(m), m, torch.zeros_like(m))


def shard_partials(shard_logits: torch.Tensor, target_ids: torch.Tensor, start: int) -> torch.Tensor:
    """[N, Vs] fp32 logits of the shard starting at vocabulary id `start` -> [3, N] (max, sumexp, picked)."""
    m = shard_logits.amax(dim=1)
    s = torch.exp(shard_logits - _finite_or_zero(m)[:, None]).sum(dim=1)
    width = shard_logits.shape[1]
    in_shard = (target_ids >= start) & (target_ids < start + width)
    index = (target_ids - start).clamp(0, width - 1)
    picked = shard_logits.gather(1, index[:, None]).squeeze(1)
    return torch.stack([m, s, torch.where(in_shard, picked, torch.zeros_like(picked))])


def merge_logsumexp(a: tuple, b: tuple) -> tuple:
    """(m, s) + (m', s') = (M, s * exp(m - M) + s' * exp(m' - M))."""
    (m_a, s_a), (m_b, s_b) = a, b
    m = torch.maximum(m_a, m_b)
    shift = _finite_or_zero(m)
    return m, s_a * torch.exp(m_a - shift) + s_b * torch.exp(m_b - shift)


def combine_partials(partials: torch.Tensor, target_ids: torch.Tensor, shard_size: int):
    """[4, 3, N] canonical shard partials -> (logp [N], lse [N]), the same on every rank."""
    m, s = tree_reduce([(p[_MAX], p[_SUMEXP]) for p in partials.unbind(0)], merge_logsumexp)
    lse = m + torch.log(s)
    owner = (target_ids // shard_size)[None, :]
    picked = partials[:, _PICKED].gather(0, owner).squeeze(0)
    return picked - lse, lse


def _shard_grad(logits: torch.Tensor, target_ids: torch.Tensor, start: int, lse, grad_logp) -> torch.Tensor:
    """d loss / d logits of one shard: g * ([v = target] - exp(x - lse))."""
    probs = torch.exp(logits - lse[:, None])
    columns = torch.arange(start, start + logits.shape[1], device=logits.device)
    onehot = (columns[None, :] == target_ids[:, None]).to(logits.dtype)
    return grad_logp[:, None] * (onehot - probs)


class _VocabParallelLogp(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, target_ids, layout):
        size = layout.local_size("logits", logits.shape[1], "vocabulary slice V_local")
        with tf32_off():
            parts = [
                shard_partials(local_shard(logits, 1, j, size).float(), target_ids, shard * size)
                for j, shard in enumerate(layout.local_shards)
            ]
            logp, lse = combine_partials(gather_shards(torch.stack(parts), layout), target_ids, size)
        ctx.save_for_backward(logits, target_ids, lse)
        ctx.layout, ctx.size = layout, size
        return logp

    @staticmethod
    def backward(ctx, grad_logp):
        logits, target_ids, lse = ctx.saved_tensors
        layout, size = ctx.layout, ctx.size
        grad_logp = grad_logp.float().contiguous()
        grads = [
            _shard_grad(local_shard(logits, 1, j, size).float(), target_ids, shard * size, lse, grad_logp)
            for j, shard in enumerate(layout.local_shards)
        ]
        return torch.cat(grads, dim=1).to(logits.dtype), None, None


def _check_targets(target_ids, leading: tuple, vocab: int) -> torch.Tensor:
    expect_shape("target_ids", target_ids, leading, "the logits' leading dims")
    expect_ids_in_range("target_ids", target_ids, vocab, f"the global vocabulary size V={vocab}")
    return target_ids.reshape(-1).long()


def vocab_parallel_logp(logits: torch.Tensor, target_ids: torch.Tensor, group=None) -> torch.Tensor:
    """logp[b, s] of global `target_ids` from this rank's logits [B, S, V_local] (V_local = V / TP).

    Returns fp32 [B, S], identical on every rank and for every TP in (1, 2, 4).
    """
    layout = ShardLayout.from_group(group)
    expect_rank("logits", logits, 3, "[B,S,V_local]")
    b, s, v_local = logits.shape
    layout.local_size("logits", v_local, "vocabulary slice V_local")
    targets = _check_targets(target_ids, (b, s), v_local * layout.world_size)
    logp = _VocabParallelLogp.apply(logits.reshape(b * s, v_local), targets, layout)
    return logp.reshape(b, s)


class _VocabParallelLinearLogp(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, bias, target_ids, layout):
        size = layout.local_size("lm_head_weight", weight.shape[0], "vocabulary slice V_local")
        h = hidden.float().contiguous()
        with tf32_off():
            parts = [
                shard_partials(_shard_logits(h, weight, bias, j, size), target_ids, shard * size)
                for j, shard in enumerate(layout.local_shards)
            ]
            logp, lse = combine_partials(gather_shards(torch.stack(parts), layout), target_ids, size)
        ctx.save_for_backward(hidden, weight, bias, target_ids, lse)
        ctx.layout, ctx.size = layout, size
        return logp

    @staticmethod
    def backward(ctx, grad_logp):
        hidden, weight, bias, target_ids, lse = ctx.saved_tensors
        layout, size = ctx.layout, ctx.size
        h = hidden.float().contiguous()
        grad_logp = grad_logp.float().contiguous()
        grad_h, grad_w, grad_b = [], [], []
        with tf32_off():
            for j, shard in enumerate(layout.local_shards):
                logits = _shard_logits(h, weight, bias, j, size)  # recomputed: [N, Vs] is never kept
                grad_logits = _shard_grad(logits, target_ids, shard * size, lse, grad_logp)
                grad_h.append(grad_logits @ local_shard(weight, 0, j, size).float())
                grad_w.append(grad_logits.t() @ h)
                grad_b.append(grad_logits.sum(dim=0))
            # The hidden gradient sums every shard's contribution: gathered, then the canonical tree.
            grad_hidden = sum_shards(torch.stack(grad_h), layout)
        grad_weight = torch.cat(grad_w, dim=0).to(weight.dtype)
        grad_bias = torch.cat(grad_b, dim=0).to(bias.dtype) if bias is not None else None
        return grad_hidden.to(hidden.dtype), grad_weight, grad_bias, None, None


def _shard_logits(h, weight, bias, j: int, size: int) -> torch.Tensor:
    logits = h @ local_shard(weight, 0, j, size).float().t()
    if bias is not None:
        logits = logits + local_shard(bias, 0, j, size).float()
    return logits


def vocab_parallel_linear_logp(
    hidden: torch.Tensor, lm_head_weight: torch.Tensor, target_ids: torch.Tensor, bias=None, group=None
) -> torch.Tensor:
    """logp of global `target_ids` under hidden @ W^T (+ bias), W = this rank's lm_head rows [V_local, H].

    hidden [B, S, H] is replicated; bias, if any, is this rank's slice [V_local]. Returns fp32 [B, S],
    identical on every rank and for every TP in (1, 2, 4). Only one [B*S, V/4] shard of logits is live
    at a time.
    """
    layout = ShardLayout.from_group(group)
    expect_rank("hidden", hidden, 3, "[B,S,H]")
    b, s, h = hidden.shape
    expect_rank("lm_head_weight", lm_head_weight, 2, "[V_local,H]")
    v_local = lm_head_weight.shape[0]
    expect_shape("lm_head_weight", lm_head_weight, (v_local, h), "[V_local,H]")
    layout.local_size("lm_head_weight", v_local, "vocabulary slice V_local")
    if bias is not None:
        expect_shape("bias", bias, (v_local,), "[V_local]")
    targets = _check_targets(target_ids, (b, s), v_local * layout.world_size)
    logp = _VocabParallelLinearLogp.apply(hidden.reshape(b * s, h), lm_head_weight, bias, targets, layout)
    return logp.reshape(b, s)
