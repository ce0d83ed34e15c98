"""Attention of Sq new queries against a KV cache in Triton (chunked prefill, decode).

q [B,Sq,Hq,D], k_cache/v_cache [B,Smax,Hkv,D], cache_seqlens [B] = valid cached length, the new
tokens included: query i of row b sits at position cache_seqlens[b] − Sq + i and attends to cache
positions <= its own. It runs the forward kernel of `flash.py` with the same tiles as the prefill
(key blocks aligned to cache position 0), so a token's output has the same bits as in a full prefill,
a packed batch, or any chunking. To use the tile's rows when Sq is small (decode), the tile is filled
with the other query heads of the same KV head;
a row's result does not depend on its neighbours. On the H200 a bf16 step at head_dim 64 / 128 whose KV head has at most
16 query columns (group · Sq) runs `gluon_decode.py` instead: the same bits, the lengths read in the kernel.

A paged cache (flash_attn_with_kvcache's: pools [num_blocks, page_block_size, Hkv, D] + block_table
[B, max_blocks]) is read through the table in the kernel (flash.py's `_key_rows`), never gathered: the same key
blocks and splits from position 0, so the same bits as the contiguous cache its pages make (Smax = max_blocks ·
page_block_size). On the H200 the Gluon decode takes paged steps (one TMA copy per page, `gluon_decode.PAGED`);
elsewhere flash.py's kernel does.

Cached positions at or beyond cache_seqlens[b] are never read (they may hold anything, even NaN).
Lengths are checked against [Sq, Smax] when cache_seqlens lives on the CPU; on the GPU they are
clamped to [0, Smax] instead, so a decode step costs no device-to-host synchronisation.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from rl_engine.kernels.ops.pytorch.attention.kv_cache_attention import NativeKvCacheAttentionOp, paged_cache_view
from rl_engine.kernels.ops.triton.attention.contract import (
    MAX_SEQUENCES,
    NO_WINDOW,
    SequenceTable,
    attention_config,
    default_scale,
)
from rl_engine.kernels.ops.triton.attention.dispatch import _aligned, flash_attention_op, flash_forward
from rl_engine.kernels.ops.triton.runtime import check_devices, interpreting, unit_column_rows

TABLE_BLOCK = 128  # cache rows per program


@triton.jit
def _kv_cache_table_kernel(LENGTHS, INFO, batch, sq, smax, k_rows, no_window, BLOCK: tl.constexpr):
    """The sequence table of a KV-cache call (flash.py's layout rows), one row per cache row b: its
    queries at rows b·Sq…, positions length − Sq…, its keys at rows b·k_rows… (k_rows = Smax; 1 for a paged
    cache, whose k_row0 is the block table's row), length clamped to [0, Smax]."""
    b = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    ok = b < batch
    n = tl.load(LENGTHS + b, mask=ok, other=0)
    n = tl.minimum(tl.maximum(n, 0), smax).to(tl.int32)
    row = INFO + b * 6
    tl.store(row + 0, b * sq, mask=ok)
    tl.store(row + 1, tl.zeros_like(b) + sq, mask=ok)
    tl.store(row + 2, n - sq, mask=ok)
    tl.store(row + 3, b * k_rows, mask=ok)
    tl.store(row + 4, n, mask=ok)
    tl.store(row + 5, tl.zeros_like(b) + no_window, mask=ok)


def kv_cache_table(cache_seqlens: torch.Tensor, sq: int, smax: int, device, *, paged: bool = False) -> SequenceTable:
    """The sequence table in one launch: a decode step replayed from a CUDA graph pays per kernel, and the
    same table from torch ops took eight."""
    b = cache_seqlens.shape[0]
    if b > MAX_SEQUENCES:
        raise ValueError(f"cache_seqlens: at most {MAX_SEQUENCES} sequences per call, got {b}")
    info = torch.empty((b, 6), dtype=torch.int32, device=device)
    if b:
        _kv_cache_table_kernel[(triton.cdiv(b, TABLE_BLOCK),)](
            cache_seqlens.to(device=device), info, b, sq, smax, 1 if paged else smax, NO_WINDOW, BLOCK=TABLE_BLOCK)
    return SequenceTable(info, sq, smax)


def _heads_per_tile(group: int, block_m: int, sq: int) -> int:
    """How many query heads of one KV head share a tile: the most that still fit Sq queries each. A program walks
    its tile's keys whatever how many of its rows are queries, so fewer programs never cost time, and one tile per
    query head multiplied the waves of programs once one CTA filled an SM (cf112e1's shared memory; H200:
    1.01-1.64x). A parallelism choice only: a tile's rows do not depend on
    each other, so the bits are the same for every choice (test_attention_consistency)."""
    fits = [h for h in range(1, group + 1) if group % h == 0 and block_m % h == 0 and block_m // h >= sq] or [1]
    return max(fits)


def triton_kv_cache_attention(q, k_cache, v_cache, cache_seqlens, *, scale: float | None = None, block_table=None):
    """[B,Sq,Hq,D] in q's dtype (forward only). block_table [B, max_blocks] (int32, as flash_attn_with_kvcache's):
    k_cache/v_cache are page pools [num_blocks, page_block_size, Hkv, D], read through the table."""
    op = NativeKvCacheAttentionOp(scale)
    paged = block_table is not None
    # Values are checked where they live on the CPU; on the GPU a decode step reads nothing back (lengths are clamped
    # to [0, Smax] in the kernel; page ids are trusted, as flash_attn_with_kvcache trusts them).
    smax = op.check_shapes(q=q, k_cache=k_cache, v_cache=v_cache, cache_seqlens=cache_seqlens, block_table=block_table)
    if paged and block_table.device.type == "cpu":
        op.check_block_table(k_cache, block_table)
    if cache_seqlens.device.type == "cpu":
        op.check_lengths(cache_seqlens, q.shape[1], smax)
    if not (q.dtype == k_cache.dtype == v_cache.dtype):
        raise ValueError(f"k_cache, v_cache: expected q's dtype {q.dtype}, got {k_cache.dtype}, {v_cache.dtype}")
    b, sq, hq, d = q.shape
    hkv = k_cache.shape[2]
    page_size = k_cache.shape[1] if paged else None
    if paged:
        block_table = block_table.to(device=q.device, dtype=torch.int32).contiguous()
        if torch.compiler.is_compiling():  # traced: the custom op reads contiguous rows; the gathered cache's bits
            k_cache, v_cache = paged_cache_view(k_cache, block_table), paged_cache_view(v_cache, block_table)
            paged, page_size = False, None
    # q's rows at their row stride (q of a stacked q/k, read in place) for the Gluon decode; contiguous for flash.py
    q_rows = unit_column_rows(q, hq * d).view(-1, hq, d)
    rows = [t.reshape(-1, t.shape[2], t.shape[3]).contiguous() for t in (k_cache, v_cache)]
    if q.is_cuda and not interpreting() and not torch.compiler.is_compiling() and 0 < b <= MAX_SEQUENCES:
        from rl_engine.kernels.ops.triton.attention import gluon_decode

        if gluon_decode.covers(q_rows, rows[0], sq, page_size):  # the table built in the kernel: one launch fewer
            with torch.no_grad():
                out, _ = gluon_decode.gluon_decode_cache(*_aligned(q_rows, *rows), cache_seqlens.to(device=q.device),
                                                         sq, smax, scale=default_scale(d, scale),
                                                         block_table=block_table, page_size=page_size or 1)
            return out.reshape(q.shape)
    rows = [q_rows.contiguous(), *rows]
    table = kv_cache_table(cache_seqlens, sq, smax, q.device, paged=paged)
    heads_per_tile = _heads_per_tile(hq // hkv, attention_config(q.dtype, d).forward.block_m, sq)
    with torch.no_grad():  # forward only: cached rows past a length are not covered by the table
        if torch.compiler.is_compiling():  # traced: the custom op, whose fake gives the compiler shapes
            out, _ = flash_attention_op(*rows, table.info, table.max_q_count, table.max_kv_len, True,
                                        default_scale(d, scale), heads_per_tile)
        else:  # eager (a decode step): the kernels directly, without a custom op's dispatch per call
            out, _ = flash_forward(*rows, table, causal=True, scale=default_scale(d, scale),
                                   heads_per_tile=heads_per_tile, block_table=block_table if paged else None,
                                   page_size=page_size or 1)
    return out.reshape(q.shape)


class TritonKvCacheAttentionOp:
    """Candidate for NativeKvCacheAttentionOp: op(q=, k_cache=, v_cache=, cache_seqlens=)."""

    input_names = ("q", "k_cache", "v_cache", "cache_seqlens", "block_table")

    def __init__(self, scale: float | None = None):
        self.scale = scale

    def __call__(self, q, k_cache, v_cache, cache_seqlens, block_table=None):
        check_devices("TritonKvCacheAttentionOp", q=q, k_cache=k_cache, v_cache=v_cache, cache_seqlens=cache_seqlens,
                      block_table=block_table)
        return triton_kv_cache_attention(q, k_cache, v_cache, cache_seqlens, scale=self.scale, block_table=block_table)
