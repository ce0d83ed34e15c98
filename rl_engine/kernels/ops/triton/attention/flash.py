"""The Triton flash-attention kernels: forward (whole query tiles or one KV split a program), the split
combine, and the backward (delta, dQ, dK/dV). They follow contract.py; dispatch.py chooses and launches them.

Key blocks that every query of a tile sees whole (below the tile's diagonal, inside kv_len) run
without masks, their K/V read through TMA descriptors where the rows allow (dispatch.py's `row_descriptors`: whole
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

Non-finite inputs are never hidden: a NaN/inf in q row i, or in k/v at a key row i sees, makes row i
non-finite as IEEE says. Invisible scores are replaced by `where`, but the tile products (p·v forward,
ds·k for dQ, ds·q for dK) multiply an invisible pair's exact 0 weight by its operand, so a NaN/inf in
k/v (or q, for dK) at a key hidden by the causal mask inside the same key block also makes the rows
that share the block NaN: louder than the gold, never quieter. Zeroing non-finite operands in the main
loop and a second exact pass cost 33–60% of the H200 throughput (measured 2026-11-30), so we don't.
"""

from __future__ import annotations

import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from rl_engine.kernels.ops.triton.attention.contract import _NO_WINDOW, M_INIT, RESCALE_ABOVE
from rl_engine.kernels.ops.triton.runtime import cast_rne

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
    # waits for that kernel to finish and its writes to land; a decode matmul after it (o_proj, launched
    # the same way) may start its weight prefetch meanwhile.
    if AFTER_PDL:
        gdc_launch_dependents()
        gdc_wait()
    pair = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    ok = pair < n_rows * hq
    r64 = (pair // hq).to(tl.int64)
    head = pair % hq
    d = tl.arange(0, BLOCK_D)
    d_ok = d < head_dim
    m_t, l_t, acc_t = _fresh_state(BLOCK_R, BLOCK_D)
    # Loads staged ahead of the folds (a batch-1 step's combine is a chain of folds over independent
    # loads): H200, 57.3 -> 54.6 us at 32k cached, 16 splits.
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
