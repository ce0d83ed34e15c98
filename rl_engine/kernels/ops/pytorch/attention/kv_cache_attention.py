"""Attention of Sq new queries against a KV cache (chunked prefill and decode).

cache_seqlens[b] is the valid cached length, the new tokens included: query i of batch row b sits
at position cache_seqlens[b] - Sq + i and attends to cached positions <= its own.
"""

from __future__ import annotations

import math

import torch

from rl_engine.kernels.ops.pytorch.attention.attention import check_heads, grouped_attention, sdpa
from rl_engine.kernels.ops.pytorch.base import NativeOp, capturing, expect_rank, expect_shape


def kv_cache_mask(q, k_cache, cache_seqlens) -> torch.Tensor:
    """[B,Sq,Smax] bool: query i of row b (at position cache_seqlens[b] - Sq + i) sees cached keys <= it."""
    sq, smax = q.shape[1], k_cache.shape[1]
    query_pos = cache_seqlens.long().to(q.device)[:, None] - sq + torch.arange(sq, device=q.device)[None, :]
    return torch.arange(smax, device=q.device)[None, None, :] <= query_pos[:, :, None]


class NativeKvCacheAttentionOp(NativeOp):
    input_names = ("q", "k_cache", "v_cache", "cache_seqlens")

    def __init__(self, scale: float | None = None):
        self.scale = scale

    def validate(self, *, q, k_cache, v_cache, cache_seqlens):
        expect_rank("q", q, 4, "[B,Sq,Hq,D]")
        b, sq, _, d = q.shape
        expect_rank("k_cache", k_cache, 4, "[B,Smax,Hkv,D]")
        smax = k_cache.shape[1]
        expect_shape("k_cache", k_cache, (b, smax, k_cache.shape[2], d), "[B,Smax,Hkv,D]")
        expect_shape("v_cache", v_cache, tuple(k_cache.shape), "[B,Smax,Hkv,D]")
        expect_shape("cache_seqlens", cache_seqlens, (b,), "[B]")
        check_heads("q", q, "k_cache", k_cache)
        if cache_seqlens.is_floating_point():
            raise ValueError(f"cache_seqlens: expected integer lengths [B], got dtype {cache_seqlens.dtype}")
        if b and not capturing(cache_seqlens) and (int(cache_seqlens.min()) < sq or int(cache_seqlens.max()) > smax):
            raise ValueError(
                f"cache_seqlens: each length must lie in [Sq={sq}, Smax={smax}] (the new tokens are in the "
                f"cache), got {cache_seqlens.tolist()}"
            )

    def _scale(self, q):
        return self.scale if self.scale is not None else 1.0 / math.sqrt(q.shape[3])

    def forward(self, *, q, k_cache, v_cache, cache_seqlens):
        return grouped_attention(q, k_cache, v_cache, kv_cache_mask(q, k_cache, cache_seqlens), self._scale(q))

    def baseline(self, *, q, k_cache, v_cache, cache_seqlens):
        """SDPA in the inputs' dtype with the cache mask, as users call it."""
        self.validate(q=q, k_cache=k_cache, v_cache=v_cache, cache_seqlens=cache_seqlens)
        return sdpa(q, k_cache, v_cache, kv_cache_mask(q, k_cache, cache_seqlens), self._scale(q))
