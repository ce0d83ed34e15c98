"""On the GPU: the fused policy loss (gradient in the forward) against the fp32 gold, bf16 judged
against plain bf16 PyTorch's error (the contract's baseline_relative rule, k = 2), and batch
invariance of a sequence's hidden gradient. Qwen3-8B hidden size, vocab 32768, 2048 tokens."""

import pytest
import torch

from rl_engine.kernels.ops.pytorch.loss.linear_policy_loss import (
    PolicyLossConfig,
    policy_loss_from_logits,
    reference_linear_policy_loss,
)
from rl_engine.losses import linear_policy_loss

pytestmark = pytest.mark.gpu

B, T, H, V = 4, 512, 4096, 32768
VARIANTS = {
    "dapo-kl-entropy": dict(clip_ratio_high=0.28, kl_coef=0.04, entropy_coef=0.01, temperature=0.8),
    "gspo": dict(policy_loss="gspo", clip_ratio_low=3e-3, clip_ratio_high=4e-3),
}


def make_inputs(dtype, temperature=1.0):
    g = torch.Generator(device="cuda").manual_seed(0)
    hidden = torch.randn(B, T, H, device="cuda", generator=g)
    weight = torch.randn(V, H, device="cuda", generator=g) / H**0.5 * 2
    target = torch.randint(0, V, (B, T), device="cuda", generator=g)
    hidden, weight = hidden.to(dtype), weight.to(dtype)
    with torch.no_grad():
        logits = (hidden.float() @ weight.float().t()) / temperature
        logp = torch.log_softmax(logits, -1).gather(-1, target.unsqueeze(-1)).squeeze(-1)
    adv = torch.randn(B, 1, device="cuda", generator=g).expand(B, T).contiguous()
    old = logp + 0.2 * torch.randn(B, T, device="cuda", generator=g)
    ref = logp + 0.2 * torch.randn(B, T, device="cuda", generator=g)
    mask = (torch.rand(B, T, device="cuda", generator=g) > 0.1).float()
    return dict(hidden=hidden, lm_head_weight=weight, target_ids=target, advantages=adv, old_logprobs=old,
                mask=mask, ref_logprobs=ref)


def grads(fn, inputs, **kw):
    h = inputs["hidden"].detach().requires_grad_(True)
    w = inputs["lm_head_weight"].detach().requires_grad_(True)
    loss = fn(**dict(inputs, hidden=h, lm_head_weight=w), **kw)
    loss = loss[0] if isinstance(loss, tuple) else loss
    dh, dw = torch.autograd.grad(loss, (h, w))
    return loss.detach().double(), dh.double(), dw.double()


def baseline(kw):
    """Plain PyTorch in the inputs' dtype: bf16 logits, log_softmax in bf16."""
    cfg = PolicyLossConfig(**kw)

    def fn(hidden, lm_head_weight, target_ids, advantages, old_logprobs, mask, ref_logprobs):
        return policy_loss_from_logits(hidden @ lm_head_weight.t(), target_ids, advantages, old_logprobs, mask,
                                       ref_logprobs, cfg)[0]
    return fn


@pytest.mark.parametrize("name", list(VARIANTS))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_fused_loss_matches_the_gold_on_the_gpu(dtype, name):
    kw = VARIANTS[name]
    inputs = make_inputs(dtype, kw.get("temperature", 1.0))
    # The gold differentiates fp32 copies (exact) so its gradients are not rounded to the case dtype.
    fp32 = {k: (v.float() if v.is_floating_point() else v) for k, v in inputs.items()}
    gold = grads(lambda **x: reference_linear_policy_loss(**x, cfg=PolicyLossConfig(**kw)), fp32)
    ours = grads(linear_policy_loss, inputs, **kw)
    if dtype == torch.float32:
        for got, want in zip(ours, gold):
            torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
        return
    base = grads(baseline(kw), inputs)
    for i, (got, want, plain) in enumerate(zip(ours, gold, base)):
        err, plain_err = (got - want).abs().max().item(), (plain - want).abs().max().item()
        assert err <= 2 * plain_err + 1e-4, (i, err, plain_err)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("name", list(VARIANTS))
def test_a_sequence_alone_has_its_batch_gradient_bits(name, dtype):
    kw = dict(VARIANTS[name], normalizer=1000.0)
    inputs = make_inputs(dtype, kw.get("temperature", 1.0))
    _, dh, _ = grads(linear_policy_loss, inputs, **kw)
    for b in (0, 2):
        one = {k: (v[b:b + 1] if k != "lm_head_weight" else v) for k, v in inputs.items()}
        _, dh_one, _ = grads(linear_policy_loss, one, **kw)
        assert torch.equal(dh_one[0], dh[b])
