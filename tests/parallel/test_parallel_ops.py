"""The parallel ops on one process (TP = 1, no process group): the single-GPU ops, the mHC lane groups, the checker."""

from __future__ import annotations

import pytest
import torch

from rl_engine.checks.tp_invariance.harness import compare_runs
from rl_engine.mhc.contract import LayerContract
from rl_engine.mhc.numerics import lane_sum
from rl_engine.parallel import ShardLayout, tree_reduce
from rl_engine.parallel.mhc_placements import cp_token_sharded_site, sharded_lane_sum
from rl_engine.parallel.tp_kernels import (
    column_parallel_matmul,
    row_parallel_matmul,
    vocab_parallel_embedding,
    vocab_parallel_linear_logp,
)

gen = torch.Generator().manual_seed(0)


def rand(*shape, dtype=torch.float64):
    return torch.randn(*shape, generator=gen, dtype=dtype)


def test_without_a_process_group_the_parallel_ops_are_the_single_gpu_ops():
    from rl_engine.kernels.ops.triton.linear.matmul import batch_invariant_mm
    from rl_engine.kernels.ops.triton.loss.linear_logp import linear_logp

    x, w = rand(5, 32, dtype=torch.float32).bfloat16(), (rand(16, 32, dtype=torch.float32) / 6).bfloat16()
    assert torch.equal(row_parallel_matmul(x, w), batch_invariant_mm(x, w.t()))
    assert torch.equal(column_parallel_matmul(x, w), batch_invariant_mm(x, w.t()))
    h, targets = x[None], torch.randint(0, 16, (1, 5), generator=gen)
    assert torch.equal(vocab_parallel_linear_logp(h, w, targets), linear_logp(h, w, targets))
    assert torch.equal(vocab_parallel_embedding(targets, w), w[targets])


def test_linear_logp_continued_over_vocabulary_runs_matches_float64_autograd():
    h, w = rand(1, 5, 32), rand(64, 32) / 6
    targets, g = torch.randint(0, 64, (1, 5), generator=gen), rand(1, 5)
    ours = [t.float().requires_grad_() for t in (h, w)]
    (vocab_parallel_linear_logp(ours[0], ours[1], targets) * g.float()).sum().backward()
    ref = [t.clone().requires_grad_() for t in (h, w)]
    logp = (ref[0] @ ref[1].t()).log_softmax(-1).gather(-1, targets[..., None]).squeeze(-1)
    (logp * g).sum().backward()
    for a, r in zip(ours, ref):
        torch.testing.assert_close(a.grad.double(), r.grad, atol=1e-5, rtol=0)


def test_tree_reduce_needs_a_power_of_two():
    with pytest.raises(ValueError, match="power-of-two"):
        tree_reduce([1, 2, 3], lambda a, b: a + b)


@pytest.mark.parametrize("n", [1, 7, 16, 63, 64, 65, 200])
def test_lane_group_partials_rebuild_the_oracles_lane_sum(n):
    x = rand(n, 3, dtype=torch.float32)
    ours = sharded_lane_sum(x, n, 64, ShardLayout.from_group(), dim=0)
    assert torch.equal(ours.view(torch.int32), lane_sum(x, 64, dim=0).view(torch.int32))


def test_lane_group_split_needs_at_least_four_lanes():
    with pytest.raises(ValueError, match="lanes"):
        sharded_lane_sum(torch.zeros(4), 4, 2, ShardLayout.from_group(), dim=0)


def test_cp_token_sharded_rejects_a_batch_that_is_not_this_ranks_tokens():
    from rl_engine.mhc.fixtures import Case, build_inputs

    contract, batch, controller, norm = build_inputs(Case("t", tokens=8, hidden=8, seed=1))
    with pytest.raises(ValueError, match="batch_local"):
        cp_token_sharded_site(batch, 9, controller, norm, contract)
    assert isinstance(contract, LayerContract)


def _runs(value: torch.Tensor, rank1_value: torch.Tensor) -> dict:
    return {"1": [{"y": value}], "2": [{"y": value}, {"y": rank1_value}]}


def test_checker_flags_a_one_ulp_change_on_one_rank():
    y = torch.tensor([1.0, -2.5, 3.0e-3])
    nudged = y.clone()
    nudged[1] = torch.nextafter(nudged[1], torch.tensor(0.0))
    report = compare_runs(_runs(y, nudged))
    v = report["results"]["y"]["2"]
    assert not report["passed"] and not v["ranks_agree"] and not v["bitwise_equal_to_tp1"]
    assert v["max_abs_diff_to_tp1"] == pytest.approx(2.0**-22)
    assert compare_runs(_runs(y, y.clone()))["passed"]


def test_checker_tells_signed_zeros_and_nan_payloads_apart():
    zero = torch.tensor([0.0])
    assert not compare_runs(_runs(zero, -zero))["passed"]
    nan = torch.tensor([float("nan")])
    assert compare_runs(_runs(nan, nan.clone()))["passed"]
