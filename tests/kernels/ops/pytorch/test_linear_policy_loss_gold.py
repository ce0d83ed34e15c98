"""The fused policy loss's gold against independent float64 numpy formulas (verl's), and gradcheck."""

import dataclasses

import numpy as np
import pytest
import torch

from rl_engine.kernels.ops.pytorch.loss.linear_policy_loss import PolicyLossConfig, reference_linear_policy_loss


def make_inputs(seed=0, b=3, t=7, h=6, v=11, temperature=1.0, dual_clip=False, dtype=torch.float64):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(b, t, h, generator=g, dtype=torch.float64)
    weight = torch.randn(v, h, generator=g, dtype=torch.float64) * 0.5
    target = torch.randint(0, v, (b, t), generator=g)
    logp = torch.log_softmax(hidden @ weight.t() / temperature, -1).gather(-1, target.unsqueeze(-1)).squeeze(-1)
    adv = torch.randn(b, t, generator=g, dtype=torch.float64)
    old = logp + 0.3 * torch.randn(b, t, generator=g, dtype=torch.float64)
    if dual_clip:  # ratios near e^1.5 ~ 4.5 > clip_ratio_c = 3 where A < 0: the dual-clip branch
        old = torch.where(adv < -0.5, old - 1.5, old)
    ref = logp + 0.3 * torch.randn(b, t, generator=g, dtype=torch.float64)
    mask = (torch.rand(b, t, generator=g) > 0.25).double()
    mask[-1, -2:] = 0  # right padding
    inputs = dict(hidden=hidden, lm_head_weight=weight, target_ids=target, advantages=adv, old_logprobs=old,
                  mask=mask, ref_logprobs=ref)
    return {k: (x.to(dtype) if x.is_floating_point() else x) for k, x in inputs.items()}


def numpy_policy_loss(inputs, cfg: PolicyLossConfig, normalizer=None):
    """verl's definitions, written again in float64 numpy (core_algos.py, dp_actor.py)."""
    x = {k: v.detach().double().numpy() if v.is_floating_point() else v.numpy() for k, v in inputs.items()}
    z = x["hidden"] @ x["lm_head_weight"].T / cfg.temperature
    top = z.max(-1, keepdims=True)
    lse = top[..., 0] + np.log(np.exp(z - top).sum(-1))
    logp = np.take_along_axis(z, x["target_ids"][..., None], -1)[..., 0] - lse
    p = np.exp(z - lse[..., None])
    entropy = lse - (p * z).sum(-1)
    a, old, ref, m = x["advantages"], x["old_logprobs"], x["ref_logprobs"], x["mask"]
    lo, hi = 1 - cfg.clip_ratio_low, 1 + cfg.clip_ratio_high
    delta = np.clip(logp - old, -20, 20)
    lens = np.maximum(m.sum(-1), 1)
    if cfg.policy_loss == "ppo":
        r = np.exp(delta)
        l1, l2 = -a * r, -a * np.clip(r, lo, hi)
        c = np.maximum(l1, l2)
        l3 = -a * cfg.clip_ratio_c
        pg = np.where(a < 0, np.minimum(l3, c), c)
        lower = (c > l3) & (a < 0)
    else:
        s = (m * (logp - old)).sum(-1) / lens
        r = np.broadcast_to(np.exp(np.minimum(s, 10))[:, None], a.shape)
        l1, l2 = -a * r, -a * np.clip(r, lo, hi)
        pg = np.maximum(l1, l2)
        lower = np.zeros_like(m, dtype=bool)
    k = np.clip(ref - logp, -20, 20)
    kl = np.clip(np.exp(k) - k - 1, -10, 10)
    loss_t = pg + cfg.kl_coef * kl - cfg.entropy_coef * entropy
    mode = cfg.agg_mode
    if mode == "token-mean":
        loss = (m * loss_t).sum() / (max(m.sum(), 1) if normalizer is None else normalizer)
    else:
        per_seq = (m * loss_t).sum(-1) / (lens if mode == "seq-mean-token-mean" else 1)
        loss = per_seq.sum() / (m.shape[0] if normalizer is None else normalizer)
    active = max(m.sum(), 1)

    def mean(q):
        return float((q * m).sum() / active)

    # The closed-form gradient the Triton kernels use: a = dL/dlogp_t, b = dL/dH_t per token, then
    # dz = a (onehot - p) - b p (z - E[z]) and d logits = dz / temperature.
    if mode == "token-mean":
        w = m / (max(m.sum(), 1) if normalizer is None else normalizer)
    else:
        w = m / (lens[:, None] if mode == "seq-mean-token-mean" else 1)
        w = w / (m.shape[0] if normalizer is None else normalizer)
    if cfg.policy_loss == "ppo":
        live = np.abs(logp - old) <= 20
        dpg = np.where((l1 >= l2) & live, -a * r, 0.0)
        dpg = np.where((a < 0) & (l3 < c), 0.0, dpg)
    else:
        dpg = np.where((l1 >= l2) & (s[:, None] <= 10), -a * r, 0.0)
    dkl = np.where(np.abs(ref - logp) <= 20, 1 - np.exp(k), 0.0)
    coef_a, coef_b = w * (dpg + cfg.kl_coef * dkl), -w * cfg.entropy_coef
    onehot = np.zeros_like(z)
    np.put_along_axis(onehot, x["target_ids"][..., None], 1.0, -1)
    mean_z = (p * z).sum(-1, keepdims=True)
    dlogits = (coef_a[..., None] * (onehot - p) - coef_b[..., None] * p * (z - mean_z)) / cfg.temperature
    grads = (dlogits @ x["lm_head_weight"], np.einsum("btv,bth->vh", dlogits, x["hidden"]))

    metrics = {"pg_clipfrac": mean(l2 > l1), "ppo_kl": mean(-delta), "k3_kl": mean(np.exp(delta) - 1 - delta),
               "kl_loss": mean(kl)}
    if cfg.policy_loss == "ppo":
        metrics["pg_clipfrac_lower"] = mean(lower)
    if cfg.needs_entropy:
        metrics["entropy"] = mean(entropy)
    return float(loss), metrics, grads


