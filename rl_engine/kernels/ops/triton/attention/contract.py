"""The attention contract: what every attention kernel shares (flash.py's Triton kernels and the Gluon
kernels of gluon_forward.py, gluon_backward.py and gluon_decode.py), so that they all give the same bits: the
constants, the one tile configuration per (dtype, head_dim) and the table of sequences that describes a layout.
dispatch.py chooses and launches the kernels; this module imports none.

Train/infer consistency (DESIGN.md rule 3) comes from running ONE forward kernel, with ONE tile
configuration per (dtype, head_dim), for every layout. Each layout is described to the kernel by a
table of sequences, one int32 row per sequence (`SequenceTable`):

    q_row0   memory row of the sequence's first query (q viewed as rows [R, Hq, D])
    q_count  number of queries
    q_pos0   position of the first query, counted from the sequence's first key
    k_row0   memory row of the sequence's first key (k/v viewed as rows [Rk, Hkv, D]); for a paged cache
             (flash_forward's block_table), the sequence's row of the block table
    kv_len   number of keys; key position j < kv_len is visible to a query at position p iff j <= p
    window   ... and p − window < j (NO_WINDOW for every real sequence; 1 for left-padding queries,
             which see only their own key, as the gold reference defines them)

Keys are walked in blocks [n·BLOCK_N, (n+1)·BLOCK_N) counted from the sequence's first key, so a
token meets the same keys in the same blocks in the same order whatever the layout: a full prefill,
a left/right-padded batch, a packed batch, one chunk of a chunked prefill, or a decode step.

Head sizes: the head dim is padded inside the kernel to BLOCK_D = max(16, next_power_of_2(head_dim))
(`block_d`), so every `tl.dot` has M, N, K >= 16 (what the GPU compiler needs) for any head_dim <= 256;
padded lanes load as exact zeros and add exact zeros to fp32 accumulators, which changes no bits.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

LOG2_E = 1.4426950408889634
# The running max starts finite so that a block masked for a row gives alpha = exp2(0) = 1, not NaN.
M_INIT = tl.constexpr(-1.0e30)
# The running max moves only when a block raises it by more than this many log2 units (`_lazy_max`;
# FlashAttention-4's conditional rescaling); every kernel and path walks the same rule, so their bits stay equal.
RESCALE_ABOVE = tl.constexpr(8.0)
NO_WINDOW = 1 << 30
_NO_WINDOW = tl.constexpr(NO_WINDOW)  # the same, readable inside kernels
MAX_SEQUENCES = 65535  # the launch grid's third axis
COMBINE_BLOCK_R = 16  # (row, head) pairs per program of the split combine (flash._split_combine_kernel)


@dataclass(frozen=True)
class TileConfig:
    block_m: int
    block_n: int
    num_warps: int
    num_stages: int


@dataclass(frozen=True)
class AttentionConfig:
    forward: TileConfig
    backward_dq: TileConfig
    backward_dkdv: TileConfig
    # Keys per KV split (a multiple of the forward's BLOCK_N): every forward reduces a query's keys split
    # by split, folding the splits' partial softmax states left to right (see the module docstring).
    # 2048 as SGLang's deterministic mode uses; to be measured (benchmarks/attention_tiles.py).
    kv_split: int = 2048
    # How the forward walks a tile's splits, with the same bits either way: one loop per split, or one
    # flat loop over the blocks that folds at each split's end. Which is faster depends on the head dim
    # (H200, 2026-12-01: flat 0.94 vs 1.09 ms at head_dim 64, nested 1.41 vs 1.54 ms at 128).
    flat_splits: bool = False


def attention_config(dtype: torch.dtype, head_dim: int) -> AttentionConfig:
    """The one tile configuration per (dtype, head_dim): never chosen from batch, length or layout."""
    if head_dim > 256:
        raise ValueError(f"q: head_dim must be at most 256, got {head_dim}")
    flat = head_dim <= 64
    if head_dim <= 32:  # small heads (the interpreter tests): several blocks and splits even at S ~ 40
        tile = TileConfig(16, 16, 4, 2)
        return AttentionConfig(tile, tile, tile, kv_split=32, flat_splits=flat)
    if dtype == torch.float32 and head_dim > 128:
        # 64-row fp32 tiles 256 lanes wide need 256 KiB of shared memory in the backward (H200: 227 KiB).
        small = TileConfig(32, 32, 4, 2)
        return AttentionConfig(TileConfig(64, 32, 4, 2), small, small)
    if dtype == torch.float32:
        return AttentionConfig(TileConfig(64, 32, 4, 2), TileConfig(64, 32, 4, 2), TileConfig(32, 64, 4, 2),
                               flat_splits=flat)
    if head_dim > 128:
        # H200, 2026-12-01: 32x64 dK/dV tiles spill 4.6 KB a thread; 32x32 took the backward 27 -> 16 ms;
        # 128x32 dQ tiles on 8 warps: forward + backward 18.07 vs 18.95 ms, ABBA.
        # 64-key forward blocks: the Gluon forward (bf16, sm_90) 1.06-1.11x with K and V in separate rings; this
        # kernel 0.83x at S = 4k.
        return AttentionConfig(TileConfig(64, 64, 4, 2), TileConfig(128, 32, 8, 2), TileConfig(32, 32, 4, 2))
    # bf16/fp16, head_dim 33…128: chosen on the H200 by benchmarks/attention_tiles.py (2026-11-30 and
    # 2026-12-01 with TMA loads, benchmarks/results/attention_tiles.json); dQ tiles made no measurable difference.
    # Head_dim 64's backward tiles: 2026-12-01 with TMA (about 3-5% faster than the tiles before).
    return AttentionConfig(
        forward=TileConfig(64, 64, 4, 3),
        backward_dq=TileConfig(64, 64, 4, 3) if head_dim <= 64 else TileConfig(64, 64, 4, 2),
        backward_dkdv=TileConfig(32, 64, 4, 3),
        flat_splits=flat,
    )


@dataclass(frozen=True)
class SequenceTable:
    """Per-sequence layout rows (see the module docstring) plus the host-side bounds of the grid."""

    info: torch.Tensor  # int32 [Z, 6]: q_row0, q_count, q_pos0, k_row0, kv_len, window
    max_q_count: int
    max_kv_len: int

    @property
    def num_sequences(self) -> int:
        return self.info.shape[0]


def sequence_table(q_row0, q_count, q_pos0, k_row0, kv_len, window=None, *, max_q_count: int, max_kv_len: int):
    if window is None:
        window = torch.full_like(q_count, NO_WINDOW)
    info = torch.stack([q_row0, q_count, q_pos0, k_row0, kv_len, window], dim=1).to(torch.int32).contiguous()
    if info.shape[0] > MAX_SEQUENCES:
        raise ValueError(f"cu_seqlens: at most {MAX_SEQUENCES} sequences per call, got {info.shape[0]}")
    return SequenceTable(info, int(max_q_count), int(max_kv_len))


def block_d(head_dim: int) -> int:
    """The padded head dim: a power of two (Triton tiles) and >= 16 (tl.dot's smallest K and N)."""
    return max(16, triton.next_power_of_2(head_dim))


def default_scale(head_dim: int, scale: float | None) -> float:
    return float(scale) if scale is not None else 1.0 / math.sqrt(head_dim)
