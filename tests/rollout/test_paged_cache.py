"""The paged cache's pages, read through its block table, hold exactly what a contiguous cache holds; pages are
taken and given back."""

import pytest
import torch

from rl_engine.kernels.ops.pytorch.attention.kv_cache_attention import paged_cache_view
from rl_engine.models.decoder import KvCache
from rl_engine.rollout.paged_cache import NULL_PAGE, PagedKvCache, padded_block_table


def test_pages_through_the_block_table_equal_the_contiguous_cache(micro_config):
    g = torch.Generator().manual_seed(0)
    paged = PagedKvCache(micro_config, num_pages=12, page_size=3, dtype=torch.float32, device="cpu")
    paged.reserve(7, 2)  # a neighbour takes the first pages, so sequence 5's pages are not 1, 2, ...
    paged.reserve(5, 8)
    paged.reserve(9, 4)
    paged.release(7)
    paged.reserve(8, 5)  # reuses the pages 7 gave back
    ids, lengths = [5, 9, 8], [8, 4, 5]
    dense = KvCache.empty(micro_config, 3, 9, torch.float32, "cpu")
    paged.bind(ids)
    for start, stop in ((0, 2), (2, 4), (4, 5)):  # chunks of different sizes, as prefill + decode write them
        pos = torch.arange(start, stop)[None].expand(3, -1)
        k = torch.randn(3, stop - start, micro_config.num_kv_heads, micro_config.head_dim, generator=g)
        v = torch.randn(k.shape, generator=g)
        paged.write(0, pos, k, v)
        dense.write(0, pos, k, v)
    pk, pv = paged.layer_kv(0)
    assert pk is paged.k[0] and pv is paged.v[0]  # the pools themselves: attention reads them in place
    assert paged.block_table.dtype == torch.int32 and paged.block_table.shape == (3, 3)
    gk, gv = paged_cache_view(pk, paged.block_table), paged_cache_view(pv, paged.block_table)
    assert gk.shape == (3, 9, micro_config.num_kv_heads, micro_config.head_dim)  # 3 pages of 3 for the longest table
    for row, length in enumerate(lengths):
        n = min(length, 5)
        assert torch.equal(gk[row, :n], dense.k[0][row, :n]) and torch.equal(gv[row, :n], dense.v[0][row, :n])
    assert torch.equal(gk[1, 6:], torch.zeros_like(gk[1, 6:]))  # past its pages: the null page, zeros


def test_pages_are_reserved_and_given_back(micro_config):
    paged = PagedKvCache(micro_config, num_pages=5, page_size=4, dtype=torch.float32, device="cpu")
    assert paged.free_pages == 4  # page 0 is the null page
    paged.reserve(1, 9)
    assert len(paged.tables[1]) == 3 and NULL_PAGE not in paged.tables[1]
    with pytest.raises(RuntimeError, match="needs 2 more pages, 1 free"):
        paged.reserve(2, 5)
    paged.reserve(1, 12)  # growing within its pages takes nothing more
    assert paged.free_pages == 1
    paged.release(1)
    assert paged.free_pages == 4 and 1 not in paged.tables


def test_a_forwards_layers_share_the_slots_and_binding_resets_them(micro_config):
    # Every layer of a forward writes the same positions tensor: its pool slots are computed once. A new batch bound
    # with the same tensor (a CUDA graph's static buffer) must get its own pages, not the previous batch's slots.
    paged = PagedKvCache(micro_config, num_pages=8, page_size=2, dtype=torch.float32, device="cpu")
    paged.reserve(1, 4)
    paged.reserve(2, 4)
    pos = torch.tensor([[2, 3]])
    x = torch.ones(1, 2, micro_config.num_kv_heads, micro_config.head_dim)
    paged.bind([1])
    paged.write(0, pos, x, x)
    paged.write(0, pos, 2 * x, 2 * x)  # a second layer's write (the micro config has one layer: the same pool)
    paged.bind([2])
    paged.write(0, pos, 3 * x, 3 * x)
    page_1, page_2 = paged.tables[1][1], paged.tables[2][1]
    assert torch.equal(paged.k[0][page_1], 2 * x[0]) and torch.equal(paged.k[0][page_2], 3 * x[0])
    # A static block table refilled in place between forwards (decode graphs): use_block_table resets the slots.
    static = padded_block_table([paged.tables[1]], 2)
    paged.use_block_table(static)
    paged.write(0, pos, 4 * x, 4 * x)
    static.copy_(padded_block_table([paged.tables[2]], 2))
    paged.use_block_table(static)
    paged.write(0, pos, 5 * x, 5 * x)
    assert torch.equal(paged.k[0][page_1], 4 * x[0]) and torch.equal(paged.k[0][page_2], 5 * x[0])


def test_shared_pages_are_counted_and_copied_on_write(micro_config):
    paged = PagedKvCache(micro_config, num_pages=8, page_size=4, dtype=torch.float32, device="cpu")
    paged.reserve(1, 6)  # pages 1, 2: positions 0-3 and 4-5 (a partial page)
    for pool in paged.k + paged.v:
        pool[1:3] = torch.randn(pool[1:3].shape)
    paged.share(1, 2, 5)  # sequence 2 reads positions 0-4 from 1's pages
    assert paged.tables[2] == [1, 2] and paged.free_pages == 5
    assert paged.write_cost(2, 5, 9) == 2  # a copy of page 2 and a new page 3
    paged.prepare_write(2, 5, 9)
    copy = paged.tables[2][1]
    assert paged.tables[2][0] == 1 and copy not in (1, 2) and paged.free_pages == 3
    assert all(torch.equal(pool[copy], pool[2]) for pool in paged.k + paged.v)
    assert paged.write_cost(1, 6, 8) == 0  # page 2 is 1's alone again
    paged.release(1)
    assert paged.free_pages == 4 and 1 not in paged._free  # page 1 is still 2's
    paged.release(2)
    assert paged.free_pages == 7 and sum(paged._refs) == 0
    with pytest.raises(RuntimeError, match="share into an empty table"):
        paged.reserve(3, 1)
        paged.share(3, 3, 1)
