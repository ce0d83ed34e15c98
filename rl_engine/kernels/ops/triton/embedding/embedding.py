"""Token embedding in Triton: out[t, :] = weight[token_ids[t], :]; backward without atomics.

Forward: a gather, one program per (token, block of BLOCK_H columns); bits are copied, so the result
is trivially batch-invariant.
Backward, deterministic and in a fixed order. The flattened token ids are sorted with a *stable*
device sort (torch.sort(stable=True) is deterministic; keys are sorted as int32 when the vocabulary
allows, half the radix passes of int64, the same order), so equal ids keep their original token
order; `searchsorted` gives each sorted position the start and end of its run of equal ids.
A run is cut into segments of SEGMENT rows from its start. One program per (sorted position, column
block) works only if its position starts a segment: it sums dy over the segment in tiles of RUN_TILE
consecutive rows (in increasing flattened token index b·S + s); each tile is reduced by a fixed tree
(tl.sum over the tile) and the tiles are accumulated in order, all in fp32.
- A run of at most SEGMENT rows is one segment: its sum is cast once and written to grad_weight.
- A longer run writes each segment's fp32 sum to a partial row; a second kernel adds the partial
  rows of the run in segment order and writes the row once, cast once to weight's dtype. Without
  this split one program summed a whole run serially (a padding id over half the batch took 1.1 ms
  instead of 0.5, benchmarks/results/embedding.json).
Partial rows need no allocation per run: a long run's first segment uses slot 2·⌊p/SEGMENT⌋ + 1 and
each later segment (starting at p) slot 2·⌊p/SEGMENT⌋; two segments of long runs never share a slot
(a long run spans more than SEGMENT positions), so 2·⌈N/SEGMENT⌉ rows suffice.
Rows of ids that never occur are zero: grad_weight starts as torch.zeros, launched first so that its
fill (the 1.2 GB table at Qwen3 scale, most of the backward's time) hides the host work of the rest.
The order depends only on the ids and is the same for every run of the program; no host syncs.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from rl_engine.kernels.ops.pytorch.embedding.embedding import NativeEmbeddingOp
from rl_engine.kernels.ops.triton.runtime import cast_rne, check_devices, needs_autograd, register_autograd


@triton.jit
def _embedding_forward_kernel(ids_ptr, weight_ptr, out_ptr, H, BLOCK_H: tl.constexpr):
    token = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    mask = cols < H
    row = tl.load(ids_ptr + token).to(tl.int64)
    values = tl.load(weight_ptr + row * H + cols, mask=mask)
    tl.store(out_ptr + token * H + cols, values, mask=mask)


@triton.jit
def _embedding_segment_kernel(
    grad_out_ptr, order_ptr, sorted_ids_ptr, run_start_ptr, run_end_ptr, grad_weight_ptr, partial_ptr,
    H, SEGMENT: tl.constexpr, RUN_TILE: tl.constexpr, BLOCK_H: tl.constexpr,
):
    pos = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    col_mask = cols < H
    start = tl.load(run_start_ptr + pos)
    run_end = tl.load(run_end_ptr + pos)
    starts_segment = (pos - start) % SEGMENT == 0
    # Programs that do not start a segment get an empty loop and masked-off stores.
    end = tl.where(starts_segment, tl.minimum(pos + SEGMENT, run_end), pos)
    tile = tl.arange(0, RUN_TILE)
    acc = tl.zeros([BLOCK_H], dtype=tl.float32)
    for first in range(pos, end, RUN_TILE):
        rows = first + tile
        row_mask = rows < end
        tokens = tl.load(order_ptr + rows, mask=row_mask, other=0)
        values = tl.load(grad_out_ptr + tokens[:, None] * H + cols[None, :],
                         mask=row_mask[:, None] & col_mask[None, :], other=0.0)
        acc += tl.sum(values.to(tl.float32), axis=0)
    long_run = run_end - start > SEGMENT
    short_run = run_end - start <= SEGMENT
    vocab_row = tl.load(sorted_ids_ptr + pos).to(tl.int64)
    # Masks are block comparisons, not `col_mask & <scalar condition>`: Triton 3.9's interpreter
    # broadcasts a scalar comparison into an integer array, which store rejects as a mask.
    tl.store(grad_weight_ptr + vocab_row * H + cols, cast_rne(acc, grad_weight_ptr.dtype.element_ty),
             mask=cols < tl.where(starts_segment & short_run, H, 0))
    slot = 2 * (pos // SEGMENT) + (pos == start).to(tl.int64)
    tl.store(partial_ptr + slot * H + cols, acc, mask=cols < tl.where(starts_segment & long_run, H, 0))


@triton.jit
def _embedding_long_run_kernel(
    sorted_ids_ptr, run_start_ptr, run_end_ptr, grad_weight_ptr, partial_ptr,
    H, SEGMENT: tl.constexpr, BLOCK_H: tl.constexpr,
):
    pos = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    col_mask = cols < H
    start = tl.load(run_start_ptr + pos)
    run_end = tl.load(run_end_ptr + pos)
    owns_long_run = (pos == start) & (run_end - start > SEGMENT)
    end = tl.where(owns_long_run, run_end, pos)
    acc = tl.zeros([BLOCK_H], dtype=tl.float32)
    for segment in range(pos, end, SEGMENT):  # partial rows in segment order
        slot = 2 * (segment // SEGMENT) + (segment == pos).to(tl.int64)
        acc += tl.load(partial_ptr + slot * H + cols, mask=col_mask, other=0.0)
    vocab_row = tl.load(sorted_ids_ptr + pos).to(tl.int64)
    tl.store(grad_weight_ptr + vocab_row * H + cols, cast_rne(acc, grad_weight_ptr.dtype.element_ty),
             mask=cols < tl.where(owns_long_run, H, 0))  # a block comparison: see above


# Rows summed per step of the backward and rows per segment: constants, so the summation order
# depends only on the ids. SEGMENT is a multiple of RUN_TILE (tiles never straddle two segments).
RUN_TILE = 8
SEGMENT = 128
BACKWARD_BLOCK_H = 1024


@functools.cache
def launch_config(hidden: int) -> tuple[int, int]:
    """(BLOCK_H, num_warps): fixed per H."""
    block = min(triton.next_power_of_2(hidden), 2048)
    return block, 8 if block >= 2048 else 4 if block >= 512 else 1


def embedding_forward(ids: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """Rows of weight [V,H] (contiguous) for flat ids [N]: [N,H] in weight's dtype."""
    n, hidden = ids.numel(), weight.shape[1]
    out = torch.empty(n, hidden, dtype=weight.dtype, device=weight.device)
    block, warps = launch_config(hidden)
    if n:
        _embedding_forward_kernel[(n, triton.cdiv(hidden, block))](ids, weight, out, hidden, BLOCK_H=block,
                                                                    num_warps=warps)
    return out


