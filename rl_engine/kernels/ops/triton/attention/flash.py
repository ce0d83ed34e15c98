"""The flash-attention kernels shared by every attention entry point (prefill, packed, KV cache).

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
Key blocks that every query of a tile sees whole (below the tile's diagonal, inside kv_len) run
without masks, their K/V read through TMA descriptors where the rows allow (`row_descriptors`: whole
blocks hold only the sequence's own rows, so the copy engine reads nothing of a neighbour's); the
others are masked and read through pointers. Both kinds of block run the same instructions on a visible
score (the scale goes in through an explicit fma, never a contraction the compiler may or may not
make), so a (query, block) pair gives the same bits whichever kind its tile makes it. fp32 skips
the split (MASK_SPLIT=False): it doubles the compile time of kernels whose speed matters less.
KV splits (one size per (dtype, head_dim), `AttentionConfig.kv_split`, never chosen from the batch):
a query's keys are reduced split by split, [0, kv_split), [kv_split, 2·kv_split), …, each split from
a fresh softmax state, and the splits' states are folded left to right (`_merge_split`, explicit fmas).
A prefill program folds its splits as it walks them (in one loop per split, or in one flat loop that
folds at each split's last block: `AttentionConfig.flat_splits`, the same bits, whichever is faster for
the head dim); decode and short chunks, whose one query tile
would leave the GPU idle, run one program per split (PARTIAL) and fold the same states in the same
order in `_split_combine_kernel`: the same bits, prefill ≡ packed ≡ chunked ≡ decode, with the
parallelism of split-KV decoding. Within one split nothing changes, so a sequence shorter than a split
gets the bits of a kernel without splits.
The online softmax keeps (m, l, acc) in fp32; a key block entirely masked for a query row leaves
that row's (m, l, acc) bitwise unchanged (alpha = exp2(0) = 1, p = 0, acc + 0·v = acc), so the
extra blocks a tile walks for its other rows never change a row's bits. A row of a `tl.dot` result
depends only on that row of its left operand, so which other rows share the tile does not matter
either: decode pads its queries up to BLOCK_M with masked rows (and may fill the tile with the other
query heads of the same KV head, `heads_per_tile`), keeping the same instruction shapes.

Backward (FlashAttention-2 split, deterministic, no atomics): `delta = rowsum(dO·O)`; dQ by a
program per query block looping over key blocks; dK/dV by a program per key block looping over the
query heads of its group (fixed order) and over query blocks aligned to the sequence's first query.

Scores are kept in log2 units: s = (q·k)·scale·log2(e), p = exp2(s − m); lse = m + log2(l).

Head sizes: the head dim is padded inside the kernel to BLOCK_D = max(16, next_power_of_2(head_dim))
(`block_d`), so every `tl.dot` has M, N, K >= 16 (what the GPU compiler needs) for any head_dim <= 256;
padded lanes load as exact zeros and add exact zeros to fp32 accumulators, which changes no bits.

Non-finite inputs are never hidden: a NaN/inf in q row i, or in k/v at a key row i sees, makes row i
non-finite as IEEE says. Invisible scores are replaced by `where`, but the tile products (p·v forward,
ds·k for dQ, ds·q for dK) multiply an invisible pair's exact 0 weight by its operand, so a NaN/inf in
k/v (or q, for dK) at a key hidden by the causal mask inside the same key block also makes the rows
that share the block NaN: louder than the gold, never quieter. Zeroing non-finite operands in the main
loop and a second exact pass cost 33–60% of the H200 throughput (measured 2026-11-30), so we don't.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_wait

from rl_engine.kernels.ops.triton.runtime import (
    SideStream,
    cast_rne,
    dot_fp32,
    dot_precision,
    ensure_cuda_context,
    host_descriptor,
    interpreting,
    register_autograd,
)

LOG2_E = 1.4426950408889634
# The running max starts finite so that a block masked for a row gives alpha = exp2(0) = 1, not NaN.
M_INIT = tl.constexpr(-1.0e30)
# The running max moves only when a block raises it by more than this many log2 units (`_lazy_max`;
# FlashAttention-4's conditional rescaling); every kernel and path walks the same rule, so their bits stay equal.
RESCALE_ABOVE = tl.constexpr(8.0)
NO_WINDOW = 1 << 30
_NO_WINDOW = tl.constexpr(NO_WINDOW)  # the same, readable inside kernels
MAX_SEQUENCES = 65535  # the launch grid's third axis


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
        # 128x32 dQ tiles on 8 warps: forward + backward 18.07 vs 18.95 ms, ABBA (h200_probe_attention_hd256_dq_*.log).
        # 64-key forward blocks: the Gluon forward (bf16, sm_90) 1.06-1.11x with K and V in separate rings; this
        # kernel 0.83x at S = 4k (h200_probe_fwd_split_rings.log).
        return AttentionConfig(TileConfig(64, 64, 4, 2), TileConfig(128, 32, 8, 2), TileConfig(32, 32, 4, 2))
    # bf16/fp16, head_dim 33…128: chosen on the H200 by benchmarks/attention_tiles.py (2026-11-30 and
    # 2026-12-01 with TMA loads, benchmarks/results/attention_tiles.json); dQ tiles made no measurable difference.
    # Head_dim 64's backward tiles: 2026-12-01 with TMA (docs/evidence/h200_probe_decode_split_hd64_bwd_d65edc0.log).
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


def row_descriptors(tensors, block_rows: int):
    """TMA descriptors of contiguous 16-bit rows [R, H, D], seen as [R, H·D] in blocks [block_rows, D], or
    None (the kernels then load through pointers): for a head dim that is not a power of two >= 16, rows
    not 16-byte aligned, or fp32 (whose kernels have no unmasked loop, where the descriptors are read)."""
    first = tensors[0]
    rows, heads, head_dim = first.shape
    size = first.element_size()
    if (size != 2 or block_d(head_dim) != head_dim or (heads * head_dim * size) % 16
            or any(t.data_ptr() % 16 for t in tensors)):
        return None
    if not interpreting():
        ensure_cuda_context(first.device.index if first.device.index is not None else torch.cuda.current_device())
    return [host_descriptor(t, [rows, heads * head_dim], [heads * head_dim, 1], [block_rows, head_dim])
            for t in tensors]


# --------------------------------------------------------------------------------------------------
# forward


@triton.jit
def _key_blocks(q_pos0, first_q, rows, q_count, kv_len, window, CAUSAL: tl.constexpr, BLOCK_N: tl.constexpr,
                MASK_SPLIT: tl.constexpr):
    """The key blocks of a query tile (queries first_q … first_q + rows − 1 of a sequence): [lo, mid)
    every query of the tile sees whole (no mask), [mid, hi) the rest (masked); all multiples of BLOCK_N
    counted from the first key. Only windowed (padding) rows skip leading blocks."""
    hi = kv_len
    if CAUSAL:
        hi = tl.minimum(kv_len, q_pos0 + tl.minimum(first_q + rows, q_count))
    hi = tl.where(first_q < q_count, hi, 0)  # a tile past the sequence's queries: no work
    lo = (tl.maximum(q_pos0 + first_q - window + 1, 0) // BLOCK_N) * BLOCK_N
    mid = kv_len
    if CAUSAL:
        mid = tl.minimum(mid, q_pos0 + first_q + 1)
    mid = tl.where(window == _NO_WINDOW, lo + tl.maximum(mid - lo, 0) // BLOCK_N * BLOCK_N, lo)
    mid = tl.minimum(mid, hi)
    if not MASK_SPLIT:
        mid = lo
    return lo, mid, hi


@triton.jit
def _key_rows(k_row0, k_pos, k_ok, BLOCK_TABLE, stride_bt, PAGE_SIZE: tl.constexpr, PAGED: tl.constexpr):
    """Memory rows (int64) of the sequence's keys at positions k_pos. PAGED: k_row0 is the sequence's row of the
    block table [B, max_blocks] (flash_attn_with_kvcache's), and position p lives at row
    block_table[k_row0, p // PAGE_SIZE] · PAGE_SIZE + p % PAGE_SIZE of the page pool; positions outside k_ok
    read page 0 (their K/V loads are masked)."""
    if PAGED:
        entry = BLOCK_TABLE + k_row0.to(tl.int64) * stride_bt + k_pos // PAGE_SIZE
        if k_ok is None:
            page = tl.load(entry)
        else:
            page = tl.load(entry, mask=k_ok, other=0)
        return page.to(tl.int64) * PAGE_SIZE + k_pos % PAGE_SIZE
    else:
        return (k_row0 + k_pos).to(tl.int64)


@triton.jit
def _whole_kv_block(K, V, KD, VD, k_row0, start_n, stride_kr, k_col, kd_col, d_ok, EVEN_D: tl.constexpr,
                    BLOCK_N: tl.constexpr, TMA: tl.constexpr, DOT_FP32: tl.constexpr, BLOCK_TABLE=None,
                    stride_bt=0, PAGE_SIZE: tl.constexpr = 1, PAGED: tl.constexpr = False):
    """K and V rows [start_n, start_n + BLOCK_N) of a block inside kv_len: no row mask. TMA: through the
    descriptors KD/VD (rows [Rk, Hkv·D]), which read exactly these rows, all of them the sequence's.
    PAGED: through the block table (`_key_rows`; never with TMA)."""
    k_off = _key_rows(k_row0, start_n + tl.arange(0, BLOCK_N), None, BLOCK_TABLE, stride_bt, PAGE_SIZE,
                      PAGED) * stride_kr
    if TMA:
        k = KD.load([k_row0 + start_n, kd_col])
        v = VD.load([k_row0 + start_n, kd_col])
    elif EVEN_D:
        k = tl.load(K + k_off[:, None] + k_col)
        v = tl.load(V + k_off[:, None] + k_col)
    else:
        k = tl.load(K + k_off[:, None] + k_col, mask=d_ok[None, :], other=0.0)
        v = tl.load(V + k_off[:, None] + k_col, mask=d_ok[None, :], other=0.0)
    if DOT_FP32:
        k = k.to(tl.float32)
    return k, v


@triton.jit
def _masked_kv_block(K, V, k_row0, start_n, stride_kr, k_col, d_ok, q_pos, kv_len, window, CAUSAL: tl.constexpr,
                     BLOCK_N: tl.constexpr, DOT_FP32: tl.constexpr, BLOCK_TABLE=None, stride_bt=0,
                     PAGE_SIZE: tl.constexpr = 1, PAGED: tl.constexpr = False):
    """K and V rows [start_n, start_n + BLOCK_N) of a block that needs masks (rows past kv_len load as 0),
    and which (query, key) pairs of the tile are visible."""
    k_pos = start_n + tl.arange(0, BLOCK_N)
    k_ok = k_pos < kv_len
    k_off = _key_rows(k_row0, k_pos, k_ok, BLOCK_TABLE, stride_bt, PAGE_SIZE, PAGED) * stride_kr
    kv_mask = k_ok[:, None] & d_ok[None, :]
    k = tl.load(K + k_off[:, None] + k_col, mask=kv_mask, other=0.0)
    v = tl.load(V + k_off[:, None] + k_col, mask=kv_mask, other=0.0)
    if DOT_FP32:
        k = k.to(tl.float32)
    visible = k_ok[None, :] & (k_pos[None, :] > q_pos[:, None] - window)
    if CAUSAL:
        visible = visible & (k_pos[None, :] <= q_pos[:, None])
    return k, v, visible


@triton.jit
def _lazy_max(m, m_max):
    """The running max a block moves to: the new maximum m_max only where it exceeds m by more than RESCALE_ABOVE
    (log2 units), else m, whose stale value only lets p̃ grow to 2^RESCALE_ABOVE (exact in fp32 and bf16's
    exponent range; out = Σp̃·v / Σp̃ whatever m). alpha is then exactly 1 in almost every block after a split's
    first, so the Gluon forward skips acc's rescale (64 FMULs a thread a block at head_dim 128)."""
    return tl.where(m_max - m > RESCALE_ABOVE, m_max, m)


@triton.jit
def _online_softmax_block(q, k, v, m, l, acc, visible, qk_scale, kv_base: tl.constexpr,
                          MASKED: tl.constexpr, DOT_FP32: tl.constexpr, DOT_PRECISION: tl.constexpr):
    """One key block of the online softmax. The masked and unmasked calls run the same instructions on
    a visible score (the mask only replaces invisible scores by -inf), and the scale is applied by an
    explicit fma in both, so a (row, block) pair gives the same bits whichever loop it falls in: which
    loop that is depends on the tile, and tiles differ between layouts."""
    s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION)  # raw q·k; scaled inside the fma below
    if MASKED:
        s = tl.where(visible, s, float("-inf"))
    # max(x)·c == max(x·c) for c > 0 (rounding is monotonic): the running max is in log2 units.
    m_new = _lazy_max(m, tl.maximum(m, tl.max(s, 1) * qk_scale))
    alpha = tl.math.exp2(m - m_new)
    p = tl.math.exp2(tl.fma(s, qk_scale, -m_new[:, None]))
    # p is rounded to the value dtype for the product (tensor-core operands); l sums the same
    # rounded weights, so that out = Σ p̃·v / Σ p̃ stays a weighted mean of v (halves bf16 error).
    p_v = cast_rne(p, kv_base)
    if DOT_FP32:
        p_v = p_v.to(tl.float32)
        v = v.to(tl.float32)
    acc = tl.dot(p_v, v, acc * alpha[:, None], input_precision=DOT_PRECISION)
    # l's sum is a product too, p̃·1 (every column of it the row's sum), as the Gluon forward forms it beside
    # p̃·v: on the tensor cores its ~70 instructions a block (unpack, add, shuffles) leave the softmax.
    # l stays that [BLOCK_M, 16] tile until a split ends (_l_rows): reducing it here would make Triton wait
    # for the product in every block, and wgmma groups retire in order, so p̃·v's wait with it.
    ones = tl.full([v.shape[0], 16], 1.0, p_v.dtype)
    l = tl.dot(p_v, ones, l * alpha[:, None], input_precision=DOT_PRECISION)
    return m_new, l, acc


@triton.jit
def _fresh_state(BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr):
    """(running max, sum, accumulator) of BLOCK_M rows before any key: a split's start, or the fold's."""
    return (tl.full([BLOCK_M], M_INIT, dtype=tl.float32), tl.zeros([BLOCK_M], dtype=tl.float32),
            tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32))


