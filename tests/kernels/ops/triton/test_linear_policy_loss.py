"""Fused lm_head + policy loss in Triton (CPU interpreter, fp32): against the gold for each variant,
batch invariance of per-token losses and hidden gradients, and the gradient coming from the forward.

Shapes cross the interpreter's token chunk (16), vocabulary chunk (32) and tile (16) borders."""

import pytest
import torch

from rl_engine.kernels.ops.pytorch.loss.linear_policy_loss import HARNESS_CONFIG, NativeLinearPolicyLossOp
from rl_engine.kernels.ops.triton.loss import linear_policy_loss as fused_module
from rl_engine.kernels.ops.triton.loss.linear_policy_loss import TritonLinearPolicyLossOp, config
from rl_engine.losses import linear_policy_loss

B, T, H, V = 2, 11, 16, 40  # 22 tokens > TOKEN_CHUNK 16; V 40 > VOCAB_CHUNK 32, not a multiple of 16


def make_inputs(seed=0, b=B, t=T, temperature=1.0):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(b, t, H, generator=g)
    weight = torch.randn(V, H, generator=g) * 0.4
    target = torch.randint(0, V, (b, t), generator=g)
    logp = torch.log_softmax(hidden @ weight.t() / temperature, -1).gather(-1, target.unsqueeze(-1)).squeeze(-1)
    adv = torch.randn(b, t, generator=g)
    old = logp + 0.3 * torch.randn(b, t, generator=g)
    old = torch.where(adv < -0.5, old - 1.5, old)  # some dual-clipped tokens
    ref = logp + 0.3 * torch.randn(b, t, generator=g)
    mask = (torch.rand(b, t, generator=g) > 0.2).float()
    return dict(hidden=hidden, lm_head_weight=weight, target_ids=target, advantages=adv, old_logprobs=old,
                mask=mask, ref_logprobs=ref)


def run(backend, inputs, **kw):
    hidden = inputs["hidden"].clone().requires_grad_(True)
    weight = inputs["lm_head_weight"].clone().requires_grad_(True)
    loss, metrics = linear_policy_loss(**dict(inputs, hidden=hidden, lm_head_weight=weight), backend=backend, **kw)
    loss.backward()
    return loss.detach(), metrics, hidden.grad, weight.grad


VARIANTS = {
    "grpo": dict(),
    "dapo-kl-entropy-temperature": dict(clip_ratio_high=0.28, kl_coef=0.1, entropy_coef=0.02, temperature=0.7),
    "seq-mean-token-sum": dict(loss_agg_mode="seq-mean-token-sum", compute_entropy=True),
    "gspo": dict(policy_loss="gspo", clip_ratio_low=0.02, clip_ratio_high=0.03, kl_coef=0.1),
}


@pytest.mark.parametrize("name", list(VARIANTS))
def test_fused_loss_matches_the_gold(name):
    kw = VARIANTS[name]
    inputs = make_inputs(temperature=kw.get("temperature", 1.0))
    want_loss, want_metrics, want_dh, want_dw = run("pytorch", inputs, **kw)
    loss, metrics, dh, dw = run("triton", inputs, **kw)
    assert abs(float(loss) - float(want_loss)) <= 1e-5
    assert metrics.keys() == want_metrics.keys()
    for key in metrics:
        assert abs(float(metrics[key]) - float(want_metrics[key])) <= 1e-5, key
    torch.testing.assert_close(dh, want_dh, atol=1e-5, rtol=1e-4)
    torch.testing.assert_close(dw, want_dw, atol=1e-5, rtol=1e-4)
    assert want_dh.abs().max() > 1e-3 and 0 < float(want_metrics["pg_clipfrac"]) < 1


def _token_rows(inputs, b, pad=0):
    """Sequence b alone, right-padded with `pad` inactive tokens of junk."""
    g = torch.Generator().manual_seed(99)
    row = {k: v[b:b + 1] for k, v in inputs.items() if k != "lm_head_weight"}
    if pad:
        row = {k: torch.cat([v, (torch.randint(0, V, (1, pad), generator=g) if k == "target_ids" else
                                 torch.zeros(1, pad) if k == "mask" else
                                 torch.randn((1, pad) + tuple(v.shape[2:]), generator=g))], dim=1)
               for k, v in row.items()}
    return dict(row, lm_head_weight=inputs["lm_head_weight"])


