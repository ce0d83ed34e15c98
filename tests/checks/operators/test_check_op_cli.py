"""The check-op command: report format, JSON, --list, and exit codes 0 / 1 / 2."""

import dataclasses
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from rl_engine import cli
from rl_engine.checks.operators.tolerance import load_contract
from rl_engine.kernels import records
from rl_engine.kernels.records import OPS

ROOT = Path(__file__).resolve().parents[3]
FIRST_LINE = re.compile(r"^suite=(\w+) passed=(True|False) pass_rate=(\d\.\d{4})$")
SMALL = ["--device", "cpu", "--batch", "2", "--seq", "2", "--vocab", "17"]


def check_op(capsys, *args):
    code = cli.main(["check-op", *args])
    out, err = capsys.readouterr()
    return code, out, err


def test_the_seeds_smoke_command_passes(capsys):
    code, out, err = check_op(capsys, "--op", "logp", "--candidate", "pytorch", "--device", "cpu", "--dtype", "fp32",
                              "--batch", "1", "--seq", "2", "--vocab", "17")
    assert code == 0 and not err
    lines = out.splitlines()
    assert FIRST_LINE.match(lines[0]).groups() == ("logp", "True", "1.0000")
    assert lines[1] == "candidate=pytorch-logp backend=pytorch passed=True pass_rate=1.0000"
    assert lines[2].startswith("  case=logp-fp32-1x2x17 output=0 role=output judgment=forward_accuracy shape=(1, 2)")


@pytest.mark.parametrize("op", list(OPS))
def test_grad_invariance_and_json_work_for_every_op(capsys, op):
    has_backward = bool(OPS[op].grad_input_names)
    grad = ["--check-grad"] if has_backward else []
    code, out, _ = check_op(capsys, "--op", op, "--dtype", "bf16", *grad, "--check-invariance", "--json", *SMALL)
    report = json.loads(out)
    assert report["suite"] == op and report["contract_fingerprint"].startswith("sha256:")
    assert {"seed", "torch", "triton", "device", "candidates"} <= set(report)
    roles = {(o["judgment"], o["role"]) for o in report["candidates"][0]["outputs"]}
    assert ("forward_accuracy", "output") in roles and ("forward_invariance", "output") in roles
    assert any(j == "gradient_accuracy" for j, _ in roles) == has_backward
    assert code == (0 if report["passed"] else 1)


def test_kv_cache_attention_is_declared_forward_only():
    assert OPS["kv_cache_attention"].grad_input_names == ()
    assert all(spec.grad_input_names for name, spec in OPS.items() if name != "kv_cache_attention")


def test_check_grad_is_refused_by_the_spec_not_by_the_name(capsys, monkeypatch):
    # silu has a backward; declared forward-only, --check-grad must be refused for it too.
    monkeypatch.setitem(records.OPS, "silu", dataclasses.replace(OPS["silu"], grad_input_names=()))
    code, out, err = check_op(capsys, "--op", "silu", "--check-grad", *SMALL)
    assert code == 2 and not out and err.strip().endswith("silu has no backward (an inference op); drop --check-grad")


def test_the_harness_refuses_check_grad_on_a_forward_only_case():
    from rl_engine.checks.operators.op_checks import run_operator_suite
    from rl_engine.checks.operators.operator_specs import make_candidate, make_operator_case

    case = make_operator_case("kv_cache_attention")
    with pytest.raises(ValueError, match="no gradient inputs"):
        run_operator_suite("kv_cache_attention", candidates=[make_candidate("kv_cache_attention", "pytorch")],
                           cases=[case], check_grad=True)


def test_a_known_arch_key_selects_its_rows(capsys):
    code, out, err = check_op(capsys, "--op", "matmul", "--arch-key", "sm90", "--json", *SMALL)
    report = json.loads(out)
    assert code == 0 and not err and report["candidates"][0]["arch_key"] == "sm90"
    assert {o["tolerance"]["arch_key"] for o in report["candidates"][0]["outputs"]} == {"sm90"}


