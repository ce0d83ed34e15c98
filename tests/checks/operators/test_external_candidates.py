"""Candidates from outside the package: `check-op --candidate module:attr` and assert_operator_matches."""

import json
import sys
import types
from pathlib import Path

import pytest
import torch

from rl_engine import cli
from rl_engine.checks.testing import assert_operator_matches
from rl_engine.errors import UsageError
from rl_engine.loading import load_callable, load_object

SMALL = ["--device", "cpu", "--dtype", "fp32", "--batch", "2", "--seq", "2", "--vocab", "17"]


@pytest.fixture(autouse=True)
def importable(monkeypatch):
    """The candidates module sits next to this file, as a user's module sits on their path."""
    monkeypatch.syspath_prepend(str(Path(__file__).parent))


def check_op(capsys, *args):
    code = cli.main(["check-op", "--op", "logp", *args, *SMALL])
    out, err = capsys.readouterr()
    return code, out, err


@pytest.mark.parametrize("path", ["external_candidates:logp", "external_candidates:LogpOp"])
def test_a_correct_external_candidate_passes(capsys, path):
    code, out, err = check_op(capsys, "--candidate", path, "--check-grad", "--check-invariance", "--json")
    assert code == 0 and not err, err
    candidate = json.loads(out)["candidates"][0]
    assert (candidate["name"], candidate["backend"], candidate["passed"]) == (path, "external", True)
    roles = {o["role"] for o in candidate["outputs"]}
    judgments = {o["judgment"] for o in candidate["outputs"]}
    assert roles == {"output", "gradient:logits"}
    assert judgments == {"forward_accuracy", "gradient_accuracy", "forward_invariance", "gradient_invariance"}


def test_a_planted_scale_bug_fails(capsys):
    code, out, _ = check_op(capsys, "--candidate", "external_candidates:logp_scaled", "--check-grad")
    assert code == 1
    assert "candidate=external_candidates:logp_scaled backend=external passed=False" in out.splitlines()[1]


def test_a_candidate_that_raises_is_a_failed_case(capsys):
    code, out, err = check_op(capsys, "--candidate", "external_candidates:logp_raises")
    assert code == 1 and not err
    assert "candidate raised RuntimeError: kernel exploded" in out


@pytest.mark.parametrize("path,message", [
    ("external_candidates:logp_exits", "candidate raised SystemExit: 0"),
    ("external_candidates:logp_base_exception", "candidate raised CandidateGaveUp: no kernel for this shape"),
])
def test_a_candidate_that_exits_or_raises_a_base_exception_fails_its_case(capsys, path, message):
    code, out, err = check_op(capsys, "--candidate", path)
    assert code == 1 and not err and message in out


def test_a_backward_that_exits_fails_its_case(capsys):
    code, out, err = check_op(capsys, "--candidate", "external_candidates:logp_backward_exits", "--check-grad")
    assert code == 1 and not err and "backward raised" in out and "SystemExit" in out


def test_a_hung_candidate_is_stopped_at_the_case_time_limit(capsys):
    import time

    start = time.monotonic()
    code, out, err = check_op(capsys, "--candidate", "external_candidates:logp_hangs", "--case-timeout", "0.5")
    assert code == 1 and not err and time.monotonic() - start < 30
    assert "candidate external_candidates:logp_hangs on case logp-fp32-2x2x17 exceeded the per-case time limit " \
           "of 0.5 s" in out


def test_a_candidate_that_swallows_the_stop_ends_the_process_with_one_line():
    import subprocess

    code = ("import sys; import rl_engine.checks.operators.op_checks as o; o.TIMEOUT_GRACE_S = 0.5; "
            "from rl_engine.cli import main; sys.exit(main(sys.argv[1:]))")
    proc = subprocess.run([sys.executable, "-c", code, "check-op", "--op", "logp", *SMALL, "--candidate",
                           "external_candidates:logp_swallows_everything", "--case-timeout", "0.5"],
                          capture_output=True, text=True, timeout=120, cwd=Path(__file__).parent)
    assert proc.returncode == 1 and not proc.stdout
    assert proc.stderr.strip() == ("check-op: candidate external_candidates:logp_swallows_everything on case "
                                   "logp-fp32-2x2x17 did not return within the per-case time limit of 0.5 s and "
                                   "could not be interrupted; process ended")


