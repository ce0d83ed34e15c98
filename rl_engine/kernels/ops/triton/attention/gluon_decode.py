"""Decode attention in Gluon (Hopper, Triton 3.6-3.9): a KV head's whole query group in one program with the products
transposed; flash.py's bits.

A decode step has group · Sq query rows per KV head (4 at Qwen3-8B's batch 1) and walks each 2048-key split as one
chain of 64-key blocks (the split order is every path's contract). flash.py pads the rows to a 64-row tile. Here the
keys are the tensor cores' M side (M is 64 at least, N goes down to 8) and the queries QN = 8 or 16 columns
(`query_columns`):

    sᵀ = k·qᵀ [64, QN],   accᵀ = vᵀ·p̃ᵀ + accᵀ [D, QN],   lᵀ = 1·p̃ᵀ + lᵀ [64, QN]

A split is walked by five partitions (`gl.warp_specialize`): a load warp streams K/V blocks by TMA into a
STAGES-deep ring; three softmax warpgroups take every third block: each computes its block's k·qᵀ, mask and column
maxima while the others do theirs, then takes block t - 1's m from shared memory, publishes block t's (the lazy max
chains blocks only through m), and leaves p̃ (the products' B operand) and alpha in ring slot t % STAGES; the
accumulator warpgroup holds accᵀ and lᵀ, and its chain per block is only the rescale by alpha_t and the two products,
waited for before it releases the slot (K, V, p̃ and alpha at once). At batch 1 the softmax's chain, its cross-warp
column max the largest part, was the step, so it is split over softmax warpgroups: one, two and three each ran
faster than the form before (same bits).
A warpgroup's column max crosses its four warps through one barrier (`_column_max`; gl.max takes two and a shuffle
round): 1.05-1.06x at batch 1 x 1k-8k, the same bits.
Every loop waits for the products it issues: with products in flight across a loop's back edge (or out of a branch)
ptxas serialised every wgmma (C7514/C7515). A program may take a part of
the head dim (D_PARTS: accᵀ's rows are independent), so a batch-1 step has 16-64 programs instead of 8-32. A KV-cache
step reads its lengths in the kernel (`gluon_decode_cache`), which saves kv_cache_attention's table launch. A paged
cache (`PAGED`) comes into a ring slot as one TMA copy per page of the block (`_load`), the walk unchanged.

Every element is flash.py's: the same key blocks from the sequence's first key, the same KV splits folded by flash.py's
combine kernel (or, in one split, into a fresh state as flash.py's program does), the scale in an explicit fma, exp2,
p̃ rounded to bf16 before both products, l a product p̃·1, acc + p̃·v then acc·alpha (flash.py's order, as in
gluon_forward.py), masks by `where` (applied to every block: a fully visible block's scores pass unchanged), V rows past
kv_len zeroed. The H200 gives flash.py's bits (a wgmma's sum for one element does not depend on which operand is which,
nor on N or M): 0 tokens differ in the probe above and in the gpu tests (test_attention_consistency).

Eight query columns instead of 16 when a group's queries fit (Qwen3-8B's decode: 4 heads x 1 query) halve the scores
each softmax warpgroup masks, exponentiates and rounds: 1.11-1.14x at batch 1, same bits in 19 cases.

H200 (torch 2.11, Triton 3.6; CUDA graphs, 32/8 heads x 128): batch 1 x 1k / 2k / 4k / 8k 8.3 / 12.9 / 15.1 / 15.5 us
(SDPA 6.6 / 7.3 / 9.2 / 11.1), batch 16 x 8k 130 us (SDPA 122).
"""

from __future__ import annotations

import functools

import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared,
    mbarrier,
    warpgroup_mma,
    warpgroup_mma_wait,
)

from rl_engine.kernels.ops.triton.attention import flash, gluon_forward
from rl_engine.kernels.ops.triton.attention.contract import _NO_WINDOW, COMBINE_BLOCK_R, LOG2_E, attention_config
from rl_engine.kernels.ops.triton.attention.gluon_compat import async_load
from rl_engine.kernels.ops.triton.attention.gluon_forward import (
    M_INIT,
    RESCALE_ABOVE,
    _sequence,
    _tile_blocks,
    _to_bf16,
    compile_sm90a,
)

