"""Every Triton candidate through `rl-engine check-op`, as a user runs it: forward, gradients and
bitwise batch invariance against the gold, under the CPU interpreter at the harness's default dims
(the H200 runs of the same command at Qwen3-8B geometry are in docs/evidence/check_op_*.json)."""

import pytest
import torch

from rl_engine.checks.operators.operator_specs import get_spec, operator_names
from rl_engine.cli import main

pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="the GPU runs are the check_op_*.json reports")


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
@pytest.mark.parametrize("op", operator_names())
def test_check_op_passes_for_the_triton_candidate(op, dtype, capsys):
    argv = ["check-op", "--op", op, "--candidate", "triton", "--device", "cpu", "--dtype", dtype,
            "--check-invariance"]
    if get_spec(op).grad_input_names:  # forward-only ops declare none
        argv.append("--check-grad")
    code = main(argv)
    out = capsys.readouterr().out
    assert code == 0, out
    assert out.startswith(f"suite={op} passed=True pass_rate=1.0000")
    assert "backend=triton passed=True" in out.splitlines()[1]