def embedding_backward(grad_out: torch.Tensor, ids: torch.Tensor, vocab: int, dtype: torch.dtype) -> torch.Tensor:
    """grad_weight [V,H] in `dtype` from grad_out [N,H] (contiguous) and flat ids [N]; fixed order."""
    n, hidden = grad_out.shape
    grad_weight = torch.zeros(vocab, hidden, dtype=dtype, device=grad_out.device)
    if not n:
        return grad_weight
    keys = ids.to(torch.int32) if vocab <= torch.iinfo(torch.int32).max else ids.to(torch.int64)
    sorted_ids, order = torch.sort(keys, stable=True)
    run_start = torch.searchsorted(sorted_ids, sorted_ids)
    run_end = torch.searchsorted(sorted_ids, sorted_ids, right=True)
    partial = torch.empty(2 * triton.cdiv(n, SEGMENT), hidden, dtype=torch.float32, device=grad_out.device)
    block = min(triton.next_power_of_2(hidden), BACKWARD_BLOCK_H)
    grid = (n, triton.cdiv(hidden, block))
    _embedding_segment_kernel[grid](
        grad_out, order, sorted_ids, run_start, run_end, grad_weight, partial, hidden,
        SEGMENT=SEGMENT, RUN_TILE=RUN_TILE, BLOCK_H=block, num_warps=4,
    )
    _embedding_long_run_kernel[grid](
        sorted_ids, run_start, run_end, grad_weight, partial, hidden,
        SEGMENT=SEGMENT, BLOCK_H=block, num_warps=4,
    )
    return grad_weight


