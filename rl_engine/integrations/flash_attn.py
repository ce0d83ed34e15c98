"""FlashAttention's Python API (flash-attn 2's names and argument order) on rl_engine's batch-invariant
attention kernel, for trainers and rollout code written against `flash_attn` (public as `rl_engine.flash_attn`):

    from rl_engine.flash_attn import flash_attn_func, flash_attn_varlen_func, flash_attn_with_kvcache

- `flash_attn_func(q, k, v, ...)`: q, k, v [B,S,H,D];
- `flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, ...)`:
  packed [T,H,D] sequences (verl's "remove padding" layout), self-attention (cu_seqlens_q == cu_seqlens_k);
- `flash_attn_with_kvcache(q, k_cache, v_cache, k=None, v=None, cache_seqlens=..., block_table=...)`:
  chunked prefill and decode; new k/v are written into the cache in place at `cache_seqlens`, as
  flash-attn does; a paged cache (`block_table`) is gathered into the contiguous layout the kernel reads.

GQA (Hq a multiple of Hkv) as flash-attn. One kernel serves all three, so a token's output has the
same bits in a padded batch, packed, chunked and decoded (DESIGN.md rule 3). Differentiable in q, k, v
except `flash_attn_with_kvcache` (inference). What the kernel does not implement is refused with a
ValueError naming the argument, never ignored: dropout, sliding windows, softcap, ALiBi, attention
probabilities, a non-causal query chunk against a cache, cross-attention varlen.
"""

from __future__ import annotations

import torch

__all__ = ["flash_attn_func", "flash_attn_varlen_func", "flash_attn_with_kvcache"]


def _refuse_unsupported(dropout_p: float = 0.0, window_size: tuple[int, int] = (-1, -1), softcap: float = 0.0,
                        alibi_slopes: torch.Tensor | None = None, return_attn_probs: bool = False) -> None:
    if dropout_p:
        raise ValueError(f"dropout_p: attention dropout is not supported (got {dropout_p}); RL training uses 0")
    if tuple(window_size) != (-1, -1):
        raise ValueError(f"window_size: sliding-window attention is not supported (got {tuple(window_size)})")
    if softcap:
        raise ValueError(f"softcap: logit soft-capping is not supported (got {softcap})")
    if alibi_slopes is not None:
        raise ValueError("alibi_slopes: ALiBi is not supported")
    if return_attn_probs:
        raise ValueError("return_attn_probs: not supported (the kernel never materialises probabilities)")


def flash_attn_func(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, dropout_p: float = 0.0,
                    softmax_scale: float | None = None, causal: bool = False,
                    window_size: tuple[int, int] = (-1, -1), softcap: float = 0.0,
                    alibi_slopes: torch.Tensor | None = None, deterministic: bool = False,
                    return_attn_probs: bool = False) -> torch.Tensor:
    """out [B,S,Hq,D] = attention over q, k, v [B,S,H,D] (deterministic whatever `deterministic` says)."""
    from rl_engine.kernels.ops.triton.attention.attention import triton_attention

    _refuse_unsupported(dropout_p, window_size, softcap, alibi_slopes, return_attn_probs)
    if q.dim() != 4 or k.shape[1] != q.shape[1]:
        raise ValueError(f"q, k: expected [B,S,H,D] with one sequence length for queries and keys, got "
                         f"{tuple(q.shape)} and {tuple(k.shape)} (cross-attention is not supported)")
    return triton_attention(q, k, v, causal=causal, scale=softmax_scale)


def flash_attn_varlen_func(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens_q: torch.Tensor,
                           cu_seqlens_k: torch.Tensor, max_seqlen_q: int, max_seqlen_k: int, dropout_p: float = 0.0,
                           softmax_scale: float | None = None, causal: bool = False,
                           window_size: tuple[int, int] = (-1, -1), softcap: float = 0.0,
                           alibi_slopes: torch.Tensor | None = None, deterministic: bool = False,
                           return_attn_probs: bool = False, block_table: torch.Tensor | None = None) -> torch.Tensor:
    """out [T,Hq,D] for sequences packed along dim 0 of q, k, v [T,H,D], bounded by cu_seqlens [N+1] (int32)."""
    from rl_engine.kernels.ops.triton.attention.attention import triton_attention

    _refuse_unsupported(dropout_p, window_size, softcap, alibi_slopes, return_attn_probs)
    if block_table is not None:
        raise ValueError("block_table: a paged varlen call is not supported; use flash_attn_with_kvcache")
    # Compared where they live: one sync, not two copies to the host.
    if cu_seqlens_q is not cu_seqlens_k and not torch.equal(cu_seqlens_q, cu_seqlens_k.to(cu_seqlens_q)):
        raise ValueError("cu_seqlens_k: must equal cu_seqlens_q (self-attention over packed sequences); "
                         "cross-attention varlen is not supported")
    if q.dim() != 3:
        raise ValueError(f"q: expected packed [T,H,D], got {tuple(q.shape)}")
    return triton_attention(q, k, v, causal=causal, scale=softmax_scale, cu_seqlens=cu_seqlens_q)


