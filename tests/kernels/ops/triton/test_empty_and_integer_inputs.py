"""Edge inputs the gold handles: 0 tokens in the embedding backward, K = 0 in the GEMMs; and integer
inputs to float-only ops, refused by the candidate and the gold alike with one ValueError."""

from __future__ import annotations

import pytest
import torch

from rl_engine.kernels.ops.pytorch.activation.silu import NativeSiluOp
from rl_engine.kernels.ops.pytorch.activation.swiglu import NativeSwigluOp
from rl_engine.kernels.ops.pytorch.embedding.embedding import NativeEmbeddingOp
from rl_engine.kernels.ops.pytorch.linear.lm_head import NativeLmHeadOp
from rl_engine.kernels.ops.pytorch.linear.matmul import NativeMatmulOp
from rl_engine.kernels.ops.pytorch.norm.rms_norm import NativeRmsNormOp
from rl_engine.kernels.ops.pytorch.position.rope import NativeRopeOp
from rl_engine.kernels.ops.triton.activation.silu import TritonSiluOp, silu
from rl_engine.kernels.ops.triton.activation.swiglu import TritonSwigluOp, swiglu
from rl_engine.kernels.ops.triton.embedding.embedding import TritonEmbeddingOp
from rl_engine.kernels.ops.triton.linear.lm_head import TritonLmHeadOp
from rl_engine.kernels.ops.triton.linear.matmul import TritonMatmulOp
from rl_engine.kernels.ops.triton.norm.rms_norm import TritonRmsNormOp, rms_norm
from rl_engine.kernels.ops.triton.position.rope import TritonRopeOp, rope

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _forward_backward(op, inputs):
    leaves = {k: v.clone().requires_grad_() if v.is_floating_point() else v for k, v in inputs.items()}
    out = op(**leaves)
    out.backward(torch.ones_like(out))
    return out.detach(), {k: v.grad for k, v in leaves.items() if v.is_floating_point()}


@pytest.mark.parametrize("tokens", [(1, 0), (0, 3)])
def test_embedding_backward_with_no_tokens_gives_a_zero_gradient(tokens):
    inputs = dict(token_ids=torch.zeros(tokens, dtype=torch.long, device=DEVICE),
                  weight=torch.randn(5, 4, device=DEVICE))
    out, grads = _forward_backward(TritonEmbeddingOp(), inputs)
    ref, ref_grads = _forward_backward(NativeEmbeddingOp(), inputs)
    assert out.shape == ref.shape == (*tokens, 4)
    assert torch.equal(grads["weight"], ref_grads["weight"]) and not grads["weight"].any()


@pytest.mark.parametrize("candidate, gold, inputs", [
    (TritonMatmulOp, NativeMatmulOp, lambda: dict(a=torch.randn(2, 3, 0), b=torch.randn(0, 4))),
    (TritonLmHeadOp, NativeLmHeadOp, lambda: dict(hidden=torch.randn(2, 3, 0), weight=torch.randn(4, 0))),
], ids=["matmul", "lm_head"])
def test_an_empty_reduction_gives_zeros_and_empty_gradients(candidate, gold, inputs):
    inputs = {k: v.to(DEVICE) for k, v in inputs().items()}
    out, grads = _forward_backward(candidate(), inputs)
    ref, ref_grads = _forward_backward(gold(), inputs)
    assert out.shape == ref.shape == (2, 3, 4) and torch.equal(out, ref) and not out.any()
    for name, grad in grads.items():
        assert grad.shape == inputs[name].shape and torch.equal(grad, ref_grads[name])


def _float_inputs():
    gen = torch.Generator().manual_seed(0)
    return {
        "rms_norm": (TritonRmsNormOp, NativeRmsNormOp, dict(x=torch.randn(1, 2, 8, generator=gen),
                                                           weight=torch.randn(8, generator=gen))),
        "silu": (TritonSiluOp, NativeSiluOp, dict(x=torch.randn(1, 2, 8, generator=gen))),
        "swiglu": (TritonSwigluOp, NativeSwigluOp, dict(gate=torch.randn(1, 2, 8, generator=gen),
                                                        up=torch.randn(1, 2, 8, generator=gen))),
        "rope": (TritonRopeOp, NativeRopeOp, dict(x=torch.randn(1, 2, 1, 8, generator=gen),
                                                  positions=torch.tensor([[0, 1]]))),
    }


INTEGER_CASES = [(op, name, dtype) for op, (_, _, inputs) in _float_inputs().items() for name in inputs
                 if inputs[name].is_floating_point() for dtype in (torch.int64, torch.int32)]


@pytest.mark.parametrize("op, name, dtype", INTEGER_CASES)
def test_integer_inputs_are_refused_by_the_candidate_and_the_gold(op, name, dtype):
    candidate, gold, inputs = _float_inputs()[op]
    inputs = {k: v.to(DEVICE) for k, v in inputs.items()}
    inputs[name] = (inputs[name] * 3).to(dtype)
    for impl in (candidate(), gold()):
        with pytest.raises(ValueError, match=rf"^{name}: .*{dtype}"):
            impl(**inputs)


@pytest.mark.parametrize("call, name", [
    (lambda i: rms_norm(i, torch.ones(8, device=DEVICE)), "x"),
    (lambda i: rms_norm(torch.ones(2, 8, device=DEVICE), i[0]), "weight"),
    (lambda i: silu(i), "x"),
    (lambda i: swiglu(i, i.float()), "gate"),
    (lambda i: swiglu(i.float(), i), "up"),
    (lambda i: rope(i.reshape(1, 2, 1, 8), torch.zeros(1, 2, dtype=torch.long, device=DEVICE)), "x"),
], ids=["rms_norm-x", "rms_norm-weight", "silu", "swiglu-gate", "swiglu-up", "rope"])
def test_the_functional_entries_refuse_integer_inputs_too(call, name):
    with pytest.raises(ValueError, match=rf"^{name}: .*torch.int64"):
        call(torch.arange(16, device=DEVICE).reshape(2, 8))
