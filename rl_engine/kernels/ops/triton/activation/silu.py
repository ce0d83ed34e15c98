"""SiLU in Triton: y = x · sigmoid(x), elementwise over the flattened tensor, fp32 math, one cast.

Backward: dx = dy · s · (1 + x · (1 - s)) with s = sigmoid(x), recomputed from x (nothing saved
but x). Elementwise with no reduction, so every element's bits are independent of the batch, the
block it falls in and the grid: batch-invariant and deterministic by construction.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from rl_engine.kernels.ops.pytorch.activation.silu import NativeSiluOp
from rl_engine.kernels.ops.pytorch.base import expect_float
from rl_engine.kernels.ops.triton.runtime import cast_rne, check_devices, needs_autograd, register_autograd

# Elements per program and warps: fixed, so a tensor's bits never depend on its size.
BLOCK = 4096
NUM_WARPS = 8


@triton.jit
def _silu_forward_kernel(x_ptr, y_ptr, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    x = tl.load(x_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    y = x * tl.sigmoid(x)
    tl.store(y_ptr + offs, cast_rne(y, y_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _silu_backward_kernel(dy_ptr, x_ptr, dx_ptr, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    dy = tl.load(dy_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    x = tl.load(x_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    s = tl.sigmoid(x)
    dx = dy * s * (1.0 + x * (1.0 - s))
    tl.store(dx_ptr + offs, cast_rne(dx, dx_ptr.dtype.element_ty), mask=mask)


def silu_forward(x: torch.Tensor) -> torch.Tensor:
    """silu of a contiguous tensor, in its dtype."""
    y = torch.empty_like(x)
    n = x.numel()
    if n:
        _silu_forward_kernel[(triton.cdiv(n, BLOCK),)](x, y, n, BLOCK=BLOCK, num_warps=NUM_WARPS)
    return y


def silu_backward(dy: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    dx = torch.empty_like(x)
    n = x.numel()
    if n:
        _silu_backward_kernel[(triton.cdiv(n, BLOCK),)](dy, x, dx, n, BLOCK=BLOCK, num_warps=NUM_WARPS)
    return dx


# Forward and backward are torch custom ops (fake + autograd registered), so torch.compile traces them.
@torch.library.custom_op("rl_engine::silu", mutates_args=())
def silu_op(x: torch.Tensor) -> torch.Tensor:
    """silu of any float tensor (torch.ops.rl_engine.silu); differentiable."""
    return silu_forward(x.contiguous())


@silu_op.register_fake
def _silu_fake(x: torch.Tensor) -> torch.Tensor:
    return torch.empty_like(x, memory_format=torch.contiguous_format)


@torch.library.custom_op("rl_engine::silu_backward", mutates_args=())
def silu_backward_op(dy: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    return silu_backward(dy.contiguous(), x.contiguous())


@silu_backward_op.register_fake
def _(dy: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    return torch.empty_like(x, memory_format=torch.contiguous_format)


def _silu_setup_context(ctx, inputs, output) -> None:
    ctx.save_for_backward(inputs[0])


def _silu_backward(ctx, dy: torch.Tensor):
    (x,) = ctx.saved_tensors
    return silu_backward_op(dy, x)


silu_autograd = register_autograd(silu_op, _silu_backward, _silu_setup_context)


def silu(x: torch.Tensor) -> torch.Tensor:
    """x · sigmoid(x) for any shape; returns x's dtype."""
    expect_float("x", x, "of any shape")
    if not needs_autograd(x):
        return silu_forward(x.contiguous())
    return silu_autograd(x)


class TritonSiluOp:
    """Triton candidate for NativeSiluOp: op(x=[B,S,I]) -> [B,S,I] in x's dtype."""

    input_names = NativeSiluOp.input_names

    def __call__(self, *, x: torch.Tensor) -> torch.Tensor:
        check_devices("TritonSiluOp", x=x)
        NativeSiluOp().validate(x=x)
        return silu(x)
