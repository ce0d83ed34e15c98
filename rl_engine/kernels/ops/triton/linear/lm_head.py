"""Language-model head on the batch-invariant GEMM: logits[B,S,V] = hidden[B,S,H] @ weight[V,H]^T.

The weight is read in place through weight.t() (the GEMM takes strided and transposed operands:
no copy of the 151936 x 4096 matrix per call). Backward runs the same kernel:
d_hidden = d_logits @ weight (rows batch-invariant), d_weight = d_logits^T @ hidden, written
directly in the weight's [V,H] layout; its reduction runs over tokens, so its bits depend on the
batch, deterministically.
"""

from __future__ import annotations

import torch

from rl_engine.kernels.ops.pytorch.linear.lm_head import NativeLmHeadOp
from rl_engine.kernels.ops.triton.linear.matmul import batch_invariant_mm
from rl_engine.kernels.ops.triton.runtime import check_devices, needs_autograd, register_autograd


@torch.library.custom_op("rl_engine::lm_head", mutates_args=())
def lm_head_op(hidden: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """logits[M,V] = hidden[M,H] @ weight[V,H]^T (torch.ops.rl_engine.lm_head), differentiable."""
    return batch_invariant_mm(hidden, weight.t())


@lm_head_op.register_fake
def _(hidden: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    return hidden.new_empty((hidden.shape[0], weight.shape[0]))


def _lm_head_setup_context(ctx, inputs, output) -> None:
    ctx.save_for_backward(*inputs)


def _lm_head_backward(ctx, grad_logits: torch.Tensor):
    hidden, weight = ctx.saved_tensors
    grad_hidden = lm_head_op(grad_logits, weight.t()) if ctx.needs_input_grad[0] else None
    # d_weight = d_logits^T @ hidden, computed directly in the weight's [V,H] layout.
    grad_weight = lm_head_op(grad_logits.t(), hidden.t()) if ctx.needs_input_grad[1] else None
    return grad_hidden, grad_weight


lm_head_autograd = register_autograd(lm_head_op, _lm_head_backward, _lm_head_setup_context)


def triton_lm_head(hidden: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """logits[..., V] = hidden[..., H] @ weight[V,H]^T in hidden's dtype; differentiable."""
    lead = hidden.shape[:-1]
    hidden2d = hidden.reshape(lead.numel(), hidden.shape[-1])  # not -1, ambiguous when H = 0
    if needs_autograd(hidden, weight):
        logits = lm_head_autograd(hidden2d, weight)
    else:  # no autograd, no torch.compile: the GEMM alone, without the op's dispatch cost
        logits = batch_invariant_mm(hidden2d, weight.t())
    return logits.reshape(*lead, weight.shape[0])


class TritonLmHeadOp:
    """Triton candidate for NativeLmHeadOp: hidden [B,S,H], weight [V,H] -> logits [B,S,V]."""

    input_names = NativeLmHeadOp.input_names

    def __call__(self, *, hidden: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        check_devices("TritonLmHeadOp", hidden=hidden, weight=weight)
        NativeLmHeadOp().validate(hidden=hidden, weight=weight)
        return triton_lm_head(hidden, weight)
