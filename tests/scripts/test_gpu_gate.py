"""The GPU gate's verdict: read from pytest's closing line and the check-op results, never green on a subset."""

import importlib.util
from pathlib import Path

import pytest

_spec = importlib.util.spec_from_file_location("gpu_gate", Path(__file__).parents[2] / "scripts" / "gpu_gate.py")
gpu_gate = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(gpu_gate)

OPS_OK = [{"op": "logp", "dtype": "bf16", "passed": True}]


def suite(line: str, rc: int = 0) -> dict:
    return {**gpu_gate.pytest_counts("....\n" + line), "rc": rc}


def test_counts_read_from_the_closing_line():
    counts = gpu_gate.pytest_counts("x\n= 6 failed, 131 passed, 2 skipped, 1 error in 40.12s =")
    assert (counts["failed"], counts["passed"], counts["skipped"], counts["errors"]) == (6, 131, 2, 1)


def test_green_run_passes():
    assert gpu_gate.gate_passed(suite("140 passed in 50.0s"), OPS_OK)


@pytest.mark.parametrize("line, rc", [
    ("6 failed, 131 passed in 40s", 1),       # the run this issue started from
    ("131 passed, 1 error in 40s", 1),
    ("131 passed, 3 skipped in 40s", 0),      # a skipped GPU test is not a pass
    ("no tests ran in 0.1s", 5),
    ("131 passed in 40s", 3),                 # pytest's own exit code disagrees: interrupted
])
def test_planted_suite_failures_fail_the_gate(line, rc):
    assert not gpu_gate.gate_passed(suite(line, rc), OPS_OK)


def test_one_failing_op_or_no_ops_fails_the_gate():
    green = suite("140 passed in 50.0s")
    assert not gpu_gate.gate_passed(green, OPS_OK + [{"op": "rope", "dtype": "fp32", "passed": False}])
    assert not gpu_gate.gate_passed(green, [])


def test_check_ops_covers_every_record_layout_and_dtype(tmp_path, monkeypatch):
    """The gate's op list is the records': every op in every layout, bf16 and fp32, with --check-grad
    exactly where the op has a backward; one op's error does not stop the others."""
    from rl_engine.checks.operators import check_op
    from rl_engine.kernels.records import OPS

    calls = []

    def fake_run(args):
        calls.append((args.op, args.layout, args.dtype, args.check_grad))
        if args.op == "rope":
            raise RuntimeError("planted")
        return 0

    monkeypatch.setattr(check_op, "run", fake_run)
    with open(tmp_path / "log", "w") as fh:
        rows = gpu_gate.check_ops(tmp_path, fh)
    expected = {(op, layout, dtype, bool(r.grad_input_names))
                for op, r in OPS.items() for layout in r.layouts for dtype in ("bf16", "fp32")}
    assert set(calls) == expected and len(calls) == len(expected)
    assert ("attention", "packed", "bf16", True) in expected
    assert [r["passed"] for r in rows if r["op"] == "rope"] == [False, False]
    assert not gpu_gate.gate_passed(suite("140 passed in 50.0s"), rows)


def test_a_whole_gate_run_writes_its_summary_and_verdict(tmp_path, monkeypatch, capsys):
    """main() end to end with the GPU parts faked: the verdict names the device from the shared
    environment record (a KeyError there would lose a whole GPU run's verdict)."""
    import subprocess
    import sys

    import torch

    def fake_pytest(out, workers):
        return subprocess.Popen([sys.executable, "-c", "print('140 passed in 1.0s')"],
                                stdout=open(out / "pytest_gpu.log", "w"), start_new_session=True)

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: None)
    real_environment = gpu_gate.environment
    monkeypatch.setattr(gpu_gate, "environment", lambda commit: real_environment(commit, device="cpu"))
    monkeypatch.setattr(gpu_gate, "check_ops", lambda out, fh: list(OPS_OK))
    monkeypatch.setattr(gpu_gate, "start_pytest", fake_pytest)
    monkeypatch.setattr(sys, "argv", ["gpu_gate.py", "--out", str(tmp_path / "gate"), "--commit", "abc1234"])
    assert gpu_gate.main() == 0
    summary = __import__("json").loads((tmp_path / "gate" / "gpu_gate_summary.json").read_text())
    assert summary["passed"] and summary["environment"]["commit"] == "abc1234"
    assert "GPU gate PASSED: pytest -m gpu 140 passed" in capsys.readouterr().out


def _tree(root):
    for rel, text in {"rl_engine/a.py": "x = 1\n", "tests/test_a.py": "def test(): pass\n", "pyproject.toml": "[p]\n",
                      "benchmarks/results/a.json": "{}", "rl_engine/__pycache__/a.pyc": "bytes"}.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(text)


def test_the_tree_hash_names_the_code_not_its_outputs(tmp_path):
    # The log names the tested code by content (a device copy's .git may be stale): a changed or added source
    # file changes the digest, a benchmark result or a bytecode cache does not.
    _tree(tmp_path)
    base = gpu_gate.tree_hash(tmp_path)
    assert base == gpu_gate.tree_hash(tmp_path) and len(base) == 16
    (tmp_path / "benchmarks/results/a.json").write_text('{"ms": 2}')
    (tmp_path / "rl_engine/__pycache__/a.pyc").write_text("other")
    assert gpu_gate.tree_hash(tmp_path) == base
    (tmp_path / "rl_engine/a.py").write_text("x = 2\n")  # planted: one changed constant
    changed = gpu_gate.tree_hash(tmp_path)
    assert changed != base
    (tmp_path / "tests/test_b.py").write_text("")  # an added test
    assert gpu_gate.tree_hash(tmp_path) != changed


def test_tree_hash_flag_and_missing_out(capsys, monkeypatch):
    monkeypatch.setattr("sys.argv", ["gpu_gate", "--tree-hash"])
    assert gpu_gate.main() == 0
    assert capsys.readouterr().out.strip() == gpu_gate.tree_hash()
    monkeypatch.setattr("sys.argv", ["gpu_gate"])
    with pytest.raises(SystemExit) as info:
        gpu_gate.main()
    assert info.value.code == 2 and "--out" in capsys.readouterr().err
