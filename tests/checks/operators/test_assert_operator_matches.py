"""rl_engine.checks.testing.assert_operator_matches: the harness inside a user's own test suite."""

import pytest
import torch

from rl_engine.checks.testing import assert_operator_matches


def silu(x):
    return x * torch.sigmoid(x)


def test_a_matching_candidate_passes_and_returns_the_report():
    report = assert_operator_matches("silu", silu, dtype=torch.float32, device="cpu", batch=3, seq=2, intermediate=32)
    assert report.passed and report.candidates[0].backend == "user"


def test_a_wrong_candidate_raises_with_the_report_text():
    with pytest.raises(AssertionError, match=r"suite=swiglu passed=False") as info:
        assert_operator_matches("swiglu", lambda gate, up: silu(up) * gate, dtype="bf16", device="cpu")
    assert "gradient:gate" in str(info.value)


def test_unknown_dims_are_rejected():
    with pytest.raises(ValueError, match="hidden"):
        assert_operator_matches("silu", silu, dtype="fp32", device="cpu", hidden=4)
