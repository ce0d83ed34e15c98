"""examples/grpo_step.py runs one GRPO step; under triton_bf16 the rollout/trainer mismatch is exactly 0."""

import importlib.util
from pathlib import Path

import pytest
import torch

PATH = Path(__file__).resolve().parents[2] / "examples" / "grpo_step.py"


@pytest.fixture(scope="module")
def grpo_step():
    spec = importlib.util.spec_from_file_location("grpo_step_example", PATH)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


ZERO_WHEN_BITWISE = ("kl", "k3_kl", "log_ppl_diff", "log_ppl_abs_diff", "chi2_token", "chi2_seq", "max_abs_dlogp",
                     "mean_abs_dlogp", "clipfrac")


def test_one_step_under_triton_is_exactly_on_policy(grpo_step, micro_config, monkeypatch, capsys):
    # The micro config (1 layer, V=64) in place of tiny keeps the interpreted backward to seconds.
    monkeypatch.setattr(grpo_step, "get_config", lambda name: micro_config)
    argv = ["--profile", "triton_bf16", "--prompts", "1", "--group-size", "2", "--max-new-tokens", "3",
            "--temperature", "0.9", "--device", "cpu"]
    out = grpo_step.run(grpo_step.parse_args(argv))
    metrics = out["metrics"]
    for name in ZERO_WHEN_BITWISE:
        assert float(metrics[f"rollout_corr/{name}"]) == 0.0, name
    assert float(metrics["rollout_corr/ppl_ratio"]) == 1.0
    assert float(out["loss_metrics"]["ppo_kl"]) == 0.0  # the loss's own logp is the rollout's, bit for bit
    assert out["tokens"] > 0 and float(out["grad_norm"]) > 0
    assert set(out["seconds"]) >= {"rollout", "train.forward", "train.loss+backward", "optimizer"}
    assert grpo_step.main(["--profile", "torch_bf16", "--prompts", "1", "--group-size", "2",
                           "--max-new-tokens", "2"]) == 0
    printed = capsys.readouterr().out
    assert "rollout_corr/k3_kl" in printed and "time: rollout=" in printed


def test_the_reward_counts_even_tokens_and_ignores_the_stop_token(grpo_step):
    assert grpo_step.reward([2, 3, 4, grpo_step.STOP_TOKEN]) == pytest.approx(2 / 3)
    assert grpo_step.reward([grpo_step.STOP_TOKEN]) == 0.0


@pytest.mark.parametrize("argv, message", [
    (["--profile", "nope"], "profile: expected one of"),
    (["--group-size", "1"], "--group-size"),
    (["--temperature", "0"], "--temperature"),
    (["--config", "nope"], "model: expected one of"),
])
def test_bad_flags_are_one_line_and_exit_2(grpo_step, capsys, argv, message):
    assert grpo_step.main(argv) == 2
    err = capsys.readouterr().err
    assert message in err and len(err.strip().splitlines()) == 1


def test_the_masters_receive_the_gradient(grpo_step, micro_config, monkeypatch):
    # A disconnected cast (weights detached from the masters) would leave every gradient empty.
    monkeypatch.setattr(grpo_step, "get_config", lambda name: micro_config)
    args = grpo_step.parse_args(["--profile", "torch_bf16", "--prompts", "1", "--group-size", "2",
                                 "--max-new-tokens", "2"])
    model, master, _ = grpo_step.setup(args)
    hidden = model.forward(torch.tensor([[1, 2, 3]]), torch.arange(3)[None])
    model.selected_logprobs(hidden, torch.tensor([[2, 3, 4]])).sum().backward()
    assert all(p.grad is not None for p in master.values())