@pytest.mark.parametrize("kw", [dict(normalizer=7.0, kl_coef=0.1, entropy_coef=0.02, temperature=0.7),
                                dict(policy_loss="gspo", clip_ratio_low=0.02, normalizer=3.0)], ids=["ppo", "gspo"])
def test_a_sequence_has_the_same_hidden_gradient_alone_padded_or_permuted(kw):
    """Given the same normaliser, a sequence's hidden gradient bits do not depend on the batch."""
    inputs = make_inputs(b=3, t=9)
    batch = run("triton", inputs, **kw)[2]
    permuted = run("triton", {k: v.flip(0) if k != "lm_head_weight" else v for k, v in inputs.items()}, **kw)[2]
    assert torch.equal(permuted.flip(0), batch)
    assert torch.equal(run("triton", _token_rows(inputs, 1), **kw)[2][0], batch[1])
    assert torch.equal(run("triton", _token_rows(inputs, 2, pad=6), **kw)[2][0, :9], batch[2])


def test_the_invariance_check_sees_a_batch_dependent_normaliser():
    """Planted: token-mean with the batch's own active-token count scales each token by 1/N_batch."""
    inputs = make_inputs(b=3, t=9)
    batch = run("triton", inputs)[2]
    alone = run("triton", _token_rows(inputs, 1))[2]
    assert not torch.equal(alone[0], batch[1])


def test_per_token_losses_are_batch_invariant_and_match_the_gold():
    inputs = make_inputs(b=3, t=9)
    op, gold = TritonLinearPolicyLossOp(), NativeLinearPolicyLossOp()
    whole = op(**inputs)
    torch.testing.assert_close(whole, gold(**inputs), atol=1e-5, rtol=1e-5)
    for b in range(3):
        assert torch.equal(op(**_token_rows(inputs, b, pad=5))[0, :9], whole[b])
    assert HARNESS_CONFIG.entropy_coef > 0 and HARNESS_CONFIG.kl_coef > 0


def test_the_gradient_is_computed_in_the_forward(monkeypatch):
    inputs = make_inputs()
    loss, _, dh, dw = run("triton", inputs)
    hidden = inputs["hidden"].clone().requires_grad_(True)
    weight = inputs["lm_head_weight"].clone().requires_grad_(True)
    loss2, _ = linear_policy_loss(**dict(inputs, hidden=hidden, lm_head_weight=weight))

    def no_kernels(*args, **kwargs):
        raise AssertionError("backward launched the gradient kernels")

    monkeypatch.setattr(fused_module, "_gradients", no_kernels)
    (2 * loss2).backward()  # backward only scales the saved gradients by the upstream
    assert torch.equal(hidden.grad, 2 * dh) and torch.equal(weight.grad, 2 * dw)


def test_the_token_chunk_is_a_constant():
    assert config(torch.float32)["TOKEN_CHUNK"] == fused_module.TOKEN_CHUNK["interpreter"]
    assert config(torch.bfloat16)["TOKEN_CHUNK"] == config(torch.float32)["TOKEN_CHUNK"]


def test_flat_tokens_and_bad_inputs():
    inputs = make_inputs()
    flat = {k: (v.reshape(B * T, *v.shape[2:]) if k != "lm_head_weight" else v) for k, v in inputs.items()}
    loss_flat = linear_policy_loss(**flat)[0]
    assert torch.equal(loss_flat, linear_policy_loss(**inputs)[0])
    with pytest.raises(ValueError, match="needs sequences"):
        linear_policy_loss(**flat, policy_loss="gspo")
    with pytest.raises(ValueError, match="backend"):
        linear_policy_loss(**inputs, backend="cuda")


def test_torch_compile_traces_the_custom_op_and_gives_the_eager_bits():
    inputs = make_inputs()
    kw = dict(kl_coef=0.1, entropy_coef=0.02)
    compiled = torch.compile(lambda **x: linear_policy_loss(**x, **kw), backend="aot_eager", fullgraph=True)
    eager = run("triton", inputs, **kw)
    hidden = inputs["hidden"].clone().requires_grad_(True)
    weight = inputs["lm_head_weight"].clone().requires_grad_(True)
    loss, metrics = compiled(**dict(inputs, hidden=hidden, lm_head_weight=weight))
    loss.backward()
    assert torch.equal(loss.detach(), eager[0]) and torch.equal(metrics["entropy"], eager[1]["entropy"])
    assert torch.equal(hidden.grad, eager[2]) and torch.equal(weight.grad, eager[3])


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
def test_backward_scales_the_gradients_in_place_with_the_bits_of_one_multiply(dtype):
    # The loss's backward multiplies the saved [V,H] gradient by the upstream scalar in place (no second
    # [V,H] copy): the fp32 product rounded once, as torch computes it; g = 1 leaves it untouched.
    for shape in ((10, 7), (2, 5, 4), (0, 4), (3, 13)):
        grad = torch.randn(shape).to(dtype)
        for g in (1.0, 0.37, -3.0):
            g = torch.tensor(g)
            scaled = grad.clone()
            fused_module.scale_gradient_(scaled, g)
            assert torch.equal(scaled, (grad.float() * g).to(dtype)), (shape, g)


