"""The MoE router, combine and permute backward in Triton give the bits of their torch form
(rl_engine.models.moe), on the CPU interpreter here and on CUDA in the GPU gate: forward, grad_rows,
grad_weights, grad_x, and the router's weights, experts, probabilities and logits' gradient."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from rl_engine.kernels.ops.triton import moe as kernels
from rl_engine.models import moe


def _problem(t, k, h, experts, dtype, device, seed=0):
    g = torch.Generator().manual_seed(seed)
    chosen = torch.stack([torch.randperm(experts, generator=g)[:k] for _ in range(t)])
    plan = moe.Dispatch(chosen.to(device), experts)
    rows = torch.randn(t * k, h, generator=g).to(dtype).to(device)
    weights = torch.rand(t, k, generator=g).to(dtype).to(device)
    grad_out = torch.randn(t, h, generator=g).to(dtype).to(device)
    grad_rows = torch.randn(t * k, h, generator=g).to(dtype).to(device)
    return plan, rows, weights, grad_out, grad_rows


def _compare(t, k, h, dtype, device):
    plan, rows, weights, grad_out, grad_rows = _problem(t, k, h, 8, dtype, device)
    slots = plan.row_of_slot
    bad = []
    torch_out = moe.combine_torch(rows, weights, slots)
    if not torch.equal(kernels.combine(rows, weights, slots).view(torch.int8), torch_out.view(torch.int8)):
        bad.append("combine")
    ref_rows, ref_w = moe.combine_backward_torch(grad_out, rows, weights, slots)
    got_rows, got_w = kernels.combine_backward(grad_out, rows, weights, slots)
    if not torch.equal(got_rows.view(torch.int8), ref_rows.view(torch.int8)):
        bad.append("combine_backward.grad_rows")
    if not torch.equal(got_w.view(torch.int8), ref_w.view(torch.int8)):
        bad.append("combine_backward.grad_weights")
    ref_x = moe.permute_backward_torch(grad_rows, slots)
    if not torch.equal(kernels.permute_backward(grad_rows, slots).view(torch.int8), ref_x.view(torch.int8)):
        bad.append("permute_backward")
    return bad


# H = 48: not a power of two (the tree pads with zeros); 64 and 2 slots; 3 tokens of 8 slots
@pytest.mark.parametrize("t,k,h", [(5, 2, 48), (3, 8, 64), (4, 3, 33)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
def test_the_triton_combine_has_the_torch_bits(t, k, h, dtype):
    assert _compare(t, k, h, dtype, "cpu") == []


def test_strided_rows_give_the_contiguous_bits():
    # Expert outputs viewed out of a wider buffer: grad_rows must still land row by row.
    plan, rows, weights, grad_out, grad_rows = _problem(5, 3, 40, 8, torch.float32, "cpu")
    wide = torch.zeros(rows.shape[0], 56)
    wide[:, 8:48] = rows
    view = wide[:, 8:48]
    slots = plan.row_of_slot
    assert torch.equal(kernels.combine(view, weights, slots), kernels.combine(rows, weights, slots))
    for got, want in zip(kernels.combine_backward(grad_out, view, weights, slots),
                         kernels.combine_backward(grad_out, rows, weights, slots), strict=True):
        assert torch.equal(got, want)


def test_the_comparison_catches_a_reordered_sum(monkeypatch):
    # Planted: the tree summed in the other direction (lower half onto the upper): bits differ.
    def reversed_tree(x):
        return x.flip(-1).cumsum(-1)[..., -1]

    monkeypatch.setattr(moe, "tree_sum", reversed_tree)
    assert "combine_backward.grad_weights" in _compare(6, 4, 40, torch.float32, "cpu")


@pytest.mark.gpu
@pytest.mark.parametrize("t,k,h", [(4096, 8, 2048), (7, 8, 1000)])
def test_the_triton_combine_has_the_torch_bits_on_cuda(t, k, h):
    assert _compare(t, k, h, torch.bfloat16, "cuda") == []


def _router_problem(t, e, k, dtype, device, seed=0):
    g = torch.Generator().manual_seed(seed)
    # Integer-valued logits in a narrow range: many exact ties, which the top-k breaks to the lower expert.
    logits = torch.randint(-3, 4, (t, e), generator=g).float().add(torch.rand(t, e, generator=g).round())
    grad = torch.randn(t, k, generator=g)  # the weights' gradient, in their (the logits') dtype
    grad[0, 0] = -0.0  # a signed zero must reach the scatter as is
    return logits.to(dtype).to(device), grad.to(dtype).to(device)


def _compare_router(t, e, k, norm, dtype, device):
    logits, grad = _router_problem(t, e, k, dtype, device)
    names = ("weights", "experts", "probs", "picked")
    want = moe.route_torch(logits, k, norm)
    got = kernels.route(logits, k, norm)
    # Bits, not values: torch.equal would let -0.0 pass for +0.0.
    bits = (lambda x: x.contiguous().view(torch.int8) if x.is_floating_point() else x)  # noqa: E731
    bad = [n for n, a, b in zip(names, got, want, strict=True)
           if a.dtype != b.dtype or a.shape != b.shape or not torch.equal(bits(a), bits(b))]
    ref = moe.route_backward_torch(grad, want[2], want[1], want[3], norm, dtype)
    dl = kernels.route_backward(grad, got[2], got[1], got[3], norm, dtype)
    if dl.dtype != ref.dtype or not torch.equal(dl.view(torch.int8), ref.view(torch.int8)):
        bad.append("dlogits")
    return bad


def _numpy_exp(x):
    # The interpreter's exp is numpy's; torch's CPU exp differs from it in the last bit, so the torch form
    # runs with numpy's here (on CUDA both are libdevice's expf, compared as they are).
    return torch.from_numpy(np.exp(x.cpu().numpy())).to(x.device)


# E = 6 and 40: padded to 64 lanes; 128: Qwen3-30B-A3B; k = 3: the tree pads the slots with a zero.
@pytest.mark.parametrize("t,e,k,norm", [(6, 8, 2, True), (4, 128, 8, True), (5, 6, 3, False), (3, 40, 3, True)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
def test_the_triton_router_has_the_torch_bits(monkeypatch, t, e, k, norm, dtype):
    monkeypatch.setattr(torch, "exp", _numpy_exp)
    assert _compare_router(t, e, k, norm, dtype, "cpu") == []


def test_the_router_comparison_catches_a_tie_broken_upwards(monkeypatch):
    # Planted: among equal probabilities the higher expert first (an unstable descending order).
    monkeypatch.setattr(torch, "exp", _numpy_exp)
    real_sort = torch.sort

    def upward_ties(x, dim=-1, descending=False, stable=False):
        flipped = real_sort(x.flip(dim), dim=dim, descending=descending, stable=True)
        return torch.return_types.sort((flipped.values, x.shape[dim] - 1 - flipped.indices))

    monkeypatch.setattr(torch, "sort", upward_ties)
    assert "experts" in _compare_router(6, 8, 2, True, torch.float32, "cpu")


def test_the_router_comparison_catches_a_reordered_sum(monkeypatch):
    monkeypatch.setattr(torch, "exp", _numpy_exp)
    monkeypatch.setattr(moe, "tree_sum", lambda x: x.flip(-1).cumsum(-1)[..., -1])
    assert "probs" in _compare_router(4, 128, 8, True, torch.float32, "cpu")


@pytest.mark.gpu
@pytest.mark.parametrize("t,e,k", [(4096, 128, 8), (7, 6, 3)])
def test_the_triton_router_has_the_torch_bits_on_cuda(t, e, k):
    for norm in (True, False):
        assert _compare_router(t, e, k, norm, torch.bfloat16, "cuda") == []
