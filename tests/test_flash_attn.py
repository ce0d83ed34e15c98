"""flash-attn's API on rl_engine's kernel: the same function as the gold in each layout, the same bits
across them (padded = varlen = cache decode, contiguous = paged), refusals in one line."""

import pytest
import torch

from rl_engine.flash_attn import flash_attn_func, flash_attn_varlen_func, flash_attn_with_kvcache
from rl_engine.kernels.ops.pytorch.attention.attention import NativeAttentionOp

HQ, HKV, D = 4, 2, 16
LENGTHS = [5, 9, 3]


def _seqs(dtype=torch.bfloat16, seed=0, device="cpu"):
    g = torch.Generator().manual_seed(seed)
    return [tuple(torch.randn(n, h, D, generator=g).to(device, dtype) for h in (HQ, HKV, HKV)) for n in LENGTHS]


def _cu(lengths, device="cpu"):
    return torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32, device=device)


@pytest.mark.parametrize("causal", [True, False])
def test_flash_attn_func_is_the_gold_function(causal):
    q, k, v = (t[None].float() for t in _seqs(torch.float32)[1])
    got = flash_attn_func(q, k, v, causal=causal, softmax_scale=0.3)
    want = NativeAttentionOp(causal=causal, scale=0.3)(q=q, k=k, v=v)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def test_varlen_sequences_have_the_bits_of_each_alone():
    seqs = _seqs()
    q, k, v = (torch.cat([s[i] for s in seqs]) for i in range(3))
    cu = _cu(LENGTHS)
    packed = flash_attn_varlen_func(q, k, v, cu, cu, max(LENGTHS), max(LENGTHS), causal=True)
    for (sq, sk, sv), start, end in zip(seqs, cu[:-1].tolist(), cu[1:].tolist()):
        alone = flash_attn_func(sq[None], sk[None], sv[None], causal=True)[0]
        assert torch.equal(packed[start:end], alone)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
@pytest.mark.parametrize("page", [None, 4])
def test_decode_through_the_cache_has_the_bits_of_the_packed_forward(page, device):
    """Prefill a chunk, then decode token by token, writing k/v into the cache (contiguous or paged)."""
    seqs = _seqs(seed=1, device=device)
    cu = _cu(LENGTHS, device)
    q, k, v = (torch.cat([s[i] for s in seqs]) for i in range(3))
    reference = flash_attn_varlen_func(q, k, v, cu, cu, max(LENGTHS), max(LENGTHS), causal=True)
    b, smax = len(seqs), 12
    if page is None:
        k_cache, v_cache = (torch.zeros(b, smax, HKV, D, dtype=torch.bfloat16, device=device) for _ in range(2))
        table = None
    else:
        blocks = smax // page
        k_cache = torch.zeros(1 + b * blocks, page, HKV, D, dtype=torch.bfloat16, device=device)
        v_cache = torch.zeros_like(k_cache)
        table = (1 + torch.arange(b * blocks, device=device)).reshape(b, blocks).flip(1).to(torch.int32)
    prefill = 2
    lengths = torch.zeros(b, dtype=torch.int32, device=device)

    def step(sl):
        qs, ks, vs = (torch.stack([s[i][sl] for s in seqs]) for i in range(3))
        return flash_attn_with_kvcache(qs, k_cache, v_cache, ks, vs, cache_seqlens=lengths, block_table=table,
                                       causal=True)

    outs = [step(slice(0, prefill))]
    lengths += prefill
    for t in range(prefill, min(LENGTHS)):
        outs.append(step(slice(t, t + 1)))
        lengths += 1
    got = torch.cat(outs, dim=1)  # [B, min(LENGTHS), Hq, D]
    for i, start in enumerate(cu[:-1].tolist()):
        assert torch.equal(got[i], reference[start:start + min(LENGTHS)]), i


@pytest.mark.parametrize(("call", "message"), [
    (lambda q: flash_attn_func(q, q, q, dropout_p=0.1), "dropout_p"),
    (lambda q: flash_attn_func(q, q, q, window_size=(8, 0)), "window_size"),
    (lambda q: flash_attn_func(q, q, q, softcap=30.0), "softcap"),
    (lambda q: flash_attn_func(q, q, q, return_attn_probs=True), "return_attn_probs"),
    (lambda q: flash_attn_varlen_func(q[0], q[0], q[0], _cu([2, 2]), _cu([1, 3]), 2, 3), "cu_seqlens_k"),
    (lambda q: flash_attn_with_kvcache(q, q, q, cache_seqlens=4), "causal"),
    (lambda q: flash_attn_with_kvcache(q, q, q, causal=True), "cache_seqlens"),
    (lambda q: flash_attn_with_kvcache(q[:, :1], q, q, k=q[:, :1], cache_seqlens=1), "k, v"),
])
def test_what_the_kernel_does_not_do_is_refused_by_name(call, message):
    q = torch.zeros(1, 4, 2, D, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match=message) as info:
        call(q)
    assert "\n" not in str(info.value)


def test_gradients_flow_through_the_varlen_call():
    seqs = _seqs(torch.float32, seed=2)
    q, k, v = (torch.cat([s[i] for s in seqs]).requires_grad_(True) for i in range(3))
    cu = _cu(LENGTHS)
    flash_attn_varlen_func(q, k, v, cu, cu, 9, 9, causal=True).square().sum().backward()
    assert all(t.grad is not None and torch.isfinite(t.grad).all() and t.grad.abs().sum() > 0 for t in (q, k, v))
