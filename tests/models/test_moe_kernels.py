"""The MoE combine and permute backward in Triton give the bits of their torch form (rl_engine.models.moe),
on the CPU interpreter here and on CUDA in the GPU gate: forward, grad_rows, grad_weights, grad_x."""

from __future__ import annotations

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
