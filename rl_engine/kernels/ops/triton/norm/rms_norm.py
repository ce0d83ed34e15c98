"""RMSNorm in Triton: y = x · rsqrt(mean(x²) + eps) · weight (eps inside the root, as Qwen3).

Forward: one program per row; the row is loaded once, reduced in fp32, and y is cast once to x's
dtype. The per-row rstd (fp32) is saved for the backward.
Backward: dx = rstd · (g - x̂ · mean(g · x̂)) with g = dy · weight and x̂ = x · rstd, per row.
dweight = Σ_rows dy · x̂ with no atomics: program p owns the ROWS_PER_PROGRAM consecutive rows
[p·R, (p+1)·R), accumulates them in row order into fp32 registers and writes the partial sum to
row p of a [num_chunks, H] fp32 buffer; the chunks are then summed by `torch.sum(dim=0)` (a fixed
reduction for a fixed shape, hence deterministic) and cast once to weight's dtype. The program
prefetches row r+1 while it reduces row r (two rows in flight; the same arithmetic, the same bits).
Why not a Triton kernel for the chunk sum: at 32768 x 4096 the buffer is 16 MB (2% of the
backward's traffic) and torch's column reduction reads it at full bandwidth in one launch; a Triton
column sum in a fixed serial order would be a long dependent chain per column block.

Batch invariance: a row's y, rstd and dx are computed by the same code whatever the number of rows
or the program that owns it; the launch configuration depends only on (H, dtype). R is a constant,
so the dweight summation order depends only on the number of rows, never on the grid.
Host cost per call is kept small: no copies of contiguous inputs, launch configuration cached per H,
and without autograd (no_grad, or no input needing a gradient) the forward kernel is launched
directly, without the custom op.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from rl_engine.kernels.ops.pytorch.base import expect_float
from rl_engine.kernels.ops.pytorch.norm.rms_norm import NativeRmsNormOp
from rl_engine.kernels.ops.triton.runtime import (
    cast_rne,
    check_devices,
    needs_autograd,
    pdl_launch,
    register_autograd,
)

# Rows per backward program; a constant so that dweight's order never depends on the launch grid.
ROWS_PER_PROGRAM = 32


@triton.jit
def _rms_norm_forward_kernel(
    x_ptr, weight_ptr, y_ptr, rstd_ptr,
    H, eps, group_rows, stride_group, stride_row, heads, split,
    BLOCK_H: tl.constexpr, SPLIT_WEIGHT: tl.constexpr, PDL: tl.constexpr,
):
    # x's row r lies at (r // group_rows) · stride_group + (r % group_rows) · stride_row: contiguous rows, or a
    # stacked product's heads read in place (q or k of q/k/v: tokens × heads). y is contiguous.
    # SPLIT_WEIGHT: rows are tokens × `heads` heads; heads [0, split) take weight row 0, the rest row 1 (q's and
    # k's norms in one launch: the same code per row, only the weight's address differs).
    if PDL:  # launched as a programmatic dependent (runtime.pdl_launch)
        gdc_launch_dependents()
        gdc_wait()
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK_H)
    mask = cols < H
    src = (row // group_rows) * stride_group + (row % group_rows) * stride_row
    x = tl.load(x_ptr + src + cols, mask=mask, other=0.0).to(tl.float32)
    w_ptrs = weight_ptr + cols
    if SPLIT_WEIGHT:
        w_ptrs += tl.where(row % heads >= split, H, 0)
    w = tl.load(w_ptrs, mask=mask, other=0.0).to(tl.float32)
    rstd = tl.rsqrt(tl.sum(x * x, axis=0) / H + eps)
    y = x * rstd * w
    tl.store(y_ptr + row * H + cols, cast_rne(y, y_ptr.dtype.element_ty), mask=mask)
    tl.store(rstd_ptr + row, rstd)


@triton.jit
def _rms_norm_backward_kernel(
    dy_ptr, x_ptr, weight_ptr, rstd_ptr, dx_ptr, dweight_partial_ptr,
    n_rows, H,
    ROWS_PER_PROGRAM: tl.constexpr, BLOCK_H: tl.constexpr,
):
    chunk = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK_H)
    mask = cols < H
    w = tl.load(weight_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    dweight = tl.zeros([BLOCK_H], dtype=tl.float32)
    first = chunk * ROWS_PER_PROGRAM
    last = tl.minimum(first + ROWS_PER_PROGRAM, n_rows)
    # Rows are prefetched one ahead: the loads of row r+1 are issued before row r's reduction, so
    # two rows per program are in flight (the loop is otherwise latency-bound: load, reduce, store).
    # Same arithmetic in the same order as without the prefetch, so the same bits.
    dy_next = tl.load(dy_ptr + first * H + cols, mask=mask, other=0.0)
    x_next = tl.load(x_ptr + first * H + cols, mask=mask, other=0.0)
    for row in range(first, last):
        dy = dy_next.to(tl.float32)
        x = x_next.to(tl.float32)
        # A block comparison, not `mask & (row + 1 < last)`: Triton 3.9's interpreter broadcasts a scalar
        # comparison into an integer array, which load and store reject as a mask.
        next_mask = cols < tl.where(row + 1 < last, H, 0)
        dy_next = tl.load(dy_ptr + (row + 1) * H + cols, mask=next_mask, other=0.0)
        x_next = tl.load(x_ptr + (row + 1) * H + cols, mask=next_mask, other=0.0)
        rstd = tl.load(rstd_ptr + row)
        x_hat = x * rstd
        g = dy * w
        mean_g_xhat = tl.sum(g * x_hat, axis=0) / H
        dx = (g - x_hat * mean_g_xhat) * rstd
        tl.store(dx_ptr + row * H + cols, cast_rne(dx, dx_ptr.dtype.element_ty), mask=mask)
        dweight += dy * x_hat
    tl.store(dweight_partial_ptr + chunk * H + cols, dweight, mask=mask)


@functools.cache
def launch_config(hidden: int) -> tuple[int, int]:
    """(BLOCK_H, num_warps) for a row of `hidden` elements: fixed per H, never per number of rows."""
    block = triton.next_power_of_2(hidden)
    num_warps = 16 if block >= 16384 else 8 if block >= 2048 else 4 if block >= 512 else 1
    return block, num_warps


def _row_layout(x: torch.Tensor) -> tuple[torch.Tensor, int, int, int]:
    """(x or a copy, group_rows, stride_group, stride_row) locating the kernel's rows of x [..., H]: rows in place
    where x views as [rows, H] or [groups, rows, H] with a unit last stride, else a contiguous copy."""
    hidden = x.shape[-1]
    for shape in ((-1, hidden), (-1, x.shape[-2] if x.dim() > 1 else 1, hidden)):
        try:
            v = x.view(shape)
        except RuntimeError:
            continue
        if v.numel() and (hidden == 1 or v.stride(-1) == 1):
            return (v, max(v.shape[0], 1), 0, v.stride(0)) if v.dim() == 2 else (v, v.shape[1], v.stride(0),
                                                                                    v.stride(1))
    return x.reshape(-1, hidden).contiguous(), max(x.numel() // max(hidden, 1), 1), 0, hidden


def rms_norm_forward(x: torch.Tensor, weight: torch.Tensor, eps: float, num_warps: int | None = None,
                     split: int | None = None):
    """(y [N,H] contiguous in x's dtype, rstd [N] fp32) for the N rows of x [..., H] (read in place where the
    layout allows: `_row_layout`). split: x is [..., Hh, H] and weight [2, H] (contiguous), heads [0, split) are
    normed by weight[0] and the rest by weight[1]."""
    hidden = x.shape[-1]
    n = x.numel() // hidden if hidden else 0
    y = torch.empty((n, hidden), dtype=x.dtype, device=x.device)
    rstd = torch.empty(n, dtype=torch.float32, device=x.device)
    block, warps = launch_config(hidden)
    if n:
        src, group_rows, stride_group, stride_row = _row_layout(x)
        heads = x.shape[-2] if split is not None else 1
        _rms_norm_forward_kernel[(n,)](src, weight, y, rstd, hidden, eps, group_rows, stride_group, stride_row,
                                       heads, heads if split is None else split, BLOCK_H=block,
                                       SPLIT_WEIGHT=split is not None, num_warps=num_warps or warps, **pdl_launch())
    return y, rstd


def rms_norm_backward(dy2d: torch.Tensor, x2d: torch.Tensor, weight: torch.Tensor, rstd: torch.Tensor,
                      num_warps: int | None = None):
    """(dx [N,H] in x's dtype, dweight [H] in weight's dtype); dweight summed in a fixed order."""
    n, hidden = x2d.shape
    dx = torch.empty_like(x2d)
    chunks = triton.cdiv(n, ROWS_PER_PROGRAM)
    partial = torch.empty(chunks, hidden, dtype=torch.float32, device=x2d.device)
    block, warps = launch_config(hidden)
    if n:
        _rms_norm_backward_kernel[(chunks,)](
            dy2d, x2d, weight, rstd, dx, partial, n, hidden,
            ROWS_PER_PROGRAM=ROWS_PER_PROGRAM, BLOCK_H=block, num_warps=num_warps or warps,
        )
    dweight = partial.sum(dim=0) if n else torch.zeros(hidden, dtype=torch.float32, device=x2d.device)
    return dx, dweight.to(weight.dtype)


# Forward and backward are torch custom ops (fake + autograd registered), so torch.compile traces them.
@torch.library.custom_op("rl_engine::rms_norm", mutates_args=())
def rms_norm_op(x: torch.Tensor, weight: torch.Tensor, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(y in x's shape and dtype, rstd [N] fp32) (torch.ops.rl_engine.rms_norm); differentiable in y."""
    y, rstd = rms_norm_forward(x.reshape(-1, x.shape[-1]).contiguous(), weight.contiguous(), eps)
    return y.reshape(x.shape), rstd


