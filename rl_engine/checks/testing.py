"""Helpers for users' own test suites."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import torch

from rl_engine.checks.operators.op_checks import CandidateSpec, run_operator_suite
from rl_engine.checks.operators.operator_inputs import OperatorDims
from rl_engine.checks.operators.operator_specs import make_candidate, make_operator_case
from rl_engine.checks.operators.tolerance import load_contract


def assert_operator_matches(
    op: str,
    candidate_fn: Callable[..., Any] | str,
    *,
    dtype: str | torch.dtype,
    device: str | torch.device,
    check_grad: bool = True,
    check_invariance: bool = True,
    arch_key: str | None = None,
    contract: str | dict | None = None,
    seed: int = 0,
    input_mode: str = "random",
    grad_mode: str = "random",
    **dims: int,
):
    """Check `candidate_fn(**inputs)` against the gold of `op`; raise AssertionError with the report text.

    `candidate_fn` is a callable, or a path as `check-op --candidate` takes it ("pytorch", "triton",
    "module:attr"; a path that will not load raises UsageError).

    `dims` are OperatorDims fields (batch, seq, vocab, normalized_dim, ...); `contract` is a path or a
    contract dict (default: the packaged contract). Returns the report when the candidate passes.
    """
    unknown = set(dims) - {f.name for f in dataclasses.fields(OperatorDims)}
    if unknown:
        raise ValueError(f"dims: unknown {sorted(unknown)}; expected OperatorDims fields")
    if contract is None or not isinstance(contract, dict):
        contract = load_contract(contract)
    dims = OperatorDims(**dims)
    case = make_operator_case(op, dtype=dtype, device=device, dims=dims, input_mode=input_mode, seed=seed)
    if isinstance(candidate_fn, str):
        candidate = make_candidate(op, candidate_fn, dims=dims, arch_key=arch_key)
    else:
        candidate = CandidateSpec(name=getattr(candidate_fn, "__name__", type(candidate_fn).__name__),
                                  fn=candidate_fn, backend="user", arch_key=arch_key)
    report = run_operator_suite(op, candidates=[candidate], cases=[case], contract=contract, check_grad=check_grad,
                                grad_mode=grad_mode, check_invariance=check_invariance, seed=seed)
    if not report.passed:
        raise AssertionError(report.to_text())
    return report


def assert_never_quieter(name: str, got, ref) -> None:
    """A candidate never hides a non-finite value: every NaN/inf of the gold `ref` is NaN/inf in `got` (an inf may
    come out NaN), and no inf changes sign. `got` may be non-finite where the gold is finite (louder, e.g. the
    0·NaN spread inside an attention key block that flash.py documents); compare the finite rest separately."""
    got = got.float()
    hidden = (~torch.isfinite(ref) & torch.isfinite(got)).nonzero().tolist()
    assert not hidden, f"{name}: non-finite gold turned finite at {hidden[:5]} ({len(hidden)} in all)"
    wrong_inf = ((torch.isposinf(ref) & torch.isneginf(got)) | (torch.isneginf(ref) & torch.isposinf(got))).nonzero()
    assert not len(wrong_inf), f"{name}: inf of the wrong sign at {wrong_inf.tolist()[:5]}"
