"""Tensor-parallel linears, embedding and linear + logp on the single-GPU Triton kernels, with their bits.

A split reduction is not summed from per-rank partials (an all_reduce, or any tree, is a different
order of fp32 adds than one GPU's loop, and a tree on one GPU costs 4x on the GEMMs: docs/parallel.md).
It is *continued*: rank 0 runs the first part of the single GPU's reduction loop and hands its fp32
accumulator, unrounded, to rank 1, which starts its loop from it, and so on; the last rank rounds
once and broadcasts. Every add is the one the single GPU makes, in its order, so the bits are the
single GPU's at every TP size, and the single-GPU kernels keep their speed (they do not change).
The cost is paid in the split reductions only: rank r waits for rank r - 1, block of rows by block
(PIPELINE_ROWS), so the ranks overlap (measured by benchmarks/tp_decoder.py).

- row-parallel (o_proj, down_proj; K split evenly in whole BLOCK_K steps): `batch_invariant_mm` over
  the rank's K slice, starting from the previous rank's accumulator (`init=`), with the whole product's
  tile configuration. Backward: the rank's columns of the input gradient, no reduction.
- column-parallel (q/k/v, gate/up; output rows split): the forward computes the rank's columns (no
  reduction); the input gradient reduces over the split rows: continued, as above.
- vocab-parallel linear + logp (vocabulary split at multiples of the chunk and tile sizes): the
  forward's per-tile (max, sum-exp, target logit) partials are independent per vocabulary tile, so
  each rank computes its tiles', all_gathers them (a copy) and runs the single GPU's combine kernel
  over all of them in vocabulary order. The hidden gradient's fp32 accumulator runs across the
  vocabulary chunks in order: continued rank to rank.
- vocab-parallel embedding: a lookup; the owner rank's row is selected after an all_gather (a copy).

All ranks hold the replicated activations. `group=None` is one process: the single-GPU ops themselves.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.distributed as dist

from rl_engine.kernels.ops.triton.embedding.embedding import embedding, embedding_backward, embedding_forward
from rl_engine.kernels.ops.triton.linear.matmul import batch_invariant_mm, matmul_config
from rl_engine.kernels.ops.triton.loss import linear_logp as ll


@dataclass(frozen=True)
class Ranks:
    """This process's place in the tensor-parallel group (group None: one process, TP = 1)."""

    group: object = None

    @property
    def size(self) -> int:
        return dist.get_world_size(self.group) if self.group is not None else 1

    @property
    def rank(self) -> int:
        return dist.get_rank(self.group) if self.group is not None else 0

    def global_rank(self, rank: int) -> int:
        return dist.get_global_rank(self.group, rank)

    def even_split(self, name: str, size: int, step: int = 1) -> slice:
        """This rank's slice of `size` split evenly in whole `step`s; ValueError otherwise."""
        if size % (self.size * step):
            raise ValueError(f"{name} = {size}: TP = {self.size} needs a multiple of {self.size * step}")
        part = size // self.size
        return slice(self.rank * part, (self.rank + 1) * part)


