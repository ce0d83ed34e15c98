"""The parallel ops on one process (TP = 1, no process group): correctness, input errors, the checker."""

from __future__ import annotations

import pytest
import torch

from rl_engine.mhc.contract import LayerContract
from rl_engine.mhc.numerics import lane_sum
from rl_engine.parallel import (
    ShardLayout,
    column_parallel_linear,
    row_parallel_linear,
    tree_reduce,
    vocab_parallel_linear_logp,
    vocab_parallel_logp,
)
from rl_engine.parallel.invariance import compare_runs
from rl_engine.parallel.mhc_placements import cp_token_sharded_site, sharded_lane_sum

gen = torch.Generator().manual_seed(0)


def rand(*shape, dtype=torch.float64):
    return torch.randn(*shape, generator=gen, dtype=dtype)


def test_logp_forward_and_backward_match_float64_autograd():
    logits, targets, g = rand(2, 3, 16), torch.randint(0, 16, (2, 3), generator=gen), rand(2, 3)
    ours = logits.float().requires_grad_()
    (vocab_parallel_logp(ours, targets) * g.float()).sum().backward()
    ref = logits.clone().requires_grad_()
    logp = ref.log_softmax(-1).gather(-1, targets[..., None]).squeeze(-1)
    (logp * g).sum().backward()
    torch.testing.assert_close(vocab_parallel_logp(logits.float(), targets).double(), logp, atol=1e-5, rtol=0)
    torch.testing.assert_close(ours.grad.double(), ref.grad, atol=1e-5, rtol=0)


def test_linear_logp_forward_and_backward_match_float64_autograd():
    h, w, b = rand(2, 3, 8), rand(16, 8) / 3, rand(16) / 10
    targets, g = torch.randint(0, 16, (2, 3), generator=gen), rand(2, 3)
    ours = [t.float().requires_grad_() for t in (h, w, b)]
    (vocab_parallel_linear_logp(ours[0], ours[1], targets, bias=ours[2]) * g.float()).sum().backward()
    ref = [t.clone().requires_grad_() for t in (h, w, b)]
    logp = (ref[0] @ ref[1].t() + ref[2]).log_softmax(-1).gather(-1, targets[..., None]).squeeze(-1)
    (logp * g).sum().backward()
    for a, r in zip(ours, ref):
        torch.testing.assert_close(a.grad.double(), r.grad, atol=1e-5, rtol=0)


@pytest.mark.parametrize("kind", ["column", "row"])
def test_linear_layers_match_float64_autograd(kind):
    x, w, b, g = rand(5, 8), rand(12, 8) / 3, rand(12), rand(5, 12)
    ours = [t.float().requires_grad_() for t in (x, w, b)]
    layer = column_parallel_linear if kind == "column" else row_parallel_linear
    y = layer(*ours)
    (y * g.float()).sum().backward()
    ref = [t.clone().requires_grad_() for t in (x, w, b)]
    ((ref[0] @ ref[1].t() + ref[2]) * g).sum().backward()
    torch.testing.assert_close(y.double(), x @ w.t() + b, atol=1e-5, rtol=0)
    for a, r in zip(ours, ref):
        torch.testing.assert_close(a.grad.double(), r.grad, atol=1e-5, rtol=0)


def test_bf16_logits_give_fp32_logp_and_bf16_gradient():
    logits = rand(1, 2, 8, dtype=torch.float32).bfloat16().requires_grad_()
    logp = vocab_parallel_logp(logits, torch.tensor([[1, 7]]))
    logp.sum().backward()
    assert logp.dtype == torch.float32 and logits.grad.dtype == torch.bfloat16


def test_bad_inputs_raise_value_errors_naming_the_input():
    with pytest.raises(ValueError, match="logits: .*divisible by the 4 canonical"):
        vocab_parallel_logp(torch.zeros(1, 2, 30), torch.zeros(1, 2, dtype=torch.long))
    with pytest.raises(ValueError, match="target_ids"):
        vocab_parallel_logp(torch.zeros(1, 2, 32), torch.full((1, 2), 32))
    with pytest.raises(ValueError, match="lm_head_weight"):
        vocab_parallel_linear_logp(torch.zeros(1, 2, 8), torch.zeros(30, 8), torch.zeros(1, 2, dtype=torch.long))
    with pytest.raises(ValueError, match="weight: .*K_local"):
        row_parallel_linear(torch.zeros(3, 6), torch.zeros(4, 6))
    with pytest.raises(ValueError, match="weight"):
        column_parallel_linear(torch.zeros(3, 8), torch.zeros(4, 7))
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
