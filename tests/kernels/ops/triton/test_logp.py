"""TritonLogpOp against the fp32 gold op; batch invariance and determinism, bit for bit.

Without CUDA these run under the Triton CPU interpreter (tests/conftest.py) at small shapes with
BLOCK_V = 32, so V = 37 / 64 / 100 cover one partial chunk, exact chunks and a tail. The forward
tests run every forward algorithm (module.ALGOS), not only the shipped one, so that the one the
H200 sweep picks is already tested.
"""

from __future__ import annotations

import pytest
import torch

import rl_engine.kernels.ops.triton.loss.logp as module
from rl_engine.kernels.ops.pytorch.loss.logp import NativeLogpOp
from rl_engine.kernels.ops.triton.loss.logp import TritonLogpOp

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _inputs(b, s, v, dtype, seed=0, scale=3.0):
    gen = torch.Generator().manual_seed(seed)
    logits = (torch.randn(b, s, v, generator=gen) * scale).to(dtype)
    targets = torch.randint(0, v, (b, s), generator=gen)
    targets[0, 0] = 0
    targets[-1, -1] = v - 1
    return logits.to(DEVICE), targets.to(DEVICE)


@pytest.fixture(params=module.ALGOS)
def algo(request, monkeypatch):
    """Run the test with this forward algorithm for every dtype."""
    configs = {k: dict(v, ALGO=request.param) for k, v in module.FORWARD_CONFIGS.items()}
    monkeypatch.setattr(module, "FORWARD_CONFIGS", configs)
    return request.param


def _grads(op, logits, targets, grad_out):
    x = logits.detach().clone().requires_grad_()
    out = op(logits=x, target_ids=targets)
    (grad,) = torch.autograd.grad(out, x, grad_out)
    return out.detach(), grad


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("vocab", [37, 64, 100])
def test_forward_matches_fp32_reference(dtype, vocab, algo):
    logits, targets = _inputs(2, 3, vocab, dtype)
    out = TritonLogpOp()(logits=logits, target_ids=targets)
    ref = NativeLogpOp()(logits=logits, target_ids=targets)
    assert out.dtype == torch.float32 and out.shape == (2, 3)
    # fp32-exact from the upcast logits, whatever the input dtype (Liger's bf16 path is 3e-2 off).
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("vocab", [37, 100])
def test_backward_matches_autograd_of_reference(dtype, vocab):
    logits, targets = _inputs(2, 3, vocab, dtype, seed=1)
    grad_out = torch.randn(2, 3, generator=torch.Generator().manual_seed(2)).to(DEVICE)
    _, grad = _grads(TritonLogpOp(), logits, targets, grad_out)
    x = logits.detach().float().requires_grad_()
    (ref,) = torch.autograd.grad(NativeLogpOp()(logits=x, target_ids=targets), x, grad_out)
    assert grad.dtype == dtype
    if dtype == torch.float32:
        torch.testing.assert_close(grad, ref, rtol=1e-5, atol=1e-6)
    else:
        # One round-to-nearest of the fp32 gradient to bf16: within half an ulp (2^-8 relative).
        assert ((grad.float() - ref).abs() <= ref.abs() * 2**-8 + 1e-6).all()


def test_masked_vocabulary_entries_and_extreme_values(algo):
    logits, targets = _inputs(2, 3, 100, torch.float32, scale=30.0)
    logits[:, :, 50:70] = float("-inf")  # e.g. tokens masked out by a sampler
    logits[0, 1, :33] = float("-inf")  # a whole first chunk of -inf
    out = TritonLogpOp()(logits=logits, target_ids=targets)
    ref = NativeLogpOp()(logits=logits, target_ids=targets)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)


def test_a_fully_masked_row_is_nan_like_the_reference(algo):
    logits, targets = _inputs(1, 2, 100, torch.float32)
    logits[0, 1] = float("-inf")
    out = TritonLogpOp()(logits=logits, target_ids=targets)
    ref = NativeLogpOp()(logits=logits, target_ids=targets)
    assert torch.isfinite(out[0, 0]) and torch.isnan(out[0, 1]) and torch.isnan(ref[0, 1])


