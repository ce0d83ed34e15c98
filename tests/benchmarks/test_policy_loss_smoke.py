"""benchmarks/policy_loss.py on the CPU: its command line, and the code paths of its new columns at toy shapes
(Triton interpreter): the fp64 gold, dhidden / dW errors of both modes and of torch's linear_cross_entropy
peer, and the main-grad mode's bits against the lean mode's. The timing itself needs the GPU."""

import sys

import pytest
import torch


@pytest.fixture(scope="module")
def bench(load_benchmark):
    return load_benchmark("policy_loss")


def test_help_names_both_modes_and_no_cuda_is_a_configuration_error(bench, monkeypatch, capsys):
    monkeypatch.setattr(sys, "argv", ["policy_loss.py", "--help"])
    with pytest.raises(SystemExit) as done:
        bench.main()
    assert done.value.code == 0 and "--out" in capsys.readouterr().out
    assert "triton_main_grad" in bench.__doc__ and {"triton", "triton_main_grad"} <= set(bench.GOALS)
    if not torch.cuda.is_available():
        monkeypatch.setattr(sys, "argv", ["policy_loss.py", "--out", "unused"])
        with pytest.raises(SystemExit) as done:
            bench.main()
        assert done.value.code == 2


def test_accuracy_and_bits_columns_at_toy_shapes(bench):
    inputs = bench.make_inputs(32, device="cpu", hidden_size=16, vocab=40, seq=16)
    gold = bench.gold_of(inputs)
    impls = bench.implementations(liger=False)
    assert {"triton", "triton_main_grad", "eager_fp32"} <= set(impls)
    rows = {name: bench.accuracy(impls[name], inputs, gold) for name in ("triton", "triton_main_grad", "eager_fp32")}
    if "torch_lce" in impls:
        rows["torch_lce"] = bench.accuracy(impls["torch_lce"], inputs, gold)
    for name, row in rows.items():
        assert row["loss_abs_err"] < 1e-2 and row["dhidden_rel_err"] < 2e-2, (name, row)  # bf16 peers: ~1e-3
        assert row["dweight_rel_err"] < 2e-2, (name, row)
    assert bench.mode_bits(inputs) == {"bits_equal_lean": True}
