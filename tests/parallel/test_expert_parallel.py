"""EP = 1, 2, 4 on gloo, one launch of 4 CPU processes: the MoE block's outputs, input gradients and
expert weight gradients are bit for bit those of one rank (triton_bf16 profile, CPU interpreter)."""

from __future__ import annotations

import pytest
import torch

from rl_engine.parallel.expert_parallel import EpSizes, compare_ep, expert_range, run_ep_sizes, token_slice
from rl_engine.parallel.launch import spawn_group

SIZES = EpSizes()


@pytest.fixture(scope="module")
def ranks():
    return spawn_group(run_ep_sizes, 4, backend="gloo", device="cpu", args=(SIZES, (1, 2, 4)))


def test_ep_1_2_4_give_the_same_bits(ranks):
    assert compare_ep(ranks, SIZES) == {"1": [], "2": [], "4": []}
    assert [sorted(r) for r in ranks] == [["1", "2", "4"], ["2", "4"], ["4"], ["4"]]
    one = ranks[0]["1"]
    # Every expert served some token (each EP rank had work), and the slices covered every token.
    assert all(one[f"grad_expert.{e}.down"].abs().sum() > 0 for e in range(SIZES.experts))
    assert [r["4"]["tokens"] for r in ranks] == [[0, 3], [3, 6], [6, 8], [8, 10]]


def test_the_comparison_catches_one_ulp(ranks):
    """Planted: one bf16 ulp in one token of EP = 4 rank 2's output, and in rank 3's expert gradient."""
    planted = [{ep: dict(r) for ep, r in rank.items()} for rank in ranks]
    out = planted[2]["4"]["out"].clone()
    out.view(torch.int16)[1, 0] += 1
    planted[2]["4"]["out"] = out
    grad = planted[3]["4"]["grad_expert.3.up"].clone()
    grad.view(torch.int16)[0, 0] ^= 1
    planted[3]["4"]["grad_expert.3.up"] = grad
    assert compare_ep(planted, SIZES) == {"1": [], "2": [], "4": ["grad_expert.3.up", "out"]}


def test_expert_and_token_split():
    assert list(expert_range(128, 4, 1)) == list(range(32, 64))
    with pytest.raises(ValueError, match="does not divide"):
        expert_range(6, 4, 0)
    assert [token_slice(10, 4, r) for r in range(4)] == [slice(0, 3), slice(3, 6), slice(6, 8), slice(8, 10)]


@pytest.mark.gpu
def test_ep_on_nccl_as_many_ranks_as_gpus():
    """The same check through NCCL: EP = 1, 2 on two GPUs; on one GPU, EP = 1 on a one-rank group (the
    GPU gate admits no skips). Passed with two H200s on 2026-11-30 (docs/evidence/gpu_gate_db2f2c1_2gpus.log)."""
    launch = 2 if torch.cuda.device_count() >= 2 else 1
    ep_sizes = (1, 2)[:launch]
    ranks = spawn_group(run_ep_sizes, launch, backend="nccl", device="cuda", args=(SIZES, ep_sizes))
    assert compare_ep(ranks, SIZES) == {str(ep): [] for ep in ep_sizes}