VARIANTS = {
    "grpo-token-mean": (PolicyLossConfig(), {}),
    "dapo-asymmetric-dual-clip": (PolicyLossConfig(clip_ratio_high=0.28), dict(dual_clip=True)),
    "ppo-seq-mean-token-mean": (PolicyLossConfig(loss_agg_mode="seq-mean-token-mean"), {}),
    "ppo-seq-mean-token-sum": (PolicyLossConfig(loss_agg_mode="seq-mean-token-sum"), {}),
    "gspo": (PolicyLossConfig(policy_loss="gspo", clip_ratio_low=3e-4, clip_ratio_high=4e-4), {}),
    "gspo-token-mean": (PolicyLossConfig(policy_loss="gspo", clip_ratio_low=3e-4, clip_ratio_high=4e-4,
                                         loss_agg_mode="token-mean"), {}),
    "kl-entropy-temperature": (PolicyLossConfig(kl_coef=0.1, entropy_coef=0.01, temperature=0.7),
                               dict(temperature=0.7)),
}


@pytest.mark.parametrize("name", list(VARIANTS))
def test_gold_matches_float64_formulas(name):
    cfg, opts = VARIANTS[name]
    inputs = make_inputs(**opts)
    loss, metrics = reference_linear_policy_loss(**inputs, cfg=cfg)
    want, want_metrics, _ = numpy_policy_loss(inputs, cfg)
    assert loss.dtype == torch.float64
    assert abs(float(loss) - want) <= 1e-12 * max(1.0, abs(want))
    for key, value in metrics.items():
        assert abs(float(value) - want_metrics[key]) <= 1e-12, key
    # The inputs exercise the clip: some tokens clipped, not all (else the clip bounds go untested).
    assert 0 < want_metrics["pg_clipfrac"] < 1


def test_the_formula_tests_see_each_knob():
    """Each knob changes the loss on these inputs, so a gold that dropped one would fail above."""
    inputs = make_inputs(seed=7, dual_clip=True)
    base = PolicyLossConfig(clip_ratio_high=0.28, kl_coef=0.1, entropy_coef=0.01)
    loss = numpy_policy_loss(inputs, base)[0]
    for change in (dict(clip_ratio_high=0.2), dict(clip_ratio_low=0.1), dict(clip_ratio_c=10.0), dict(kl_coef=0.0),
                   dict(entropy_coef=0.0), dict(loss_agg_mode="seq-mean-token-mean"), dict(policy_loss="gspo")):
        assert abs(numpy_policy_loss(inputs, dataclasses.replace(base, **change))[0] - loss) > 1e-6, change
    assert numpy_policy_loss(inputs, base)[1]["pg_clipfrac_lower"] > 0