def vocab_bounds(vocab: int, tp: int, align: int) -> list[int]:
    """Rank boundaries of a vocabulary split into `tp` nearly equal runs of whole `align`-sized blocks."""
    blocks = -(-vocab // align)
    if blocks < tp:
        raise ValueError(f"vocabulary {vocab}: fewer than TP = {tp} blocks of {align}")
    return [min(vocab, (blocks * r // tp) * align) for r in range(tp)] + [vocab]


def vocab_align(dtype: torch.dtype) -> int:
    """A vocabulary split must fall on linear_logp's tile and chunk borders (its partials and its
    hidden-gradient loop are per tile and per chunk)."""
    cfg = ll.config(dtype)
    return math.lcm(cfg["BLOCK_V"], cfg["VOCAB_CHUNK"])


# Rows per hand-off: rank r + 1 continues a block of rows while rank r computes the next one. A row's
# result does not depend on the other rows (the kernels are batch invariant), so this changes no bit.
PIPELINE_ROWS = 1024


def continued(compute, ranks: Ranks, shape, device, out_dtype) -> torch.Tensor:
    """Run a reduction split over the ranks in rank order, in blocks of PIPELINE_ROWS rows.

    compute(init, last, rows) -> this rank's part of rows `rows` (a slice), starting from init (the
    previous rank's fp32 accumulator of those rows; None on rank 0); fp32 unless last. Every rank
    returns the last rank's result.
    """
    if ranks.group is None:
        return compute(None, True, slice(None))
    rank, last = ranks.rank, ranks.rank == ranks.size - 1
    blocks = [slice(i, min(i + PIPELINE_ROWS, shape[0])) for i in range(0, shape[0], PIPELINE_ROWS)]
    inits, recvs, sends = [], [], []
    if rank > 0:  # posted up front, matched in order with the previous rank's sends
        inits = [torch.empty((b.stop - b.start, *shape[1:]), dtype=torch.float32, device=device) for b in blocks]
        recvs = [dist.irecv(t, src=ranks.global_rank(rank - 1), group=ranks.group) for t in inits]
    out = torch.empty(shape, dtype=out_dtype, device=device)
    for i, rows in enumerate(blocks):
        if recvs:
            recvs[i].wait()
        part = compute(inits[i] if inits else None, last, rows)
        if last:
            out[rows] = part
        else:
            part = part.contiguous()
            sends.append((part, dist.isend(part, dst=ranks.global_rank(rank + 1), group=ranks.group)))
    for _, work in sends:
        work.wait()
    dist.broadcast(out, src=ranks.global_rank(ranks.size - 1), group=ranks.group)
    return out


def _continued_mm(a: torch.Tensor, b: torch.Tensor, k_full: int, ranks: Ranks) -> torch.Tensor:
    """a @ b where the reduction (a's columns, b's rows) is split over the ranks in order."""
    config = matmul_config(a.dtype, b.shape[1], k_full)
    if a.shape[1] % config.block_k:
        raise ValueError(f"a rank's reduction slice of {a.shape[1]} is not whole steps of {config.block_k}")
    return continued(lambda init, last, rows: batch_invariant_mm(a[rows], b, config=config, init=init,
                                                                 out_fp32=not last),
                     ranks, (a.shape[0], b.shape[1]), a.device, a.dtype)


class _RowParallel(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, ranks):
        ctx.save_for_backward(x, weight)
        ctx.k_full = x.shape[1] * ranks.size
        return _continued_mm(x, weight.t(), ctx.k_full, ranks)

    @staticmethod
    def backward(ctx, grad_y):
        x, weight = ctx.saved_tensors
        n = weight.shape[0]
        # The rank's columns of the whole gradient grad_y @ W, with the whole product's tiles.
        grad_x = batch_invariant_mm(grad_y, weight, config=matmul_config(grad_y.dtype, ctx.k_full, n))
        # dW's rows K_local of x^T @ grad_y (reduced over tokens, which are not split): as on one GPU.
        grad_w = batch_invariant_mm(x.t(), grad_y).t() if ctx.needs_input_grad[1] else None
        return grad_x, grad_w, None


class _ColumnParallel(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, ranks):
        ctx.save_for_backward(x, weight)
        ctx.ranks, ctx.n_full = ranks, weight.shape[0] * ranks.size
        return batch_invariant_mm(x, weight.t(), config=matmul_config(x.dtype, ctx.n_full, x.shape[1]))

    @staticmethod
    def backward(ctx, grad_y):
        x, weight = ctx.saved_tensors
        grad_y = grad_y.contiguous()
        grad_x = _continued_mm(grad_y, weight, ctx.n_full, ctx.ranks)
        grad_w = None
        if ctx.needs_input_grad[1]:  # the rank's output columns of x^T @ grad_y, the whole product's tiles
            config = matmul_config(x.dtype, ctx.n_full, x.shape[0])
            grad_w = batch_invariant_mm(x.t(), grad_y, config=config).t()
        return grad_x, grad_w, None


def _rows(x: torch.Tensor) -> torch.Tensor:
    return x.reshape(-1, x.shape[-1])


def row_parallel_matmul(x: torch.Tensor, weight: torch.Tensor, group=None) -> torch.Tensor:
    """x [..., K/TP] @ weight[N, K/TP]^T, summed over the ranks' K slices in the single GPU's order."""
    y = _RowParallel.apply(_rows(x), weight, Ranks(group))
    return y.reshape(*x.shape[:-1], weight.shape[0])


def column_parallel_matmul(x: torch.Tensor, weight: torch.Tensor, group=None) -> torch.Tensor:
    """x [..., K] @ weight[N/TP, K]^T: this rank's output columns."""
    y = _ColumnParallel.apply(_rows(x), weight, Ranks(group))
    return y.reshape(*x.shape[:-1], weight.shape[0])


class _VocabParallelLinearLogp(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, targets, v_start, vocab, ranks):
        cfg = ll.config(hidden.dtype)
        local = targets - v_start  # outside [0, V_local): picked by no tile of this rank
        part_max, part_sum, target_logit = ll.partials(hidden, weight, None, local, cfg)
        if ranks.group is not None:
            part_max, part_sum = (_gather_tiles(p, ranks) for p in (part_max, part_sum))
            target_logit = _owner_value(target_logit, targets, vocab, weight.dtype, ranks)
        logp, lse = ll.combine(part_max, part_sum, target_logit)
        ctx.save_for_backward(hidden, weight, local, lse)
        ctx.ranks, ctx.v_start = ranks, v_start
        return logp

    @staticmethod
    def backward(ctx, grad_logp):
        hidden, weight, local, lse = ctx.saved_tensors
        cfg = ll.config(hidden.dtype)
        grad_out = grad_logp.to(torch.float32).contiguous()

        def compute(init, last, rows):
            grad_h = ll.hidden_grad(hidden[rows], weight, local[rows], lse[rows], grad_out[rows], cfg, init=init)
            return grad_h.to(hidden.dtype) if last else grad_h

        grad = continued(compute, ctx.ranks, hidden.shape, hidden.device, hidden.dtype)
        grad_w = None
        if ctx.needs_input_grad[1]:  # the rank's vocabulary rows: reduced over all tokens, not continued
            grad_w = ll._backward(hidden, weight, None, local, lse, grad_out, cfg, False, True, False)[1]
        return grad, grad_w, None, None, None, None


def _gather_tiles(p: torch.Tensor, ranks: Ranks) -> torch.Tensor:
    """[N, tiles_r] per rank -> [N, all tiles] in rank (= vocabulary) order; ranks' tile counts differ."""
    counts = torch.tensor([p.shape[1]], device=p.device)
    all_counts = [torch.empty_like(counts) for _ in range(ranks.size)]
    dist.all_gather(all_counts, counts, group=ranks.group)
    widest = int(max(c.item() for c in all_counts))
    padded = torch.zeros(p.shape[0], widest, dtype=p.dtype, device=p.device)
    padded[:, : p.shape[1]] = p
    parts = [torch.empty_like(padded) for _ in range(ranks.size)]
    dist.all_gather(parts, padded, group=ranks.group)
    return torch.cat([q[:, : int(c.item())] for q, c in zip(parts, all_counts, strict=True)], 1).contiguous()


def _owner_value(value: torch.Tensor, targets: torch.Tensor, vocab: int, dtype, ranks: Ranks) -> torch.Tensor:
    """Each token's value from the rank that holds its target (a copy, no arithmetic)."""
    parts = [torch.empty_like(value) for _ in range(ranks.size)]
    dist.all_gather(parts, value.contiguous(), group=ranks.group)
    bounds = torch.tensor(vocab_bounds(vocab, ranks.size, vocab_align(dtype))[1:-1], device=targets.device)
    owner = torch.bucketize(targets, bounds, right=True)
    return torch.stack(parts).gather(0, owner[None]).squeeze(0)


def vocab_parallel_linear_logp(hidden: torch.Tensor, weight: torch.Tensor, target_ids: torch.Tensor, group=None,
                               vocab: int | None = None) -> torch.Tensor:
    """fp32 logp [...] of target_ids, from this rank's vocabulary rows `weight` (its run of
    vocab_bounds(vocab, TP, vocab_align(dtype))); the single-GPU linear_logp's bits at every TP."""
    ranks = Ranks(group)
    vocab = vocab if vocab is not None else weight.shape[0] * ranks.size
    v_start = vocab_bounds(vocab, ranks.size, vocab_align(hidden.dtype))[ranks.rank]
    logp = _VocabParallelLinearLogp.apply(_rows(hidden).contiguous(), weight.contiguous(),
                                         target_ids.reshape(-1).contiguous(), v_start, vocab, ranks)
    return logp.reshape(target_ids.shape)


class _VocabParallelEmbedding(torch.autograd.Function):
    @staticmethod
    def forward(ctx, ids, weight, start, stop, bounds, ranks):
        mine = (ids >= start) & (ids < stop)
        rows = embedding_forward(torch.where(mine, ids - start, 0).contiguous(), weight.contiguous())
        parts = [torch.empty_like(rows) for _ in range(ranks.size)]
        dist.all_gather(parts, rows, group=ranks.group)
        owner = torch.bucketize(ids, torch.tensor(bounds[1:-1], device=ids.device), right=True)
        ctx.save_for_backward(ids, mine)
        ctx.start, ctx.vocab_local, ctx.dtype = start, weight.shape[0], weight.dtype
        return torch.stack(parts).gather(0, owner[None, :, None].expand(1, *rows.shape)).squeeze(0)

    @staticmethod
    def backward(ctx, grad_out):
        ids, mine = ctx.saved_tensors
        # This rank's rows only: its tokens, in their order, so each row sums the very same run of
        # gradients as on one GPU (the kernel's order depends on a row's own tokens alone).
        grad_w = embedding_backward(grad_out[mine].contiguous(), (ids[mine] - ctx.start).contiguous(),
                                    ctx.vocab_local, ctx.dtype)
        return None, grad_w, None, None, None, None


def vocab_parallel_embedding(token_ids: torch.Tensor, weight: torch.Tensor, group=None,
                             vocab: int | None = None) -> torch.Tensor:
    """Rows of the embedding whose vocabulary is split as `vocab_bounds` says; differentiable in weight."""
    ranks = Ranks(group)
    if ranks.group is None:
        return embedding(token_ids, weight)
    bounds = vocab_bounds(vocab, ranks.size, vocab_align(weight.dtype))
    start, stop = bounds[ranks.rank], bounds[ranks.rank + 1]
    out = _VocabParallelEmbedding.apply(token_ids.reshape(-1), weight, start, stop, bounds, ranks)
    return out.reshape(*token_ids.shape, weight.shape[1])


class _HeadsGathered(torch.autograd.Function):
    """fn over all heads, on every rank, for this rank's heads: for a weight shared by the heads (q/k
    RMSNorm), whose gradient sums over all of them in the single GPU's order. x [..., heads_local, D]."""

    @staticmethod
    def forward(ctx, x, weight, fn, ranks):
        full = _gather_heads(x, ranks)
        ctx.save_for_backward(full, weight)
        ctx.fn, ctx.ranks, ctx.local = fn, ranks, ranks.even_split("heads", full.shape[-2])
        with torch.no_grad():
            return fn(full, weight)[..., ctx.local, :].contiguous()

    @staticmethod
    def backward(ctx, grad_local):
        full, weight = ctx.saved_tensors
        grad_full = _gather_heads(grad_local, ctx.ranks)
        with torch.enable_grad():  # the single GPU's backward, on the same whole inputs
            x = full.detach().requires_grad_()
            w = weight.detach().requires_grad_(ctx.needs_input_grad[1])
            wrt = [x, w] if ctx.needs_input_grad[1] else [x]
            grads = torch.autograd.grad(ctx.fn(x, w), wrt, grad_full)
        return grads[0][..., ctx.local, :], grads[1] if ctx.needs_input_grad[1] else None, None, None


def _gather_heads(x: torch.Tensor, ranks: Ranks) -> torch.Tensor:
    parts = [torch.empty_like(x) for _ in range(ranks.size)]
    dist.all_gather(parts, x.contiguous(), group=ranks.group)
    return torch.cat(parts, -2)


def heads_gathered(fn, x: torch.Tensor, weight: torch.Tensor, group=None) -> torch.Tensor:
    """fn(x_all_heads, weight)[this rank's heads], differentiable in x and weight with one GPU's bits."""
    ranks = Ranks(group)
    if ranks.group is None:
        return fn(x, weight)
    return _HeadsGathered.apply(x, weight, fn, ranks)
