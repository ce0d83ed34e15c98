"""benchmarks/transformers_step.py end to end on the CPU at toy sizes (--device cpu): every implementation, mode,
shape and task, the JSON rows, ratios and --append, before it meets the H200. Liger is a stand-in module here
(plain torch), so its glue runs even where liger_kernel is not installed."""

import json
import sys
import types

import pytest
import torch
import torch.nn.functional as F


@pytest.fixture
def bench(load_benchmark):
    return load_benchmark("transformers_step")


def stub_liger(monkeypatch, fail=False):
    """liger_kernel.transformers as the script uses it: apply_liger_kernel_to_qwen3(model=...) and
    LigerFusedLinearCrossEntropyLoss(reduction="none")(weight, hidden, targets) -> per-token CE."""
    calls = []

    def apply_liger_kernel_to_qwen3(model=None, **kwargs):
        if fail:
            raise RuntimeError("planted")
        calls.append(model)

    class LigerFusedLinearCrossEntropyLoss(torch.nn.Module):
        def __init__(self, reduction="mean"):
            super().__init__()
            self.reduction = reduction

        def forward(self, weight, hidden, targets):
            return F.cross_entropy((hidden @ weight.t()).float(), targets, reduction=self.reduction)

    module = types.ModuleType("liger_kernel.transformers")
    module.apply_liger_kernel_to_qwen3 = apply_liger_kernel_to_qwen3
    module.LigerFusedLinearCrossEntropyLoss = LigerFusedLinearCrossEntropyLoss
    monkeypatch.setitem(sys.modules, "liger_kernel", types.ModuleType("liger_kernel"))
    monkeypatch.setitem(sys.modules, "liger_kernel.transformers", module)
    return calls


def result(out):
    return json.loads((out / "transformers_step.json").read_text())


def cells(payload):
    return {(r["impl"], r["mode"], r["shape"], r["task"]): r for r in payload["rows"]}


def test_every_cell_runs_on_cpu_and_appends(bench, monkeypatch, tmp_path):
    calls = stub_liger(monkeypatch)
    cpu = ["--out", str(tmp_path), "--device", "cpu", "--profile", "torch_bf16"]
    assert bench.main([*cpu, "--modes", "eager"]) == 0
    got = cells(result(tmp_path))
    assert set(got) == {(i, "eager", s, t) for i in bench.IMPLS for s in bench.CPU_SHAPES for t in bench.TASKS}
    for key, row in got.items():
        assert "error" not in row and row["ms"] > 0 and row["peak_gb"] is None, (key, row)
        if key[0] != "sdpa":  # the same logprobs as the unpatched model, within bf16 error (a wrong target: ~1)
            assert row["max_abs_dlogp_vs_sdpa"] < 0.1, (key, row)
    assert len(calls) == 1 and calls[0] is not None  # Liger patched the model instance
    payload = result(tmp_path)
    assert set(payload["implementations"]["sdpa"]["sdpa_backend"]) == set(bench.CPU_SHAPES)
    assert payload["implementations"]["rl_engine"]["attn_implementation"] == "rl_engine"
    assert {(r["impl"], r["shape"], r["task"]) for r in payload["ratios"] if "time_ratio" in r} == {
        (i, s, t) for i in ("rl_engine", "liger") for s in bench.CPU_SHAPES for t in bench.TASKS}
    assert (tmp_path / "transformers_step.png").exists()

    # A later run with --append adds its cells and keeps the earlier ones.
    assert bench.main([*cpu, "--modes", "compiled", "--compile-backend", "eager", "--impls", "sdpa",
                       "--shapes", "1x16", "--tasks", "forward", "--append"]) == 0
    merged = cells(result(tmp_path))
    assert set(got) < set(merged)
    compiled = merged[("sdpa", "compiled", "1x16", "forward")]
    assert "error" not in compiled and compiled["bitwise_vs_eager"] is True, compiled


def test_patched_triton_profile_cell(bench, monkeypatch, tmp_path):
    stub_liger(monkeypatch)
    assert bench.main(["--out", str(tmp_path), "--device", "cpu", "--impls", "sdpa,rl_engine", "--modes", "eager",
                       "--tasks", "forward", "--shapes", "1x16"]) == 0
    row = cells(result(tmp_path))[("rl_engine", "eager", "1x16", "forward")]
    assert "error" not in row and row["max_abs_dlogp_vs_sdpa"] < 0.1, row


def test_a_failing_implementation_is_recorded_and_the_others_kept(bench, monkeypatch, tmp_path):
    stub_liger(monkeypatch, fail=True)
    assert bench.main(["--out", str(tmp_path), "--device", "cpu", "--impls", "sdpa,liger", "--modes", "eager",
                       "--tasks", "forward"]) == 0
    got = cells(result(tmp_path))
    assert all(got[("liger", "eager", s, "forward")]["error"] == "RuntimeError: planted" for s in bench.CPU_SHAPES)
    assert all(got[("sdpa", "eager", s, "forward")]["ms"] > 0 for s in bench.CPU_SHAPES)


def test_ratios_and_goals(bench):
    rows = [{"impl": i, "mode": "eager", "shape": "8x1024", "task": t, "ms": ms, "peak_gb": gb}
            for i, t, ms, gb in [("sdpa", "train", 100.0, 10.0), ("rl_engine", "train", 111.0, 9.0),
                                 ("sdpa", "forward", 50.0, 4.0), ("rl_engine", "forward", 49.0, 5.0)]]
    got = {r["task"]: r for r in bench.ratios(rows)}
    assert got["train"]["time_ratio"] == pytest.approx(1.11) and got["train"]["time_goal_met"] is False
    assert got["train"]["memory_goal_met"] is True
    assert got["forward"]["time_goal_met"] is True and got["forward"]["memory_goal_met"] is False


def test_a_run_cut_short_keeps_what_it_measured(bench, monkeypatch, tmp_path):
    measured = bench.run_impl

    def cut(impl, *args):
        if impl == "rl_engine":
            raise KeyboardInterrupt  # as the device tool's time limit ends a command
        return measured(impl, *args)

    monkeypatch.setattr(bench, "run_impl", cut)
    with pytest.raises(KeyboardInterrupt):
        bench.main(["--out", str(tmp_path), "--device", "cpu", "--modes", "eager", "--tasks", "forward"])
    assert set(cells(result(tmp_path))) == {("sdpa", "eager", s, "forward") for s in bench.CPU_SHAPES}


@pytest.mark.parametrize("argv", [[], ["--device", "cpu", "--impls", "vllm"],
                                  ["--device", "cpu", "--shapes", "8x1024"]])
def test_usage_errors_exit_2(bench, argv, tmp_path):
    if not argv and torch.cuda.is_available():
        pytest.skip("CUDA present: the default device is valid")
    with pytest.raises(SystemExit) as exc:
        bench.main(["--out", str(tmp_path), *argv])
    assert exc.value.code == 2
