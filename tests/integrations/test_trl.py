"""TRL's GRPOTrainer on rl_engine (examples/trl_grpo.py, 2 steps on the CPU): the rollout runs on
RolloutEngine, logprobs and loss on the fused op, and under triton_bf16 verl's rollout_corr/* mismatch
metrics in TRL's logs are exactly 0. GRPOConfig settings rl_engine does not compute are refused by name."""

import importlib.util
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

# A skip mark, not a module-level importorskip: `pytest -m gpu` (the GPU gate) deselects these CPU tests on a
# machine without TRL instead of counting the module as skipped.
pytestmark = pytest.mark.skipif(importlib.util.find_spec("trl") is None,
                                reason="TRL is not installed (pip install 'rl_engine[trl]')")
if importlib.util.find_spec("trl") is not None:
    import trl

    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "examples"))
    import trl_grpo

    from rl_engine.integrations.trl import check_args
from rl_engine.errors import UsageError  # noqa: E402

MISMATCH = ("kl", "k3_kl", "log_ppl_diff", "log_ppl_abs_diff", "max_abs_dlogp", "mean_abs_dlogp", "chi2_token",
            "chi2_seq", "clipfrac")


def test_two_grpo_steps_rollout_corr_zero_under_triton_bf16():
    logs = trl_grpo.run("triton_bf16", steps=2, generations=2, max_completion_length=2, device="cpu")
    assert len(logs) == 2
    assert logs[0]["grad_norm"] > 0  # the weights moved: step 2's rollout must sample from the new ones
    for log in logs:
        assert log["loss"] == log["loss"]  # not NaN
        assert all(log[f"rollout_corr/{name}"] == 0 for name in MISMATCH), log
        assert log["rollout_corr/rollout_is_mean"] == 1
        assert log["actor/ppo_kl"] == 0 and "entropy" in log and "clip_ratio/region_mean" in log


@pytest.mark.parametrize(("field", "value"), [
    ("loss_type", "cispo"), ("loss_type", "sapo"), ("delta", 2.0), ("top_entropy_quantile", 0.5),
    ("entropy_coef", 0.01), ("off_policy_mask_threshold", 0.5), ("repetition_penalty", 1.1),
    ("use_bias_correction_kl", True),
])
def test_unsupported_settings_refused_by_name(tmp_path, field, value):
    fine = {"output_dir": str(tmp_path), "use_cpu": True, "report_to": "none", "beta": 0.04,
            "use_bias_correction_kl": False}
    check_args(trl.GRPOConfig(**fine))
    with pytest.raises(UsageError, match=f"GRPOConfig.{field}="):
        check_args(trl.GRPOConfig(**{**fine, field: value}))


def trl_loss(hidden, weight, ids, adv, old, ref, mask, t, loss_type, level, accumulation=2, spg=2):
    """TRL 1.16 GRPOTrainer._compute_loss's formula (grpo/bnpo/dr_grpo/dapo, token or sequence level, k3 KL
    without the IS correction), written out from logits: what loss_options must reproduce."""
    logp = torch.log_softmax(hidden @ weight.t() / t.temperature, -1).gather(-1, ids[..., None])[..., 0]
    log_ratio = logp - old
    if level == "sequence":
        log_ratio = ((log_ratio * mask).sum(-1) / mask.sum(-1).clamp(min=1.0))[:, None]
    coef1 = torch.exp(log_ratio)
    coef2 = torch.clamp(coef1, 1 - t.epsilon_low, 1 + t.epsilon_high)
    per_token = -torch.min(coef1 * adv[:, None], coef2 * adv[:, None])
    per_token = per_token + t.beta * (torch.exp(ref - logp) - (ref - logp) - 1)
    total = (per_token * mask).sum()
    if loss_type == "grpo":
        return ((per_token * mask).sum(-1) / mask.sum(-1).clamp(min=1.0)).mean() / accumulation
    if loss_type == "bnpo":
        return total / mask.sum().clamp(min=1.0) / accumulation
    if loss_type == "dr_grpo":
        return total / (mask.shape[0] * t.max_completion_length) / accumulation
    return total / (mask.sum() * accumulation / spg)  # dapo, one process: num_items_in_batch = this batch's


