"""The shared bit comparison: what 'bitwise' and 'ulp' mean in every report."""

import pytest
import torch

from rl_engine.bits import bit_mismatch, bitwise_equal, dtype_key, ordered_bits
from rl_engine.environment import environment


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_ulp_distance_counts_representable_steps_across_zero(dtype):
    x = torch.tensor([1.0, -1.0, 0.0], dtype=dtype)
    up = torch.nextafter(x.float(), torch.tensor(2.0)).to(dtype) if dtype == torch.float32 else None
    if up is not None:
        assert bit_mismatch(up, x) == (3, 1)
    ints = {4: torch.int32, 2: torch.int16}[x.element_size()]
    smallest = torch.ones(1, dtype=ints).view(dtype)  # the smallest subnormal
    # +0.0 and -0.0 are the same point of the ordering (0 ulp) but different bits: still a mismatch.
    assert bit_mismatch(torch.tensor([0.0], dtype=dtype), torch.tensor([-0.0], dtype=dtype)) == (1, 0)
    assert bit_mismatch(smallest, -smallest)[1] == 2
    assert int(ordered_bits(smallest) - ordered_bits(torch.zeros(1, dtype=dtype))) > 0


def test_bitwise_equal_is_about_bits_shape_and_dtype():
    nan = torch.tensor([float("nan")])
    assert bitwise_equal(nan, nan.clone())  # the same NaN pattern is equal bits (torch.equal says no)
    assert not bitwise_equal(torch.tensor([0.0]), torch.tensor([-0.0]))
    assert not bitwise_equal(torch.zeros(2), torch.zeros(2, dtype=torch.float64))
    assert not bitwise_equal(torch.zeros(2), torch.zeros(1, 2))


def test_integers_compare_by_value():
    assert bit_mismatch(torch.tensor([1, 5]), torch.tensor([1, 2])) == (1, 3)


def test_one_dtype_spelling():
    assert [dtype_key(d) for d in (torch.float32, torch.bfloat16, torch.float16, torch.float64, torch.int32)] == [
        "fp32", "bf16", "fp16", "fp64", "int32"]
    with pytest.raises(ValueError, match="expected one of fp32, bf16, fp16"):
        dtype_key("float32")


def test_environment_names_what_ran():
    env = environment("cpu")
    assert {"date", "python", "torch", "triton", "numpy", "cuda", "device", "device_name"} <= set(env)
    assert env["device"] == "cpu"