@triton.jit
def _fresh_split(BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr):
    """A split's start as _online_softmax_block carries it: l as the [BLOCK_M, 16] tile of its product."""
    return (tl.full([BLOCK_M], M_INIT, dtype=tl.float32), tl.zeros([BLOCK_M, 16], dtype=tl.float32),
            tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32))


@triton.jit
def _l_rows(l):
    """The row sums from l's product tile (its columns are equal; max picks one without arithmetic)."""
    return tl.max(l, 1)


@triton.jit
def _merge_split(m_t, l_t, acc_t, m, l, acc):
    """(m_t, l_t, acc_t) ⊕ (m, l, acc): the left fold of KV-split partial states, the same instructions in
    the forward kernel and in the combine kernel (explicit fmas). Folding a fresh state (M_INIT, 0, 0)
    changes nothing, and folding into one gives the other state's bits back."""
    m_new = tl.maximum(m_t, m)
    a_t = tl.math.exp2(m_t - m_new)
    a = tl.math.exp2(m - m_new)
    l_new = tl.fma(l, a, l_t * a_t)
    acc_new = tl.fma(acc, a[:, None], acc_t * a_t[:, None])
    return m_new, l_new, acc_new


@triton.jit(do_not_specialize=["heads_per_tile", "q_per_tile"])
def _flash_forward_kernel(
    Q, K, V, KD, VD, O, LSE, PM, PL, PACC, SEQ_INFO, BLOCK_TABLE,
    stride_qr, stride_qh, stride_kr, stride_kh, stride_or, stride_oh, stride_lr,
    stride_ps, stride_pr, stride_ph, stride_as, stride_ar, stride_ah, stride_bt,
    qk_scale, group, heads_per_tile, q_per_tile, head_dim,
    CAUSAL: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
    KV_SPLIT: tl.constexpr, PARTIAL: tl.constexpr,
    EVEN_D: tl.constexpr, MASK_SPLIT: tl.constexpr, DOT_FP32: tl.constexpr, DOT_PRECISION: tl.constexpr,
    TMA: tl.constexpr, FLAT: tl.constexpr, PAGE_SIZE: tl.constexpr, PAGED: tl.constexpr,
):
    # PAGED: K and V are a page pool's rows [num_pages·PAGE_SIZE, Hkv, D] and a sequence's k_row0 is its row of
    # BLOCK_TABLE (`_key_rows`); the blocks, splits and their order are the contiguous layout's.
    # PARTIAL: program_id(0) is a KV split of the sequence's only query tile; the program writes that
    # split's unnormalised state (m, l, acc) to PM/PL/PACC for the combine kernel. Otherwise it is a
    # query tile (the last ones, which walk the most key blocks under the causal mask, launched first)
    # and the program folds all the tile's splits itself and writes the output.
    if PARTIAL:
        pid_m = 0
    else:
        pid_m = tl.num_programs(0) - 1 - tl.program_id(0)
    pid_h = tl.program_id(1)
    info = SEQ_INFO + tl.program_id(2) * 6
    q_row0 = tl.load(info + 0)
    q_count = tl.load(info + 1)
    q_pos0 = tl.load(info + 2)
    k_row0 = tl.load(info + 3)
    kv_len = tl.load(info + 4)
    window = tl.load(info + 5)

    # Tile row r holds query (pid_m·q_per_tile + r % q_per_tile) of head (first head + r // q_per_tile).
    rows = tl.arange(0, BLOCK_M)
    tile_head = rows // q_per_tile
    q_idx = pid_m * q_per_tile + rows % q_per_tile
    head = pid_h * heads_per_tile + tile_head
    kv_head = (pid_h * heads_per_tile) // group
    row_ok = (tile_head < heads_per_tile) & (q_idx < q_count)
    q_pos = q_pos0 + q_idx
    d = tl.arange(0, BLOCK_D)
    d_ok = d < head_dim

    q_off = (q_row0 + q_idx).to(tl.int64) * stride_qr + head * stride_qh
    q = tl.load(Q + q_off[:, None] + d[None, :], mask=row_ok[:, None] & d_ok[None, :], other=0.0)
    if DOT_FP32:
        q = q.to(tl.float32)

    lo, mid, hi = _key_blocks(q_pos0, pid_m * q_per_tile, q_per_tile, q_count, kv_len, window, CAUSAL, BLOCK_N,
                              MASK_SPLIT)
    # KV splits [s0, s0 + KV_SPLIT), aligned to the sequence's first key like the blocks.
    kv_base = K.dtype.element_ty
    k_col = kv_head * stride_kh + d[None, :]
    kd_col = kv_head * BLOCK_D

    m_t, l_t, acc_t = _fresh_state(BLOCK_M, BLOCK_D)
    m, l, acc = _fresh_split(BLOCK_M, BLOCK_D)
    if FLAT:  # one loop over the blocks; a split's state is folded when its last block is done
        blo = lo
        bhi = hi
        if PARTIAL:  # this split's blocks only
            blo = tl.maximum(lo, tl.program_id(0) * KV_SPLIT)
            bhi = tl.minimum(hi, (tl.program_id(0) + 1) * KV_SPLIT)
        umid = tl.minimum(tl.maximum(mid, blo), bhi)  # [blo, umid) unmasked, [umid, bhi) masked
        if MASK_SPLIT:
            for start_n in range(blo, umid, BLOCK_N):
                k, v = _whole_kv_block(K, V, KD, VD, k_row0, start_n, stride_kr, k_col, kd_col, d_ok, EVEN_D,
                                       BLOCK_N, TMA, DOT_FP32, BLOCK_TABLE, stride_bt, PAGE_SIZE, PAGED)
                m, l, acc = _online_softmax_block(q, k, v, m, l, acc, None, qk_scale, kv_base,
                                                  False, DOT_FP32, DOT_PRECISION)
                if not PARTIAL:
                    if (start_n + BLOCK_N) % KV_SPLIT == 0:  # a split ends: fold it, start the next fresh
                        m_t, l_t, acc_t = _merge_split(m_t, l_t, acc_t, m, _l_rows(l), acc)
                        m, l, acc = _fresh_split(BLOCK_M, BLOCK_D)
        else:
            umid = blo
        for start_n in range(umid, bhi, BLOCK_N):
            k, v, visible = _masked_kv_block(K, V, k_row0, start_n, stride_kr, k_col, d_ok, q_pos, kv_len, window,
                                             CAUSAL, BLOCK_N, DOT_FP32, BLOCK_TABLE, stride_bt, PAGE_SIZE, PAGED)
            m, l, acc = _online_softmax_block(q, k, v, m, l, acc, visible, qk_scale, kv_base,
                                              True, DOT_FP32, DOT_PRECISION)
            if not PARTIAL:
                if (start_n + BLOCK_N) % KV_SPLIT == 0:
                    m_t, l_t, acc_t = _merge_split(m_t, l_t, acc_t, m, _l_rows(l), acc)
                    m, l, acc = _fresh_split(BLOCK_M, BLOCK_D)
        if not PARTIAL:  # the last split (a fresh state when the last block ended one: a no-op fold)
            m_t, l_t, acc_t = _merge_split(m_t, l_t, acc_t, m, _l_rows(l), acc)
    else:  # one loop per split
        split_lo = lo // KV_SPLIT * KV_SPLIT
        split_hi = hi
        if PARTIAL:
            split_lo = tl.maximum(split_lo, tl.program_id(0) * KV_SPLIT)
            split_hi = tl.minimum(hi, tl.program_id(0) * KV_SPLIT + 1)  # this split only
        for s0 in range(split_lo, split_hi, KV_SPLIT):
            s1 = tl.minimum(s0 + KV_SPLIT, hi)
            b0 = tl.maximum(s0, lo)
            m, l, acc = _fresh_split(BLOCK_M, BLOCK_D)
            if MASK_SPLIT:  # fp32 skips the mask split: its speed matters less than its compile time
                for start_n in range(b0, tl.minimum(mid, s1), BLOCK_N):
                    k, v = _whole_kv_block(K, V, KD, VD, k_row0, start_n, stride_kr, k_col, kd_col, d_ok, EVEN_D,
                                           BLOCK_N, TMA, DOT_FP32, BLOCK_TABLE, stride_bt, PAGE_SIZE, PAGED)
                    m, l, acc = _online_softmax_block(q, k, v, m, l, acc, None, qk_scale, kv_base,
                                                      False, DOT_FP32, DOT_PRECISION)
            for start_n in range(tl.maximum(mid, b0), s1, BLOCK_N):
                k, v, visible = _masked_kv_block(K, V, k_row0, start_n, stride_kr, k_col, d_ok, q_pos, kv_len,
                                                 window, CAUSAL, BLOCK_N, DOT_FP32, BLOCK_TABLE, stride_bt,
                                                 PAGE_SIZE, PAGED)
                m, l, acc = _online_softmax_block(q, k, v, m, l, acc, visible, qk_scale, kv_base,
                                                  True, DOT_FP32, DOT_PRECISION)
            if not PARTIAL:
                m_t, l_t, acc_t = _merge_split(m_t, l_t, acc_t, m, _l_rows(l), acc)

    if PARTIAL:  # this split's state (fresh if it holds none of the tile's keys: folding it is a no-op)
        r64 = (q_row0 + q_idx).to(tl.int64)
        split = tl.program_id(0)
        p_off = split * stride_ps + r64 * stride_pr + head * stride_ph
        tl.store(PM + p_off, m, mask=row_ok)
        tl.store(PL + p_off, _l_rows(l), mask=row_ok)
        a_off = split * stride_as + r64 * stride_ar + head * stride_ah
        tl.store(PACC + a_off[:, None] + d[None, :], acc, mask=row_ok[:, None] & d_ok[None, :])
    else:
        # A query with no visible key outputs 0, not NaN; a NaN l (inf − inf in the scores) stays NaN,
        # so the lse and the backward's weights of that row are NaN too, as the gold's softmax says.
        l_safe = tl.where(l_t == 0.0, 1.0, l_t)
        out = acc_t / l_safe[:, None]
        o_off = (q_row0 + q_idx).to(tl.int64) * stride_or + head * stride_oh
        tl.store(O + o_off[:, None] + d[None, :], cast_rne(out, O.dtype.element_ty),
                 mask=row_ok[:, None] & d_ok[None, :])
        lse = m_t + tl.math.log2(l_safe)  # rows without keys are never stored
        tl.store(LSE + (q_row0 + q_idx).to(tl.int64) * stride_lr + head, lse, mask=row_ok)


