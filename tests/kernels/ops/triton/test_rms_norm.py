"""Triton RMSNorm against the gold: forward, backward, batch invariance, determinism."""

import pytest
import torch

from rl_engine.kernels.ops.pytorch.norm.rms_norm import NativeRmsNormOp
from rl_engine.kernels.ops.triton.norm import rms_norm as triton_rms_norm
from rl_engine.kernels.ops.triton.norm.rms_norm import ROWS_PER_PROGRAM, TritonRmsNormOp

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
# fp32: a few fp32 ulps (different reduction order); bf16: within one bf16 rounding of the reference.
TOL = {torch.float32: dict(rtol=1e-5, atol=1e-6), torch.bfloat16: dict(rtol=2**-7, atol=1e-5)}


def _inputs(shape, dtype, seed=0):
    gen = torch.Generator().manual_seed(seed)
    x = (torch.randn(shape, generator=gen) * 2 + 0.5).to(dtype).to(DEVICE)
    weight = (torch.rand(shape[-1], generator=gen) + 0.5).to(dtype).to(DEVICE)
    dy = torch.randn(shape, generator=gen).to(dtype).to(DEVICE)
    return x, weight, dy


def _run(op, x, weight, dy):
    x, weight = x.clone().requires_grad_(), weight.clone().requires_grad_()
    y = op(x=x, weight=weight)
    y.backward(dy.to(y.dtype))
    return y.detach(), x.grad, weight.grad


def _assert_close(actual, expected, dtype):
    tol = dict(TOL[dtype])
    tol["atol"] = tol["atol"] * max(1.0, float(expected.abs().max()))
    torch.testing.assert_close(actual.float(), expected.float(), **tol)

