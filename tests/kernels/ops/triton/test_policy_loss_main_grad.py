"""The fp32 main-grad mode of the fused linear policy loss: the lean mode's loss, logp, metric and dhidden bits;
dL/dW added into the caller's fp32 buffer (or the weight's Megatron-style .main_grad), in fixed token-chunk
order, the weight left without .grad; closer to fp64 than the bf16 gradient; bad buffers refused by name."""

import pytest
import torch

from rl_engine.losses import linear_policy_loss

B, T, H, V = 3, 8, 16, 40  # 24 tokens: past the interpreter's token chunk (16), so chunks accumulate
OPTIONS = {"clip_ratio_high": 0.28, "kl_coef": 0.1, "entropy_coef": 0.01, "temperature": 0.9}


def inputs(dtype=torch.bfloat16, seed=0):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(B, T, H, generator=g).to(dtype)
    weight = (torch.randn(V, H, generator=g) / 4).to(dtype)
    ids = torch.randint(0, V, (B, T), generator=g)
    adv = torch.randn(B, generator=g)
    old = -torch.rand(B, T, generator=g) * 3
    ref = -torch.rand(B, T, generator=g) * 3
    mask = torch.ones(B, T)
    mask[1, 5:] = 0
    return hidden, weight, ids, adv, old, mask, ref


def step(main_grad=None, backend="triton", dtype=torch.bfloat16, attribute=False, **options):
    hidden, weight, *rest = inputs(dtype)
    hidden.requires_grad_(True)
    weight.requires_grad_(True)
    if attribute:
        weight.main_grad = main_grad
        main_grad = None
    loss, metrics = linear_policy_loss(hidden, weight, *rest, **{**OPTIONS, **options}, backend=backend,
                                       main_grad=main_grad)
    loss.backward()
    return loss.detach(), metrics, hidden.grad, weight.grad


@pytest.mark.parametrize("policy_loss", ["ppo", "gspo"])
def test_main_grad_mode_has_the_lean_bits_and_accumulates_the_weight_gradient_in_fp32(policy_loss):
    lean = step(policy_loss=policy_loss)
    buffer = torch.zeros(V, H)
    loss, metrics, dhidden, dweight = step(buffer, policy_loss=policy_loss)
    assert torch.equal(loss, lean[0]) and metrics.keys() == lean[1].keys()
    assert all(torch.equal(metrics[k], lean[1][k]) for k in metrics)
    assert torch.equal(dhidden, lean[2])
    assert dweight is None  # the buffer holds it
    # the same fp32 sums in the same order; the lean mode rounds them once to bf16
    assert torch.equal(buffer.to(torch.bfloat16), lean[3])
    first = buffer.clone()
    step(buffer, policy_loss=policy_loss)  # a second micro-batch adds on
    torch.testing.assert_close(buffer, 2 * first, rtol=1e-6, atol=1e-7)


def test_the_weights_megatron_main_grad_is_used_and_the_gold_agrees():
    buffer = torch.zeros(V, H)
    step(buffer, attribute=True)
    gold = torch.zeros(V, H)
    _, _, _, none = step(gold, backend="pytorch")
    assert none is None and bool(buffer.abs().sum() > 0)
    torch.testing.assert_close(buffer, gold, rtol=2e-2, atol=2e-4)


def test_main_grad_is_closer_to_fp64_than_the_bf16_gradient():
    exact = torch.zeros(V, H, dtype=torch.float64)
    hidden, weight, ids, adv, old, mask, ref = inputs()
    w64 = weight.double().requires_grad_(True)
    loss, _ = linear_policy_loss(hidden.double(), w64, ids, adv.double(), old.double(), mask.double(), ref.double(),
                                 **OPTIONS, backend="pytorch")
    loss.backward()
    exact = w64.grad
    buffer = torch.zeros(V, H)
    step(buffer)
    lean = step()[3]
    err_main = (buffer.double() - exact).abs().max()
    err_lean = (lean.double() - exact).abs().max()
    assert err_main < err_lean, (err_main, err_lean)


def test_gold_main_grad_mode_is_the_gold_gradient_in_fp64():
    buffer = torch.zeros(V, H, dtype=torch.float32)
    hidden, weight, *rest = inputs(torch.float64)
    weight.requires_grad_(True)
    with pytest.raises(ValueError, match="main_grad: expected a contiguous torch.float32"):
        linear_policy_loss(hidden, weight, *rest, backend="pytorch", main_grad=buffer.double())
    w32 = weight.detach().float().requires_grad_(True)
    linear_policy_loss(hidden.float(), w32, *rest, **OPTIONS, backend="pytorch")[0].backward()
    linear_policy_loss(hidden.float(), weight.detach().float().requires_grad_(True), *rest, **OPTIONS,
                       backend="pytorch", main_grad=buffer)[0].backward()
    assert torch.equal(buffer, w32.grad)


@pytest.mark.parametrize(("bad", "message"), [
    (torch.zeros(V, H, dtype=torch.bfloat16), "torch.bfloat16"),
    (torch.zeros(V, H + 1), r"\(40, 17\)"),
    (torch.zeros(H, V).t(), "not contiguous"),
    ("buffer", "str"),
])
def test_a_bad_main_grad_is_refused_by_name(bad, message):
    hidden, weight, *rest = inputs()
    for backend in ("triton", "pytorch"):
        with pytest.raises(ValueError, match=f"main_grad: .*{message}"):
            linear_policy_loss(hidden, weight, *rest, backend=backend, main_grad=bad)


@pytest.mark.gpu
@pytest.mark.parametrize("policy_loss", ["ppo", "gspo"])
def test_main_grad_mode_on_the_gpu_has_the_lean_bits(policy_loss):
    """The compiled kernels, past one GPU token chunk (4096): lean bits, and main_grad cast == lean dW."""
    g = torch.Generator(device="cuda").manual_seed(0)
    b, t, h, v = 5, 1000, 256, 3000
    hidden = torch.randn(b, t, h, device="cuda", generator=g).to(torch.bfloat16)
    weight = (torch.randn(v, h, device="cuda", generator=g) / 16).to(torch.bfloat16)
    ids = torch.randint(0, v, (b, t), device="cuda", generator=g)
    adv = torch.randn(b, device="cuda", generator=g)
    old = -torch.rand(b, t, device="cuda", generator=g) * 3
    runs = []
    for buffer in (None, torch.zeros(v, h, device="cuda")):
        x, w = hidden.clone().requires_grad_(True), weight.clone().requires_grad_(True)
        loss, metrics = linear_policy_loss(x, w, ids, adv, old, None, None, policy_loss=policy_loss, main_grad=buffer)
        loss.backward()
        runs.append((loss.detach(), metrics, x.grad, w.grad if buffer is None else buffer.to(torch.bfloat16)))
    (l1, m1, h1, w1), (l2, m2, h2, w2) = runs
    assert torch.equal(l1, l2) and all(torch.equal(m1[k], m2[k]) for k in m1)
    assert torch.equal(h1, h2) and torch.equal(w1, w2)