@triton.jit
def _split_combine_kernel(
    PM, PL, PACC, O, LSE, num_splits, n_rows, hq, head_dim,
    stride_ps, stride_pr, stride_ph, stride_as, stride_ar, stride_ah, stride_or, stride_oh, stride_lr,
    BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr, AFTER_PDL: tl.constexpr = False,
):
    # Folds the splits' states of BLOCK_R (row, head) pairs left to right, exactly as the forward
    # kernel folds them in a program that walks every split, then normalises as it does.
    # AFTER_PDL: launched while the split kernel still runs (programmatic dependent launch), so it first
    # waits for that kernel to finish and its writes to land.
    if AFTER_PDL:
        gdc_wait()
    pair = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    ok = pair < n_rows * hq
    r64 = (pair // hq).to(tl.int64)
    head = pair % hq
    d = tl.arange(0, BLOCK_D)
    d_ok = d < head_dim
    m_t, l_t, acc_t = _fresh_state(BLOCK_R, BLOCK_D)
    # Loads staged ahead of the folds (a batch-1 step's combine is a chain of folds over independent
    # loads): H200, 57.3 -> 54.6 us at 32k cached, 16 splits (docs/evidence/h200_probe_combine_6682062.log).
    for split in tl.range(0, num_splits, num_stages=4):
        p_off = split * stride_ps + r64 * stride_pr + head * stride_ph
        m = tl.load(PM + p_off, mask=ok, other=M_INIT)
        l = tl.load(PL + p_off, mask=ok, other=0.0)
        a_off = split * stride_as + r64 * stride_ar + head * stride_ah
        acc = tl.load(PACC + a_off[:, None] + d[None, :], mask=ok[:, None] & d_ok[None, :], other=0.0)
        m_t, l_t, acc_t = _merge_split(m_t, l_t, acc_t, m, l, acc)
    l_safe = tl.where(l_t == 0.0, 1.0, l_t)
    out = acc_t / l_safe[:, None]
    o_off = r64 * stride_or + head * stride_oh
    tl.store(O + o_off[:, None] + d[None, :], cast_rne(out, O.dtype.element_ty), mask=ok[:, None] & d_ok[None, :])
    tl.store(LSE + r64 * stride_lr + head, m_t + tl.math.log2(l_safe), mask=ok)


def _check_rows(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not t.is_contiguous():
            raise ValueError(f"{name}: expected contiguous rows [R,H,D]")
    if k.shape != v.shape:
        raise ValueError(f"v: expected the shape of k {tuple(k.shape)}, got {tuple(v.shape)}")


def flash_forward(q, k, v, table: SequenceTable, *, causal: bool, scale: float, heads_per_tile: int = 1,
                  block_table: torch.Tensor | None = None, page_size: int = 1):
    """q [R,Hq,D], k/v [Rk,Hkv,D] contiguous rows -> (out [R,Hq,D] in q's dtype, lse [R,Hq] fp32 log2).

    block_table (int32 [B, max_blocks], contiguous): k/v are a page pool's rows [num_pages·page_size, Hkv, D], a
    sequence's k_row0 is its row of the table, and key position p is read from page block_table[k_row0,
    p // page_size] (flash_attn_with_kvcache's paged cache); the bits are those of the gathered cache.
    Rows no sequence covers are left uninitialised.
    """
    _check_rows(q, k, v)
    rows, hq, head_dim = q.shape
    hkv = k.shape[1]
    group = hq // hkv
    config = attention_config(q.dtype, head_dim)
    cfg = config.forward
    if group % heads_per_tile or cfg.block_m % heads_per_tile:
        raise ValueError(f"heads_per_tile={heads_per_tile} must divide the group {group} and BLOCK_M")
    out = torch.empty_like(q)
    lse = torch.empty((rows, hq), dtype=torch.float32, device=q.device)  # read back only for covered rows
    q_per_tile = cfg.block_m // heads_per_tile
    if table.num_sequences == 0 or rows == 0:
        return out, lse
    paged = block_table is not None
    if q.is_cuda and not interpreting():
        from rl_engine.kernels.ops.triton.attention import gluon_decode  # imports this module

        if gluon_decode.covers(q, k, table.max_q_count, page_size if paged else None):  # the same bits
            return gluon_decode.gluon_decode(*_aligned(q, k, v), table, causal=causal, scale=scale,
                                             block_table=block_table, page_size=page_size)
    kv_split = config.kv_split
    num_splits = triton.cdiv(max(table.max_kv_len, 1), kv_split)
    # One query tile per sequence (decode, short chunks) and several splits: one program per split, then
    # the combine kernel. The bits are the same either way (both fold the same split states in the same
    # order); only the parallelism differs.
    partial = table.max_q_count <= q_per_tile and num_splits > 1
    if not partial and heads_per_tile == 1 and not paged and _gluon_covers(q, k, v):
        from rl_engine.kernels.ops.triton.attention.gluon_forward import gluon_forward

        return gluon_forward(*_aligned(q, k, v), table, causal=causal, scale=scale)  # flash.py's bits
    if partial:
        pm = torch.empty((num_splits, rows, hq), dtype=torch.float32, device=q.device)
        pl = torch.empty_like(pm)
        pacc = torch.empty((num_splits, rows, hq, head_dim), dtype=torch.float32, device=q.device)
        grid = (num_splits, hq // heads_per_tile, table.num_sequences)
    else:
        pm = pl = pacc = lse  # unused
        grid = (triton.cdiv(max(table.max_q_count, 1), q_per_tile), hq // heads_per_tile, table.num_sequences)
    p_strides = (pm.stride(0), pm.stride(1), pm.stride(2)) if partial else (0, 0, 0)
    a_strides = (pacc.stride(0), pacc.stride(1), pacc.stride(2)) if partial else (0, 0, 0)
    descs = None if paged else row_descriptors((k, v), cfg.block_n)  # a page's rows are not a block's
    _flash_forward_kernel[grid](
        q, k, v, *(descs or (k, v)), out, lse, pm, pl, pacc, table.info, block_table,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), out.stride(0), out.stride(1), lse.stride(0),
        *p_strides, *a_strides, block_table.stride(0) if paged else 0,
        scale * LOG2_E, group, heads_per_tile, q_per_tile, head_dim,
        CAUSAL=causal, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_D=block_d(head_dim),
        KV_SPLIT=kv_split, PARTIAL=partial, EVEN_D=block_d(head_dim) == head_dim,
        MASK_SPLIT=q.dtype != torch.float32, DOT_FP32=dot_fp32(q.dtype), DOT_PRECISION=dot_precision(q.dtype),
        TMA=descs is not None, FLAT=config.flat_splits, PAGE_SIZE=page_size if paged else 1, PAGED=paged,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )
    if partial:
        # Rows no sequence covers hold garbage partials; their outputs are garbage too, as documented.
        _split_combine_kernel[(triton.cdiv(rows * hq, COMBINE_BLOCK_R),)](
            pm, pl, pacc, out, lse, num_splits, rows, hq, head_dim,
            *p_strides, *a_strides, out.stride(0), out.stride(1), lse.stride(0),
            BLOCK_R=COMBINE_BLOCK_R, BLOCK_D=block_d(head_dim),
        )
    return out, lse


COMBINE_BLOCK_R = 16


# --------------------------------------------------------------------------------------------------
# backward


@triton.jit
def _flash_backward_delta_kernel(
    O, DO, DELTA, n_rows, stride_r, stride_h, stride_dr, head_dim,
    BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr,
):
    r = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    head = tl.program_id(1)
    d = tl.arange(0, BLOCK_D)
    mask = (r < n_rows)[:, None] & (d < head_dim)[None, :]
    off = r.to(tl.int64)[:, None] * stride_r + head * stride_h + d[None, :]
    o = tl.load(O + off, mask=mask, other=0.0).to(tl.float32)
    do = tl.load(DO + off, mask=mask, other=0.0).to(tl.float32)
    tl.store(DELTA + r.to(tl.int64) * stride_dr + head, tl.sum(o * do, 1), mask=r < n_rows)


@triton.jit
def _dq_block(q, do, k, v, lse, delta, dq, visible, qk_scale, k_base: tl.constexpr,
              MASKED: tl.constexpr, DOT_FP32: tl.constexpr, DOT_PRECISION: tl.constexpr):
    """dQ += dS·K for one key block; masked and unmasked calls agree bitwise on visible pairs."""
    if DOT_FP32:
        k = k.to(tl.float32)
        v = v.to(tl.float32)
    s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION)
    p = tl.math.exp2(tl.fma(s, qk_scale, -lse[:, None]))
    if MASKED:
        p = tl.where(visible, p, 0.0)
    dp = tl.dot(do, tl.trans(v), input_precision=DOT_PRECISION)
    ds = p * (dp - delta[:, None])
    ds_k = cast_rne(ds, k_base)
    if DOT_FP32:
        ds_k = ds_k.to(tl.float32)
    return tl.dot(ds_k, k, dq, input_precision=DOT_PRECISION)


@triton.jit
def _flash_backward_dq_kernel(
    Q, K, V, KD, VD, DO, LSE, DELTA, DQ, SEQ_INFO,
    stride_qr, stride_qh, stride_kr, stride_kh, stride_lr,
    qk_scale, scale, group, head_dim,
    CAUSAL: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
    EVEN_D: tl.constexpr, MASK_SPLIT: tl.constexpr, DOT_FP32: tl.constexpr, DOT_PRECISION: tl.constexpr,
    TMA: tl.constexpr,
):
    pid_m = tl.num_programs(0) - 1 - tl.program_id(0)  # the longest (last) query blocks first
    head = tl.program_id(1)
    info = SEQ_INFO + tl.program_id(2) * 6
    q_row0 = tl.load(info + 0)
    q_count = tl.load(info + 1)
    q_pos0 = tl.load(info + 2)
    k_row0 = tl.load(info + 3)
    kv_len = tl.load(info + 4)
    window = tl.load(info + 5)
    kv_head = head // group

    q_idx = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    row_ok = q_idx < q_count
    q_pos = q_pos0 + q_idx
    d = tl.arange(0, BLOCK_D)
    d_ok = d < head_dim
    row_mask = row_ok[:, None] & d_ok[None, :]
    q_off = (q_row0 + q_idx).to(tl.int64) * stride_qr + head * stride_qh
    q = tl.load(Q + q_off[:, None] + d[None, :], mask=row_mask, other=0.0)
    do = tl.load(DO + q_off[:, None] + d[None, :], mask=row_mask, other=0.0)
    l_off = (q_row0 + q_idx).to(tl.int64) * stride_lr + head
    lse = tl.load(LSE + l_off, mask=row_ok, other=0.0)
    delta = tl.load(DELTA + l_off, mask=row_ok, other=0.0)
    if DOT_FP32:
        q = q.to(tl.float32)
        do = do.to(tl.float32)

    dq = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    lo, mid, hi = _key_blocks(q_pos0, pid_m * BLOCK_M, BLOCK_M, q_count, kv_len, window, CAUSAL, BLOCK_N,
                              MASK_SPLIT)
    k_base = K.dtype.element_ty
    k_col = kv_head * stride_kh + d[None, :]
    if MASK_SPLIT:
        for start_n in range(lo, mid, BLOCK_N):
            k, v = _whole_kv_block(K, V, KD, VD, k_row0, start_n, stride_kr, k_col, kv_head * BLOCK_D, d_ok,
                                   EVEN_D, BLOCK_N, TMA, False)  # _dq_block upcasts k and v itself
            dq = _dq_block(q, do, k, v, lse, delta, dq, None, qk_scale, k_base, False, DOT_FP32, DOT_PRECISION)
    for start_n in range(mid, hi, BLOCK_N):
        k, v, visible = _masked_kv_block(K, V, k_row0, start_n, stride_kr, k_col, d_ok, q_pos, kv_len, window,
                                         CAUSAL, BLOCK_N, False)  # _dq_block upcasts k and v itself
        visible = visible & row_ok[:, None]
        dq = _dq_block(q, do, k, v, lse, delta, dq, visible, qk_scale, k_base, True, DOT_FP32, DOT_PRECISION)
    dq = dq * scale
    tl.store(DQ + q_off[:, None] + d[None, :], cast_rne(dq, DQ.dtype.element_ty), mask=row_mask)


@triton.jit
def _dkdv_block(k, v, dk, dv, Q, DO, QD, DOD, LSE, DELTA, q_row0, q_pos0, q_count, start_m, head, k_pos, k_ok,
                window, d, d_ok, stride_qr, stride_qh, stride_lr, qk_scale, q_base: tl.constexpr,
                MASKED: tl.constexpr, CAUSAL: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr,
                EVEN_D: tl.constexpr, DOT_FP32: tl.constexpr, DOT_PRECISION: tl.constexpr, TMA: tl.constexpr):
    """dV += Pᵀ·dO and dK += dSᵀ·Q for one query block; the unmasked call is only made for whole query
    blocks every one of whose queries sees every key of the block (the masked call agrees bitwise)."""
    q_idx = start_m + tl.arange(0, BLOCK_M)
    q_off = (q_row0 + q_idx).to(tl.int64) * stride_qr + head * stride_qh
    l_off = (q_row0 + q_idx).to(tl.int64) * stride_lr + head
    if MASKED:
        row_ok = q_idx < q_count
        row_mask = row_ok[:, None] & d_ok[None, :]
        q = tl.load(Q + q_off[:, None] + d[None, :], mask=row_mask, other=0.0)
        do = tl.load(DO + q_off[:, None] + d[None, :], mask=row_mask, other=0.0)
        lse = tl.load(LSE + l_off, mask=row_ok, other=0.0)
        delta = tl.load(DELTA + l_off, mask=row_ok, other=0.0)
    else:
        if TMA:  # whole query blocks of the sequence: exactly its rows
            q = QD.load([q_row0 + start_m, head * BLOCK_D])
            do = DOD.load([q_row0 + start_m, head * BLOCK_D])
        elif EVEN_D:
            q = tl.load(Q + q_off[:, None] + d[None, :])
            do = tl.load(DO + q_off[:, None] + d[None, :])
        else:
            q = tl.load(Q + q_off[:, None] + d[None, :], mask=d_ok[None, :], other=0.0)
            do = tl.load(DO + q_off[:, None] + d[None, :], mask=d_ok[None, :], other=0.0)
        lse = tl.load(LSE + l_off)
        delta = tl.load(DELTA + l_off)
    if DOT_FP32:
        q = q.to(tl.float32)
        do = do.to(tl.float32)
    s_t = tl.dot(k, tl.trans(q), input_precision=DOT_PRECISION)  # [BLOCK_N, BLOCK_M]
    p_t = tl.math.exp2(tl.fma(s_t, qk_scale, -lse[None, :]))
    if MASKED:
        q_pos = q_pos0 + q_idx
        visible = k_ok[:, None] & row_ok[None, :] & (k_pos[:, None] > q_pos[None, :] - window)
        if CAUSAL:
            visible = visible & (k_pos[:, None] <= q_pos[None, :])
        p_t = tl.where(visible, p_t, 0.0)
    p_do = cast_rne(p_t, q_base)
    if DOT_FP32:
        p_do = p_do.to(tl.float32)
    dv = tl.dot(p_do, do, dv, input_precision=DOT_PRECISION)
    dp_t = tl.dot(v, tl.trans(do), input_precision=DOT_PRECISION)
    ds_t = p_t * (dp_t - delta[None, :])
    ds_q = cast_rne(ds_t, q_base)
    if DOT_FP32:
        ds_q = ds_q.to(tl.float32)
    dk = tl.dot(ds_q, q, dk, input_precision=DOT_PRECISION)
    return dk, dv


@triton.jit
def _flash_backward_dkdv_kernel(
    Q, K, V, QD, DOD, DO, LSE, DELTA, DK, DV, SEQ_INFO,
    stride_qr, stride_qh, stride_kr, stride_kh, stride_lr,
    qk_scale, scale, group, head_dim,
    CAUSAL: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
    EVEN_D: tl.constexpr, MASK_SPLIT: tl.constexpr, DOT_FP32: tl.constexpr, DOT_PRECISION: tl.constexpr,
    TMA: tl.constexpr,
):
    pid_n = tl.program_id(0)  # under the causal mask the first key blocks do the most work: first
    kv_head = tl.program_id(1)
    info = SEQ_INFO + tl.program_id(2) * 6
    q_row0 = tl.load(info + 0)
    q_count = tl.load(info + 1)
    q_pos0 = tl.load(info + 2)
    k_row0 = tl.load(info + 3)
    kv_len = tl.load(info + 4)
    window = tl.load(info + 5)

    start_n = pid_n * BLOCK_N
    k_pos = start_n + tl.arange(0, BLOCK_N)
    k_ok = k_pos < kv_len
    d = tl.arange(0, BLOCK_D)
    d_ok = d < head_dim
    kv_mask = k_ok[:, None] & d_ok[None, :]
    k_off = (k_row0 + k_pos).to(tl.int64) * stride_kr + kv_head * stride_kh
    k = tl.load(K + k_off[:, None] + d[None, :], mask=kv_mask, other=0.0)
    v = tl.load(V + k_off[:, None] + d[None, :], mask=kv_mask, other=0.0)
    if DOT_FP32:
        k = k.to(tl.float32)
        v = v.to(tl.float32)

    dk = tl.zeros([BLOCK_N, BLOCK_D], dtype=tl.float32)
    dv = tl.zeros([BLOCK_N, BLOCK_D], dtype=tl.float32)
    # Query blocks are aligned to the sequence's first query; causal: skip those before this key block.
    lo = 0
    if CAUSAL:
        lo = (tl.maximum(start_n - q_pos0, 0) // BLOCK_M) * BLOCK_M
    hi = tl.where(start_n < kv_len, q_count, 0)
    hi = tl.minimum(hi, start_n + BLOCK_N - 1 + window - q_pos0)  # the window's last query (padding rows)
    # [lo, mid): masked (the diagonal); [mid, full): whole query blocks that see every key of this
    # block, unmasked (key rows past kv_len are never stored, so they need no mask); [full, hi): masked.
    mid = lo
    if CAUSAL:
        mid = tl.maximum(lo, lo + tl.cdiv(start_n + BLOCK_N - 1 - q_pos0 - lo, BLOCK_M) * BLOCK_M)
    full = tl.where(window == _NO_WINDOW, tl.maximum(q_count // BLOCK_M * BLOCK_M, mid), mid)
    mid = tl.minimum(mid, hi)
    full = tl.minimum(full, hi)
    if not MASK_SPLIT:  # one masked loop over [lo, hi)
        full = lo
    q_base = Q.dtype.element_ty
    for g in range(0, group):  # the group's query heads, summed in a fixed order (no atomics)
        head = kv_head * group + g
        if MASK_SPLIT:  # [lo, mid) masked, [mid, full) unmasked
            for start_m in range(lo, mid, BLOCK_M):
                dk, dv = _dkdv_block(k, v, dk, dv, Q, DO, QD, DOD, LSE, DELTA, q_row0, q_pos0, q_count, start_m, head,
                                     k_pos, k_ok, window, d, d_ok, stride_qr, stride_qh, stride_lr, qk_scale,
                                     q_base, True, CAUSAL, BLOCK_M, BLOCK_D, EVEN_D, DOT_FP32, DOT_PRECISION, TMA)
            for start_m in range(mid, full, BLOCK_M):
                dk, dv = _dkdv_block(k, v, dk, dv, Q, DO, QD, DOD, LSE, DELTA, q_row0, q_pos0, q_count, start_m, head,
                                     k_pos, k_ok, window, d, d_ok, stride_qr, stride_qh, stride_lr, qk_scale,
                                     q_base, False, CAUSAL, BLOCK_M, BLOCK_D, EVEN_D, DOT_FP32, DOT_PRECISION, TMA)
        for start_m in range(full, hi, BLOCK_M):
            dk, dv = _dkdv_block(k, v, dk, dv, Q, DO, QD, DOD, LSE, DELTA, q_row0, q_pos0, q_count, start_m, head,
                                 k_pos, k_ok, window, d, d_ok, stride_qr, stride_qh, stride_lr, qk_scale,
                                 q_base, True, CAUSAL, BLOCK_M, BLOCK_D, EVEN_D, DOT_FP32, DOT_PRECISION, TMA)
    dk = dk * scale
    tl.store(DK + k_off[:, None] + d[None, :], cast_rne(dk, DK.dtype.element_ty), mask=kv_mask)
    tl.store(DV + k_off[:, None] + d[None, :], cast_rne(dv, DV.dtype.element_ty), mask=kv_mask)


DELTA_BLOCK_R = 32


def flash_backward(do, q, k, v, out, lse, table: SequenceTable, *, causal: bool, scale: float):
    """Gradients (dq, dk, dv) of `flash_forward` (heads_per_tile = 1) for rows of q, k, v.

    Every row of q and k must belong to one sequence of the table (rows no sequence covers are garbage).
    """
    _check_rows(q, k, v)
    do = do.contiguous()
    rows, hq, head_dim = q.shape
    hkv = k.shape[1]
    group = hq // hkv
    cfg = attention_config(q.dtype, head_dim)
    padded_d = block_d(head_dim)
    dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
    if table.num_sequences == 0 or rows == 0:
        return dq, dk, dv
    delta = torch.empty((rows, hq), dtype=torch.float32, device=q.device)
    _flash_backward_delta_kernel[(triton.cdiv(rows, DELTA_BLOCK_R), hq)](
        out, do, delta, rows, out.stride(0), out.stride(1), delta.stride(0), head_dim,
        BLOCK_R=DELTA_BLOCK_R, BLOCK_D=padded_d,
    )
    common = dict(CAUSAL=causal, BLOCK_D=padded_d, EVEN_D=padded_d == head_dim, MASK_SPLIT=q.dtype != torch.float32,
                  DOT_FP32=dot_fp32(q.dtype), DOT_PRECISION=dot_precision(q.dtype))
    strides = (q.stride(0), q.stride(1), k.stride(0), k.stride(1), lse.stride(0))
    # The dQ and dK/dV kernels only read q, k, v, dO, lse and delta: the dQ kernel runs beside the other
    # (SideStream), joined before returning; forward + backward 3-5.5% faster on the H200
    # (docs/evidence/h200_probe_attention_bwd_streams_36b08a0.log).
    side = SideStream(q.device)
    gluon = _gluon_covers(q, k, v, backward=True)  # gluon_backward.py: warp-specialised
    if gluon:
        q, k, v, do = _aligned(q, k, v, do)
    with side:
        if gluon:  # flash.py's dQ bits
            from rl_engine.kernels.ops.triton.attention.gluon_backward import gluon_dq

            gluon_dq(do, q, k, v, lse, delta, table, causal=causal, scale=scale, out=dq)
        else:
            c = cfg.backward_dq
            descs = row_descriptors((k, v), c.block_n)
            _flash_backward_dq_kernel[(triton.cdiv(max(table.max_q_count, 1), c.block_m), hq, table.num_sequences)](
                q, k, v, *(descs or (k, v)), do, lse, delta, dq, table.info, *strides, scale * LOG2_E, scale, group,
                head_dim, BLOCK_M=c.block_m, BLOCK_N=c.block_n, num_warps=c.num_warps, num_stages=c.num_stages,
                TMA=descs is not None, **common,
            )
    if gluon:  # flash.py's tiles and order per key block: its dK/dV bits (equal on the H200)
        from rl_engine.kernels.ops.triton.attention.gluon_backward import gluon_dkdv

        gluon_dkdv(do, q, k, v, lse, delta, table, causal=causal, scale=scale, out=(dk, dv))
    else:
        c = cfg.backward_dkdv
        descs = row_descriptors((q, do), c.block_m)
        _flash_backward_dkdv_kernel[(triton.cdiv(max(table.max_kv_len, 1), c.block_n), hkv, table.num_sequences)](
            q, k, v, *(descs or (q, do)), do, lse, delta, dk, dv, table.info, *strides, scale * LOG2_E, scale, group,
            head_dim, BLOCK_M=c.block_m, BLOCK_N=c.block_n, num_warps=c.num_warps, num_stages=c.num_stages,
            TMA=descs is not None, **common,
        )
    side.join()
    return dq, dk, dv


def _gluon_covers(q, k, v, backward: bool = False) -> bool:
    """Whether the Gluon kernels (Hopper, Triton 3.6, bf16; gluon_forward.py head_dim 64, 128 and 256,
    gluon_backward.py too) take these CUDA rows; imported late, as they import Gluon."""
    if interpreting() or not q.is_cuda:
        return False
    from rl_engine.kernels.ops.triton.attention import gluon_backward, gluon_forward

    return (gluon_backward if backward else gluon_forward).covers(q, k, v)


def _aligned(*rows):
    """The rows with 16-byte aligned bases, as TMA descriptors need them (a copy for the rare other view)."""
    return tuple(t if t.data_ptr() % 16 == 0 else t.clone() for t in rows)


def default_scale(head_dim: int, scale: float | None) -> float:
    return float(scale) if scale is not None else 1.0 / math.sqrt(head_dim)


# --------------------------------------------------------------------------------------------------
# torch custom ops (fake + autograd registered), so torch.compile traces them. The sequence table
# travels as its tensor and its two host bounds (custom-op arguments are tensors and scalars).


@torch.library.custom_op("rl_engine::flash_attention", mutates_args=())
def flash_attention_op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, info: torch.Tensor, max_q_count: int,
                       max_kv_len: int, causal: bool, scale: float,
                       heads_per_tile: int) -> tuple[torch.Tensor, torch.Tensor]:
    """flash_forward (torch.ops.rl_engine.flash_attention): (out, lse); differentiable in out when
    heads_per_tile = 1."""
    table = SequenceTable(info, max_q_count, max_kv_len)
    return flash_forward(q, k, v, table, causal=causal, scale=scale, heads_per_tile=heads_per_tile)


@flash_attention_op.register_fake
def _(q, k, v, info, max_q_count, max_kv_len, causal, scale, heads_per_tile):
    _check_rows(q, k, v)
    return torch.empty_like(q), q.new_empty((q.shape[0], q.shape[1]), dtype=torch.float32)


@torch.library.custom_op("rl_engine::flash_attention_backward", mutates_args=())
def flash_attention_backward_op(do: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                                out: torch.Tensor, lse: torch.Tensor, info: torch.Tensor, max_q_count: int,
                                max_kv_len: int, causal: bool,
                                scale: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    table = SequenceTable(info, max_q_count, max_kv_len)
    return flash_backward(do, q, k, v, out, lse, table, causal=causal, scale=scale)


@flash_attention_backward_op.register_fake
def _(do, q, k, v, out, lse, info, max_q_count, max_kv_len, causal, scale):
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)


def _flash_setup_context(ctx, inputs, output) -> None:
    q, k, v, info, ctx.max_q_count, ctx.max_kv_len, ctx.causal, ctx.scale, ctx.heads_per_tile = inputs
    ctx.save_for_backward(q, k, v, info, *output)


def _flash_backward(ctx, d_out: torch.Tensor, _d_lse):
    if ctx.heads_per_tile != 1:
        raise ValueError("flash_attention: the backward needs heads_per_tile = 1")
    q, k, v, info, out, lse = ctx.saved_tensors
    dq, dk, dv = flash_attention_backward_op(d_out, q, k, v, out, lse, info, ctx.max_q_count, ctx.max_kv_len,
                                             ctx.causal, ctx.scale)
    return dq, dk, dv, None, None, None, None, None, None


# (out, lse) of flash_forward, differentiable in out when heads_per_tile = 1 (runtime.register_autograd).
flash_attention = register_autograd(flash_attention_op, _flash_backward, _flash_setup_context)
