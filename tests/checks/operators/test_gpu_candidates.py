"""On the GPU: every Triton candidate against the gold, forward, backward and batch invariance."""

import dataclasses

import pytest
import torch

from rl_engine.checks.operators.op_checks import run_operator_suite
from rl_engine.checks.operators.operator_inputs import QWEN3_8B, OperatorDims
from rl_engine.checks.operators.operator_specs import make_candidate, make_operator_case, operator_names

pytestmark = pytest.mark.gpu

# Qwen3-8B geometry with a few tokens; the vocab kept at 32768 so the fp32 reference stays quick.
GEOMETRIES = {
    "small": OperatorDims(batch=3, seq=5),
    "qwen3-8b": dataclasses.replace(OperatorDims(), **{**QWEN3_8B, "vocab": 32768}, batch=2, seq=16),
}


@pytest.mark.parametrize("geometry", list(GEOMETRIES))
@pytest.mark.parametrize("dtype", ["fp32", "bf16", "fp16"])
@pytest.mark.parametrize("op", operator_names())
def test_triton_candidate_matches_the_gold(op, dtype, geometry):
    dims = GEOMETRIES[geometry]
    major, minor = torch.cuda.get_device_capability()
    candidate = make_candidate(op, "triton", dims=dims, arch_key=f"sm{major}{minor}")
    case = make_operator_case(op, dtype=dtype, device="cuda", dims=dims)
    # Our kv_cache_attention is an inference op: forward only.
    report = run_operator_suite(op, candidates=[candidate], cases=[case], check_grad=op != "kv_cache_attention",
                                check_invariance=True)
    assert report.passed, report.to_text()
