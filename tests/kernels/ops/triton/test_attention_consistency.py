"""Train/infer consistency (DESIGN.md rule 3), bit for bit: a token's attention output is the same
whether computed in a full prefill of its sequence, a left- or right-padded batch, a packed varlen
batch, one chunk (7 tokens) of a chunked prefill, or a token-by-token decode with a KV cache; and its
sequence's gradients are the same in a prefill, a padded batch and a packed batch.

Under the CPU interpreter bf16 operands take the fp32-upcast `tl.dot` path (`dot_fp32`); on the H200
(gpu tests, Qwen3-8B head geometry) the bf16 tensor-core path.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from rl_engine.kernels.ops.triton.attention import contract, dispatch, triton_attention, triton_kv_cache_attention
from rl_engine.kernels.ops.triton.runtime import dot_fp32

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _sequences(lengths, hq, hkv, d, dtype, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return [
        tuple(torch.randn(n, h, d, generator=gen).to(dtype).to(DEVICE) for h in (hq, hkv, hkv)) for n in lengths
    ]


def _padded(tensors, width, left):
    out = torch.zeros(len(tensors), width, *tensors[0].shape[1:], dtype=tensors[0].dtype, device=DEVICE)
    for b, t in enumerate(tensors):
        if left:
            out[b, width - len(t):] = t
        else:
            out[b, : len(t)] = t
    return out


def packed_form(seqs):
    """Per-sequence outputs [L,Hq,D] of one packed varlen batch."""
    cu = torch.tensor([0, *torch.tensor([len(s[0]) for s in seqs]).cumsum(0).tolist()], dtype=torch.int32,
                      device=DEVICE)
    out = triton_attention(*[torch.cat([s[i] for s in seqs]) for i in range(3)], cu_seqlens=cu)
    return [out[cu[b]: cu[b + 1]] for b in range(len(seqs))]


def prefill_forms(seqs):
    """{form: [per-sequence output [L,Hq,D]]} for alone, left-padded, right-padded and packed batches."""
    lengths = [len(s[0]) for s in seqs]
    width = max(lengths)
    forms = {"alone": [triton_attention(q[None], k[None], v[None])[0] for q, k, v in seqs]}
    left = [_padded([s[i] for s in seqs], width, left=True) for i in range(3)]
    starts = torch.tensor([width - n for n in lengths], device=DEVICE)
    out = triton_attention(*left, seq_starts=starts)
    forms["left_padded"] = [out[b, width - n:] for b, n in enumerate(lengths)]
    out = triton_attention(*[_padded([s[i] for s in seqs], width, left=False) for i in range(3)])
    forms["right_padded"] = [out[b, :n] for b, n in enumerate(lengths)]
    forms["packed"] = packed_form(seqs)
    return forms


def _cache(seqs, extra=5):
    """k/v caches [B,Smax,Hkv,D] holding each sequence, NaN beyond its length (must never be read)."""
    smax = max(len(s[0]) for s in seqs) + extra
    caches = []
    for i in (1, 2):
        c = torch.full((len(seqs), smax, *seqs[0][i].shape[1:]), float("nan"), dtype=seqs[0][i].dtype, device=DEVICE)
        for b, s in enumerate(seqs):
            c[b, : len(s[i])] = s[i]
        caches.append(c)
    return caches


def chunked(seqs, chunk):
    """Per-sequence outputs of a chunked prefill: chunk by chunk against the cache, one row per call."""
    k_cache, v_cache = _cache(seqs)
    outs = []
    for b, (q, _, _) in enumerate(seqs):
        parts = []
        for start in range(0, len(q), chunk):
            end = min(len(q), start + chunk)
            lengths = torch.tensor([end], device=DEVICE)
            rows = (q[None, start:end], k_cache[b: b + 1], v_cache[b: b + 1])
            parts.append(triton_kv_cache_attention(*rows, lengths)[0])
        outs.append(torch.cat(parts))
    return outs


def decoded(seqs):
    """Per-sequence outputs of token-by-token decode, all sequences in one batch with ragged lengths.

    At step t row b decodes token min(t, L_b − 1) (a finished row repeats its last token).
    """
    k_cache, v_cache = _cache(seqs)
    lengths = [len(s[0]) for s in seqs]
    outs = [[] for _ in seqs]
    for t in range(max(lengths)):
        pos = [min(t, n - 1) for n in lengths]
        q = torch.stack([s[0][p] for s, p in zip(seqs, pos)])[:, None]
        out = triton_kv_cache_attention(q, k_cache, v_cache, torch.tensor([p + 1 for p in pos], device=DEVICE))
        for b, n in enumerate(lengths):
            if t < n:
                outs[b].append(out[b, 0])
    return [torch.stack(o) for o in outs]


def assert_all_forms_bitwise_equal(seqs, chunk=7):
    """Asserts every form has the bits of the prefill alone; returns the forms (the prefill alone under "alone")."""
    forms = prefill_forms(seqs)
    forms[f"chunked_{chunk}"] = chunked(seqs, chunk)
    forms["decode"] = decoded(seqs)
    reference = forms.pop("alone")
    for name, outs in forms.items():
        for b, (got, want) in enumerate(zip(outs, reference)):
            assert torch.isfinite(got).all(), f"{name}: non-finite output for sequence {b}"
            diff = (got != want).any(dim=(1, 2)).nonzero().flatten().tolist()
            assert not diff, f"{name}: sequence {b} tokens {diff[:10]} differ from the prefill alone"
    return {"alone": reference, **forms}


def _sequence_grads(seqs):
    """Gradients of each sequence alone, in a left-padded batch and in a packed batch."""
    lengths = [len(s[0]) for s in seqs]
    gen = torch.Generator().manual_seed(7)
    grad_outs = [torch.randn(s[0].shape, generator=gen).to(s[0].dtype).to(DEVICE) for s in seqs]

    def run(fn, tensors, grad_out):
        leaves = [t.detach().clone().requires_grad_() for t in tensors]
        return torch.autograd.grad(fn(*leaves), leaves, grad_out)

    forms = {"alone": [run(lambda q, k, v: triton_attention(q, k, v), [t[None] for t in s], g[None])
                       for s, g in zip(seqs, grad_outs)]}
    forms["alone"] = [[t[0] for t in grads] for grads in forms["alone"]]
    width = max(lengths)
    starts = torch.tensor([width - n for n in lengths], device=DEVICE)
    grads = run(lambda q, k, v: triton_attention(q, k, v, seq_starts=starts),
                [_padded([s[i] for s in seqs], width, left=True) for i in range(3)],
                _padded(grad_outs, width, left=True))
    forms["left_padded"] = [[t[b, width - n:] for t in grads] for b, n in enumerate(lengths)]
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32, device=DEVICE)
    grads = run(lambda q, k, v: triton_attention(q, k, v, cu_seqlens=cu),
                [torch.cat([s[i] for s in seqs]) for i in range(3)], torch.cat(grad_outs))
    forms["packed"] = [[t[cu[b]: cu[b + 1]] for t in grads] for b in range(len(seqs))]
    return forms


def assert_gradients_bitwise_equal(seqs):
    forms = _sequence_grads(seqs)
    reference = forms.pop("alone")
    for name, per_seq in forms.items():
        for b, (got, want) in enumerate(zip(per_seq, reference)):
            for grad_name, g, w in zip(("dq", "dk", "dv"), got, want):
                assert torch.equal(g, w), f"{name}: {grad_name} of sequence {b} differs from the prefill alone"


def test_interpreter_takes_the_upcast_dot_path():
    assert dot_fp32(torch.bfloat16) == (DEVICE == "cpu")


def test_every_form_gives_the_same_bits_bf16():
    # GQA 4: decode and chunks fill the tile with the group's heads; lengths cross block edges (16).
    assert_all_forms_bitwise_equal(_sequences([33, 5, 16], 4, 1, 16, torch.bfloat16))


def test_gradients_are_the_same_in_padded_and_packed_batches_bf16():
    assert_gradients_bitwise_equal(_sequences([29, 6, 17], 4, 2, 16, torch.bfloat16, seed=3))


@pytest.mark.parametrize("head_dim, dtype", [(8, torch.bfloat16), (80, torch.float32)])
def test_every_form_gives_the_same_bits_padded_head(head_dim, dtype):
    # Head sizes padded inside the kernel (8 -> 16 lanes, 80 -> 128) keep every form bitwise equal.
    seqs = _sequences([21, 4], 4, 2, head_dim, dtype, seed=head_dim)
    assert_all_forms_bitwise_equal(seqs)
    assert_gradients_bitwise_equal(seqs)


def test_another_key_block_size_is_caught(monkeypatch):
    # Planted bug: a path that walks keys in other blocks (8 instead of 16) must not pass as bitwise.
    (q, k, v), = _sequences([37], 2, 1, 16, torch.float32, seed=5)
    baseline = triton_attention(q[None], k[None], v[None])
    config = contract.attention_config(torch.float32, 16)
    other = contract.TileConfig(config.forward.block_m, 8, config.forward.num_warps, config.forward.num_stages)
    monkeypatch.setattr(dispatch, "attention_config", lambda dtype, d: contract.AttentionConfig(other, other, other))
    assert not torch.equal(triton_attention(q[None], k[None], v[None]), baseline)


def test_decode_gives_the_same_bits_with_any_number_of_heads_per_tile(monkeypatch):
    # Decode packs the whole GQA group into a tile, a chunk as many heads as fit its queries: a parallelism
    # choice that must change no bit. Planted: a different KV split is still caught here.
    from rl_engine.kernels.ops.triton.attention import kv_cache_attention as kv

    assert kv._heads_per_tile(4, 64, 1) == 4  # decode
    assert kv._heads_per_tile(4, 64, 20) == 2  # a 20-query chunk: 32 rows a head
    assert kv._heads_per_tile(4, 16, 20) == 1  # a chunk longer than a tile
    seqs = _sequences([45, 30], 8, 2, 16, torch.bfloat16, seed=8)
    k_cache, v_cache = _cache(seqs)
    q = torch.stack([s[0][-1] for s in seqs])[:, None]
    lengths = torch.tensor([45, 30], device=DEVICE)
    outs = {}
    for heads in (1, 2, 4):
        monkeypatch.setattr(kv, "_heads_per_tile", lambda *args, h=heads: h)
        outs[heads] = triton_kv_cache_attention(q, k_cache, v_cache, lengths)
    assert torch.equal(outs[1], outs[4]) and torch.equal(outs[2], outs[4])
    config = contract.attention_config(torch.bfloat16, 16)
    monkeypatch.setattr(dispatch, "attention_config", lambda dtype, d: dataclasses.replace(config, kv_split=16))
    assert not torch.equal(triton_kv_cache_attention(q, k_cache, v_cache, lengths), outs[4])


def test_another_kv_split_is_caught(monkeypatch):
    # Planted bug: decode folding its keys in 16-key splits while the prefill used 32-key ones.
    (q, k, v), = _sequences([45], 4, 1, 16, torch.bfloat16, seed=6)
    prefill = triton_attention(q[None], k[None], v[None])[0, -1]
    k_cache, v_cache = _cache([(q, k, v)])
    decode = lambda: triton_kv_cache_attention(q[None, -1:], k_cache, v_cache, torch.tensor([45], device=DEVICE))  # noqa: E731
    assert torch.equal(decode()[0, 0], prefill)
    config = contract.attention_config(torch.bfloat16, 16)
    monkeypatch.setattr(dispatch, "attention_config", lambda dtype, d: dataclasses.replace(config, kv_split=16))
    assert not torch.equal(decode()[0, 0], prefill)


def _packed_forward_and_grads(seqs):
    cu = torch.tensor([0, *torch.tensor([len(s[0]) for s in seqs]).cumsum(0).tolist()], dtype=torch.int32,
                      device=DEVICE)
    leaves = [torch.cat([s[i] for s in seqs]).detach().requires_grad_() for i in range(3)]
    out = triton_attention(*leaves, cu_seqlens=cu)
    grad_out = torch.randn(out.shape, generator=torch.Generator().manual_seed(1)).to(out.dtype).to(DEVICE)
    return (out.detach(), *torch.autograd.grad(out, leaves, grad_out))


def test_tma_and_pointer_loads_give_the_same_bits(monkeypatch):
    # Unmasked blocks read K/V (forward, dQ) and Q/dO (dK/dV) through TMA descriptors; the pointer loads
    # they replace must give the same bits, and a descriptor of the wrong tensor must be seen.
    seqs = _sequences([41, 5, 16], 4, 2, 16, torch.bfloat16, seed=8)
    q, k, _ = seqs[0]
    assert dispatch.row_descriptors((k, k), 16) is not None, "these rows should take the TMA path"
    with_tma = _packed_forward_and_grads(seqs)
    descriptors = dispatch.row_descriptors
    monkeypatch.setattr(dispatch, "row_descriptors", lambda tensors, block_rows: None)
    pointers = _packed_forward_and_grads(seqs)
    for name, a, b in zip(("out", "dq", "dk", "dv"), with_tma, pointers):
        assert torch.equal(a, b), f"{name}: TMA and pointer loads differ"
    # Planted bug: the descriptors swapped (K read from V's rows, Q from dO's).
    monkeypatch.setattr(dispatch, "row_descriptors", lambda tensors, block_rows: descriptors(tensors[::-1], block_rows))
    swapped = _packed_forward_and_grads(seqs)
    assert not all(torch.equal(a, b) for a, b in zip(with_tma, swapped))


def test_row_descriptors_only_for_16bit_power_of_two_aligned_rows():
    rows = torch.zeros(9, 2, 64, dtype=torch.bfloat16, device=DEVICE)
    assert len(dispatch.row_descriptors((rows, rows), 32)) == 2
    assert dispatch.row_descriptors((rows.float(), rows.float()), 32) is None  # fp32: no unmasked loop
    odd = torch.zeros(9, 2, 80, dtype=torch.bfloat16, device=DEVICE)
    assert dispatch.row_descriptors((odd, odd), 32) is None  # head dim padded inside the kernel
    shifted = torch.zeros(9 * 2 * 64 + 1, dtype=torch.bfloat16, device=DEVICE)[1:].view(9, 2, 64)
    assert dispatch.row_descriptors((rows, shifted), 32) is None  # base not 16-byte aligned


def test_flat_and_nested_split_loops_give_the_same_bits(monkeypatch):
    # Lengths over three 32-key splits; both loop forms of the forward bit for bit, every layout in the one
    # this config does not take (the other's layouts: test_every_form_gives_the_same_bits_bf16).
    seqs = _sequences([75, 5, 33], 4, 1, 16, torch.bfloat16, seed=9)
    config = contract.attention_config(torch.bfloat16, 16)
    results = {}
    for flat in (True, False):
        monkeypatch.setattr(dispatch, "attention_config", lambda dtype, d, flat=flat: dataclasses.replace(
            config, flat_splits=flat))
        if flat != config.flat_splits:
            results[flat] = assert_all_forms_bitwise_equal(seqs)["packed"]
        else:
            results[flat] = packed_form(seqs)
    for b, (got, want) in enumerate(zip(results[True], results[False])):
        assert torch.equal(got, want), f"sequence {b}: the flat and nested split loops differ"


@pytest.mark.gpu
def test_gpu_every_form_gives_the_same_bits_qwen3_8b():
    seqs = _sequences([2048, 1531, 700, 129, 64, 1], 32, 8, 128, torch.bfloat16, seed=11)
    assert_all_forms_bitwise_equal(seqs, chunk=7)
    assert_all_forms_bitwise_equal(seqs[1:4], chunk=256)


@pytest.mark.gpu
@pytest.mark.parametrize("head_dim", [64, 128, 256])
def test_gpu_every_form_gives_the_same_bits_across_kv_splits(head_dim):
    # 3834 tokens of uneven lengths, the longest past the first KV split (2048 keys), chunks of 7 and 300
    # that end on either side of the split boundary: head_dim 64 takes the flat split loop, 128 and 256
    # the nested one, all with TMA loads in the unmasked blocks.
    assert contract.attention_config(torch.bfloat16, head_dim).kv_split < 2600
    seqs = _sequences([2600, 900, 333, 1], 32, 8, head_dim, torch.bfloat16, seed=13)
    assert_all_forms_bitwise_equal(seqs, chunk=7)
    assert_all_forms_bitwise_equal(seqs[:2], chunk=300)


@pytest.mark.gpu
@pytest.mark.parametrize("head_dim", [64, 128, 256])
def test_gpu_gradients_are_the_same_in_padded_and_packed_batches(head_dim):
    # 3382 tokens of uneven lengths at Qwen3-8B's 32/8 heads; on the H200 the Gluon backward at each of its head_dims
    assert_gradients_bitwise_equal(_sequences([2048, 1000, 333, 1], 32, 8, head_dim, torch.bfloat16, seed=12))


@pytest.mark.gpu
@pytest.mark.parametrize("head_dim", [8, 16, 32, 64, 80, 96, 128, 192, 256])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=["fp32", "bf16", "fp16"])
def test_gpu_every_form_gives_the_same_bits_every_head_size(dtype, head_dim):
    seqs = _sequences([77, 16, 1], 4, 2, head_dim, dtype, seed=head_dim)
    assert_all_forms_bitwise_equal(seqs, chunk=7)
    assert_gradients_bitwise_equal(seqs)