def _assert_rounds_to_nearest(actual, reference):
    """bf16 outputs are the fp32 reference rounded to nearest even, but for a few near-ties.

    A truncating cast (what Triton's interpreter does without runtime.cast_rne) misses about half."""
    misses = int((actual != reference.to(actual.dtype)).sum())
    assert misses <= max(1, actual.numel() // 100), f"{misses} of {actual.numel()} not rounded to nearest"



@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", [(3, 23, 37), (1, 2 * ROWS_PER_PROGRAM + 1, 64), (2, 1, 8)])
def test_forward_and_backward_match_gold(shape, dtype):
    x, weight, dy = _inputs(shape, dtype)
    y, dx, dweight = _run(TritonRmsNormOp(), x, weight, dy)
    assert y.dtype == dx.dtype == dweight.dtype == dtype
    y_ref, dx_ref, dweight_ref = _run(NativeRmsNormOp(), x.float(), weight.float(), dy.float())
    _assert_close(y, y_ref, dtype)
    _assert_close(dx, dx_ref, dtype)
    _assert_close(dweight, dweight_ref, dtype)
    if dtype == torch.bfloat16:
        _assert_rounds_to_nearest(y, y_ref)


def test_eps_is_used():
    x, weight, dy = _inputs((1, 3, 16), torch.float32)
    x = x * 1e-3
    y_ref, *_ = _run(NativeRmsNormOp(eps=1e-2), x, weight, dy)
    y, *_ = _run(TritonRmsNormOp(eps=1e-2), x, weight, dy)
    _assert_close(y, y_ref, torch.float32)
    y_default, *_ = _run(TritonRmsNormOp(), x, weight, dy)
    assert not torch.allclose(y_default, y_ref, rtol=1e-3)


def _rows_bitwise_equal(op, x, weight, dy, rows):
    """Every (b, s) in `rows`: y and dx computed alone equal the same row computed in the batch."""
    y, dx, _ = _run(op, x, weight, dy)
    for b, s in rows:
        y1, dx1, _ = _run(op, x[b:b + 1, s:s + 1], weight, dy[b:b + 1, s:s + 1])
        if not (torch.equal(y1[0, 0], y[b, s]) and torch.equal(dx1[0, 0], dx[b, s])):
            return False
    return True


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_batch_invariance_bitwise(dtype):
    x, weight, dy = _inputs((2, 37, 40), dtype, seed=1)
    rows = [(0, 0), (1, 36), (1, ROWS_PER_PROGRAM - 1)]
    assert _rows_bitwise_equal(TritonRmsNormOp(), x, weight, dy, rows)


def test_batch_invariance_check_catches_a_batch_dependent_op():
    # Planted bug: eps that grows with the number of rows. The check above must reject it.
    class BatchDependent(TritonRmsNormOp):
        def __call__(self, *, x, weight):
            return triton_rms_norm.rms_norm(x, weight, 1e-6 * x.shape[0] * x.shape[1])

    x, weight, dy = _inputs((2, 5, 16), torch.float32, seed=2)
    x = x * 1e-3
    assert not _rows_bitwise_equal(BatchDependent(), x, weight, dy, [(1, 3)])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_deterministic(dtype):
    x, weight, dy = _inputs((2, 45, 24), dtype, seed=3)
    first = _run(TritonRmsNormOp(), x, weight, dy)
    second = _run(TritonRmsNormOp(), x, weight, dy)
    for a, b in zip(first, second):
        assert torch.equal(a, b)


def test_dweight_over_several_row_chunks_matches_fp64():
    # Three backward programs (two full chunks of ROWS_PER_PROGRAM rows and a partial one).
    x, weight, dy = _inputs((1, 2 * ROWS_PER_PROGRAM + 5, 16), torch.float32, seed=4)
    _, _, dweight = _run(TritonRmsNormOp(), x, weight, dy)
    x2, dy2 = x[0].double(), dy[0].double()
    x_hat = x2 * torch.rsqrt(x2.pow(2).mean(-1, keepdim=True) + 1e-6)
    torch.testing.assert_close(dweight.double(), (dy2 * x_hat).sum(0), rtol=1e-5, atol=1e-5)


def test_no_grad_path_equals_autograd_path_bitwise():
    x, weight, dy = _inputs((2, 9, 24), torch.bfloat16, seed=6)
    y, _, _ = _run(TritonRmsNormOp(), x, weight, dy)
    with torch.no_grad():
        assert torch.equal(TritonRmsNormOp()(x=x, weight=weight), y)
    assert torch.equal(TritonRmsNormOp()(x=x, weight=weight), y)  # no input requires grad


def test_bad_inputs_raise_value_error_naming_the_input():
    with pytest.raises(ValueError, match="weight"):
        TritonRmsNormOp()(x=torch.zeros(1, 2, 8), weight=torch.zeros(7))
    with pytest.raises(ValueError, match="x"):
        TritonRmsNormOp()(x=torch.zeros(2, 8), weight=torch.zeros(8))


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_qwen3_8b_shape_on_gpu(dtype):
    x, weight, dy = _inputs((4, 2048, 4096), dtype, seed=5)
    y, dx, dweight = _run(TritonRmsNormOp(), x, weight, dy)
    y_ref, dx_ref, dweight_ref = _run(NativeRmsNormOp(), x.float(), weight.float(), dy.float())
    _assert_close(y, y_ref, dtype)
    _assert_close(dx, dx_ref, dtype)
    _assert_close(dweight, dweight_ref, dtype)
    assert _rows_bitwise_equal(TritonRmsNormOp(), x, weight, dy, [(0, 0), (3, 2047), (2, 1000)])
    again = _run(TritonRmsNormOp(), x, weight, dy)
    assert all(torch.equal(a, b) for a, b in zip((y, dx, dweight), again))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_heads_of_a_stacked_product_are_normed_in_place_with_the_bits_of_a_copy(dtype, monkeypatch):
    """q's heads as a view of one [B, (Hq + 2 Hkv) D] q/k/v product (the decoder's q_norm input at decode): read in
    place (tokens × heads) with the bits of the contiguous copy; a planted token stride is caught."""
    from rl_engine.kernels.ops.triton.norm import rms_norm as module

    qkv = torch.randn(3, (4 + 2 * 2) * 16, generator=torch.Generator().manual_seed(0)).to(dtype).to(DEVICE)
    q = qkv[:, : 4 * 16].view(3, 4, 16)
    w = torch.randn(16, generator=torch.Generator().manual_seed(1)).to(dtype).to(DEVICE)
    assert not q.is_contiguous() and module._row_layout(q)[1:] == (4, qkv.stride(0), 16)
    want = module.rms_norm(q.contiguous(), w)
    assert torch.equal(module.rms_norm(q, w), want)
    monkeypatch.setattr(module, "_row_layout", lambda x: (x, x.shape[1], x.shape[1] * x.shape[2], x.shape[2]))
    assert not torch.equal(module.rms_norm(q, w), want)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_q_and_k_heads_normed_in_one_launch_with_the_bits_of_two(dtype, monkeypatch):
    """q's and k's heads of one q/k/v product (tokens × (Hq + Hkv) heads, read at the token stride) normed by one
    launch with weight rows [q_norm, k_norm]: each part's bits as its own launch; gradients as the parts'; a planted
    split one head off is caught."""
    from rl_engine.kernels.ops.triton.norm import rms_norm as module

    gen = torch.Generator().manual_seed(2)
    hq, hkv, d = 4, 2, 16
    qkv = torch.randn(2, 3, (hq + 2 * hkv) * d, generator=gen).to(dtype).to(DEVICE)
    qk = qkv[..., : (hq + hkv) * d].view(2, 3, hq + hkv, d)
    weights = (torch.rand(2, d, generator=gen) + 0.5).to(dtype).to(DEVICE)
    assert not qk.is_contiguous()
    want = torch.cat([module.rms_norm(qk[:, :, :hq].contiguous(), weights[0]),
                      module.rms_norm(qk[:, :, hq:].contiguous(), weights[1])], dim=2)
    got = TritonRmsNormOp(split=hq)(x=qk, weight=weights)
    assert torch.equal(got, want)
    gold = NativeRmsNormOp(split=hq)(x=qk.double(), weight=weights.double())
    _assert_close(got, gold, dtype)
    # under autograd: the parts through the differentiable op, the same bits and the parts' gradients
    x, w = qk.clone().requires_grad_(), weights.clone().requires_grad_()
    y = module.rms_norm(x, w, split=hq)
    assert torch.equal(y.detach(), want)
    y.float().square().sum().backward()
    x_ref, w_ref = qk.clone().requires_grad_(), weights.clone().requires_grad_()
    torch.cat([module.rms_norm(x_ref[:, :, :hq], w_ref[0]), module.rms_norm(x_ref[:, :, hq:], w_ref[1])],
              dim=2).float().square().sum().backward()
    assert torch.equal(x.grad, x_ref.grad) and torch.equal(w.grad, w_ref.grad)
    launch = module.rms_norm_forward
    monkeypatch.setattr(module, "rms_norm_forward", lambda *a, split=None, **k: launch(*a, split=split - 1, **k))
    assert not torch.equal(module.rms_norm(qk, weights, split=hq), want)


@pytest.mark.parametrize("split", [0, 6])
def test_a_split_outside_the_heads_is_refused(split):
    x = torch.randn(1, 2, 6, 8, device=DEVICE)
    with pytest.raises(ValueError, match="split"):
        TritonRmsNormOp(split=split)(x=x, weight=torch.ones(2, 8, device=DEVICE))
