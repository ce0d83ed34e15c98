"""The fp32 main-grad mode of the fused linear policy loss (issue 55): 3 GEMMs' work in token chunks.

What is pinned here, on the CPU interpreter (tiny shapes: the interpreter's token chunk is 16 rows, so 24-48
tokens cross chunk borders):
- the loss, per-token logp / loss / a / b / clip / KL terms and the metrics are the lean mode's, bit for bit;
- dhidden and the dW added into the caller's fp32 buffer agree with fp64: |err| <= 1e-2 max|grad| for bf16
  inputs (dlogits are rounded to bf16 for the GEMMs, as in the lean mode), <= 1e-5 max|grad| for fp32 inputs;
  and with fp64 central differences of the gold loss (gradcheck-style), through an upstream of 1 and not;
- dW is summed over token chunks in their fixed order (a reversed or dropped chunk is caught);
- a sequence's dhidden rows are the same alone and in a batch (the chunk size changes with N, no bit does);
- working memory beyond the caller's buffer <= 2% of the fp32 logits at the issue's shapes (GPU configuration).
"""

import pytest
import torch

from rl_engine.kernels.ops.triton.loss import linear_policy_loss as ours
from rl_engine.losses import linear_policy_loss

B, T, H, V = 3, 8, 16, 40  # 24 tokens: past the interpreter's main-grad chunk (16), so chunks accumulate
OPTIONS = {"clip_ratio_high": 0.28, "kl_coef": 0.1, "entropy_coef": 0.01, "temperature": 0.9}
TOLERANCE = {torch.bfloat16: 1e-2, torch.float32: 1e-5}  # max |err| / max |fp64 gradient|


def inputs(dtype=torch.bfloat16, seed=0, b=B, t=T):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(b, t, H, generator=g).to(dtype)
    weight = (torch.randn(V, H, generator=g) / 2).to(dtype)
    ids = torch.randint(0, V, (b, t), generator=g)
    adv = torch.randn(b, generator=g)
    old = -torch.rand(b, t, generator=g) * 3
    ref = -torch.rand(b, t, generator=g) * 3
    mask = torch.ones(b, t)
    mask[1, 5:] = 0
    return hidden, weight, ids, adv, old, mask, ref


def step(main_grad=None, backend="triton", dtype=torch.bfloat16, attribute=False, upstream=1.0, data=None,
         **options):
    hidden, weight, *rest = data if data is not None else inputs(dtype)
    hidden = hidden.clone().requires_grad_(True)
    weight = weight.clone().requires_grad_(True)
    if attribute:
        weight.main_grad = main_grad
        main_grad = None
    loss, metrics = linear_policy_loss(hidden, weight, *rest, **{**OPTIONS, **options}, backend=backend,
                                       main_grad=main_grad)
    (loss * upstream if upstream != 1.0 else loss).backward()
    return loss.detach(), metrics, hidden.grad, weight.grad


def fp64_gradients(data, **options):
    """(dL/dhidden, dL/dW) of the gold in fp64 on the same (rounded) inputs."""
    hidden, weight, *rest = data
    h64, w64 = hidden.double().requires_grad_(True), weight.double().requires_grad_(True)
    rest = [t.double() if t is not None and t.is_floating_point() else t for t in rest]
    linear_policy_loss(h64, w64, *rest, **{**OPTIONS, **options}, backend="pytorch")[0].backward()
    return h64.grad, w64.grad


def relative_error(got, want):
    return float((got.double() - want).abs().max() / want.abs().max())


@pytest.mark.parametrize(("policy_loss", "agg"), [("ppo", None), ("gspo", None), ("ppo", "seq-mean-token-sum")])
def test_the_loss_per_token_and_metric_bits_are_the_lean_modes(policy_loss, agg):
    cfg = ours.PolicyLossConfig(policy_loss=policy_loss, loss_agg_mode=agg, clip_ratio_high=0.28, kl_coef=0.1,
                                entropy_coef=0.01, temperature=0.9)
    hidden, weight, ids, adv, old, mask, ref = inputs()
    adv = adv[:, None].expand(B, T)
    token_weight = ours.aggregation_weights(mask, cfg)
    lean = ours._policy_terms(hidden, weight, ids, adv, old, ref, mask, token_weight, cfg)
    buffer = torch.zeros(V, H)
    main, dhidden = ours._main_grad_forward(hidden, weight, ids, adv, old, ref, mask, token_weight, cfg, buffer, True)
    for key in ("logp", "lse", "mean_z", "loss", "dlogp", "dent", "clipped", "clipped_lower", "kl"):
        assert torch.equal(main[key], lean[key]), key
    assert dhidden.shape == (B * T, H) and bool(buffer.abs().sum() > 0)
    if agg is not None:
        return
    # the public API: the same loss and metrics, the weight without .grad, the buffer filled
    lean_run = step(policy_loss=policy_loss, loss_agg_mode=agg)
    buffer = torch.zeros(V, H)
    loss, metrics, _, dweight = step(buffer, policy_loss=policy_loss, loss_agg_mode=agg)
    assert torch.equal(loss, lean_run[0]) and metrics.keys() == lean_run[1].keys()
    assert all(torch.equal(metrics[k], lean_run[1][k]) for k in metrics)
    assert dweight is None and bool(buffer.abs().sum() > 0)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("policy_loss", ["ppo", "gspo"])