@pytest.mark.parametrize("level", ["token", "sequence"])
@pytest.mark.parametrize("loss_type", ["grpo", "bnpo", "dr_grpo", "dapo"])
def test_loss_options_compute_trls_loss(loss_type, level):
    from rl_engine.integrations.trl import loss_options
    from rl_engine.losses import linear_policy_loss

    g = torch.Generator().manual_seed(0)
    b, t_len, h, v = 4, 5, 8, 16
    hidden = torch.randn(b, t_len, h, generator=g, dtype=torch.float64)
    weight = torch.randn(v, h, generator=g, dtype=torch.float64)
    ids = torch.randint(0, v, (b, t_len), generator=g)
    adv = torch.tensor([1.0, -1.0, 0.5, -0.25], dtype=torch.float64)
    with torch.no_grad():  # old and reference policies away from the current one, so that ratios clip
        logp = torch.log_softmax(hidden @ weight.t() / 0.9, -1).gather(-1, ids[..., None])[..., 0]
    old = logp + 0.6 * torch.randn(b, t_len, generator=g, dtype=torch.float64)
    ref = logp + 0.3 * torch.randn(b, t_len, generator=g, dtype=torch.float64)
    mask = torch.ones(b, t_len, dtype=torch.float64)
    mask[1, 3:] = 0
    mask[3, 1:] = 0
    trainer = SimpleNamespace(
        args=SimpleNamespace(loss_type=loss_type, importance_sampling_level=level, steps_per_generation=2),
        current_gradient_accumulation_steps=2, max_completion_length=t_len,
        accelerator=SimpleNamespace(num_processes=1), epsilon_low=0.2, epsilon_high=0.28, beta=0.04, temperature=0.9)
    grads = []
    for which in ("trl", "rl_engine"):
        x = hidden.clone().requires_grad_(True)
        if which == "trl":
            loss = trl_loss(x, weight, ids, adv, old, ref, mask, trainer, loss_type, level)
        else:
            loss, _ = linear_policy_loss(x, weight, ids, adv, old, mask, ref, backend="pytorch",
                                         **loss_options(trainer, mask.sum(), mask, "train"))
        loss.backward()
        grads.append((loss.detach(), x.grad))
    (want, want_grad), (got, got_grad) = grads
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-14)
    torch.testing.assert_close(got_grad, want_grad, rtol=1e-10, atol=1e-14)


def test_prepatched_model_kept_under_its_profile_refused_under_another_and_multiprocess(tmp_path, monkeypatch):
    from datasets import Dataset

    from rl_engine.integrations.transformers import patch
    from rl_engine.integrations.trl import RLEngineGRPOTrainer

    tok = trl_grpo.tokenizer()
    args = trl.GRPOConfig(output_dir=str(tmp_path), use_cpu=True, report_to="none", per_device_train_batch_size=2,
                          num_generations=2, max_completion_length=2)
    data = Dataset.from_dict({"prompt": ["a b"] * 2})
    def trainer(profile):
        model = trl_grpo.tiny_qwen3(len(tok))
        patch(model, "torch_bf16")
        return RLEngineGRPOTrainer(model, reward_funcs=trl_grpo.reward_a, args=args, train_dataset=data,
                                   processing_class=tok, profile=profile)

    assert trainer("torch_bf16").model._rl_engine_patch.profile == "torch_bf16"
    with pytest.raises(UsageError, match="patched under torch_bf16, not triton_bf16"):
        trainer("triton_bf16")

    import accelerate

    monkeypatch.setattr(accelerate.Accelerator, "num_processes", property(lambda self: 2))
    with pytest.raises(UsageError, match="one process only, got 2"):
        trainer("torch_bf16")


def test_a_trl_outside_the_supported_range_is_refused_at_import(monkeypatch):
    # In this process (TRL is already imported: a subprocess spent ~9 s importing it again): the module imported
    # afresh under the other version; monkeypatch puts the imported module and the version back.
    import importlib

    monkeypatch.setattr(trl, "__version__", "1.7.1")
    monkeypatch.delitem(sys.modules, "rl_engine.integrations.trl", raising=False)
    with pytest.raises(ImportError, match=r"supports TRL >=1\.10,<1\.17, found 1\.7\.1"):
        importlib.import_module("rl_engine.integrations.trl")