def test_a_failing_candidate_exits_1(capsys, monkeypatch):
    module = type(sys)("planted_candidates")
    module.scaled = lambda x: torch.nn.functional.silu(x.float()) * 2
    monkeypatch.setitem(sys.modules, "planted_candidates", module)
    code, out, _ = check_op(capsys, "--op", "silu", "--candidate", "planted_candidates:scaled", *SMALL)
    assert code == 1 and FIRST_LINE.match(out.splitlines()[0]).group(2) == "False"


def test_json_out_writes_the_report(capsys, tmp_path):
    path = tmp_path / "evidence" / "silu.json"
    code, out, _ = check_op(capsys, "--op", "silu", "--json-out", str(path), *SMALL)
    assert code == 0 and FIRST_LINE.match(out.splitlines()[0])
    assert json.loads(path.read_text())["suite"] == "silu"


def test_list_names_every_op(capsys):
    code, out, _ = check_op(capsys, "--list")
    assert code == 0 and [line.split()[0] for line in out.splitlines()] == list(OPS)


def _bad_contract(tmp_path):
    contract = load_contract()
    contract["rows"][0]["mode"] = "roughly"
    path = tmp_path / "contract.json"
    path.write_text(json.dumps(contract))
    return str(path)


USAGE_ERRORS = {
    "unknown op": (["--op", "conv"], "valid ops: logp"),
    "unknown candidate": (["--op", "logp", "--candidate", "cuda"], "valid candidates: pytorch, triton"),
    "missing op": ([], "--op is required"),
    "non-positive size": (["--op", "logp", "--seq", "0"], "--seq: expected a positive integer"),
    "unsupported dtype": (["--op", "logp", "--dtype", "fp8"], "unsupported dtype 'fp8'"),
    "bad input mode": (["--op", "logp", "--input-mode", "zeros"], "--input-mode"),
    "bad grad mode": (["--op", "logp", "--grad-mode", "twos"], "--grad-mode"),
    "unreadable contract": (["--op", "logp", "--contract", "/nonexistent/contract.json"], "cannot read"),
    "invalid contract": (["--op", "logp", "--contract", "BAD"], "rows[0].mode"),
    "check-grad on a forward-only op": (["--op", "kv_cache_attention", "--candidate", "triton", "--check-grad"],
                                        "kv_cache_attention has no backward (an inference op); drop --check-grad"),
    "unknown arch key": (["--op", "logp", "--arch-key", "sm80"],
                         "--arch-key: the contract has no rows for 'sm80'; known keys: sm90 (leave the flag out"),
}


@pytest.mark.parametrize("name", list(USAGE_ERRORS))
def test_usage_errors_exit_2_with_one_line(capsys, tmp_path, name):
    args, expected = USAGE_ERRORS[name]
    args = [_bad_contract(tmp_path) if a == "BAD" else a for a in args]
    code, out, err = check_op(capsys, *args, "--device", "cpu")
    assert code == 2 and not out
    assert len(err.strip().splitlines()) == 1 and expected in err, err


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
def test_cuda_asked_for_but_absent_exits_2(capsys):
    code, _, err = check_op(capsys, "--op", "logp", "--device", "cuda")
    assert code == 2 and "CUDA was asked for but is not available" in err


def test_python_m_from_a_checkout_is_the_same_command(tmp_path):
    # How scripts/h200_session.sh runs the checkers where the package is not installed: PYTHONPATH = the checkout.
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    script = [sys.executable, "-m", "rl_engine.cli", "check-op"]
    good = subprocess.run([*script, "--op", "silu", "--check-grad", *SMALL], capture_output=True, text=True, env=env,
                          cwd=tmp_path)
    assert good.returncode == 0 and FIRST_LINE.match(good.stdout.splitlines()[0])
    bad = subprocess.run([*script, "--op", "nope"], capture_output=True, text=True, env=env, cwd=tmp_path)
    assert bad.returncode == 2 and len(bad.stderr.splitlines()) == 1 and "Traceback" not in bad.stderr
    assert bad.stderr.startswith("rl-engine check-op: error: unknown op 'nope'")