def test_the_gradients_agree_with_fp64(dtype, policy_loss):
    data = inputs(dtype)
    want_dh, want_dw = fp64_gradients(data, policy_loss=policy_loss)
    buffer = torch.zeros(V, H)
    _, _, dhidden, _ = step(buffer, data=data, policy_loss=policy_loss)
    assert dhidden.dtype == dtype
    assert relative_error(dhidden, want_dh) <= TOLERANCE[dtype]
    assert relative_error(buffer, want_dw) <= TOLERANCE[dtype]
    if dtype == torch.bfloat16:  # and the fp32 buffer is no further from fp64 than the lean mode's bf16 dW
        lean_dw = step(data=data, policy_loss=policy_loss)[3]
        assert relative_error(buffer, want_dw) <= relative_error(lean_dw, want_dw)


def test_gradcheck_style_fp64_the_main_grad_buffer_is_the_checked_fp64_gradient_through_any_upstream():
    """torch.autograd.gradcheck passes the fp64 gold (its analytic gradient is its central differences: every
    entry of dW, a random projection of dhidden and dW together); the
    main-grad mode (fp32 inputs, IEEE fp32 products) adds that gradient into the buffer, on top of what the
    buffer held, for an upstream of 1 (3 GEMMs) and of 0.5 (the correcting pass adds (g - 1) dW)."""
    b, t, h, v = 2, 12, 4, 20  # 24 tokens: two chunks
    g = torch.Generator().manual_seed(3)
    hidden = torch.randn(b, t, h, generator=g, dtype=torch.float64)
    weight = torch.randn(v, h, generator=g, dtype=torch.float64)
    ids = torch.randint(0, v, (b, t), generator=g)
    adv, old, ref = torch.randn(b, generator=g), -torch.rand(b, t, generator=g) * 3, -torch.rand(b, t, generator=g)
    mask = torch.ones(b, t)
    mask[0, 9:] = 0
    rest = (ids, adv.double(), old.double(), mask.double(), ref.double())

    def gold(x, w):
        return linear_policy_loss(x, w, *rest, **OPTIONS, backend="pytorch")[0]

    x64, w64 = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    assert torch.autograd.gradcheck(lambda w: gold(hidden, w), (w64,))  # every entry of dW
    assert torch.autograd.gradcheck(gold, (x64, w64), fast_mode=True)  # and a random projection of both
    want_dh, want_dw = torch.autograd.grad(gold(x64, w64), (x64, w64))
    start = torch.randn(v, h, generator=g)
    for upstream in (1.0, 0.5):
        buffer = start.clone()
        x, w = hidden.float().requires_grad_(), weight.float().requires_grad_()
        loss = linear_policy_loss(x, w, ids, adv, old, mask, ref, **OPTIONS, main_grad=buffer)[0]
        (loss * upstream).backward()
        assert w.grad is None
        torch.testing.assert_close(buffer.double() - start.double(), upstream * want_dw, rtol=1e-4, atol=1e-6)
        torch.testing.assert_close(x.grad.double(), upstream * want_dh, rtol=1e-4, atol=1e-6)


def test_an_upstream_of_one_runs_one_pass_and_another_one_more(monkeypatch):
    passes = []
    real = ours._main_grad_pass
    monkeypatch.setattr(ours, "_main_grad_pass", lambda *a, **k: passes.append(a[6] is not None) or real(*a, **k))
    step(torch.zeros(V, H))
    assert passes == [True]  # the forward's pass, with dhidden: 3 GEMMs in all
    step(torch.zeros(V, H), upstream=2.0)
    assert passes == [True, True, False]  # the correcting pass: dW only


def _chunks_alone(data, normalizer):
    """Each main-grad token chunk of the flattened batch run alone into a zero buffer (same normaliser)."""
    hidden, weight, ids, adv, old, mask, ref = data
    adv = adv[:, None].expand_as(old)
    n = ids.numel()
    c = ours.chunk_rows(ours.config(hidden.dtype), n)
    parts = []
    for t0 in range(0, n, c):
        at = slice(t0, min(t0 + c, n))
        flat = [t.reshape(n, *t.shape[2:])[at] for t in (hidden, ids, adv, old, mask, ref)]
        buffer = torch.zeros(V, H)
        x, i, a, o, m, r = flat
        step(buffer, data=(x, weight, i, a, o, m, r), normalizer=normalizer)
        parts.append(buffer)
    return parts