@torch.no_grad()
def flash_attn_with_kvcache(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                            k: torch.Tensor | None = None, v: torch.Tensor | None = None,
                            rotary_cos: torch.Tensor | None = None, rotary_sin: torch.Tensor | None = None,
                            cache_seqlens: int | torch.Tensor | None = None,
                            cache_batch_idx: torch.Tensor | None = None, cache_leftpad: torch.Tensor | None = None,
                            block_table: torch.Tensor | None = None, softmax_scale: float | None = None,
                            causal: bool = False, window_size: tuple[int, int] = (-1, -1), softcap: float = 0.0,
                            rotary_interleaved: bool = True, alibi_slopes: torch.Tensor | None = None,
                            num_splits: int = 0, return_softmax_lse: bool = False) -> torch.Tensor:
    """out [B,Sq,Hq,D]: q [B,Sq,Hq,D] against the cache, after writing k, v [B,Sq,Hkv,D] (if given) at
    positions cache_seqlens[b] .. + Sq. Cache: [B,Smax,Hkv,D], or pages [num_blocks,page,Hkv,D] with
    block_table [B,max_blocks]. Query i of row b sits at position (cached length) - Sq + i, as in
    flash-attn (bottom-right aligned); with Sq > 1 the call must be causal (chunked prefill)."""
    from rl_engine.kernels.ops.triton.attention.kv_cache_attention import triton_kv_cache_attention
    from rl_engine.rollout.paged_cache import write_pages

    _refuse_unsupported(0.0, window_size, softcap, alibi_slopes, False)
    for name, value in (("rotary_cos", rotary_cos), ("rotary_sin", rotary_sin), ("cache_leftpad", cache_leftpad)):
        if value is not None:
            raise ValueError(f"{name}: not supported (apply rotary embeddings before the call; no left padding)")
    if return_softmax_lse:
        raise ValueError("return_softmax_lse: not supported")
    if (k is None) != (v is None):
        raise ValueError("k, v: give both new keys and values, or neither")
    b, sq = q.shape[0], q.shape[1]
    if sq > 1 and not causal:
        raise ValueError("causal: a chunk of Sq > 1 queries against a cache is causal here; pass causal=True")
    if cache_seqlens is None:
        raise ValueError("cache_seqlens: required (the cached length of each row before this call)")
    if isinstance(cache_seqlens, int):
        cache_seqlens = torch.full((b,), cache_seqlens, dtype=torch.int32, device=q.device)
    lengths = cache_seqlens.to(device=q.device, dtype=torch.int64)
    if cache_batch_idx is not None:
        if block_table is not None or k is not None:
            raise ValueError("cache_batch_idx: supported only to read a contiguous cache (no block_table, no new k, v)")
        k_cache, v_cache = k_cache[cache_batch_idx.long()], v_cache[cache_batch_idx.long()]
    if k is not None:
        positions = lengths[:, None] + torch.arange(sq, device=q.device)[None, :]  # [B,Sq]
        if block_table is None:
            rows = torch.arange(b, device=q.device)[:, None].expand_as(positions)
            k_cache[rows, positions] = k
            v_cache[rows, positions] = v
        else:
            write_pages(k_cache, block_table, positions, k)
            write_pages(v_cache, block_table, positions, v)
        lengths = lengths + sq
    # A paged cache is read through block_table in the kernel (no gather).
    return triton_kv_cache_attention(q, k_cache, v_cache, lengths.to(torch.int32), scale=softmax_scale,
                                     block_table=block_table)