USAGE_ERRORS = {
    "module not importable": ("no_such_module_xyz:logp",
                              "cannot import candidate module 'no_such_module_xyz': ModuleNotFoundError"),
    "attribute missing": ("external_candidates:nope", "module 'external_candidates' has no attribute 'nope'"),
    "not callable": ("external_candidates:NOT_CALLABLE", "external_candidates:NOT_CALLABLE is a int, not callable"),
    "construction raises": ("external_candidates:RefusesToConstruct",
                            "cannot construct candidate external_candidates:RefusesToConstruct: ValueError: no device"),
    "instance not callable": ("external_candidates:NotCallableWhenBuilt", "is not callable (no __call__)"),
    "empty attribute": ("external_candidates:", "candidate must be 'module:attr'"),
    "neither backend nor path": ("cuda", "valid candidates: pytorch, triton, or module:attr"),
}


@pytest.mark.parametrize("name", list(USAGE_ERRORS))
def test_candidates_that_will_not_load_exit_2_with_one_line(capsys, name):
    path, expected = USAGE_ERRORS[name]
    code, out, err = check_op(capsys, "--candidate", path)
    assert code == 2 and not out
    assert len(err.strip().splitlines()) == 1 and expected in err and "Traceback" not in err, err


def test_a_module_that_fails_at_import_is_named_with_its_error(monkeypatch, capsys, tmp_path):
    (tmp_path / "broken_candidate_mod.py").write_text("import does_not_exist_either\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    code, _, err = check_op(capsys, "--candidate", "broken_candidate_mod:logp")
    assert code == 2 and len(err.strip().splitlines()) == 1
    assert "cannot import candidate module 'broken_candidate_mod'" in err and "does_not_exist_either" in err


def test_assert_operator_matches_catches_a_planted_bug():
    import external_candidates

    kwargs = dict(dtype="fp32", device="cpu", batch=2, seq=2, vocab=17)
    assert assert_operator_matches("logp", external_candidates.logp, **kwargs).passed
    with pytest.raises(AssertionError, match="suite=logp passed=False"):
        assert_operator_matches("logp", external_candidates.logp_scaled, **kwargs)
    with pytest.raises(AssertionError, match="backend=external passed=False"):
        assert_operator_matches("logp", "external_candidates:logp_scaled", check_grad=False, **kwargs)


def test_the_loader_takes_colon_and_dotted_paths_and_nested_attributes(monkeypatch):
    module = types.ModuleType("loader_probe")
    module.Outer = type("Outer", (), {"inner": staticmethod(torch.neg)})
    monkeypatch.setitem(sys.modules, module.__name__, module)
    assert load_object("loader_probe:Outer.inner", "x") is torch.neg
    assert load_object("loader_probe.Outer", "x") is module.Outer
    assert load_callable("loader_probe:Outer.inner", "x", alpha=1).keywords == {"alpha": 1}
    with pytest.raises(UsageError, match="module 'loader_probe' has no attribute 'Outer.missing'"):
        load_object("loader_probe:Outer.missing", "x")
    with pytest.raises(UsageError, match="x must be 'module:attr'"):
        load_object("nodots", "x")


# -- a compiled candidate: the CUDA C++ logp in examples/ -------------------------------------------
CUDA_LOGP = "examples.cuda_logp:CudaLogp"
ROOT = Path(__file__).resolve().parents[3]


def cli_run(capsys, *args):
    code = cli.main(["check-op", *args])
    out, err = capsys.readouterr()
    return code, out, err


@pytest.mark.skipif(torch.cuda.is_available(), reason="the fail-closed path is the one without a GPU")
def test_the_cuda_candidate_fails_closed_with_one_line_where_it_cannot_be_built(capsys, monkeypatch):
    monkeypatch.syspath_prepend(str(ROOT))
    code, out, err = cli_run(capsys, "--op", "logp", "--candidate", CUDA_LOGP, "--device", "cpu")
    assert code == 2 and out == ""
    assert err.count("\n") == 1 and "needs a CUDA GPU" in err


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["bf16", "fp32"])
def test_the_cuda_candidate_passes_check_op_with_gradients_and_invariance(capsys, monkeypatch, tmp_path, dtype):
    monkeypatch.syspath_prepend(str(ROOT))
    report = tmp_path / f"cuda_logp_{dtype}.json"
    code, out, err = cli_run(capsys, "--op", "logp", "--candidate", CUDA_LOGP, "--device", "cuda", "--dtype", dtype,
                              "--qwen3-8b", "--seq", "256", "--arch-key", "sm90", "--check-grad", "--check-invariance",
                              "--json-out", str(report))
    assert code == 0, out + err
    outputs = json.loads(report.read_text())["candidates"][0]["outputs"]
    assert {o["judgment"] for o in outputs} == {"forward_accuracy", "gradient_accuracy", "forward_invariance",
                                                "gradient_invariance"}
