"""triton_kv_cache_attention / TritonKvCacheAttentionOp against the fp32 gold NativeKvCacheAttentionOp.

Without CUDA: Triton CPU interpreter, head_dim 16, 16×16 tiles; bf16 takes the fp32-upcast `tl.dot`
path (`dot_fp32`). Cache slots beyond each row's length hold NaN: they must never be read.
"""

from __future__ import annotations

import pytest
import torch

from rl_engine.checks.testing import assert_never_quieter
from rl_engine.kernels.ops.pytorch.attention.kv_cache_attention import NativeKvCacheAttentionOp
from rl_engine.kernels.ops.triton.attention import TritonKvCacheAttentionOp, triton_kv_cache_attention
from rl_engine.kernels.ops.triton.runtime import dot_fp32

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
TOL = {torch.float32: 2e-5, torch.bfloat16: 3e-2}


def _inputs(b, sq, smax, hq, hkv, d, dtype, lengths, seed=0):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(b, sq, hq, d, generator=gen).to(dtype)
    caches = [torch.randn(b, smax, hkv, d, generator=gen).to(dtype) for _ in range(2)]
    for c in caches:
        for row, n in enumerate(lengths):
            c[row, n:] = float("nan")
    return q.to(DEVICE), *(c.to(DEVICE) for c in caches), torch.tensor(lengths)


def _check(out, ref, dtype):
    assert out.dtype == dtype and torch.isfinite(out).all()
    err = (out.float() - ref).abs().max().item()
    path = "fp32-upcast dot (interpreter)" if dot_fp32(dtype) else f"native {dtype} dot"
    assert err <= TOL[dtype], f"max error {err} ({path})"


def _gold(q, k, v, lengths):
    # The gold reads the whole cache (masked by -inf) so NaN slots would poison it: zero them for it.
    keep = (torch.arange(k.shape[1])[None, :] < lengths[:, None]).to(DEVICE)[:, :, None, None]
    return NativeKvCacheAttentionOp()(
        q=q, k_cache=torch.where(keep, k, 0), v_cache=torch.where(keep, v, 0), cache_seqlens=lengths
    )


FP32, BF16 = torch.float32, torch.bfloat16


@pytest.mark.parametrize(
    "dtype, heads, sq",
    [(FP32, (4, 4), 20), (FP32, (4, 2), 7), (FP32, (4, 1), 1), (BF16, (4, 4), 1), (BF16, (4, 2), 20),
     (BF16, (4, 1), 7)],
    ids=["fp32-gqa1-sq20", "fp32-gqa2-sq7", "fp32-gqa4-sq1", "bf16-gqa1-sq1", "bf16-gqa2-sq20", "bf16-gqa4-sq7"],
)
def test_matches_gold(dtype, heads, sq):
    lengths = [sq, max(sq, 16), 37]  # up to a full cache (Smax = 37), across a block edge
    q, k, v, lens = _inputs(len(lengths), sq, 37, *heads, 16, dtype, lengths)
    _check(TritonKvCacheAttentionOp()(q, k, v, lens), _gold(q, k, v, lens), dtype)


@pytest.mark.parametrize("where", ["q", "cache"])
@pytest.mark.parametrize("value", [float("nan"), float("inf")], ids=["nan", "inf"])
def test_non_finite_values_reach_the_rows_the_gold_says(where, value):
    # The gold, given the raw cache (NaN beyond each length), must not be poisoned by slots no query
    # sees; a value planted in q row 1 reaches exactly the rows the gold says; one at cache position 9 of
    # row 1 (seen by its later queries only, inside a 16-key block) reaches them and may spread NaN to the
    # block's earlier queries (flash.py says why), never hide.
    q, k, v, lens = _inputs(2, 7, 24, 4, 2, 16, torch.float32, [7, 14])
    if where == "q":
        q[1, 1, 2, 5] = value
    else:
        k[1, 9, 0, 5] = value
        v[1, 9, 1, 5] = value
    out = TritonKvCacheAttentionOp()(q, k, v, lens)
    ref = NativeKvCacheAttentionOp()(q=q, k_cache=k, v_cache=v, cache_seqlens=lens)
    assert_never_quieter("out", out, ref)
    if where == "q":
        assert torch.equal(torch.isfinite(out), torch.isfinite(ref))
    assert not torch.isfinite(ref).all() and torch.isfinite(ref[0]).all() and torch.isfinite(out[0]).all()
    both = torch.isfinite(out) & torch.isfinite(ref)
    assert (out[both] - ref[both]).abs().max() <= TOL[torch.float32]