def test_a_second_backward_through_the_loss_fails_loudly():
    # The gradient computed in forward is scaled in place by the first backward: a retained graph's second
    # backward must refuse (autograd's saved-tensor version check), not return a gradient scaled twice.
    inputs = make_inputs()
    hidden = inputs["hidden"].clone().requires_grad_(True)
    weight = inputs["lm_head_weight"].clone().requires_grad_(True)
    loss, _ = linear_policy_loss(**dict(inputs, hidden=hidden, lm_head_weight=weight), backend="triton")
    loss.backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        loss.backward()


# --- non-finite inputs: NaN or an error, never a finite loss (#56) ---------------------------------------------

SMALL = dict(b=1, t=5)


@pytest.mark.parametrize("backend", ["triton", "pytorch"])
@pytest.mark.parametrize("bad_id", [V, -1, 10**6])
def test_an_id_outside_the_vocabulary_is_an_error_on_the_cpu(backend, bad_id):
    inputs = make_inputs(**SMALL)
    inputs["target_ids"][0, 2] = bad_id
    with pytest.raises((ValueError, IndexError, RuntimeError), match=r"target_ids|index|out of bounds"):
        linear_policy_loss(**inputs, backend=backend)


@pytest.mark.parametrize("bad_id", [V, -1])
def test_without_the_host_check_an_id_outside_the_vocabulary_makes_the_loss_nan(bad_id):
    """The GPU path (no host read): the op itself turns the token's logp into NaN, for every tile layout."""
    inputs = make_inputs(**SMALL)
    inputs["target_ids"][0, 3] = bad_id
    i = inputs
    out = fused_module.linear_policy_loss_op(
        i["hidden"], i["lm_head_weight"], i["target_ids"], i["advantages"], i["old_logprobs"], None, i["mask"],
        i["mask"], "ppo", 0.2, 0.2, 3.0, 0.0, 0.0, 1.0, False, True, False)
    loss, logp, grad_hidden = out[0], out[1], out[6]
    assert torch.isnan(loss) and torch.isnan(logp[0, 3]) and torch.isfinite(logp[0, :3]).all()
    assert torch.isnan(grad_hidden[0, 3]).all()


@pytest.mark.parametrize("backend", ["triton", "pytorch"])
@pytest.mark.parametrize("which,value", [("old_logprobs", float("-inf")), ("old_logprobs", float("inf")),
                                         ("old_logprobs", float("nan")), ("ref_logprobs", float("-inf")),
                                         ("ref_logprobs", float("nan"))])
def test_a_non_finite_old_or_reference_logprob_makes_the_loss_and_gradients_nan(backend, which, value):
    inputs = make_inputs(**SMALL)
    inputs[which][0, 1] = value
    loss, metrics, dh, _ = run(backend, inputs, kl_coef=0.1)
    assert torch.isnan(loss) and torch.isnan(dh).any()
    if which == "old_logprobs":
        assert torch.isnan(metrics["ppo_kl"])


@pytest.mark.parametrize("kw,message", [
    (dict(kl_coef=float("nan")), "kl_coef: expected a finite number >= 0, got nan"),
    (dict(kl_coef=float("inf")), "kl_coef"),
    (dict(entropy_coef=float("nan")), "entropy_coef"),
    (dict(temperature=float("inf")), "temperature: expected a positive finite number"),
    (dict(temperature=float("nan")), "temperature"),
    (dict(normalizer=0), "normalizer: expected a positive finite number, got 0"),
    (dict(normalizer=-2.0), "normalizer"),
    (dict(normalizer=float("nan")), "normalizer"),
    (dict(normalizer=float("inf")), "normalizer"),
])
def test_non_finite_or_non_positive_settings_are_refused(kw, message):
    inputs = make_inputs(**SMALL)
    for backend in ("triton", "pytorch"):
        with pytest.raises(ValueError, match=message):
            linear_policy_loss(**inputs, backend=backend, **kw)