def test_dw_is_summed_over_token_chunks_in_their_fixed_order_and_a_wrong_order_is_caught(monkeypatch):
    """On the interpreter a chunk (16 tokens) is one K step of the dW GEMM, so the buffer is exactly
    ((0 + P0) + P1) + P2, P_c the chunk's own product (a token's dlogits are the same alone: its normaliser
    is fixed). A reversed order gives other fp32 bits; a dropped chunk misses the fp64 tolerance."""
    data = inputs(b=6, t=8)  # 48 tokens: three chunks
    normalizer = float(data[5].sum())
    want = torch.zeros(V, H)
    for part in _chunks_alone(data, normalizer):
        want = want + part
    hidden, weight, ids, adv, old, mask, ref = data
    flat = (hidden.reshape(48, H), weight, ids.reshape(48), adv[:, None].expand(6, 8).reshape(48), old.reshape(48),
            mask.reshape(48), ref.reshape(48))

    def run():
        buffer = torch.zeros(V, H)
        step(buffer, data=flat, normalizer=normalizer)
        return buffer

    assert torch.equal(run(), want)
    monkeypatch.setattr(ours, "_chunk_starts", lambda n, c: reversed(range(0, n, c)))
    reordered = run()
    assert not torch.equal(reordered, want)  # caught
    torch.testing.assert_close(reordered, want, rtol=1e-5, atol=1e-6)  # by the bits only: a sum's order
    monkeypatch.setattr(ours, "_chunk_starts", lambda n, c: range(0, n - c, c))
    _, want_dw = fp64_gradients(flat, normalizer=normalizer)
    assert relative_error(run(), want_dw) > TOLERANCE[torch.bfloat16]  # a dropped chunk: caught


def test_a_sequences_hidden_gradient_is_the_same_alone_and_in_a_batch():
    """The chunk grows with N (interpreter: 16 rows at 16-63 tokens, 32 at 64), no per-row bit does."""
    data = inputs(b=8, t=8)  # 64 tokens: 32-row chunks
    normalizer = float(data[5].sum())
    assert ours.chunk_rows(ours.config(torch.bfloat16), 64) == 32
    assert ours.chunk_rows(ours.config(torch.bfloat16), 8) == 16
    _, _, batch, _ = step(torch.zeros(V, H), data=data, normalizer=normalizer)
    hidden, weight, ids, adv, old, mask, ref = data
    one = (hidden[3:4], weight, ids[3:4], adv[3:4], old[3:4], mask[3:4], ref[3:4])
    _, _, alone, _ = step(torch.zeros(V, H), data=one, normalizer=normalizer)
    assert torch.equal(alone[0], batch[3])


def test_a_second_micro_batch_adds_on_and_the_megatron_attribute_is_used():
    buffer = torch.zeros(V, H)
    step(buffer, attribute=True)
    first = buffer.clone()
    step(buffer)
    torch.testing.assert_close(buffer, 2 * first, rtol=1e-6, atol=1e-7)
    gold = torch.zeros(V, H)
    _, _, _, none = step(gold, backend="pytorch")
    assert none is None
    torch.testing.assert_close(first, gold, rtol=2e-2, atol=2e-4)


def test_working_memory_is_under_two_percent_of_the_logits_at_the_issues_shapes():
    """GPU configuration, bf16, H = 4096, V = 151936: C = 128 / 256 tokens a chunk at N = 4096 / 8192."""
    h, v = 4096, 151936
    gpu = ours.config(torch.bfloat16, "gpu")
    for n, c in ((4096, 128), (8192, 256)):
        assert ours.chunk_rows(gpu, n) == c
        share = ours.main_grad_work_bytes(n, h, v) / (n * v * 4)
        assert share <= 0.02, (n, share)
    assert ours.main_grad_work_bytes(4096, h, v, torch.float32) / (4096 * v * 4) <= 0.02


def test_gold_main_grad_mode_is_the_gold_gradient():
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
def test_main_grad_mode_on_the_gpu_has_the_lean_bits_and_fp64_close_gradients(policy_loss):
    """The compiled kernels past several main-grad chunks (128 rows at 5000 tokens): the lean mode's loss and
    metric bits; dhidden and the fp32 buffer within the bf16 tolerance of an fp64 gold."""
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
        runs.append((loss.detach(), metrics, x.grad, w.grad if buffer is None else buffer))
    (l1, m1, _, _), (l2, m2, h2, w2) = runs
    assert torch.equal(l1, l2) and all(torch.equal(m1[k], m2[k]) for k in m1)
    want_dh, want_dw = fp64_gradients((hidden, weight, ids, adv, old, torch.ones(b, t, device="cuda"), None),
                                      policy_loss=policy_loss, kl_coef=0.0, entropy_coef=0.0, temperature=1.0,
                                      clip_ratio_high=0.2)
    assert relative_error(h2, want_dh) <= TOLERANCE[torch.bfloat16]
    assert relative_error(w2, want_dw) <= TOLERANCE[torch.bfloat16]