def test_lengths_on_the_device_and_explicit_scale():
    q, k, v, lens = _inputs(2, 3, 24, 2, 1, 16, torch.float32, [3, 21])
    out = triton_kv_cache_attention(q, k, v, lens.to(DEVICE).to(torch.int32), scale=0.2)
    keep = (torch.arange(24)[None, :] < lens[:, None]).to(DEVICE)[:, :, None, None]
    ref = NativeKvCacheAttentionOp(scale=0.2)(
        q=q, k_cache=torch.where(keep, k, 0), v_cache=torch.where(keep, v, 0), cache_seqlens=lens
    )
    _check(out, ref, torch.float32)


def test_deterministic():
    q, k, v, lens = _inputs(2, 5, 30, 4, 2, 16, torch.bfloat16, [5, 30])
    assert torch.equal(triton_kv_cache_attention(q, k, v, lens), triton_kv_cache_attention(q, k, v, lens))


def test_bad_inputs_name_the_input():
    q, k, v, lens = _inputs(2, 3, 8, 4, 2, 16, torch.float32, [3, 8])
    with pytest.raises(ValueError, match="cache_seqlens"):
        triton_kv_cache_attention(q, k, v, torch.tensor([2, 8]))  # shorter than Sq
    with pytest.raises(ValueError, match="cache_seqlens"):
        triton_kv_cache_attention(q, k, v, torch.tensor([3, 9]))  # beyond Smax
    with pytest.raises(ValueError, match="v_cache"):
        triton_kv_cache_attention(q, k, v[:, :4], lens)
    with pytest.raises(ValueError, match="cache_seqlens"):
        triton_kv_cache_attention(q, k, v, lens.float())


def test_the_table_kernel_builds_the_torch_table():
    from rl_engine.kernels.ops.triton.attention import contract
    from rl_engine.kernels.ops.triton.attention.kv_cache_attention import kv_cache_table

    sq, smax = 2, 12
    lengths = torch.tensor([0, 3, 9, 12, 40, -3], dtype=torch.int64)  # 40 and -3: clamped to [0, Smax]
    got = kv_cache_table(lengths.to(DEVICE), sq, smax, DEVICE)
    n = lengths.clamp(0, smax).int()
    b = torch.arange(len(lengths), dtype=torch.int32)
    want = contract.sequence_table(b * sq, torch.full_like(n, sq), n - sq, b * smax, n, max_q_count=sq, max_kv_len=smax)
    assert torch.equal(got.info.cpu(), want.info)
    assert (got.max_q_count, got.max_kv_len) == (sq, smax)


@pytest.mark.gpu
@pytest.mark.parametrize("sq", [1, 7, 256])
def test_gpu_qwen3_8b_geometry_bf16(sq):
    lengths = [sq, 1000, 2048, 4096]
    q, k, v, lens = _inputs(4, sq, 4096, 32, 8, 128, torch.bfloat16, lengths)
    out = triton_kv_cache_attention(q, k, v, lens.to(DEVICE))
    ref = _gold(q, k, v, lens)
    base_q, base_k, base_v = q, torch.nan_to_num(k), torch.nan_to_num(v)
    base = NativeKvCacheAttentionOp().baseline(q=base_q, k_cache=base_k, v_cache=base_v, cache_seqlens=lens.to(DEVICE))
    err, base_err = (out.float() - ref).abs().max().item(), (base.float() - ref).abs().max().item()
    assert torch.isfinite(out).all() and err <= 3 * base_err + 1e-3, f"error {err} vs bf16 baseline {base_err}"
    assert torch.equal(out, triton_kv_cache_attention(q, k, v, lens.to(DEVICE)))
