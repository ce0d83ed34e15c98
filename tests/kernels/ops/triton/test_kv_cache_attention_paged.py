"""kv_cache_attention over a paged cache (flash_attn_with_kvcache's pools + block_table), read through the table in
the kernel: the bits of the contiguous cache its pages make, for any page size and any page order.

Without CUDA: Triton CPU interpreter, head_dim 16 (16-key blocks, 32-key KV splits), so a 37-key cache has whole and
masked blocks and two splits. Pool rows no table entry reaches, and cached positions past each length, hold NaN:
they must never be read.
"""

from __future__ import annotations

import pytest
import torch
import triton
import triton.language as tl

from rl_engine.kernels.ops.pytorch.attention.kv_cache_attention import NativeKvCacheAttentionOp, paged_cache_view
from rl_engine.kernels.ops.triton.attention import flash, triton_kv_cache_attention
from rl_engine.kernels.ops.triton.runtime import interpreting

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
BF16 = torch.bfloat16
LENGTHS = [1, 16, 37]  # one key, one whole block, two splits with a partial block


def _paged(page: int, lengths, sq: int, hq=4, hkv=2, d=16, dtype=BF16, seed=0, spare=3):
    """q, pools and a block table whose rows hold their pages reversed, shuffled, and in order among spare pages."""
    gen = torch.Generator().manual_seed(seed)
    b, width = len(lengths), -(-max(lengths) // page)
    num_blocks = b * width + spare
    pools = [torch.randn(num_blocks, page, hkv, d, generator=gen).to(dtype) for _ in range(2)]
    ids = (torch.randperm(num_blocks, generator=gen)[: b * width]).view(b, width)
    ids[0] = ids[0].sort(descending=True).values  # reversed
    if b > 2:
        ids[2] = ids[2].sort().values  # in order, with other rows' pages between
    table = ids.to(torch.int32)
    used = torch.zeros(num_blocks * page, dtype=torch.bool)
    for row, n in enumerate(lengths):
        pos = torch.arange(n)
        used[table[row, pos // page].long() * page + pos % page] = True
    for pool in pools:  # every row no query may read: NaN
        pool.view(num_blocks * page, hkv, d)[~used] = float("nan")
    q = torch.randn(b, sq, hq, d, generator=gen).to(dtype)
    return q.to(DEVICE), *(p.to(DEVICE) for p in pools), table.to(DEVICE), torch.tensor(lengths)


def _bits(x: torch.Tensor) -> torch.Tensor:
    return x.view(torch.int16) if x.element_size() == 2 else x.view(torch.int32)


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and torch.equal(_bits(a), _bits(b))


def _contiguous(q, kp, vp, table, lens):
    return triton_kv_cache_attention(q, paged_cache_view(kp, table), paged_cache_view(vp, table), lens)


@pytest.mark.parametrize("page", [1, 2, 3, 4, 16])
def test_decode_through_the_table_has_the_contiguous_bits(page):
    q, kp, vp, table, lens = _paged(page, LENGTHS, sq=1, seed=page)
    out = triton_kv_cache_attention(q, kp, vp, lens, block_table=table)
    assert torch.isfinite(out).all()
    assert _same_bits(out, _contiguous(q, kp, vp, table, lens))


@pytest.mark.parametrize("dtype", [BF16, torch.float32], ids=["bf16", "fp32"])
def test_a_chunk_through_the_table_has_the_contiguous_bits(dtype):
    # Sq = 7 (chunked prefill: query tiles, not split programs); page 4 does not divide a 16-key block's rows
    # into whole pages at every length; fp32 walks masked blocks only.
    q, kp, vp, table, lens = _paged(3, [7, 20, 37], sq=7, dtype=dtype, seed=5)
    out = triton_kv_cache_attention(q, kp, vp, lens, block_table=table)
    assert torch.isfinite(out).all()
    assert _same_bits(out, _contiguous(q, kp, vp, table, lens))


def test_pages_scattered_over_a_large_pool_and_the_gold():
    # 2 sequences' 5 pages among 40, a wider table than either needs (null page 0 past their pages, as the rollout's
    # tables are), lengths on the device as a decode step passes them.
    q, kp, vp, table, lens = _paged(8, [37, 9], sq=1, seed=7, spare=30)
    table = torch.cat([table, torch.zeros_like(table[:, :2])], dim=1)
    kp[0], vp[0] = 0.0, 0.0  # the null page holds finite values (the gold reads every position, masked)
    out = triton_kv_cache_attention(q, kp, vp, lens.to(DEVICE).to(torch.int32), block_table=table)
    assert _same_bits(out, _contiguous(q, kp, vp, table, lens))
    keep = (torch.arange(table.shape[1] * 8)[None, :] < lens[:, None]).to(DEVICE)[:, :, None, None]
    k, v = (torch.where(keep, paged_cache_view(p, table), 0) for p in (kp, vp))
    ref = NativeKvCacheAttentionOp()(q=q, k_cache=k, v_cache=v, cache_seqlens=lens)
    assert (out.float() - ref).abs().max() <= 3e-2
    # the gold op takes the paged form too: the cache its pages make
    gold_paged = NativeKvCacheAttentionOp()(q=q, k_cache=torch.nan_to_num(kp), v_cache=torch.nan_to_num(vp),
                                            cache_seqlens=lens, block_table=table)
    gold_view = NativeKvCacheAttentionOp()(q=q, k_cache=paged_cache_view(torch.nan_to_num(kp), table),
                                           v_cache=paged_cache_view(torch.nan_to_num(vp), table), cache_seqlens=lens)
    assert torch.equal(gold_paged, gold_view)


def test_a_table_that_names_a_wrong_page_is_caught():
    # Planted: the kernel given a table with two of row 2's pages swapped, or the contiguous cache gathered one row
    # off: the bits differ, so the equality above has the power to see a misread page.
    q, kp, vp, table, lens = _paged(4, LENGTHS, sq=1, seed=11)
    want = _contiguous(q, kp, vp, table, lens)
    swapped = table.clone()
    swapped[2, [1, 6]] = table[2, [6, 1]]
    assert not _same_bits(triton_kv_cache_attention(q, kp, vp, lens, block_table=swapped), want)
    shifted = [torch.roll(paged_cache_view(p, table).nan_to_num(), 1, dims=1) for p in (kp, vp)]
    out = triton_kv_cache_attention(q, kp, vp, lens, block_table=table)
    assert not _same_bits(out, triton_kv_cache_attention(q, *shifted, lens))


@triton.jit
def _first_row_pages(k_row0, k_pos, k_ok, BLOCK_TABLE, stride_bt, PAGE_SIZE: tl.constexpr, PAGED: tl.constexpr):
    # Planted: every sequence reads row 0 of the block table (its own position, another sequence's page).
    if k_ok is None:
        page = tl.load(BLOCK_TABLE + k_pos // PAGE_SIZE)
    else:
        page = tl.load(BLOCK_TABLE + k_pos // PAGE_SIZE, mask=k_ok, other=0)
    return page.to(tl.int64) * PAGE_SIZE + k_pos % PAGE_SIZE


@pytest.mark.skipif(not interpreting(), reason="patches a jit function read at trace time (interpreter only)")
def test_a_kernel_that_reads_another_rows_pages_is_caught(monkeypatch):
    q, kp, vp, table, lens = _paged(16, [37, 37], sq=1, seed=13)
    want = _contiguous(q, kp, vp, table, lens)
    monkeypatch.setattr(flash, "_key_rows", _first_row_pages)
    out = triton_kv_cache_attention(q, kp, vp, lens, block_table=table)
    assert _same_bits(out[0], want[0]) and not _same_bits(out[1], want[1])


def test_bad_block_tables_name_the_input():
    q, kp, vp, table, lens = _paged(4, [3, 8], sq=1, seed=1)
    with pytest.raises(ValueError, match="block_table: expected integer"):
        triton_kv_cache_attention(q, kp, vp, lens, block_table=table.float())
    with pytest.raises(ValueError, match="block_table: expected shape"):
        triton_kv_cache_attention(q, kp, vp, lens, block_table=table[:1])
    bad = table.clone()
    bad[1, 0] = kp.shape[0]
    with pytest.raises(ValueError, match=r"block_table: page ids must lie in \[0, num_blocks"):
        triton_kv_cache_attention(q, kp, vp, lens, block_table=bad.cpu())
    with pytest.raises(ValueError, match="cache_seqlens"):  # beyond max_blocks · page_block_size = 8
        triton_kv_cache_attention(q, kp, vp, torch.tensor([3, 9]), block_table=table)
    with pytest.raises(ValueError, match="v_cache"):
        triton_kv_cache_attention(q, kp, vp[:, :2], lens, block_table=table)


def test_the_gluon_decode_takes_pages_of_whole_swizzle_atoms():
    from rl_engine.kernels.ops.triton.attention import gluon_decode

    assert [p for p in (1, 3, 4, 8, 16, 24, 32, 64, 128, 256) if gluon_decode.pages_fit(p)] == [8, 16, 32, 64, 128, 256]
    q, k = torch.zeros(1, 32, 128, dtype=BF16), torch.zeros(16, 8, 128, dtype=BF16)
    assert not gluon_decode.covers(q, k, 1, 16)  # CPU rows


@pytest.mark.gpu
@pytest.mark.parametrize("gluon_paged", [False, True], ids=["paged-flash", "paged-gluon"])
@pytest.mark.parametrize("context", [1024, 4096])
@pytest.mark.parametrize("batch", [1, 16, 64])
def test_gpu_qwen3_8b_paged_decode_has_the_contiguous_bits(monkeypatch, batch, context, gluon_paged):
    # Qwen3-8B's attention (32 query heads on 8 KV heads of 128, bf16), 16-key pages in shuffled order among spare
    # ones, lengths ending in different blocks: the paged step equals the contiguous cache as kv_cache_attention routes
    # it (the Gluon decode on the H200) and through flash.py's kernel. paged-flash: the paged call in flash.py's
    # kernel (gluon_decode.PAGED off); paged-gluon: in the Gluon decode's page copies (PAGED on, the default).
    from rl_engine.kernels.ops.triton.attention import gluon_decode

    monkeypatch.setattr(gluon_decode, "PAGED", gluon_paged)
    launches = []
    launch = gluon_decode._launch
    monkeypatch.setattr(gluon_decode, "_launch",
                        lambda *a, **kw: launches.append(kw.get("block_table") is not None) or launch(*a, **kw))
    page, width = 16, context // 16
    gen = torch.Generator(device="cuda").manual_seed(batch + context)
    num_blocks = batch * width + 64
    kp, vp = (torch.randn(num_blocks, page, 8, 128, generator=gen, device="cuda", dtype=BF16) for _ in range(2))
    table = torch.randperm(num_blocks, generator=gen, device="cuda")[: batch * width].view(batch, width).int()
    lengths = (context - (torch.arange(batch, device="cuda") * 37) % 200).int()
    q = torch.randn(batch, 1, 32, 128, generator=gen, device="cuda", dtype=BF16)
    kc, vc = paged_cache_view(kp, table), paged_cache_view(vp, table)
    paged = triton_kv_cache_attention(q, kp, vp, lengths, block_table=table)
    hopper = torch.cuda.get_device_capability() == (9, 0)
    assert launches == ([True] if gluon_paged and hopper else []), launches  # which kernel read the pages
    assert torch.isfinite(paged).all()
    assert _same_bits(paged, triton_kv_cache_attention(q, kc, vc, lengths)), "paged vs contiguous (default route)"
    monkeypatch.setattr(gluon_decode, "covers", lambda *a: False)
    assert _same_bits(paged, triton_kv_cache_attention(q, kc, vc, lengths)), "paged vs contiguous (flash.py)"
