"""Triton embedding against the gold: gather, weight gradient with repeated ids, determinism."""

import pytest
import torch

from rl_engine.kernels.ops.pytorch.embedding.embedding import NativeEmbeddingOp
from rl_engine.kernels.ops.triton.embedding import embedding as triton_embedding
from rl_engine.kernels.ops.triton.embedding.embedding import RUN_TILE, SEGMENT, TritonEmbeddingOp

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
TOL = {torch.float32: dict(rtol=1e-5, atol=1e-5), torch.bfloat16: dict(rtol=2**-7, atol=1e-5)}


def _inputs(batch, seq, vocab, hidden, dtype, seed=0, id_high=None):
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, id_high or vocab, (batch, seq), generator=gen).to(DEVICE)
    weight = torch.randn(vocab, hidden, generator=gen).to(dtype).to(DEVICE)
    dy = torch.randn(batch, seq, hidden, generator=gen).to(dtype).to(DEVICE)
    return ids, weight, dy


def _run(op, ids, weight, dy):
    weight = weight.clone().requires_grad_()
    y = op(token_ids=ids, weight=weight)
    y.backward(dy.to(y.dtype))
    return y.detach(), weight.grad


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("batch, seq, vocab, hidden, id_high", [(3, 9, 11, 37, 7), (2, 1, 5, 8, None)])
def test_forward_and_weight_gradient_match_gold(batch, seq, vocab, hidden, id_high, dtype):
    # id_high < vocab leaves rows that no token uses: their gradient must be exactly zero.
    ids, weight, dy = _inputs(batch, seq, vocab, hidden, dtype, id_high=id_high)
    y, dweight = _run(TritonEmbeddingOp(), ids, weight, dy)
    y_ref, dweight_ref = _run(NativeEmbeddingOp(), ids, weight.float(), dy.float())
    assert y.dtype == dweight.dtype == dtype
    assert torch.equal(y.float(), y_ref)
    torch.testing.assert_close(dweight.float(), dweight_ref, **TOL[dtype])
    unused = torch.ones(vocab, dtype=torch.bool, device=DEVICE)
    unused[ids.reshape(-1)] = False
    assert torch.equal(dweight[unused], torch.zeros_like(dweight[unused]))


def test_long_runs_of_one_id_sum_every_occurrence():
    # One id repeated over several RUN_TILE tiles plus a partial tile, interleaved with others.
    n = 3 * RUN_TILE + 3
    ids = torch.tensor([[2] * n + [0, 2, 1]], device=DEVICE)
    gen = torch.Generator().manual_seed(1)
    weight = torch.randn(4, 16, generator=gen).to(DEVICE)
    dy = torch.randn(1, n + 3, 16, generator=gen).to(DEVICE)
    _, dweight = _run(TritonEmbeddingOp(), ids, weight, dy)
    expected = torch.zeros(4, 16, dtype=torch.float64, device=DEVICE)
    expected.index_add_(0, ids[0], dy[0].double())
    torch.testing.assert_close(dweight.double(), expected, rtol=1e-6, atol=1e-6)


def test_runs_longer_than_a_segment_are_split_and_summed_in_order(monkeypatch):
    # A small SEGMENT keeps the interpreter fast. Two adjacent long runs (40 and 20 rows of ids 1, 2
    # after two 0s) put a later segment of the first and the first segment of the second in the same
    # SEGMENT-window of sorted positions: their partial rows must not share a slot.
    monkeypatch.setattr(triton_embedding, "SEGMENT", 2 * RUN_TILE)
    gen = torch.Generator().manual_seed(5)
    flat = torch.tensor([0] * 2 + [1] * 40 + [2] * 20 + [4] * 3)
    ids = flat[torch.randperm(flat.numel(), generator=gen)].reshape(1, -1).to(DEVICE)
    weight = torch.randn(6, 24, generator=gen).to(DEVICE)
    dy = torch.randn(1, flat.numel(), 24, generator=gen).to(DEVICE)
    _, dweight = _run(TritonEmbeddingOp(), ids, weight, dy)
    expected = torch.zeros(6, 24, dtype=torch.float64, device=DEVICE)
    expected.index_add_(0, ids[0], dy[0].double())
    torch.testing.assert_close(dweight.double(), expected, rtol=1e-6, atol=1e-6)
    assert torch.equal(_run(TritonEmbeddingOp(), ids, weight, dy)[1], dweight)


def test_segment_is_a_multiple_of_the_tile():
    assert SEGMENT % RUN_TILE == 0 and SEGMENT >= RUN_TILE


def test_no_grad_forward_equals_autograd_forward():
    ids, weight, dy = _inputs(2, 5, 7, 12, torch.bfloat16, seed=6)
    y, _ = _run(TritonEmbeddingOp(), ids, weight, dy)
    with torch.no_grad():
        assert torch.equal(TritonEmbeddingOp()(token_ids=ids, weight=weight), y)


def test_gradient_is_independent_of_the_batch_shape_given_the_token_order():
    # The sum order is the flattened token order, so [2, 6] and [1, 12] views of one stream agree.
    ids, weight, dy = _inputs(2, 6, 5, 24, torch.float32, seed=2)
    _, grad_2x6 = _run(TritonEmbeddingOp(), ids, weight, dy)
    _, grad_1x12 = _run(TritonEmbeddingOp(), ids.reshape(1, 12), weight, dy.reshape(1, 12, 24))
    assert torch.equal(grad_2x6, grad_1x12)


def test_batch_invariance_and_determinism():
    ids, weight, dy = _inputs(3, 7, 9, 33, torch.bfloat16, seed=3)
    y, dweight = _run(TritonEmbeddingOp(), ids, weight, dy)
    y1, _ = _run(TritonEmbeddingOp(), ids[2:3, 4:5], weight, dy[2:3, 4:5])
    assert torch.equal(y1[0, 0], y[2, 4])
    again = _run(TritonEmbeddingOp(), ids, weight, dy)
    assert torch.equal(again[0], y) and torch.equal(again[1], dweight)


def test_bad_inputs_raise_value_error_naming_the_input():
    with pytest.raises(ValueError, match="token_ids"):
        TritonEmbeddingOp()(token_ids=torch.tensor([[0, 5]]), weight=torch.zeros(5, 4))
    with pytest.raises(ValueError, match="weight"):
        TritonEmbeddingOp()(token_ids=torch.tensor([[0, 1]]), weight=torch.zeros(5))


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_qwen3_8b_shape_on_gpu(dtype):
    # Ids drawn from the first 4096 of 151936 so that many ids repeat.
    ids, weight, dy = _inputs(4, 2048, 151936, 4096, dtype, seed=4, id_high=4096)
    y, dweight = _run(TritonEmbeddingOp(), ids, weight, dy)
    y_ref, dweight_ref = _run(NativeEmbeddingOp(), ids, weight.float(), dy.float())
    assert torch.equal(y.float(), y_ref)
    torch.testing.assert_close(dweight.float(), dweight_ref, **TOL[dtype])
    again = _run(TritonEmbeddingOp(), ids, weight, dy)
    assert torch.equal(again[0], y) and torch.equal(again[1], dweight)
