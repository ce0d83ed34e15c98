"""Strict-fp32 building blocks: accuracy of the pinned exp/log/sigmoid, and the pinned orders."""

import numpy as np
import pytest
import torch

from rl_engine.mhc import numerics as nm


def ulp_error(got32: torch.Tensor, ref64: torch.Tensor) -> float:
    """max |got − ref| in units of the fp32 ulp at ref (the spacing above |ref| rounded to fp32)."""
    r32 = ref64.float().abs()
    ulp = (torch.nextafter(r32, torch.tensor(float("inf"))) - r32).double()
    return float(((got32.double() - ref64).abs() / ulp).max())


def test_exp_within_two_ulp_over_the_normal_range():
    x = torch.cat([torch.linspace(-86.9, 88.7, 1_000_001), torch.randn(200_000) * 5])
    assert ulp_error(nm.exp(x), torch.exp(x.double())) <= 2.0


def test_log_within_two_ulp_over_positive_floats_including_subnormals():
    x = torch.exp(torch.linspace(-103.0, 88.7, 1_000_001, dtype=torch.float64)).float()
    x = torch.cat([x[x > 0], torch.rand(100_000) * 2.0])
    x = x[x > 0]
    assert ulp_error(nm.log(x), torch.log(x.double())) <= 2.0


def test_sigmoid_within_two_ulp():
    x = torch.cat([torch.linspace(-86.0, 86.0, 1_000_001), torch.randn(200_000) * 4])
    assert ulp_error(nm.sigmoid(x), torch.sigmoid(x.double())) <= 2.0


def test_special_values():
    inf, nan = float("inf"), float("nan")
    e = nm.exp(torch.tensor([nan, inf, -inf, 0.0, -200.0, 200.0]))
    assert torch.isnan(e[0]) and e[1] == inf and e[2] == 0 and e[3] == 1 and e[4] == 0 and e[5] == inf
    assert nm.exp(torch.tensor([88.7])).isfinite().all()  # n = 128 scaled in two steps
    lg = nm.log(torch.tensor([nan, inf, 0.0, -1.0, 1.0]))
    assert torch.isnan(lg[0]) and lg[1] == inf and lg[2] == -inf and torch.isnan(lg[3]) and lg[4] == 0
    s = nm.sigmoid(torch.tensor([-inf, inf, 0.0, 100.0, -100.0]))
    assert s.tolist() == [0.0, 1.0, 0.5, 1.0, 0.0]


def test_sqrt_is_correctly_rounded():
    x = torch.rand(200_000) * 1e4
    r = nm.sqrt_rn(x).double()
    for nb in (torch.nextafter(r.float(), torch.tensor(0.0)).double(),
               torch.nextafter(r.float(), torch.tensor(1e9)).double()):
        assert bool(((r * r - x.double()).abs() <= (nb * nb - x.double()).abs()).all())


def serial_lane_sum(values: np.ndarray, lanes: int) -> np.float32:
    """The documented order, written as plain scalar float32 loops."""
    acc = [np.float32(0.0)] * lanes
    for i, v in enumerate(values):
        acc[i % lanes] = np.float32(acc[i % lanes] + np.float32(v))
    while len(acc) > 1:
        acc = [np.float32(acc[i] + acc[i + 1]) for i in range(0, len(acc), 2)]
    return acc[0]


@pytest.mark.parametrize("n,lanes", [(1, 64), (7, 4), (24, 64), (100, 8), (96, 64), (512, 64)])
def test_lane_sum_follows_the_documented_order(n, lanes):
    g = torch.Generator().manual_seed(n)
    x = torch.randn(3, n, generator=g) * torch.logspace(-3, 3, n)  # wide magnitudes: order matters
    got = nm.lane_sum(x, lanes)
    want = [serial_lane_sum(row.numpy(), lanes) for row in x]
    assert got.numpy().tobytes() == np.array(want, dtype=np.float32).tobytes()
    # along another axis, the same bytes
    assert torch.equal(nm.lane_sum(x.t().contiguous(), lanes, dim=0), got)


def test_lane_sum_differs_from_a_serial_fold():
    # 1 followed by 4095 halves of an ulp: a serial fold rounds every add back to 1 (ties to even),
    # while 63 of the 64 lanes collect their small terms first and the tree adds them up.
    x = torch.full((1, 4096), 2.0**-24)
    x[0, 0] = 1.0
    assert nm.lane_sum(x, 1).item() == 1.0
    assert nm.lane_sum(x, 64).item() == 1.0 + 63 * 2.0**-18


def test_lane_sum_of_negative_zeros_is_positive_zero():
    s = nm.lane_sum(torch.full((1, 5), -0.0), 4)
    assert s.item() == 0.0 and not torch.signbit(s).item()


def test_tree4_and_softmax4_orders():
    a = torch.tensor([1e8]), torch.tensor([1.0]), torch.tensor([-1e8]), torch.tensor([1.0])
    f = np.float32
    want = (f(1e8) + f(1.0)) + (f(-1e8) + f(1.0))  # 0 in fp32; a left fold would give 1
    assert nm.tree4(*a).item() == want == 0.0
    p = nm.softmax4(torch.tensor([[1000.0, 0.0, -1000.0, 999.0]]))
    assert torch.isfinite(p).all() and abs(float(p.sum()) - 1.0) < 1e-6


def test_scalar_division_is_a_true_division():
    x = torch.rand(100_000) + 1.0
    assert torch.equal(nm.div(x, 3.0), x / torch.full_like(x, 3.0))


def test_lanes_must_be_power_of_two():
    with pytest.raises(ValueError, match="power of two"):
        nm.lane_sum(torch.ones(4), 3)
