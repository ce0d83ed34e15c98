"""Token embedding in Triton: out[t, :] = weight[token_ids[t], :]; backward without atomics.

Forward: a gather, one program per (token, block of BLOCK_H columns); bits are copied, so the result
is trivially batch-invariant.
Backward, deterministic and in a fixed order. The flattened token ids are sorted with a *stable*
device sort (torch.sort(stable=True) is deterministic), so equal ids keep their original token
order, and `searchsorted` gives each sorted position the end of its run of equal ids. One program
per (sorted position, column block) does work only if its position starts a run: it sums dy over
the run in tiles of RUN_TILE consecutive rows (in increasing flattened token index b·S + s); each
tile is reduced by a fixed tree (tl.sum over the tile) and the tiles are accumulated in run order,
all in fp32, then the row is written once, cast once to weight's dtype. Rows of ids that never
occur are zero (grad_weight starts as torch.zeros). The order depends only on the token ids.
Cost to know: a run is summed by one program, so an id repeated n times costs n / RUN_TILE serial
steps (a padding id repeated over most of the batch is the worst case).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from rl_engine.kernels.ops.pytorch.embedding.embedding import NativeEmbeddingOp
from rl_engine.kernels.ops.triton.runtime import cast_rne


@triton.jit
def _embedding_forward_kernel(ids_ptr, weight_ptr, out_ptr, H, BLOCK_H: tl.constexpr):
    token = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    mask = cols < H
    row = tl.load(ids_ptr + token).to(tl.int64)
    values = tl.load(weight_ptr + row * H + cols, mask=mask)
    tl.store(out_ptr + token * H + cols, values, mask=mask)


@triton.jit
def _embedding_backward_kernel(
    grad_out_ptr, sorted_ids_ptr, order_ptr, run_end_ptr, grad_weight_ptr,
    H, RUN_TILE: tl.constexpr, BLOCK_H: tl.constexpr,
):
    pos = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    col_mask = cols < H
    vocab_row = tl.load(sorted_ids_ptr + pos)
    previous = tl.load(sorted_ids_ptr + pos - 1, mask=pos > 0, other=-1)
    starts_run = vocab_row != previous
    # Programs that do not start a run get an empty loop and a masked-off store.
    end = tl.where(starts_run, tl.load(run_end_ptr + pos), pos)
    tile = tl.arange(0, RUN_TILE)
    acc = tl.zeros([BLOCK_H], dtype=tl.float32)
    for first in range(pos, end, RUN_TILE):
        rows = first + tile
        row_mask = rows < end
        tokens = tl.load(order_ptr + rows, mask=row_mask, other=0)
        values = tl.load(grad_out_ptr + tokens[:, None] * H + cols[None, :],
                         mask=row_mask[:, None] & col_mask[None, :], other=0.0)
        acc += tl.sum(values.to(tl.float32), axis=0)
    tl.store(grad_weight_ptr + vocab_row * H + cols, cast_rne(acc, grad_weight_ptr.dtype.element_ty),
             mask=col_mask & starts_run)


# Rows summed per step of the backward: a constant, so the summation order depends only on the ids.
RUN_TILE = 8
BACKWARD_BLOCK_H = 1024


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
    sorted_ids, order = torch.sort(ids.to(torch.int64), stable=True)
    run_end = torch.searchsorted(sorted_ids, sorted_ids, right=True)
    grad_weight = torch.zeros(vocab, hidden, dtype=dtype, device=grad_out.device)
    block = min(triton.next_power_of_2(hidden), BACKWARD_BLOCK_H)
    if n:
        _embedding_backward_kernel[(n, triton.cdiv(hidden, block))](
            grad_out, sorted_ids, order, run_end, grad_weight, hidden,
            RUN_TILE=RUN_TILE, BLOCK_H=block, num_warps=4,
        )
    return grad_weight


class _EmbeddingFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, token_ids: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        ids = token_ids.reshape(-1).contiguous()
        out = embedding_forward(ids, weight.contiguous())
        ctx.save_for_backward(ids)
        ctx.vocab, ctx.weight_dtype = weight.shape[0], weight.dtype
        return out.reshape(*token_ids.shape, weight.shape[1])

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor):
        (ids,) = ctx.saved_tensors
        grad_rows = grad_out.reshape(ids.numel(), -1).contiguous()
        return None, embedding_backward(grad_rows, ids, ctx.vocab, ctx.weight_dtype)


def embedding(token_ids: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """weight[token_ids] for integer ids of any shape and weight [V,H]; returns weight's dtype.

    Ids are not range-checked here (that needs a device sync); TritonEmbeddingOp checks them.
    """
    if weight.dim() != 2:
        raise ValueError(f"weight: expected shape [V,H], got {tuple(weight.shape)}")
    if token_ids.is_floating_point():
        raise ValueError(f"token_ids: expected integer ids, got dtype {token_ids.dtype}")
    return _EmbeddingFunction.apply(token_ids, weight)


class TritonEmbeddingOp:
    """Triton candidate for NativeEmbeddingOp: op(token_ids=[B,S], weight=[V,H]) -> [B,S,H] in weight's dtype."""

    input_names = NativeEmbeddingOp.input_names

    def __call__(self, *, token_ids: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        NativeEmbeddingOp().validate(token_ids=token_ids, weight=weight)
        return embedding(token_ids, weight)
