"""Attention of Sq new queries against a KV cache (chunked prefill and decode).

cache_seqlens[b] is the valid cached length, the new tokens included: query i of batch row b sits
at position cache_seqlens[b] - Sq + i and attends to cached positions <= its own.

The cache is contiguous, k_cache/v_cache [B,Smax,Hkv,D], or paged as in flash_attn_with_kvcache: a pool
[num_blocks, page_block_size, Hkv, D] and `block_table` [B, max_blocks] of page ids, cache position p of row b
living at row p % page_block_size of page block_table[b, p // page_block_size]. Its meaning is the contiguous
cache its pages make in table order (`paged_cache_view`), Smax = max_blocks · page_block_size.
"""

from __future__ import annotations

import math

import torch

from rl_engine.kernels.ops.pytorch.attention.attention import check_heads, grouped_attention, sdpa
from rl_engine.kernels.ops.pytorch.base import NativeOp, capturing, expect_rank, expect_shape


def paged_cache_view(cache: torch.Tensor, block_table: torch.Tensor) -> torch.Tensor:
    """[B, max_blocks·page_block_size, Hkv, D]: each row's pages of a pool [num_blocks, page_block_size, Hkv, D]
    in table order, the contiguous cache a paged one means (a copy)."""
    return cache[block_table.long()].flatten(1, 2)


def kv_cache_mask(q, k_cache, cache_seqlens) -> torch.Tensor:
    """[B,Sq,Smax] bool: query i of row b (at position cache_seqlens[b] - Sq + i) sees cached keys <= it."""
    sq, smax = q.shape[1], k_cache.shape[1]
    query_pos = cache_seqlens.long().to(q.device)[:, None] - sq + torch.arange(sq, device=q.device)[None, :]
    return torch.arange(smax, device=q.device)[None, None, :] <= query_pos[:, :, None]


class NativeKvCacheAttentionOp(NativeOp):
    input_names = ("q", "k_cache", "v_cache", "cache_seqlens", "block_table")

    def __init__(self, scale: float | None = None):
        self.scale = scale

    def check_shapes(self, *, q, k_cache, v_cache, cache_seqlens, block_table=None) -> int:
        """Every check that reads no value; returns Smax."""
        expect_rank("q", q, 4, "[B,Sq,Hq,D]")
        b, sq, _, d = q.shape
        if block_table is None:
            expect_rank("k_cache", k_cache, 4, "[B,Smax,Hkv,D]")
            smax = k_cache.shape[1]
            expect_shape("k_cache", k_cache, (b, smax, k_cache.shape[2], d), "[B,Smax,Hkv,D]")
            expect_shape("v_cache", v_cache, tuple(k_cache.shape), "[B,Smax,Hkv,D]")
        else:
            pool = "[num_blocks,page_block_size,Hkv,D]"
            expect_rank("k_cache", k_cache, 4, pool)
            expect_shape("k_cache", k_cache, (*k_cache.shape[:3], d), pool)
            expect_shape("v_cache", v_cache, tuple(k_cache.shape), pool)
            expect_rank("block_table", block_table, 2, "[B,max_blocks]")
            expect_shape("block_table", block_table, (b, block_table.shape[1]), "[B,max_blocks]")
            if block_table.is_floating_point() or block_table.dtype == torch.bool:
                raise ValueError(f"block_table: expected integer page ids [B,max_blocks], got {block_table.dtype}")
            smax = block_table.shape[1] * k_cache.shape[1]
        expect_shape("cache_seqlens", cache_seqlens, (b,), "[B]")
        check_heads("q", q, "k_cache", k_cache)
        if cache_seqlens.is_floating_point():
            raise ValueError(f"cache_seqlens: expected integer lengths [B], got dtype {cache_seqlens.dtype}")
        return smax

    def check_block_table(self, k_cache, block_table) -> None:
        """Page ids in [0, num_blocks) (reads the table back)."""
        if block_table.numel() and not capturing(block_table):
            lo, hi = int(block_table.min()), int(block_table.max())
            if lo < 0 or hi >= k_cache.shape[0]:
                raise ValueError(f"block_table: page ids must lie in [0, num_blocks={k_cache.shape[0]}), "
                                 f"got min {lo}, max {hi}")

    def check_lengths(self, cache_seqlens, sq: int, smax: int) -> None:
        """Lengths in [Sq, Smax] (reads them back)."""
        b = cache_seqlens.shape[0]
        if b and not capturing(cache_seqlens) and (int(cache_seqlens.min()) < sq or int(cache_seqlens.max()) > smax):
            raise ValueError(
                f"cache_seqlens: each length must lie in [Sq={sq}, Smax={smax}] (the new tokens are in the "
                f"cache), got {cache_seqlens.tolist()}"
            )

    def validate(self, *, q, k_cache, v_cache, cache_seqlens, block_table=None):
        smax = self.check_shapes(q=q, k_cache=k_cache, v_cache=v_cache, cache_seqlens=cache_seqlens,
                                 block_table=block_table)
        if block_table is not None:
            self.check_block_table(k_cache, block_table)
        self.check_lengths(cache_seqlens, q.shape[1], smax)

    def _scale(self, q):
        return self.scale if self.scale is not None else 1.0 / math.sqrt(q.shape[3])

    def forward(self, *, q, k_cache, v_cache, cache_seqlens, block_table=None):
        if block_table is not None:
            k_cache, v_cache = paged_cache_view(k_cache, block_table), paged_cache_view(v_cache, block_table)
        return grouped_attention(q, k_cache, v_cache, kv_cache_mask(q, k_cache, cache_seqlens), self._scale(q))

    def baseline(self, *, q, k_cache, v_cache, cache_seqlens, block_table=None):
        """SDPA in the inputs' dtype with the cache mask, as users call it (a paged cache gathered first)."""
        self.validate(q=q, k_cache=k_cache, v_cache=v_cache, cache_seqlens=cache_seqlens, block_table=block_table)
        if block_table is not None:
            k_cache, v_cache = paged_cache_view(k_cache, block_table), paged_cache_view(v_cache, block_table)
        return sdpa(q, k_cache, v_cache, kv_cache_mask(q, k_cache, cache_seqlens), self._scale(q))