@rms_norm_op.register_fake
def _(x: torch.Tensor, weight: torch.Tensor, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.empty_like(x, memory_format=torch.contiguous_format), x.new_empty(x.shape[:-1].numel(),
                                                                                   dtype=torch.float32)


@torch.library.custom_op("rl_engine::rms_norm_backward", mutates_args=())
def rms_norm_backward_op(dy: torch.Tensor, x: torch.Tensor, weight: torch.Tensor,
                         rstd: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    x2d = x.reshape(-1, x.shape[-1]).contiguous()
    dx, dweight = rms_norm_backward(dy.reshape(x2d.shape).contiguous(), x2d, weight.contiguous(), rstd)
    return dx.reshape(x.shape), dweight


@rms_norm_backward_op.register_fake
def _(dy, x, weight, rstd) -> tuple[torch.Tensor, torch.Tensor]:
    fmt = torch.contiguous_format
    return torch.empty_like(x, memory_format=fmt), torch.empty_like(weight, memory_format=fmt)


def _rms_norm_setup_context(ctx, inputs, output) -> None:
    x, weight, _ = inputs
    ctx.save_for_backward(x, weight, output[1])


def _rms_norm_backward(ctx, dy: torch.Tensor, _drstd):
    x, weight, rstd = ctx.saved_tensors
    dx, dweight = rms_norm_backward_op(dy, x, weight, rstd)
    return dx, dweight, None


rms_norm_autograd = register_autograd(rms_norm_op, _rms_norm_backward, _rms_norm_setup_context)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6, split: int | None = None) -> torch.Tensor:
    """RMSNorm over the last dim of x [..., H] with weight [H]; returns x's dtype. split: two projections' heads
    stacked, x [..., Hh, H] and weight [2, H]: heads [0, split) normed by weight[0], the rest by weight[1], in one
    launch with the bits of normalising each part on its own."""
    if split is not None:
        return _rms_norm_split(x, weight, eps, split)
    if weight.dim() != 1 or weight.shape[0] != x.shape[-1]:
        raise ValueError(f"weight: expected shape [H] = ({x.shape[-1]},), got {tuple(weight.shape)}")
    expect_float("x", x, "[..., H]")
    expect_float("weight", weight, "[H]")
    if not needs_autograd(x, weight):
        # Without autograd: the kernel alone, no custom op (its host cost shows at small shapes).
        y, _ = rms_norm_forward(x, weight.contiguous(), eps)
        return y.reshape(x.shape)
    return rms_norm_autograd(x, weight, eps)[0]


def _rms_norm_split(x: torch.Tensor, weight: torch.Tensor, eps: float, split: int) -> torch.Tensor:
    expect_float("x", x, "[..., Hh, H]")
    expect_float("weight", weight, "[2, H]")
    if x.dim() < 2 or tuple(weight.shape) != (2, x.shape[-1]) or not 0 < split < x.shape[-2]:
        raise ValueError(f"x, weight, split: expected x [..., Hh, H], weight [2, H] and 0 < split < Hh; got x "
                         f"{tuple(x.shape)}, weight {tuple(weight.shape)}, split {split}")
    if needs_autograd(x, weight):  # each part through the differentiable op: the same per-row kernel
        parts = (rms_norm(x[..., :split, :], weight[0], eps), rms_norm(x[..., split:, :], weight[1], eps))
        return torch.cat(parts, dim=-2)
    y, _ = rms_norm_forward(x, weight.contiguous(), eps, split=split)
    return y.reshape(x.shape)


class TritonRmsNormOp:
    """Triton candidate for NativeRmsNormOp: op(x=[B,S,H], weight=[H]) -> [B,S,H] in x's dtype (with `split`:
    x [B,S,Hh,D], weight [2,D])."""

    input_names = NativeRmsNormOp.input_names

    def __init__(self, eps: float = 1e-6, split: int | None = None):
        self.eps = eps
        self.split = split

    def __call__(self, *, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        check_devices("TritonRmsNormOp", x=x, weight=weight)
        NativeRmsNormOp(self.eps, self.split).validate(x=x, weight=weight)
        return rms_norm(x, weight, self.eps, self.split)
