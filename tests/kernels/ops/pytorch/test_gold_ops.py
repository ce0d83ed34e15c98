"""Gold operators against independent float64 formulas, gradcheck, and input validation."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from rl_engine.kernels.ops.pytorch.activation.silu import NativeSiluOp
from rl_engine.kernels.ops.pytorch.activation.swiglu import NativeSwigluOp
from rl_engine.kernels.ops.pytorch.attention.attention import NativeAttentionOp
from rl_engine.kernels.ops.pytorch.attention.kv_cache_attention import NativeKvCacheAttentionOp
from rl_engine.kernels.ops.pytorch.embedding.embedding import NativeEmbeddingOp
from rl_engine.kernels.ops.pytorch.linear.lm_head import NativeLmHeadOp
from rl_engine.kernels.ops.pytorch.linear.matmul import NativeMatmulOp
from rl_engine.kernels.ops.pytorch.loss.linear_logp import NativeLinearLogpOp
from rl_engine.kernels.ops.pytorch.loss.logp import NativeLogpOp
from rl_engine.kernels.ops.pytorch.norm.rms_norm import NativeRmsNormOp
from rl_engine.kernels.ops.pytorch.position.rope import NativeRopeOp


def rand(*shape, seed=0, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=g, dtype=torch.float64).to(dtype)


def ids(*shape, high, seed=1):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, high, shape, generator=g)


def close(out, expected, tol=2e-5):
    assert out.dtype == torch.float32
    np.testing.assert_allclose(out.double().numpy(), expected, rtol=tol, atol=tol)


# ---- independent float64 formulas (numpy, loops where the math is a loop) ----

def np_logp(logits, t):
    m = logits.max(-1, keepdims=True)
    lse = np.log(np.exp(logits - m).sum(-1)) + m[..., 0]
    return np.take_along_axis(logits, t[..., None], -1)[..., 0] - lse


def np_attention(q, k, v, positions_q, n_keys, scale):
    """q [B,Sq,Hq,D]; key j visible to query i of row b iff j <= positions_q[b, i] and j < n_keys[b]."""
    b_, sq, hq, d = q.shape
    hkv = k.shape[2]
    out = np.zeros_like(q)
    for b in range(b_):
        for i in range(sq):
            for h in range(hq):
                kh = h // (hq // hkv)
                visible = [j for j in range(int(n_keys[b])) if j <= positions_q[b, i]]
                s = np.array([q[b, i, h] @ k[b, j, kh] * scale for j in visible])
                p = np.exp(s - s.max())
                p /= p.sum()
                out[b, i, h] = sum(pj * v[b, j, kh] for pj, j in zip(p, visible))
    return out


@pytest.mark.parametrize("shape", [(1, 1, 17), (2, 3, 100), (3, 5, 1031)])
def test_logp(shape):
    b, s, v = shape
    logits = rand(b, s, v) * 4
    t = ids(b, s, high=v)
    t[0, 0] = 0
    t[-1, -1] = v - 1
    close(NativeLogpOp()(logits=logits, target_ids=t), np_logp(logits.double().numpy(), t.numpy()))


@pytest.mark.parametrize("bias", [False, True])
def test_linear_logp(bias):
    hidden, w = rand(2, 3, 24), rand(37, 24, seed=2)
    b = rand(37, seed=3) if bias else None
    t = ids(2, 3, high=37)
    logits = hidden.double().numpy() @ w.double().numpy().T + (b.double().numpy() if bias else 0)
    out = NativeLinearLogpOp()(hidden=hidden, lm_head_weight=w, target_ids=t, bias=b)
    close(out, np_logp(logits, t.numpy()))


@pytest.mark.parametrize("h", [7, 64])
def test_rms_norm(h):
    x, w = rand(2, 5, h), rand(h, seed=4)
    xd = x.double().numpy()
    expected = xd / np.sqrt((xd**2).mean(-1, keepdims=True) + 1e-6) * w.double().numpy()
    close(NativeRmsNormOp()(x=x, weight=w), expected)


def test_matmul_and_lm_head():
    a, b = rand(2, 3, 13), rand(13, 11, seed=5)
    close(NativeMatmulOp()(a=a, b=b), a.double().numpy() @ b.double().numpy())
    w = rand(19, 13, seed=6)
    close(NativeLmHeadOp()(hidden=a, weight=w), a.double().numpy() @ w.double().numpy().T)


def test_silu_swiglu():
    g, u = rand(2, 3, 33), rand(2, 3, 33, seed=7)
    gd = g.double().numpy()
    silu = gd / (1 + np.exp(-gd))
    close(NativeSiluOp()(x=g), silu)
    close(NativeSwigluOp()(gate=g, up=u), silu * u.double().numpy())


def test_rope_matches_rotation_formula():
    theta, d = 1e6, 8
    x = rand(2, 3, 2, d)
    pos = torch.tensor([[5, 6, 7], [100, 101, 4000]])
    xd = x.double().numpy()
    expected = np.empty_like(xd)
    for j in range(d // 2):
        freq = theta ** (-2 * j / d)
        ang = pos.numpy()[..., None] * freq
        x1, x2 = xd[..., j], xd[..., j + d // 2]
        expected[..., j] = x1 * np.cos(ang) - x2 * np.sin(ang)
        expected[..., j + d // 2] = x2 * np.cos(ang) + x1 * np.sin(ang)
    # The angle is formed in fp32 (as Hugging Face does); at position 4000 that costs ~1e-4 rad.
    close(NativeRopeOp(theta=theta)(x=x, positions=pos), expected, tol=1e-3)


def test_embedding():
    w = rand(23, 6)
    t = ids(2, 4, high=23)
    t[0, 0], t[1, 3] = 0, 22
    close(NativeEmbeddingOp()(token_ids=t, weight=w), w.double().numpy()[t.numpy()])


@pytest.mark.parametrize("hq,hkv", [(4, 4), (4, 2), (6, 1)])
def test_attention_gqa(hq, hkv):
    b, s, d = 2, 6, 8
    q, k, v = rand(b, s, hq, d), rand(b, s, hkv, d, seed=8), rand(b, s, hkv, d, seed=9)
    positions = np.tile(np.arange(s), (b, 1))
    expected = np_attention(*(t.double().numpy() for t in (q, k, v)), positions, [s] * b, 1 / math.sqrt(d))
    close(NativeAttentionOp()(q=q, k=k, v=v), expected)


def test_attention_non_causal_and_scale():
    q, k, v = rand(1, 4, 2, 4), rand(1, 4, 2, 4, seed=1), rand(1, 4, 2, 4, seed=2)
    expected = np_attention(*(t.double().numpy() for t in (q, k, v)), np.full((1, 4), 3), [4], 0.3)
    close(NativeAttentionOp(causal=False, scale=0.3)(q=q, k=k, v=v), expected)


@pytest.mark.parametrize("sq", [1, 3])
def test_kv_cache_attention_partly_filled(sq):
    b, smax, hq, hkv, d = 2, 9, 4, 2, 8
    q, kc, vc = rand(b, sq, hq, d), rand(b, smax, hkv, d, seed=3), rand(b, smax, hkv, d, seed=4)
    lens = torch.tensor([5, 9])
    positions = lens.numpy()[:, None] - sq + np.arange(sq)[None, :]
    expected = np_attention(*(t.double().numpy() for t in (q, kc, vc)), positions, lens.numpy(), 1 / math.sqrt(d))
    close(NativeKvCacheAttentionOp()(q=q, k_cache=kc, v_cache=vc, cache_seqlens=lens), expected)


@pytest.mark.parametrize("which", ["q", "k", "v"])
@pytest.mark.parametrize("value", [float("nan"), float("inf")], ids=["nan", "inf"])
def test_attention_non_finite_inputs_follow_ieee_over_visible_keys(which, value):
    # The float64 loop formula sums over visible keys only: a NaN/inf reaches the rows that see it, as
    # IEEE says, and no other (the old nan_to_num gold gave 0 for a NaN q and leaked a NaN v everywhere).
    inputs = {"q": rand(1, 6, 2, 4), "k": rand(1, 6, 1, 4, seed=2), "v": rand(1, 6, 1, 4, seed=3)}
    inputs[which][0, 3, 0, 1] = value
    got = NativeAttentionOp()(**inputs)
    expected = np_attention(*(inputs[n].double().numpy() for n in "qkv"), np.arange(6)[None], [6], 0.5)
    np.testing.assert_array_equal(np.isnan(got.numpy()), np.isnan(expected))
    np.testing.assert_array_equal(np.isinf(got.numpy()), np.isinf(expected))
    assert np.isnan(expected).any() or np.isinf(expected).any()
    finite = np.isfinite(expected)
    np.testing.assert_allclose(got.double().numpy()[finite], expected[finite], rtol=2e-5, atol=2e-5)


def test_attention_row_without_visible_key_is_zero_by_the_mask():
    # A row with no visible key outputs 0 even when its q is NaN (decided from the mask, not the values).
    from rl_engine.kernels.ops.pytorch.attention.attention import grouped_attention

    q, k, v = rand(1, 3, 2, 4), rand(1, 3, 1, 4, seed=2), rand(1, 3, 1, 4, seed=3)
    q[0, 0] = float("nan")
    mask = torch.tensor([[[False, False, False], [True, True, False], [True, True, True]]])
    out = grouped_attention(q, k, v, mask, 0.5)
    assert torch.equal(out[0, 0], torch.zeros(2, 4)) and torch.isfinite(out[0, 1:]).all()


# ---- gradients: gradcheck in float64 through the same formulas ----

GRAD_CASES = {
    "logp": (NativeLogpOp(), lambda: {"logits": rand(2, 2, 7), "target_ids": ids(2, 2, high=7)}),
    "linear_logp": (
        NativeLinearLogpOp(),
        lambda: {"hidden": rand(1, 2, 5), "lm_head_weight": rand(7, 5, seed=2), "target_ids": ids(1, 2, high=7),
                 "bias": rand(7, seed=3)},
    ),
    "rms_norm": (NativeRmsNormOp(), lambda: {"x": rand(1, 2, 5), "weight": rand(5, seed=2)}),
    "matmul": (NativeMatmulOp(), lambda: {"a": rand(1, 2, 3), "b": rand(3, 4, seed=2)}),
    "lm_head": (NativeLmHeadOp(), lambda: {"hidden": rand(1, 2, 3), "weight": rand(4, 3, seed=2)}),
    "silu": (NativeSiluOp(), lambda: {"x": rand(1, 2, 5)}),
    "swiglu": (NativeSwigluOp(), lambda: {"gate": rand(1, 2, 5), "up": rand(1, 2, 5, seed=2)}),
    "rope": (NativeRopeOp(), lambda: {"x": rand(1, 2, 2, 4), "positions": torch.tensor([[3, 9]])}),
    "embedding": (NativeEmbeddingOp(), lambda: {"token_ids": torch.tensor([[1, 1, 4]]), "weight": rand(5, 3)}),
    "attention": (
        NativeAttentionOp(),
        lambda: {"q": rand(1, 3, 2, 4), "k": rand(1, 3, 1, 4, seed=2), "v": rand(1, 3, 1, 4, seed=3)},
    ),
    "kv_cache_attention": (
        NativeKvCacheAttentionOp(),
        lambda: {"q": rand(1, 2, 2, 4), "k_cache": rand(1, 5, 1, 4, seed=2), "v_cache": rand(1, 5, 1, 4, seed=3),
                 "cache_seqlens": torch.tensor([4])},
    ),
}


@pytest.mark.parametrize("name", sorted(GRAD_CASES))
def test_gradcheck_float64(name):
    op, make = GRAD_CASES[name]
    inputs = make()
    floats = [k for k, v in inputs.items() if v is not None and v.is_floating_point()]
    for k in floats:
        inputs[k] = inputs[k].double().requires_grad_(True)

    def fn(*tensors):
        return op(**{**inputs, **dict(zip(floats, tensors))})

    assert torch.autograd.gradcheck(fn, tuple(inputs[k] for k in floats), eps=1e-6, atol=1e-5)


def test_reference_is_fp32_and_baseline_keeps_dtype():
    x, w = rand(1, 2, 8, dtype=torch.bfloat16), rand(8, dtype=torch.bfloat16)
    assert NativeRmsNormOp()(x=x, weight=w).dtype == torch.float32
    assert NativeRmsNormOp().baseline(x=x, weight=w).dtype == torch.bfloat16
    logits = rand(1, 2, 9, dtype=torch.bfloat16)
    assert NativeLogpOp()(logits=logits, target_ids=ids(1, 2, high=9)).dtype == torch.float32


def test_reference_turns_tf32_off_and_restores():
    from rl_engine.kernels.registry import tf32_enabled

    seen = {}

    class Probe(NativeMatmulOp):
        def forward(self, **inputs):
            seen["tf32"] = tf32_enabled()
            return super().forward(**inputs)

    matmul = torch.backends.cuda.matmul
    before = matmul.fp32_precision
    matmul.fp32_precision = "tf32"
    try:
        Probe()(a=rand(1, 1, 2), b=rand(2, 2))
        assert seen["tf32"] is False
        assert matmul.fp32_precision == "tf32"
    finally:
        matmul.fp32_precision = before


# ---- invalid inputs: ValueError naming the input and the expected shape ----

@pytest.mark.parametrize(
    "call,needle",
    [
        (lambda: NativeLogpOp()(logits=rand(1, 2, 5), target_ids=torch.tensor([[0, 5]])), "target_ids"),
        (lambda: NativeLogpOp()(logits=rand(1, 2, 5), target_ids=torch.tensor([[0, 1, 2]])),
         "target_ids: expected shape [B,S]"),
        (lambda: NativeLogpOp()(logits=rand(2, 5), target_ids=torch.tensor([0, 1])), "logits: expected shape [B,S,V]"),
        (lambda: NativeLinearLogpOp()(hidden=rand(1, 2, 4), lm_head_weight=rand(7, 5),
                                      target_ids=ids(1, 2, high=7)),
         "lm_head_weight: expected shape [V,H]"),
        (lambda: NativeRmsNormOp()(x=rand(1, 2, 4), weight=rand(5)), "weight: expected shape [H]"),
        (lambda: NativeMatmulOp()(a=rand(1, 2, 4), b=rand(5, 3)), "b: expected shape [K,N]"),
        (lambda: NativeSwigluOp()(gate=rand(1, 2, 4), up=rand(1, 2, 5)), "up: expected shape [B,S,I]"),
        (lambda: NativeRopeOp()(x=rand(1, 2, 1, 4), positions=torch.tensor([[0]])), "positions: expected shape [B,S]"),
        (lambda: NativeEmbeddingOp()(token_ids=torch.tensor([[9]]), weight=rand(5, 3)), "token_ids"),
        (lambda: NativeAttentionOp()(q=rand(1, 2, 3, 4), k=rand(1, 2, 2, 4), v=rand(1, 2, 2, 4)), "Hkv=2"),
        (lambda: NativeAttentionOp()(q=rand(1, 2, 2, 4), k=rand(1, 3, 2, 4), v=rand(1, 3, 2, 4)),
         "k: expected shape [B,S,Hkv,D]"),
        (lambda: NativeKvCacheAttentionOp()(q=rand(1, 1, 2, 4), k_cache=rand(1, 4, 2, 4), v_cache=rand(1, 4, 2, 4),
                                            cache_seqlens=torch.tensor([5])), "cache_seqlens"),
        (lambda: NativeKvCacheAttentionOp()(q=rand(1, 1, 2, 4), k_cache=rand(1, 4, 2, 4), v_cache=rand(1, 4, 2, 4),
                                            cache_seqlens=torch.tensor([1, 2])), "cache_seqlens: expected shape [B]"),
    ],
)
def test_invalid_inputs_raise_value_error_naming_the_input(call, needle):
    with pytest.raises(ValueError) as info:
        call()
    assert needle in str(info.value)