# Forward and backward are torch custom ops (fake + autograd registered), so torch.compile traces them.
@torch.library.custom_op("rl_engine::embedding", mutates_args=())
def embedding_op(token_ids: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """weight[token_ids] (torch.ops.rl_engine.embedding); differentiable in weight."""
    out = embedding_forward(token_ids.reshape(-1).contiguous(), weight.contiguous())
    return out.reshape(*token_ids.shape, weight.shape[1])


@embedding_op.register_fake
def _(token_ids: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    return weight.new_empty((*token_ids.shape, weight.shape[1]))


@torch.library.custom_op("rl_engine::embedding_backward", mutates_args=())
def embedding_backward_op(grad_out: torch.Tensor, token_ids: torch.Tensor, vocab: int,
                          dtype: torch.dtype) -> torch.Tensor:
    ids = token_ids.reshape(-1).contiguous()
    grad_rows = grad_out.reshape(ids.numel(), grad_out.shape[-1]).contiguous()  # not -1: 0 tokens
    return embedding_backward(grad_rows, ids, vocab, dtype)


@embedding_backward_op.register_fake
def _(grad_out, token_ids, vocab, dtype) -> torch.Tensor:
    return grad_out.new_empty((vocab, grad_out.shape[-1]), dtype=dtype)


def _embedding_setup_context(ctx, inputs, output) -> None:
    token_ids, weight = inputs
    ctx.save_for_backward(token_ids)
    ctx.vocab, ctx.weight_dtype = weight.shape[0], weight.dtype


def _embedding_backward(ctx, grad_out: torch.Tensor):
    (token_ids,) = ctx.saved_tensors
    return None, embedding_backward_op(grad_out, token_ids, ctx.vocab, ctx.weight_dtype)


embedding_autograd = register_autograd(embedding_op, _embedding_backward, _embedding_setup_context)


def embedding(token_ids: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """weight[token_ids] for integer ids of any shape and weight [V,H]; returns weight's dtype.

    Ids are not range-checked here (that needs a device sync); TritonEmbeddingOp checks them.
    """
    if weight.dim() != 2:
        raise ValueError(f"weight: expected shape [V,H], got {tuple(weight.shape)}")
    if token_ids.is_floating_point():
        raise ValueError(f"token_ids: expected integer ids, got dtype {token_ids.dtype}")
    if not needs_autograd(weight):
        # Without autograd: the kernel alone, no custom op (its host cost shows at small shapes).
        out = embedding_forward(token_ids.reshape(-1).contiguous(), weight.contiguous())
        return out.reshape(*token_ids.shape, weight.shape[1])
    return embedding_autograd(token_ids, weight)


class TritonEmbeddingOp:
    """Triton candidate for NativeEmbeddingOp: op(token_ids=[B,S], weight=[V,H]) -> [B,S,H] in weight's dtype."""

    input_names = NativeEmbeddingOp.input_names

    def __call__(self, *, token_ids: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        check_devices("TritonEmbeddingOp", token_ids=token_ids, weight=weight)
        NativeEmbeddingOp().validate(token_ids=token_ids, weight=weight)
        return embedding(token_ids, weight)
