import math

import pytest
import torch

from rl_engine.checks.forward_invariance.parity import ParityError, bitwise_parity, parity_aggregates


def test_aggregates_pin_the_sign_of_delta():
    # Δ = train − infer = +0.1 on one token, −0.3 on another.
    train = torch.tensor([-1.0, -2.0])
    infer = torch.tensor([-1.1, -1.7])
    agg = parity_aggregates(train, infer)
    d = (torch.tensor([-1.0, -2.0]) - torch.tensor([-1.1, -1.7])).double()
    assert agg["max_abs_dlogp"] == pytest.approx(0.3, rel=1e-6)
    assert agg["mean_abs_dlogp"] == pytest.approx(0.2, rel=1e-6)
    assert agg["k3_kl"] == pytest.approx(float((d.exp() - 1 - d).mean()), rel=1e-12)
    assert agg["clipfrac"] == 0.5  # exp(-0.3) = 0.74 is outside [0.8, 1.2]
    # The same tokens with Δ flipped (infer − train) give another k3: a sign flip cannot hide.
    flipped = parity_aggregates(infer, train)
    assert flipped["k3_kl"] != pytest.approx(agg["k3_kl"], rel=1e-3)
    assert agg["k3_kl"] == pytest.approx(((math.exp(0.1) - 1.1) + (math.exp(-0.3) - 0.7)) / 2, rel=1e-5)
    assert not bitwise_parity(agg)


def test_bitwise_parity_needs_exact_zero():
    x = torch.tensor([-1.5, -0.25])
    assert bitwise_parity(parity_aggregates(x, x.clone()))
    one_ulp = torch.nextafter(x, torch.zeros_like(x))
    assert not bitwise_parity(parity_aggregates(x, one_ulp))


@pytest.mark.parametrize(
    "train, infer, message",
    [
        (torch.tensor([]), torch.tensor([]), "no active tokens"),
        (torch.tensor([float("nan")]), torch.tensor([0.0]), "non-finite"),
        (torch.tensor([0.0]), torch.tensor([float("inf")]), "non-finite"),
        (torch.zeros(2), torch.zeros(3), "equal 1-D shapes"),
    ],
)
def test_unjudgeable_inputs_fail(train, infer, message):
    with pytest.raises(ParityError, match=message):
        parity_aggregates(train, infer)


def test_aggregates_are_the_trainer_metrics_on_an_all_active_mask():
    # One definition per formula: the harness and rl_engine.metrics report the same numbers.
    from rl_engine.metrics import PREFIX, rollout_corr_metrics

    g = torch.Generator().manual_seed(3)
    train = -torch.rand(40, generator=g) * 3
    infer = train + torch.randn(40, generator=g) * 0.2
    agg = parity_aggregates(train, infer)
    m = rollout_corr_metrics(train, infer, torch.ones(40, dtype=torch.bool))
    for k in ("max_abs_dlogp", "mean_abs_dlogp", "k3_kl", "clipfrac"):
        assert agg[k] == float(m[PREFIX + k]), k
    assert 0 < agg["clipfrac"] < 1