def test_non_contiguous_logits():
    wide, targets = _inputs(2, 3, 130, torch.float32)
    logits = wide[:, :, :100]  # row stride 130, last-dim stride 1
    targets = targets.clamp(max=99)
    out = TritonLogpOp()(logits=logits, target_ids=targets)
    torch.testing.assert_close(out, NativeLogpOp()(logits=logits, target_ids=targets), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_batch_invariance_bitwise(dtype, algo):
    logits, targets = _inputs(4, 5, 100, dtype, seed=3)
    grad_out = torch.randn(4, 5, generator=torch.Generator().manual_seed(4)).to(DEVICE)
    out, grad = _grads(TritonLogpOp(), logits, targets, grad_out)
    # One row alone, and a different batch composition (B=2) holding rows 2..3.
    alone, alone_grad = _grads(TritonLogpOp(), logits[2:3, 4:5], targets[2:3, 4:5], grad_out[2:3, 4:5])
    assert torch.equal(alone, out[2:3, 4:5]) and torch.equal(alone_grad, grad[2:3, 4:5])
    part, part_grad = _grads(TritonLogpOp(), logits[2:4], targets[2:4], grad_out[2:4])
    assert torch.equal(part, out[2:4]) and torch.equal(part_grad, grad[2:4])


def test_invariance_check_sees_a_config_change(monkeypatch):
    # Planted bug: a chunk size that changed with the batch would change the bits, and the
    # bitwise comparison above would catch it (it is not vacuous).
    logits, targets = _inputs(4, 5, 100, torch.float32, seed=6)
    shipped = TritonLogpOp()(logits=logits, target_ids=targets)
    cfg = module._forward_config(logits.dtype, 100)
    monkeypatch.setattr(module, "_forward_config", lambda dtype, vocab: dict(cfg, BLOCK_V=cfg["BLOCK_V"] // 2))
    planted = TritonLogpOp()(logits=logits, target_ids=targets)
    torch.testing.assert_close(planted, shipped, rtol=1e-5, atol=1e-5)
    assert not torch.equal(planted, shipped)


def test_deterministic_bitwise():
    logits, targets = _inputs(3, 4, 100, torch.bfloat16, seed=5)
    grad_out = torch.randn(3, 4).to(DEVICE)
    first = _grads(TritonLogpOp(), logits, targets, grad_out)
    second = _grads(TritonLogpOp(), logits, targets, grad_out)
    assert torch.equal(first[0], second[0]) and torch.equal(first[1], second[1])


def test_bad_inputs_raise_value_error_naming_the_input():
    logits, targets = _inputs(2, 3, 37, torch.float32)
    with pytest.raises(ValueError, match="logits"):
        TritonLogpOp()(logits=logits[0], target_ids=targets)
    with pytest.raises(ValueError, match="target_ids"):
        TritonLogpOp()(logits=logits, target_ids=targets[:, :2])
    with pytest.raises(ValueError, match="target_ids"):
        TritonLogpOp()(logits=logits, target_ids=targets.float())


def test_out_of_range_target_gives_nan_not_a_wild_read():
    logits, targets = _inputs(1, 2, 37, torch.float32)
    targets[0, 1] = 37
    out = TritonLogpOp()(logits=logits, target_ids=targets)
    assert torch.isfinite(out[0, 0]) and torch.isnan(out[0, 1])


# ---- H200 (skipped without CUDA) ------------------------------------------------------------

@pytest.mark.gpu
def test_gpu_bf16_qwen3_vocab_forward_is_fp32_exact():
    torch.manual_seed(0)
    n, vocab = 8192, 151936
    logits = (torch.randn(1, n, vocab, device="cuda") * 4).to(torch.bfloat16)
    targets = torch.randint(0, vocab, (1, n), device="cuda")
    out = TritonLogpOp()(logits=logits, target_ids=targets)
    ref = NativeLogpOp()(logits=logits, target_ids=targets)
    err = (out - ref).abs() / ref.abs().clamp(min=1.0)
    assert err.max().item() <= 1e-5, err.max().item()
    # Invariance at the real shape: a slice of rows gives the same bits as in the full batch.
    sub = TritonLogpOp()(logits=logits[:, 4000:4003].contiguous(), target_ids=targets[:, 4000:4003])
    assert torch.equal(sub, out[:, 4000:4003])


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_gpu_backward_and_invariance(dtype):
    torch.manual_seed(1)
    n, vocab = 1024, 151936
    logits = (torch.randn(2, n // 2, vocab, device="cuda") * 4).to(dtype)
    targets = torch.randint(0, vocab, (2, n // 2), device="cuda")
    grad_out = torch.randn(2, n // 2, device="cuda")
    out, grad = _grads(TritonLogpOp(), logits, targets, grad_out)
    x = logits.detach().float().requires_grad_()
    ref_out = NativeLogpOp()(logits=x, target_ids=targets)
    (ref,) = torch.autograd.grad(ref_out, x, grad_out)
    torch.testing.assert_close(out, ref_out.detach(), rtol=1e-5, atol=2e-5)
    assert ((grad.float() - ref).abs() <= ref.abs() * 2**-8 + 1e-6).all()
    alone, alone_grad = _grads(TritonLogpOp(), logits[1:2, 7:8], targets[1:2, 7:8], grad_out[1:2, 7:8])
    assert torch.equal(alone, out[1:2, 7:8]) and torch.equal(alone_grad, grad[1:2, 7:8])


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.float16])
def test_gpu_every_forward_algorithm_is_exact_and_invariant(dtype, algo):
    # Every candidate of benchmarks/logp.py --sweep, compiled for the GPU (inline ex2.approx.ftz),
    # at the real vocabulary: fp32-exact, and the same bits for a row alone as in the batch.
    torch.manual_seed(2)
    n, vocab = 512, 151936
    logits = (torch.randn(1, n, vocab, device="cuda") * 4).to(dtype)
    logits[0, 5, 1000:90000] = float("-inf")  # a masked span crossing many chunks
    targets = torch.randint(0, vocab, (1, n), device="cuda")
    targets[0, 5] = 3
    out = TritonLogpOp()(logits=logits, target_ids=targets)
    ref = NativeLogpOp()(logits=logits, target_ids=targets)
    err = (out - ref).abs() / ref.abs().clamp(min=1.0)
    assert err.max().item() <= 1e-5, (algo, err.max().item())
    alone = TritonLogpOp()(logits=logits[:, 5:6], target_ids=targets[:, 5:6])
    assert torch.equal(alone, out[:, 5:6])
    big = (torch.randn(1, 3, vocab, device="cuda") * 40).to(dtype)  # logits of magnitude ~100
    big_t = torch.randint(0, vocab, (1, 3), device="cuda")
    big_err = (TritonLogpOp()(logits=big, target_ids=big_t) - NativeLogpOp()(logits=big, target_ids=big_t)).abs()
    assert (big_err <= 1e-5 * NativeLogpOp()(logits=big, target_ids=big_t).abs().clamp(min=1.0)).all()
