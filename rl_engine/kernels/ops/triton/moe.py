"""The MoE block's combine and permute backward in Triton, with the bits of their torch form.

`rl_engine.models.moe` writes the combine (out[t] = sum over slots s, in slot order, in fp32, of
w[t,s] * rows[row_of_slot[t,s]]), its backward (grad_rows, and grad_weights[t,s] = tree_sum over H of
g[t] * rows[...]) and the permute's backward (a token's k row gradients summed in slot order in fp32)
as torch ops: about 140 launches per layer, forward and backward, at k = 8 (the tree alone is 11
levels per slot). Here each is one kernel, one program per token, doing the same IEEE operations in
the same order: products and sums are separate roundings (`enable_fp_fusion=False`: no fma
contraction), the tree adds the upper half of the (zero-padded, power-of-two) row to the lower half
level by level as `tree_sum` does, and bf16 results are rounded to nearest even once. So the torch
and Triton forms give the same bits on the same device (tests/models/test_moe_kernels.py, the
interpreter on the CPU and CUDA on the H200); the model uses this form on CUDA.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from rl_engine.kernels.ops.triton.runtime import cast_rne

_NO_FMA = {"enable_fp_fusion": False}  # torch's mul and add are two roundings; so must ours be


@triton.jit
def _slot_sum_kernel(rows_ptr, w_ptr, slot_ptr, out_ptr, H, stride_r, stride_o,
                     WEIGHTED: tl.constexpr, TOP_K: tl.constexpr, BLOCK_H: tl.constexpr):
    # out[t] = sum over slots s, in slot order, in fp32, of (w[t,s] *) rows[slot[t,s]]: the combine
    # (WEIGHTED) and the permute's backward.
    t = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK_H)
    ok = offs < H
    acc = tl.zeros([BLOCK_H], tl.float32)
    for s in tl.static_range(TOP_K):
        row = tl.load(slot_ptr + t * TOP_K + s).to(tl.int64)
        term = tl.load(rows_ptr + row * stride_r + offs, mask=ok, other=0.0).to(tl.float32)
        if WEIGHTED:
            term = tl.load(w_ptr + t * TOP_K + s).to(tl.float32) * term
        if s == 0:
            acc = term
        else:
            acc = acc + term
    tl.store(out_ptr + t * stride_o + offs, cast_rne(acc, out_ptr.dtype.element_ty), mask=ok)


@triton.jit
def _tree_sum(x, BLOCK_H: tl.constexpr, LOG_H: tl.constexpr):
    # tree_sum's order: the upper half added to the lower half until one element is left.
    for level in tl.static_range(LOG_H):
        x = tl.sum(tl.reshape(x, (2, BLOCK_H >> (level + 1))), axis=0)  # row 0 + row 1, lane by lane
    return tl.sum(x, axis=0)  # one element


@triton.jit
def _combine_backward_kernel(grad_ptr, rows_ptr, w_ptr, slot_ptr, grad_rows_ptr, grad_w_ptr, H,
                             stride_g, stride_r, TOP_K: tl.constexpr, BLOCK_H: tl.constexpr, LOG_H: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK_H)
    ok = offs < H
    g = tl.load(grad_ptr + t * stride_g + offs, mask=ok, other=0.0).to(tl.float32)
    for s in tl.static_range(TOP_K):
        row = tl.load(slot_ptr + t * TOP_K + s).to(tl.int64)
        w = tl.load(w_ptr + t * TOP_K + s).to(tl.float32)
        tl.store(grad_rows_ptr + row * stride_r + offs, cast_rne(w * g, grad_rows_ptr.dtype.element_ty), mask=ok)
        x = tl.load(rows_ptr + row * stride_r + offs, mask=ok, other=0.0).to(tl.float32)
        tl.store(grad_w_ptr + t * TOP_K + s, _tree_sum(g * x, BLOCK_H, LOG_H))


def _launch_options(h: int) -> dict:
    block = triton.next_power_of_2(max(h, 1))
    return dict(BLOCK_H=block, num_warps=4 if block <= 2048 else 8, **_NO_FMA)


def _log2(block: int) -> int:
    return block.bit_length() - 1


def combine(rows: torch.Tensor, weights: torch.Tensor, row_of_slot: torch.Tensor) -> torch.Tensor:
    """out [T,H] in rows' dtype: sum_s (fp32, slot order) of weights[t,s] * rows[row_of_slot[t,s]]."""
    rows, slots = rows.contiguous(), row_of_slot.contiguous()
    t, k = slots.shape
    out = rows.new_empty((t, rows.shape[1]))
    if t:
        _slot_sum_kernel[(t,)](rows, weights.contiguous(), slots, out, rows.shape[1], rows.stride(0), out.stride(0),
                               WEIGHTED=True, TOP_K=k, **_launch_options(rows.shape[1]))
    return out


def combine_backward(grad_out: torch.Tensor, rows: torch.Tensor, weights: torch.Tensor,
                     row_of_slot: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(grad_rows [N,H] in rows' dtype, fp32 grad_weights [T,k]): every permuted row is one slot's."""
    # Contiguous: grad_rows is written with rows' row stride.
    grad_out, rows, slots = grad_out.contiguous(), rows.contiguous(), row_of_slot.contiguous()
    t, k = slots.shape
    grad_rows = torch.empty_like(rows)
    grad_w = torch.empty((t, k), dtype=torch.float32, device=rows.device)
    if t:
        options = _launch_options(rows.shape[1])
        _combine_backward_kernel[(t,)](grad_out, rows, weights.contiguous(), slots, grad_rows, grad_w, rows.shape[1],
                                       grad_out.stride(0), rows.stride(0), TOP_K=k, LOG_H=_log2(options["BLOCK_H"]),
                                       **options)
    return grad_rows, grad_w


def permute_backward(grad_rows: torch.Tensor, row_of_slot: torch.Tensor) -> torch.Tensor:
    """grad_x [T,H] in grad_rows' dtype: a token's k row gradients summed in slot order in fp32."""
    grad_rows, slots = grad_rows.contiguous(), row_of_slot.contiguous()
    t, k = slots.shape
    out = grad_rows.new_empty((t, grad_rows.shape[1]))
    if t:
        _slot_sum_kernel[(t,)](grad_rows, grad_rows, slots, out, grad_rows.shape[1], grad_rows.stride(0),
                               out.stride(0), WEIGHTED=False, TOP_K=k, **_launch_options(grad_rows.shape[1]))
    return out
