"""SwiGLU in Triton: y = silu(gate) · up, elementwise, fp32 math, one cast. The forward reads rows of the last dim
through their row strides, so the gate and up halves of one stacked gate/up product are read in place (no copies).

Backward (recomputed from gate and up, nothing else saved), with s = sigmoid(gate):
d_up = dy · gate · s;  d_gate = dy · up · s · (1 + gate · (1 - s)).
Elementwise with no reduction: batch-invariant and deterministic by construction.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from rl_engine.kernels.ops.pytorch.activation.swiglu import NativeSwigluOp
from rl_engine.kernels.ops.pytorch.base import expect_float
from rl_engine.kernels.ops.triton.runtime import (
    cast_rne,
    check_devices,
    needs_autograd,
    pdl_launch,
    register_autograd,
    unit_column_rows,
)

# Elements per program and warps: fixed, so a tensor's bits never depend on its size.
BLOCK = 4096
NUM_WARPS = 8


@triton.jit
def _swiglu_forward_kernel(gate_ptr, up_ptr, y_ptr, n_cols, stride_g, stride_u, BLOCK: tl.constexpr,
                           PDL: tl.constexpr):
    if PDL:  # launched as a programmatic dependent (runtime.pdl_launch)
        gdc_launch_dependents()
        gdc_wait()
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < n_cols
    gate = tl.load(gate_ptr + row * stride_g + cols, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(up_ptr + row * stride_u + cols, mask=mask, other=0.0).to(tl.float32)
    y = gate * tl.sigmoid(gate) * up
    tl.store(y_ptr + row * n_cols + cols, cast_rne(y, y_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _swiglu_backward_kernel(dy_ptr, gate_ptr, up_ptr, dgate_ptr, dup_ptr, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    dy = tl.load(dy_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    gate = tl.load(gate_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(up_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    s = tl.sigmoid(gate)
    dup = dy * gate * s
    dgate = dy * up * s * (1.0 + gate * (1.0 - s))
    tl.store(dgate_ptr + offs, cast_rne(dgate, dgate_ptr.dtype.element_ty), mask=mask)
    tl.store(dup_ptr + offs, cast_rne(dup, dup_ptr.dtype.element_ty), mask=mask)


def swiglu_forward(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """silu(gate) · up for two tensors of one shape (rows of the last dim may be strided), contiguous, in gate's
    dtype."""
    cols = gate.shape[-1] if gate.dim() else 1
    g2, u2 = unit_column_rows(gate, cols), unit_column_rows(up, cols)
    y = torch.empty(gate.shape, dtype=gate.dtype, device=gate.device)
    rows = g2.shape[0]
    if gate.numel():
        _swiglu_forward_kernel[(rows, triton.cdiv(cols, BLOCK))](
            g2, u2, y, cols, g2.stride(0), u2.stride(0), BLOCK=BLOCK, **pdl_launch(),
            num_warps=NUM_WARPS)
    return y


def swiglu_backward(dy: torch.Tensor, gate: torch.Tensor, up: torch.Tensor):
    """(d_gate in gate's dtype, d_up in up's dtype)."""
    dgate, dup = torch.empty_like(gate), torch.empty_like(up)
    n = gate.numel()
    if n:
        _swiglu_backward_kernel[(triton.cdiv(n, BLOCK),)](
            dy, gate, up, dgate, dup, n, BLOCK=BLOCK, num_warps=NUM_WARPS
        )
    return dgate, dup


# Forward and backward are torch custom ops (fake + autograd registered), so torch.compile traces them.
@torch.library.custom_op("rl_engine::swiglu", mutates_args=())
def swiglu_op(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """silu(gate) · up (torch.ops.rl_engine.swiglu); differentiable."""
    return swiglu_forward(gate, up)


@swiglu_op.register_fake
def _(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    return torch.empty_like(gate, memory_format=torch.contiguous_format)


@torch.library.custom_op("rl_engine::swiglu_backward", mutates_args=())
def swiglu_backward_op(dy: torch.Tensor, gate: torch.Tensor, up: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return swiglu_backward(dy.contiguous(), gate.contiguous(), up.contiguous())


@swiglu_backward_op.register_fake
def _(dy: torch.Tensor, gate: torch.Tensor, up: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    fmt = torch.contiguous_format
    return torch.empty_like(gate, memory_format=fmt), torch.empty_like(up, memory_format=fmt)


def _swiglu_setup_context(ctx, inputs, output) -> None:
    ctx.save_for_backward(*inputs)


def _swiglu_backward(ctx, dy: torch.Tensor):
    gate, up = ctx.saved_tensors
    return swiglu_backward_op(dy, gate, up)


swiglu_autograd = register_autograd(swiglu_op, _swiglu_backward, _swiglu_setup_context)


def swiglu(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """silu(gate) · up for two tensors of one shape; returns gate's dtype."""
    if gate.shape != up.shape:
        raise ValueError(f"up: expected the shape of gate {tuple(gate.shape)}, got {tuple(up.shape)}")
    expect_float("gate", gate, "of any shape")
    expect_float("up", up, "of gate's shape")
    if not needs_autograd(gate, up):
        return swiglu_forward(gate, up)
    return swiglu_autograd(gate, up)


class TritonSwigluOp:
    """Triton candidate for NativeSwigluOp: op(gate=[B,S,I], up=[B,S,I]) -> [B,S,I] in gate's dtype."""

    input_names = NativeSwigluOp.input_names

    def __call__(self, *, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        check_devices("TritonSwigluOp", gate=gate, up=up)
        NativeSwigluOp().validate(gate=gate, up=up)
        return swiglu(gate, up)