def test_normalizer_divides_the_sum():
    inputs = make_inputs()
    cfg = PolicyLossConfig()
    loss = reference_linear_policy_loss(**inputs, cfg=cfg, normalizer=40.0)[0]
    assert abs(float(loss) - numpy_policy_loss(inputs, cfg, normalizer=40.0)[0]) < 1e-12


@pytest.mark.parametrize("name", list(VARIANTS))
def test_gold_gradients_match_the_closed_form(name):
    """Autograd of the gold equals the per-token closed form (float64) that the fused kernels implement."""
    cfg, opts = VARIANTS[name]
    inputs = make_inputs(**opts)
    hidden = inputs.pop("hidden").requires_grad_(True)
    weight = inputs.pop("lm_head_weight").requires_grad_(True)
    reference_linear_policy_loss(hidden, weight, **inputs, cfg=cfg, normalizer=5.0)[0].backward()
    dhidden, dweight = numpy_policy_loss(dict(inputs, hidden=hidden, lm_head_weight=weight), cfg, normalizer=5.0)[2]
    assert np.abs(hidden.grad.numpy() - dhidden).max() <= 1e-12
    assert np.abs(weight.grad.numpy() - dweight).max() <= 1e-12
    assert np.abs(dhidden).max() > 1e-3  # a live gradient, not zeros compared with zeros


def test_per_sequence_advantages_broadcast():
    inputs = make_inputs()
    per_seq = inputs["advantages"][:, 0].clone()
    broadcast = dict(inputs, advantages=per_seq[:, None].expand_as(inputs["advantages"]))
    got = reference_linear_policy_loss(**dict(inputs, advantages=per_seq))[0]
    assert torch.equal(got, reference_linear_policy_loss(**broadcast)[0])


# GSPO's loss detaches its sequence ratio but for the token's own logp (verl), so its gradient is
# not the derivative of its value and gradcheck does not apply; the closed-form test covers it.
GRADCHECK_CONFIGS = {
    "token-mean": PolicyLossConfig(clip_ratio_high=0.28, kl_coef=0.1, entropy_coef=0.05, temperature=0.8),
    "seq-mean": PolicyLossConfig(loss_agg_mode="seq-mean-token-mean", kl_coef=0.1),
}


@pytest.mark.parametrize("cfg", list(GRADCHECK_CONFIGS.values()), ids=list(GRADCHECK_CONFIGS))
def test_gold_gradcheck_float64(cfg):
    inputs = make_inputs(seed=1, b=2, t=3, h=4, v=5)
    hidden = inputs.pop("hidden").requires_grad_(True)
    weight = inputs.pop("lm_head_weight").requires_grad_(True)

    def fn(h, w):
        return reference_linear_policy_loss(h, w, **inputs, cfg=cfg)[0]

    assert torch.autograd.gradcheck(fn, (hidden, weight), eps=1e-6, atol=1e-8)


@pytest.mark.parametrize("bad, match", [
    (dict(cfg=PolicyLossConfig(kl_coef=0.1), ref_logprobs=None), "ref_logprobs"),
    ("flat", "hidden"),
    (dict(advantages=torch.zeros(3, 6)), "advantages"),
    (dict(target_ids=torch.zeros(3, 7)), "target_ids"),
])
def test_bad_inputs_raise_one_line(bad, match):
    inputs = make_inputs()
    if bad == "flat":  # GSPO needs sequences: [N,H] is refused
        inputs = {k: v.reshape(21, -1).squeeze(-1) if k != "lm_head_weight" else v for k, v in inputs.items()}
        bad = dict(cfg=PolicyLossConfig(policy_loss="gspo"))
    inputs.update(bad)
    with pytest.raises(ValueError, match=match) as info:
        reference_linear_policy_loss(**inputs)
    assert "\n" not in str(info.value)


@pytest.mark.parametrize("bad", [dict(policy_loss="grpo"), dict(loss_agg_mode="token-sum"), dict(clip_ratio_c=1.0),
                                 dict(temperature=0.0), dict(kl_coef=-1.0)])
def test_bad_configs_raise(bad):
    with pytest.raises(ValueError):
        PolicyLossConfig(**bad)
