"""Operator declarations, candidate loading, and the pytorch smoke candidate passing every op."""

import dataclasses

import pytest
import torch

from rl_engine.checks.operators.op_checks import CandidateSpec, run_operator_suite
from rl_engine.checks.operators.operator_specs import make_candidate, make_operator_case, operator_names
from rl_engine.errors import UsageError
from rl_engine.kernels import records
from rl_engine.kernels.records import GOLD_PACKAGE, OPS

ALL_OPS = operator_names()
DTYPES = ["fp32", "bf16", "fp16"]
# Gold ops without a matmul or einsum: plain PyTorch on a CPU computes each row the same way at any
# batch size, provided every row holds a whole number of vector registers (the default dims keep row
# sizes multiples of 64; x * sigmoid(x) on rows of 24 floats differs in its scalar tail). Golds built
# on BLAS need not be batch invariant (seen: kv_cache_attention's fp32 q gradient differs by 45 ulp
# between B=2 and B=1); the row-by-row control below covers the invariance check for those.
ROW_LOCAL_GOLDS = ["logp", "rms_norm", "silu", "swiglu", "rope", "embedding"]


def test_declarations_cover_every_op_with_gold_in_the_pytorch_package():
    assert len(ALL_OPS) == 13
    for spec in OPS.values():
        assert spec.gold_path.startswith(GOLD_PACKAGE + ".")
        assert spec.candidate_paths["pytorch"] == spec.gold_path
        assert spec.candidate_paths["triton"].startswith("rl_engine.kernels.ops.triton.")
        assert set(spec.batch_input_names)  # grad_input_names may be empty: a forward-only op


def test_unknown_op_and_candidate_list_the_valid_names():
    with pytest.raises(UsageError, match="valid ops: logp, linear_logp"):
        make_candidate("conv", "pytorch")
    with pytest.raises(UsageError, match="valid candidates: pytorch, triton"):
        make_candidate("logp", "cuda")
    with pytest.raises(UsageError, match="valid ops"):
        make_operator_case("conv")


def test_a_candidate_module_that_does_not_import_is_a_one_line_usage_error(monkeypatch):
    spec = dataclasses.replace(OPS["silu"], module="nowhere.silu")
    monkeypatch.setitem(records.OPS, "silu", spec)
    with pytest.raises(UsageError) as info:
        make_candidate("silu", "triton")
    message = str(info.value)
    assert "\n" not in message and "ModuleNotFoundError" in message
    assert "rl_engine.kernels.ops.triton.nowhere" in message


def test_constructor_dims_reach_the_op():
    from rl_engine.checks.operators.operator_inputs import OperatorDims

    cand = make_candidate("rms_norm", "pytorch", dims=OperatorDims(eps=0.25))
    assert cand.fn.eps == 0.25 and cand.name == "pytorch-rms_norm"
    assert make_operator_case("rope", dims=OperatorDims(theta=500.0)).gold_fn.theta == 500.0


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("op", ALL_OPS)
def test_pytorch_candidate_passes_forward_and_gradient(op, dtype):
    case = make_operator_case(op, dtype=dtype)
    check_invariance = op in ROW_LOCAL_GOLDS
    check_grad = bool(OPS[op].grad_input_names)
    report = run_operator_suite(op, candidates=[make_candidate(op, "pytorch")], cases=[case], check_grad=check_grad,
                                check_invariance=check_invariance)
    assert report.passed, report.to_text()
    judgments = {o.judgment for o in report.candidates[0].outputs}
    assert {"forward_accuracy", "gradient_accuracy"} <= judgments if check_grad else "forward_accuracy" in judgments
    if check_invariance:
        assert "forward_invariance" in judgments


def _row_by_row(fn, batched):
    """The gold run one batch row at a time: batch invariant by construction, the invariance check's control."""
    def run(**inputs):
        batch = inputs[batched[0]].shape[0]
        rows = [fn(**{k: (v[b:b + 1] if k in batched else v) for k, v in inputs.items()}) for b in range(batch)]
        return torch.cat(rows, dim=0)
    return run


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("op", ALL_OPS)
def test_a_row_by_row_candidate_passes_invariance_for_every_op(op, dtype):
    case = make_operator_case(op, dtype=dtype)
    candidate = CandidateSpec("rows", _row_by_row(make_candidate(op, "pytorch").fn, case.batch_input_names), "test")
    report = run_operator_suite(op, candidates=[candidate], cases=[case], check_grad=bool(case.grad_input_names),
                                check_invariance=True)
    invariance = [o for o in report.candidates[0].outputs if "invariance" in o.judgment]
    assert invariance and all(o.passed for o in invariance), report.to_text()