QN = 16  # most query columns of a program: group · queries <= 16 (decode, and a few queries per step at group <= 4)
L_ROWS = 64  # lᵀ's rows: the ones operand at the tensor cores' smallest M
HEAD_DIMS = (64, 128)
STAGES = 6  # K/V blocks in flight, each with its p̃ and alpha: 192 KiB of K/V at head_dim 128
PARTS = None  # override of head_dim_parts (probes)
# Paged caches through this kernel (page copies by TMA, `_load`); off: they run flash.py's kernel (probes compare both).
PAGED = True
SOFTMAX_GROUPS = gl.constexpr(3)  # softmax warpgroups, each taking every third block: the kernel's partitions


@gluon.jit
def _load(desc_k, desc_v, k_bufs, v_bufs, ready, t, b0, k_row0, k_col, v_col, BLOCK_N: gl.constexpr,
          STAGES: gl.constexpr, BLOCK_TABLE, stride_bt, kv_len, PAGE: gl.constexpr, PAGE_ROWS: gl.constexpr,
          PAGED: gl.constexpr):
    """Block b0 + t of the walk into ring slot t % STAGES. PAGED: k_row0 is the sequence's block-table row and the
    block comes in BLOCK_N // PAGE_ROWS copies of PAGE_ROWS rows (a page, or a block's part of a larger page), each
    from its page; a copy past kv_len reads the last page that holds keys (its rows are masked, V's zeroed)."""
    slot = t % STAGES
    bar = ready.index(slot)
    if PAGED:
        COPIES: gl.constexpr = BLOCK_N // PAGE_ROWS
        mbarrier.expect(bar, COPIES * (desc_k.block_type.nbytes + desc_v.block_type.nbytes))
        for j in gl.static_range(COPIES):
            pos = gl.minimum((b0 + t) * BLOCK_N + j * PAGE_ROWS, kv_len - 1)
            page = gl.load(BLOCK_TABLE + k_row0 * stride_bt + pos // PAGE)
            row = page * PAGE + pos % PAGE // PAGE_ROWS * PAGE_ROWS
            async_load(desc_k, [row, k_col], bar,
                                            k_bufs.index(slot).slice(j * PAGE_ROWS, PAGE_ROWS))
            async_load(desc_v, [row, v_col], bar,
                                            v_bufs.index(slot).slice(j * PAGE_ROWS, PAGE_ROWS))
    else:
        mbarrier.expect(bar, desc_k.block_type.nbytes + desc_v.block_type.nbytes)
        row = k_row0 + (b0 + t) * BLOCK_N
        async_load(desc_k, [row, k_col], bar, k_bufs.index(slot))
        async_load(desc_v, [row, v_col], bar, v_bufs.index(slot))


@gluon.jit
def _masked(s, t, k_base, b0, q_pos, kv_len, window, BLOCK_N: gl.constexpr, CAUSAL: gl.constexpr):
    """Block b0 + t's scores with its invisible keys at -inf."""
    start = (b0 + t) * BLOCK_N
    k_pos = start + k_base
    visible = gl.expand_dims(k_pos < kv_len, 1) & (gl.expand_dims(k_pos, 1) > gl.expand_dims(q_pos - window, 0))
    if CAUSAL:
        visible = visible & (gl.expand_dims(k_pos, 1) <= gl.expand_dims(q_pos, 0))
    return gl.where(visible, s, float("-inf"))


@triton.constexpr_function
def _warp_rows_layout(qn):
    """The wgmma layout of scores [64, qn] (4 warps, 16 rows each) seen as [4 warps, 16 rows, qn]."""
    return gl.DistributedLinearLayout(reg_bases=[[0, 0, 1], [0, 8, 0]] + ([[0, 0, 8]] if qn == 16 else []),
                                      lane_bases=[[0, 0, 2], [0, 0, 4], [0, 1, 0], [0, 2, 0], [0, 4, 0]],
                                      warp_bases=[[1, 0, 0], [2, 0, 0]], block_bases=[], shape=[4, 16, qn])


@triton.constexpr_function
def _warp_maxima_layout(qn):
    """[4 warps, qn] column maxima, every thread holding all four of its columns' (the wgmma layout's columns)."""
    return gl.DistributedLinearLayout(reg_bases=[[1, 0], [2, 0], [0, 1]] + ([[0, 8]] if qn == 16 else []),
                                      lane_bases=[[0, 2], [0, 4], [0, 0], [0, 0], [0, 0]],
                                      warp_bases=[[0, 0], [0, 0]], block_bases=[], shape=[4, qn])


@gluon.jit
def _column_max(s, maxima_smem, QN: gl.constexpr):
    """Column maxima of block scores [64, QN] in the wgmma layout (warp w holds rows 16w..16w+15): each warp's own by
    shuffles, then the four exchanged through shared memory across one barrier (gl.max across warps takes two and
    another shuffle round). A maximum does not depend on the order: the same values as gl.max(s, 0)."""
    per_warp = gl.max(gl.convert_layout(gl.reshape(s, [4, 16, QN]), _warp_rows_layout(QN), assert_trivial=True), 1)
    maxima_smem.store(per_warp)
    col_l: gl.constexpr = gl.SliceLayout(0, s.type.layout)
    return gl.convert_layout(gl.max(maxima_smem.load(_warp_maxima_layout(QN)), 0), col_l)


@gluon.jit
def _lazy(s, s_max, m, qk_scale):
    """(m_new, alpha, p̃ in bf16) of a masked block whose column maxima are s_max."""
    m_max = gl.maximum(m, s_max * qk_scale)
    m_new = gl.where(m_max - m > RESCALE_ABOVE, m_max, m)  # flash.py's `_lazy_max`
    alpha = gl.exp2(m - m_new)
    return m_new, alpha, _to_bf16(gl.exp2(gl.fma(s, qk_scale, -gl.expand_dims(m_new, 0))))


@gluon.jit
def _zero_tail_v(t, v_bufs, v_rows, b0, kv_len, BLOCK_N: gl.constexpr, STAGES: gl.constexpr, v_layout: gl.constexpr):
    """Block b0 + t's V rows past kv_len (a neighbour's, or anything) set to zeros in its ring slot, as flash.py reads
    them."""
    start = (b0 + t) * BLOCK_N
    if start + BLOCK_N > kv_len:
        v_slot = v_bufs.index(t % STAGES)
        v_blk = v_slot.load(v_layout)
        v_slot.store(gl.where(gl.expand_dims(start + v_rows < kv_len, 1), v_blk, 0.0))


@gluon.jit
def _scores(k_bufs, q_t, s_zero, t, STAGES: gl.constexpr):
    """Block t's k·qᵀ (its K/V landed: _arrived)."""
    return warpgroup_mma(k_bufs.index(t % STAGES), q_t, s_zero, use_acc=False, is_async=True)


@gluon.jit
def _arrived(ready, t, STAGES: gl.constexpr):
    mbarrier.wait(ready.index(t % STAGES), (t // STAGES) & 1)


@gluon.jit
def _rescale(acc, l_t, alpha):
    return acc * gl.expand_dims(alpha, 0), l_t * gl.expand_dims(alpha, 0)


@gluon.jit
def _loader(desc_k, desc_v, k_bufs, v_bufs, kv_ready, kv_empty, b0, first, n, k_row0, k_col, v_col,
            BLOCK_TABLE, stride_bt, kv_len, BLOCK_N: gl.constexpr, STAGES: gl.constexpr, PAGE: gl.constexpr,
            PAGE_ROWS: gl.constexpr, PAGED: gl.constexpr):
    """One warp: block t >= first's K and V into ring slot t % STAGES once the accumulator released its previous
    block."""
    for t in range(first, n):
        slot = t % STAGES
        mbarrier.wait(kv_empty.index(slot), ((t // STAGES) & 1) ^ 1)  # a fresh barrier passes parity 1
        _load(desc_k, desc_v, k_bufs, v_bufs, kv_ready, t, b0, k_row0, k_col, v_col, BLOCK_N, STAGES,
              BLOCK_TABLE, stride_bt, kv_len, PAGE, PAGE_ROWS, PAGED)


@gluon.jit
def _softmax(q_smem, k_bufs, v_bufs, p_bufs, a_bufs, m_smem, maxima_smem, kv_ready, p_ready, m_ready, b0, n, q_pos0,
             q_per_head, kv_len, window, qk_scale, FIRST: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr,
             QN: gl.constexpr, CAUSAL: gl.constexpr):
    """One of SOFTMAX_GROUPS warpgroups that run ahead of the accumulator, on blocks FIRST, FIRST + SOFTMAX_GROUPS, …:
    block t's k·qᵀ, masked scores and column maxima; block t - 1's m from m_smem slot t % 2 (another warpgroup's),
    block t's lazy max into slot (t + 1) % 2 (free: block t - 1's warpgroup read it before publishing the m this one
    waited for); p̃ and alpha into ring slot t % STAGES (the block's V rows past kv_len zeroed). The ring slot is free:
    its K/V block landed, so the accumulator released the block STAGES before, the last reader of that p̃."""
    mma: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, QN, 16])
    col_l: gl.constexpr = gl.SliceLayout(0, mma)
    v_layout: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [4, 1], [1, 0])
    v_rows = gl.arange(0, BLOCK_N, gl.SliceLayout(1, v_layout))
    k_base = gl.arange(0, BLOCK_N, gl.SliceLayout(1, mma))
    q_pos = q_pos0 + gl.arange(0, QN, col_l) % q_per_head
    s_zero = gl.zeros([BLOCK_N, QN], gl.float32, mma)
    q_t = q_smem.permute((1, 0))
    for t in range(FIRST, n, SOFTMAX_GROUPS):
        _arrived(kv_ready, t, STAGES)
        s = warpgroup_mma_wait(num_outstanding=0, deps=(_scores(k_bufs, q_t, s_zero, t, STAGES), ))
        s = _masked(s, t, k_base, b0, q_pos, kv_len, window, BLOCK_N, CAUSAL)
        s_max = _column_max(s, maxima_smem.index(FIRST), QN)
        mbarrier.wait(m_ready.index(t % 2), (t // 2) & 1)  # block t - 1's m, from the other warpgroup
        m, alpha, p = _lazy(s, s_max, m_smem.index(t % 2).load(col_l), qk_scale)
        m_smem.index((t + 1) % 2).store(m)
        mbarrier.arrive(m_ready.index((t + 1) % 2), count=1)
        slot = t % STAGES
        p_bufs.index(slot).store(p)
        a_bufs.index(slot).store(alpha)
        _zero_tail_v(t, v_bufs, v_rows, b0, kv_len, BLOCK_N, STAGES, v_layout)
        fence_async_shared()
        mbarrier.arrive(p_ready.index(slot), count=1)


@gluon.jit
def _accumulate(v_bufs, p_bufs, a_bufs, m_smem, kv_empty, p_ready, m_ready, l_t, acc, n, STAGES: gl.constexpr):
    """The walk's serial chain, flash.py's order per block: acc and l times alpha_t, then block t's products
    (acc + p̃·v), waited for before the slots go back. Returns (m, l_t, acc)."""
    mma: gl.constexpr = acc.type.layout
    col_l: gl.constexpr = gl.SliceLayout(0, mma)
    ones = gl.full([l_t.shape[0], p_bufs.shape[1]], 1.0, gl.bfloat16,
                   gl.DotOperandLayout(operand_index=0, parent=mma, k_width=2))
    for t in range(n):
        slot = t % STAGES
        mbarrier.wait(p_ready.index(slot), (t // STAGES) & 1)
        acc, l_t = _rescale(acc, l_t, a_bufs.index(slot).load(col_l))
        acc = warpgroup_mma(v_bufs.index(slot).permute((1, 0)), p_bufs.index(slot), acc, is_async=True)
        l_t = warpgroup_mma(ones, p_bufs.index(slot), l_t, is_async=True)
        acc, l_t = warpgroup_mma_wait(num_outstanding=0, deps=(acc, l_t))
        mbarrier.arrive(kv_empty.index(slot), count=1)  # K, V, p̃ and alpha of block t
    mbarrier.wait(m_ready.index(n % 2), (n // 2) & 1)  # the last block's m (M_INIT when there are none)
    return m_smem.index(n % 2).load(col_l), l_t, acc


@gluon.jit
def _launch_dependents():
    gl.inline_asm_elementwise("griddepcontrol.launch_dependents; // dummy $0", "=r", [], dtype=gl.int32,
                              is_pure=False, pack=1)


@gluon.jit
def gluon_decode_kernel(desc_k, desc_v, Q, O, LSE, PM, PL, PACC, SEQ_INFO, BLOCK_TABLE,
                        stride_qr, stride_qh, stride_or, stride_oh, stride_lr,
                        stride_ps, stride_pr, stride_ph, stride_as, stride_ar, stride_ah, stride_bt,
                        qk_scale, group, q_per_head, cache_rows,
                        BLOCK_N: gl.constexpr, HEAD_DIM: gl.constexpr, D_PARTS: gl.constexpr, QN: gl.constexpr,
                        L_M: gl.constexpr, STAGES: gl.constexpr, KV_SPLIT: gl.constexpr, PARTIAL: gl.constexpr,
                        CAUSAL: gl.constexpr, FROM_LENGTHS: gl.constexpr, PAGE: gl.constexpr = 1,
                        PAGE_ROWS: gl.constexpr = 1, PAGED: gl.constexpr = False, SOFTMAX_REGS: gl.constexpr = 96):
    # Program (split, KV head · D_PARTS + part, sequence). Column c holds query c % q_per_head of the group's head
    # c // q_per_head. PARTIAL: the split's state for flash.py's combine kernel; otherwise the keys fit one split
    # and the program writes the output. PAGED: K/V are a page pool's rows, a sequence's k_row0 its row of
    # BLOCK_TABLE (`_load`); cache_rows = the table's width · PAGE.
    DV: gl.constexpr = HEAD_DIM // D_PARTS
    mma: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, QN, 16])
    row_l: gl.constexpr = gl.SliceLayout(1, mma)
    col_l: gl.constexpr = gl.SliceLayout(0, mma)
    _launch_dependents()  # the combine kernel's programs start now and wait for this grid's end (PDL)
    split = gl.program_id(0)
    kv_head = gl.program_id(1) // D_PARTS
    part = gl.program_id(1) % D_PARTS
    if FROM_LENGTHS:  # a KV cache's lengths [B] (kv_cache_attention's table, without its launch)
        seq = gl.program_id(2)
        kv_len = gl.minimum(gl.maximum(gl.load(SEQ_INFO + seq), 0), cache_rows).to(gl.int32)
        q_row0 = seq * q_per_head
        q_count = q_per_head
        q_pos0 = kv_len - q_per_head
        k_row0 = seq if PAGED else seq * cache_rows
        window = _NO_WINDOW
    else:
        q_row0, q_count, q_pos0, k_row0, kv_len, window = _sequence(SEQ_INFO)
    # the group's queries [QN, HEAD_DIM] (q·kᵀ's B operand, transposed), read while the first
    # K/V blocks are requested below: the two memory latencies overlap
    q_layout: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [4, 1], [1, 0])
    c_q = gl.arange(0, QN, gl.SliceLayout(1, q_layout))
    ok_q = (c_q < group * q_per_head) & (c_q % q_per_head < q_count)
    q_off = (q_row0 + c_q % q_per_head).to(gl.int64) * stride_qr + (kv_head * group + c_q // q_per_head) * stride_qh
    q = gl.load(Q + gl.expand_dims(q_off, 1) + gl.expand_dims(gl.arange(0, HEAD_DIM, gl.SliceLayout(0, q_layout)), 0),
                mask=gl.expand_dims(ok_q, 1), other=0.0)

    # a block's rows (a paged copy fills a part of them: the descriptors carry the block's layout)
    k_bufs = gl.allocate_shared_memory(desc_k.dtype, [STAGES, BLOCK_N, desc_k.block_type.shape[1]], desc_k.layout)
    v_bufs = gl.allocate_shared_memory(desc_v.dtype, [STAGES, BLOCK_N, desc_v.block_type.shape[1]], desc_v.layout)
    # block t's p̃ and alpha share its K/V ring slot t % STAGES and are released with it (kv_empty)
    p_bufs = gl.allocate_shared_memory(gl.bfloat16, [STAGES, BLOCK_N, QN],
                                       gl.NVMMASharedLayout.get_default_for([BLOCK_N, QN], gl.bfloat16))
    a_bufs = gl.allocate_shared_memory(gl.float32, [STAGES, QN], gl.SwizzledSharedLayout(1, 1, 1, [0]))
    # block t - 1's m in slot t % 2, for block t's softmax (M_INIT for block 0)
    m_smem = gl.allocate_shared_memory(gl.float32, [2, QN], gl.SwizzledSharedLayout(1, 1, 1, [0]))
    # each softmax warpgroup's per-warp column maxima of its block (_column_max)
    maxima_smem = gl.allocate_shared_memory(gl.float32, [SOFTMAX_GROUPS, 4, QN],
                                            gl.SwizzledSharedLayout(1, 1, 1, [1, 0]))
    kv_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    kv_empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    p_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    m_ready = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(STAGES):
        mbarrier.init(kv_ready.index(i), count=1)
        mbarrier.init(kv_empty.index(i), count=1)
        mbarrier.init(p_ready.index(i), count=1)
    for i in gl.static_range(2):
        mbarrier.init(m_ready.index(i), count=1)
    fence_async_shared()  # the barriers for the copy engine

    lo_b, _, hi_b = _tile_blocks(q_pos0, 0, q_count, kv_len, window, CAUSAL, QN, BLOCK_N)
    b0 = lo_b
    b1 = hi_b
    if PARTIAL:  # this split's blocks only
        b0 = gl.maximum(lo_b, split * (KV_SPLIT // BLOCK_N))
        b1 = gl.minimum(hi_b, (split + 1) * (KV_SPLIT // BLOCK_N))
    n = gl.maximum(b1 - b0, 0)
    # the ring's first blocks (the load warp goes on from block `filled`)
    k_col = kv_head * HEAD_DIM
    v_col = k_col + part * DV
    filled = gl.minimum(n, STAGES)
    for t in gl.static_range(STAGES):
        if t < filled:
            _load(desc_k, desc_v, k_bufs, v_bufs, kv_ready, t, b0, k_row0, k_col, v_col, BLOCK_N, STAGES,
                  BLOCK_TABLE, stride_bt, kv_len, PAGE, PAGE_ROWS, PAGED)

    q_smem = gl.allocate_shared_memory(gl.bfloat16, [QN, HEAD_DIM],
                                       gl.NVMMASharedLayout.get_default_for([QN, HEAD_DIM], gl.bfloat16), q)
    fence_async_shared()  # q for the wgmma

    cols = gl.arange(0, QN, col_l)
    q_idx = cols % q_per_head
    head = kv_head * group + cols // q_per_head
    col_ok = (cols < group * q_per_head) & (q_idx < q_count)

    m_smem.index(0).store(gl.full([QN], M_INIT, gl.float32, col_l))
    mbarrier.arrive(m_ready.index(0), count=1)
    l_t = gl.zeros([L_M, QN], gl.float32, mma)
    acc = gl.zeros([DV, QN], gl.float32, mma)
    m, l_t, acc = gl.warp_specialize([
        (_accumulate, (v_bufs, p_bufs, a_bufs, m_smem, kv_empty, p_ready, m_ready, l_t, acc, n, STAGES)),
        (_softmax, (q_smem, k_bufs, v_bufs, p_bufs, a_bufs, m_smem, maxima_smem, kv_ready, p_ready, m_ready, b0, n,
                    q_pos0, q_per_head, kv_len, window, qk_scale, 0, BLOCK_N, STAGES, QN, CAUSAL)),
        (_softmax, (q_smem, k_bufs, v_bufs, p_bufs, a_bufs, m_smem, maxima_smem, kv_ready, p_ready, m_ready, b0, n,
                    q_pos0, q_per_head, kv_len, window, qk_scale, 1, BLOCK_N, STAGES, QN, CAUSAL)),
        (_softmax, (q_smem, k_bufs, v_bufs, p_bufs, a_bufs, m_smem, maxima_smem, kv_ready, p_ready, m_ready, b0, n,
                    q_pos0, q_per_head, kv_len, window, qk_scale, 2, BLOCK_N, STAGES, QN, CAUSAL)),
        (_loader, (desc_k, desc_v, k_bufs, v_bufs, kv_ready, kv_empty, b0, filled, n, k_row0, k_col, v_col,
                   BLOCK_TABLE, stride_bt, kv_len, BLOCK_N, STAGES, PAGE, PAGE_ROWS, PAGED)),
    ], [4, 4, 4, 1], [SOFTMAX_REGS, SOFTMAX_REGS, SOFTMAX_REGS, 24])
    l = gl.max(l_t, 0)  # lᵀ's rows are equal (flash._l_rows)
    dv = part * DV + gl.arange(0, DV, row_l)
    r64 = (q_row0 + q_idx).to(gl.int64)
    first = col_ok & (cols * 0 + part == 0)  # m, l, lse: every part holds the same; the first writes them
    if PARTIAL:  # fresh (M_INIT, 0, 0) when the split holds none of the sequence's keys: folding it is a no-op
        p_off = split * stride_ps + r64 * stride_pr + head * stride_ph
        gl.store(PM + p_off, m, mask=first)
        gl.store(PL + p_off, l, mask=first)
        a_off = split * stride_as + r64 * stride_ar + head * stride_ah
        gl.store(PACC + gl.expand_dims(a_off, 0) + gl.expand_dims(dv, 1), acc, mask=gl.expand_dims(col_ok, 0))
    else:  # one split, folded into a fresh state as flash.py's program folds it (`_merge_split`), then normalised
        m_new = gl.maximum(gl.full([QN], M_INIT, gl.float32, col_l), m)
        a_t = gl.exp2(M_INIT - m_new)
        a = gl.exp2(m - m_new)
        zero_t = gl.full([QN], 0.0, gl.float32, col_l) * a_t
        l = gl.fma(l, a, zero_t)
        acc = gl.fma(acc, gl.expand_dims(a, 0), gl.expand_dims(zero_t, 0))
        l_safe = gl.where(l == 0.0, 1.0, l)
        out = acc / gl.expand_dims(l_safe, 0)
        o_off = r64 * stride_or + head * stride_oh
        gl.store(O + gl.expand_dims(o_off, 0) + gl.expand_dims(dv, 1), out.to(gl.bfloat16),
                 mask=gl.expand_dims(col_ok, 0))
        gl.store(LSE + r64 * stride_lr + head, m_new + gl.log2(l_safe), mask=first)


def covers(q: torch.Tensor, k: torch.Tensor, max_q_count: int, page_size: int | None = None) -> bool:
    """Whether this kernel takes a forward: bf16 rows at head_dim 64 / 128 on sm_90 under gluon_compat.SUPPORTED, whose
    group · queries fit QN columns; a paged cache (page_size given) only with PAGED on and pages whose copies are
    whole 8-row swizzle atoms of a key block (`pages_fit`)."""
    if page_size is not None and not (PAGED and pages_fit(page_size)):
        return False
    if not (q.is_cuda and 0 < (q.shape[1] // k.shape[1]) * max_q_count <= QN):
        return False
    return gluon_forward.covers(q, k, k, HEAD_DIMS)


def pages_fit(page_size: int, block_n: int = 64) -> bool:
    """Pages a key block is copied from: a block of whole pages, or a part of one page, in copies of >= 8 rows."""
    return page_size % 8 == 0 and (block_n % page_size == 0 or page_size % block_n == 0)


def query_columns(group: int, max_q_count: int) -> int:
    """The products' N: 8 when the group's queries fit (Qwen3-8B's decode fills 4 of them), else 16. Half the columns
    are half the scores to mask, exponentiate and round; a wgmma's sum for one element does not depend on N."""
    return 8 if group * max_q_count <= 8 else QN


def head_dim_parts(head_dim: int, programs: int) -> int:
    """Programs a KV head's head dim is split over: 2 at head_dim 128 when the step has fewer programs than half the
    H200's 132 SMs (batch 1: 8-32 programs). Parallelism only: every choice gives the same bits."""
    if PARTS is not None:
        return PARTS
    return 2 if head_dim >= 128 and programs < 66 else 1


@functools.cache
def _v_layout(rows: int, cols: int):
    return gl.NVMMASharedLayout.get_default_for([rows, cols], gl.bfloat16)


def _columns_descriptor(x: torch.Tensor, block_rows: int, block_cols: int, copy_rows: int | None = None):
    """A TMA descriptor of bf16 rows [R, H, D] seen as [R, H·D], in boxes [block_rows, block_cols] (copy_rows: boxes of
    that many rows, in the shared layout of a block_rows ring slot they fill a part of)."""
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    two_d = x.view(x.shape[0], x.shape[1] * x.shape[2])
    return TensorDescriptor(two_d, list(two_d.shape), list(two_d.stride()), [copy_rows or block_rows, block_cols],
                            _v_layout(block_rows, block_cols))


def gluon_decode(q, k, v, table, *, causal: bool, scale: float, block_table=None, page_size: int = 1):
    """flash.flash_forward's contract for the rows `covers` takes: (out [R,Hq,D], lse [R,Hq] fp32 log2); with
    block_table, flash_forward's paged form (k/v a page pool's rows, k_row0 the table's row)."""
    return _launch(q, k, v, table.info, table.num_sequences, table.max_q_count, table.max_kv_len, causal, scale,
                   False, block_table=block_table, page_size=page_size)


def gluon_decode_cache(q, k, v, lengths, sq: int, smax: int, *, scale: float, block_table=None, page_size: int = 1):
    """kv_cache_attention's step on rows q [B·Sq,Hq,D], caches [B·Smax,Hkv,D] (or a page pool's rows with
    block_table [B, Smax / page_size]), lengths [B] on the GPU (clamped to [0, Smax] as its table is), with no table
    launch: (out, lse)."""
    return _launch(q, k, v, lengths, lengths.shape[0], sq, smax, True, scale, True, block_table=block_table,
                   page_size=page_size)


def _launch(q, k, v, seq_info, num_sequences, max_q_count, max_kv_len, causal, scale, from_lengths, block_table=None,
            page_size: int = 1):
    rows, hq, d = q.shape
    hkv = k.shape[1]
    config = attention_config(q.dtype, d)
    out = torch.empty_like(q)
    lse = torch.empty((rows, hq), dtype=torch.float32, device=q.device)
    num_splits = triton.cdiv(max(max_kv_len, 1), config.kv_split)
    partial = num_splits > 1
    if partial:
        pm = torch.empty((num_splits, rows, hq), dtype=torch.float32, device=q.device)
        pl = torch.empty_like(pm)
        pacc = torch.empty((num_splits, rows, hq, d), dtype=torch.float32, device=q.device)
        p_strides, a_strides = (pm.stride(0), pm.stride(1), pm.stride(2)), pacc.stride()[:3]
    else:
        pm = pl = pacc = lse  # unused
        p_strides = a_strides = (0, 0, 0)
    block_n = config.forward.block_n
    parts = head_dim_parts(d, num_splits * hkv * num_sequences)
    qn = query_columns(hq // hkv, max_q_count)
    paged = block_table is not None
    if paged and not pages_fit(page_size, block_n):
        raise ValueError(f"k_cache: page_block_size {page_size}: expected a multiple of 8 that divides {block_n} "
                         f"or that it divides")
    copy_rows = min(page_size, block_n) if paged else block_n
    gluon_decode_kernel[(num_splits, hkv * parts, num_sequences)](
        _columns_descriptor(k, block_n, d, copy_rows), _columns_descriptor(v, block_n, d // parts, copy_rows), q, out,
        lse, pm, pl, pacc, seq_info, block_table, q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        lse.stride(0), *p_strides, *a_strides, block_table.stride(0) if paged else 0, scale * LOG2_E, hq // hkv,
        max_q_count, max_kv_len, block_n, d, parts, qn, L_ROWS, STAGES, config.kv_split, partial, causal,
        from_lengths, page_size if paged else 1, copy_rows if paged else 1, paged, num_warps=4)
    if partial:
        flash._split_combine_kernel[(triton.cdiv(rows * hq, COMBINE_BLOCK_R),)](
            pm, pl, pacc, out, lse, num_splits, rows, hq, d, *p_strides, *a_strides, out.stride(0), out.stride(1),
            lse.stride(0), BLOCK_R=COMBINE_BLOCK_R, BLOCK_D=d, AFTER_PDL=True, launch_pdl=True)
    return out, lse


def compile_for_sm90(head_dim: int = 128, partial: bool = False, parts: int = 1, from_lengths: bool = False,
                     qn: int = QN, page_size: int | None = None):
    """The kernel compiled for sm_90a with no GPU present (Gluon has no interpreter), bound to stand-in tensors of a
    32/8-head problem (gluon_forward.compile_sm90a); page_size: reading a paged cache through a block table."""
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor
    from triton.runtime.jit import MockTensor

    block_n = attention_config(torch.bfloat16, head_dim).forward.block_n
    copy_rows = min(page_size, block_n) if page_size else block_n
    f32 = MockTensor("float32", [8192, 32])

    def desc(cols):
        return TensorDescriptor(MockTensor("bfloat16", [8192, 8 * head_dim]), [8192, 8 * head_dim], [8 * head_dim, 1],
                                [copy_rows, cols], _v_layout(block_n, cols))

    table = MockTensor("int32", [64, 256]) if page_size else None
    args = (desc(head_dim), desc(head_dim // parts),
            MockTensor("bfloat16", [8192, 32, head_dim]), MockTensor("bfloat16", [8192, 32, head_dim]), f32, f32, f32,
            MockTensor("float32", [4, 8192, 32, head_dim]), MockTensor("int32", [4, 6]), table,
            32 * head_dim, head_dim, 32 * head_dim, head_dim, 32, 8192 * 32, 32, 1, 8192 * 32 * head_dim,
            32 * head_dim, head_dim, 256 if page_size else 0, 0.1, 4, 1, 8192,
            block_n, head_dim, parts, qn, L_ROWS, STAGES, 2048, partial, True, from_lengths,
            page_size or 1, copy_rows if page_size else 1, bool(page_size))
    return compile_sm90a(gluon_decode_kernel, args)
