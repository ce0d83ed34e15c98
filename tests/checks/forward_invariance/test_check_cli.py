import json

import pytest

from rl_engine.cli import main


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--profile", "torch_bf16", "--device", "cuda:0"], "CUDA asked for but not available"),
        (["--profile", "torch_bf16", "--layers", "0"], "--layers"),
        (["--profile", "torch_bf16", "--weights-path", "/nonexistent"], "has no config.json"),
        (["--profile", "torch_bf16", "--manifest", "/nonexistent.json"], "cannot read"),
    ],
)
def test_usage_errors_exit_2(argv, message, capsys):
    assert main(["check-invariance", *argv]) == 2
    err = capsys.readouterr().err.strip()
    assert message in err and len(err.splitlines()) == 1


def test_unknown_profile_exits_2(capsys):
    with pytest.raises(SystemExit) as exc:
        main(["check-invariance", "--profile", "cuda_bf16"])
    assert exc.value.code == 2 and "invalid choice" in capsys.readouterr().err


def test_failing_profile_exits_1_with_json_and_plot(tmp_path, capsys):
    code = main(
        [
            "check-invariance",
            "--profile",
            "torch_bf16",
            "--layers",
            "1",
            "--no-gradients",
            "--json",
            "--out",
            str(tmp_path),
        ]
    )
    report = json.loads(capsys.readouterr().out)
    assert code == 1 and not report["passed"] and report["layers"] == 1
    assert set(report["parity"]["infer"]) == {"b1", "bn"}
    assert (tmp_path / "invariance_torch_bf16_tiny.png").stat().st_size > 0
    assert json.loads((tmp_path / "invariance_torch_bf16_tiny.json").read_text())["profile"] == "torch_bf16"


def test_json_to_a_path_writes_report_and_plot_beside_it(tmp_path, capsys):
    path = tmp_path / "evidence" / "inv.json"
    code = main(["check-invariance", "--profile", "torch_bf16", "--layers", "1", "--no-gradients", "--json", str(path)])
    out = capsys.readouterr().out
    assert code == 1 and out.startswith("check-invariance torch_bf16 on tiny[:1] (cpu): FAILED")
    assert json.loads(path.read_text())["passed"] is False
    assert (tmp_path / "evidence" / "inv.png").stat().st_size > 0
