"""The attention backward on Hopper in Gluon (Triton 3.6-3.9), warp-specialised as the forward is
(gluon_forward.py): flash_backward runs these for bf16 head_dim 64, 128 and 256 on sm_90 (dQ on its side stream).

dQ: per CTA two (head_dim 128, 256) or three (64) 64-row query tiles of one sequence and head (Q and dO in shared
memory), each on its own consumer warpgroup, and the forward's 1-warp producer streaming the union of their K/V
blocks (flash.py's: 64 keys, 32 at 256) by TMA. A consumer issues block j's s = q·kᵀ and dp = dO·vᵀ together with
block j-1's dq += ds·k, and forms block j's ds while that runs. Per row it is flash.py's `_dq_block`, block after
block in the same order.

dK/dV: per CTA two 64-key tiles of one sequence and KV head (K and V in shared memory), one per consumer (at
head_dim 256 one tile, whose dV one consumer forms and dK the other: a tile's two fp32 gradients would take a
consumer's 256 registers), and a
producer streaming Q and dO blocks of 64 queries for each head of the group in order, with their LSE and delta
(as FA3 does: a consumer that loaded them itself waited on global memory at every block, and held their
addresses in spilled registers). Per block it is flash.py's `_dkdv_block` (sᵀ = k·qᵀ and dpᵀ = v·dOᵀ, then
dv += pᵀ·dO and dk += dsᵀ·q), over flash.py's query ranges.

Both keep flash.py's tiles, block order and group order (the Triton kernels' bits are expected: the gpu tests
check it). Invisible pairs' ds are zeroed with `where` (not only p), and operands past a sequence's end are
zeroed (the dQ tile's last K block in a consumer's own copy; a dK/dV block's Q and dO rows past the sequence in the
ring slot, which every consumer zeroes alike), as TMA zero-fills only at the tensor's edge: a neighbour's NaN cannot
leak in.

dq, dk, dv equal the Triton kernels' (flash.py's) at head_dim 64, 128 and 256; on the H200 (B·S = 16k, 32/8 heads,
causal) the whole backward is faster than flash.py's at each of them (measurements: docs/kernels.md,
docs/evidence/README.md).
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

from rl_engine.kernels.ops.triton.attention import gluon_forward
from rl_engine.kernels.ops.triton.attention.contract import LOG2_E, NO_WINDOW, attention_config
from rl_engine.kernels.ops.triton.attention.gluon_compat import async_load
from rl_engine.kernels.ops.triton.attention.gluon_forward import (
    BLOCK_M,
    _drain,
    _last_product,
    _or_drain,
    _producer,
    _query_tiles_start,
    _ring_range,
    _sequence,
    _tile_blocks,
    check_rows,
    compile_sm90a,
    mock_row_descriptor,
    row_descriptor,
)

HEAD_DIMS = (64, 128, 256)
CONSUMERS, STAGES, REGS = 2, 4, 240  # a consumer holds block j-1 (its dq product in flight) and block j
# dQ: head_dim -> (consumer warpgroups, ring depth, registers per consumer thread). At 64 a consumer's tiles fit 160
# registers, so three share a CTA (192 query rows, one K/V stream): the same bits, dQ alone 7-10% faster and the
# backward 3-5% (H200); a 2-deep ring was slower. At 128 three would spill.
# At 256 (flash.py's 32-key dQ blocks) two consumers and a 2-deep ring fill 224 KiB of shared memory.
DQ_SHAPES = {64: (3, 3, 160), 128: (CONSUMERS, STAGES, REGS), 256: (CONSUMERS, 2, REGS)}
# dK/dV: 64-query blocks, two of flash.py's 32-query blocks (the same k16 products in the same order: its bits); with
# LSE and delta in the ring they spill 284-436 bytes (1.3-1.6 KB before), and run 8-12% faster than 32-query blocks
# (H200). Two 64-key tiles (K, V) and a 2-deep (Q, dO, LSE, delta) ring: 129 KiB at
# head_dim 128. At 256 a 64-key tile's dK and dV would take a consumer's 256 registers: its two consumers share one
# key tile, one forms dV (sᵀ, then pᵀ·dO), the other dK (sᵀ, dpᵀ, then dsᵀ·Q), 5 GEMMs' work for 4; 192 KiB.
DKDV_BLOCK_Q, DKDV_STAGES = 64, 2
BOTH, DV_ONLY, DK_ONLY = gl.constexpr(0), gl.constexpr(1), gl.constexpr(2)  # a dK/dV consumer's ROLE
NO_WINDOW_C = gl.constexpr(NO_WINDOW)
ROW_LAYOUT = gl.NVMMASharedLayout(swizzle_byte_width=0, element_bitwidth=32, rank=2)  # a block's LSE or delta row


@gluon.jit
def _ds_block(s, dp, lse, delta, j, q_pos, k_base, kv_len, window, qk_scale, BLOCK_N: gl.constexpr,
              MASKED: gl.constexpr, CAUSAL: gl.constexpr):
    """flash.py's `_dq_block` up to the dq product: ds = p·(dp - delta) in bf16 for key block j."""
    p = gl.exp2(gl.fma(s, qk_scale, -gl.expand_dims(lse, 1)))
    ds = p * (dp - gl.expand_dims(delta, 1))
    if MASKED:
        k_pos = j * BLOCK_N + k_base
        visible = gl.expand_dims(k_pos < kv_len, 0) & (gl.expand_dims(k_pos, 0) > gl.expand_dims(q_pos - window, 1))
        if CAUSAL:
            visible = visible & (gl.expand_dims(k_pos, 0) <= gl.expand_dims(q_pos, 1))
        ds = gl.where(visible, ds, 0.0)
    return ds.to(gl.bfloat16)


@gluon.jit
def _dq_step(ds_prev, dq, j, q_smem, do_smem, k_bufs, v_bufs, kv_ready, kv_empty, lse, delta, q_pos, k_base, kv_len,
             window, qk_scale, s_zero, glo, BLOCK_N: gl.constexpr, STAGES: gl.constexpr, MASKED: gl.constexpr,
             CAUSAL: gl.constexpr, ds_layout: gl.constexpr):
    """Key block j (not the tile's first): its s and dp issued with block j-1's dq product, its ds formed
    while that runs; block j-1's stage released once its product is done."""
    t = j - glo
    st = t % STAGES
    prv = (t - 1) % STAGES
    mbarrier.wait(kv_ready.index(st), (t // STAGES) & 1)
    s = warpgroup_mma(q_smem, k_bufs.index(st).permute((1, 0)), s_zero, use_acc=False, is_async=True)
    dp = warpgroup_mma(do_smem, v_bufs.index(st).permute((1, 0)), s_zero, use_acc=False, is_async=True)
    dq = warpgroup_mma(ds_prev, k_bufs.index(prv), dq, is_async=True)
    s, dp = warpgroup_mma_wait(num_outstanding=1, deps=(s, dp))
    ds = _ds_block(s, dp, lse, delta, j, q_pos, k_base, kv_len, window, qk_scale, BLOCK_N, MASKED, CAUSAL)
    dq, ds_prev = warpgroup_mma_wait(num_outstanding=0, deps=(dq, ds_prev))
    mbarrier.arrive(kv_empty.index(prv), count=1)
    return gl.convert_layout(ds, ds_layout, assert_trivial=True), dq


@gluon.jit
def _dq_consumer(q_smem, do_smem, q_bar, k_bufs, v_bufs, k_tail, kv_ready, kv_empty, DQ, LSE, DELTA,
                 stride_qr, stride_qh, stride_lr, qk_scale, scale, head, q_row0, q_count, q_pos0, first_q, kv_len,
                 window, lo_b, mid_b, hi_b, glo, ghi,
                 BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, HEAD_DIM: gl.constexpr, STAGES: gl.constexpr,
                 CAUSAL: gl.constexpr):
    """dq of one 64-row query tile on one warpgroup over key blocks [lo_b, mid_b) unmasked, [mid_b, hi_b)
    masked; the other blocks of the CTA's ring drained."""
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                       instr_shape=[16, BLOCK_N, 16])
    o_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                       instr_shape=[16, HEAD_DIM, 16])
    ds_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=2)
    row_s: gl.constexpr = gl.SliceLayout(1, s_layout)
    row_o: gl.constexpr = gl.SliceLayout(1, o_layout)
    mbarrier.wait(q_bar, 0)  # also for a tile without work: no copy may be in flight when the CTA exits
    _drain(kv_ready, kv_empty, glo, lo_b, glo, STAGES)
    if hi_b > lo_b:
        q_idx = first_q + gl.arange(0, BLOCK_M, row_s)
        q_pos = q_pos0 + q_idx
        rows_ok = (q_idx >= 0) & (q_idx < q_count)
        l_off = (q_row0 + q_idx).to(gl.int64) * stride_lr + head  # lse and delta: [R, Hq] alike
        lse = gl.load(LSE + l_off, mask=rows_ok, other=0.0)
        delta = gl.load(DELTA + l_off, mask=rows_ok, other=0.0)
        k_base = gl.arange(0, BLOCK_N, gl.SliceLayout(0, s_layout))
        s_zero = gl.zeros([BLOCK_M, BLOCK_N], gl.float32, s_layout)
        dq = gl.zeros([BLOCK_M, HEAD_DIM], gl.float32, o_layout)
        # block lo_b: its s, dp and ds
        t = lo_b - glo
        mbarrier.wait(kv_ready.index(t % STAGES), (t // STAGES) & 1)
        s = warpgroup_mma(q_smem, k_bufs.index(t % STAGES).permute((1, 0)), s_zero, use_acc=False, is_async=True)
        dp = warpgroup_mma(do_smem, v_bufs.index(t % STAGES).permute((1, 0)), s_zero, use_acc=False, is_async=True)
        s, dp = warpgroup_mma_wait(num_outstanding=0, deps=(s, dp))
        if lo_b < mid_b:
            ds = _ds_block(s, dp, lse, delta, lo_b, q_pos, k_base, kv_len, window, qk_scale, BLOCK_N, False, CAUSAL)
        else:
            ds = _ds_block(s, dp, lse, delta, lo_b, q_pos, k_base, kv_len, window, qk_scale, BLOCK_N, True, CAUSAL)
        ds_op = gl.convert_layout(ds, ds_layout, assert_trivial=True)
        u = gl.maximum(mid_b, lo_b + 1)
        for j in range(lo_b + 1, u):  # unmasked blocks
            ds_op, dq = _dq_step(ds_op, dq, j, q_smem, do_smem, k_bufs, v_bufs, kv_ready, kv_empty, lse, delta, q_pos,
                                 k_base, kv_len, window, qk_scale, s_zero, glo, BLOCK_N, STAGES, False, CAUSAL,
                                 ds_layout)
        for j in range(u, hi_b):  # masked blocks
            ds_op, dq = _dq_step(ds_op, dq, j, q_smem, do_smem, k_bufs, v_bufs, kv_ready, kv_empty, lse, delta, q_pos,
                                 k_base, kv_len, window, qk_scale, s_zero, glo, BLOCK_N, STAGES, True, CAUSAL,
                                 ds_layout)
        dq = _last_product(ds_op, k_bufs, k_tail, dq, kv_ready, kv_empty, hi_b, glo, kv_len, BLOCK_N, STAGES)
        dq = dq * scale
        rows_o = first_q + gl.arange(0, BLOCK_M, row_o)
        d = gl.arange(0, HEAD_DIM, gl.SliceLayout(0, o_layout))
        ptr = DQ + gl.expand_dims((q_row0 + rows_o).to(gl.int64) * stride_qr + head * stride_qh, 1)
        ptr = ptr + gl.expand_dims(d, 0)
        gl.store(ptr, dq.to(gl.bfloat16), mask=gl.expand_dims((rows_o >= 0) & (rows_o < q_count), 1))
    _drain(kv_ready, kv_empty, gl.maximum(hi_b, lo_b), ghi, glo, STAGES)


@gluon.jit
def gluon_dq_kernel(desc_q, desc_do, desc_k, desc_v, DQ, LSE, DELTA, SEQ_INFO,
                    stride_qr, stride_qh, stride_lr, qk_scale, scale, group,
                    BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, HEAD_DIM: gl.constexpr, STAGES: gl.constexpr,
                    CAUSAL: gl.constexpr, REGS: gl.constexpr, CONSUMERS: gl.constexpr):
    # grid (cdiv(max q_count, CONSUMERS * 64), Hq, sequences), the heaviest CTAs first; under a causal mask
    # aligned to the sequence's end, as the forward's (a row's dq does not depend on where its tile starts).
    head = gl.program_id(1)
    q_row0, q_count, q_pos0, k_row0, kv_len, window = _sequence(SEQ_INFO)
    first_q = _query_tiles_start(q_count, CONSUMERS * BLOCK_M, CAUSAL)
    lo0, mid0, hi0 = _tile_blocks(q_pos0, first_q, q_count, kv_len, window, CAUSAL, BLOCK_M, BLOCK_N)
    lo1, mid1, hi1 = _tile_blocks(q_pos0, first_q + BLOCK_M, q_count, kv_len, window, CAUSAL, BLOCK_M, BLOCK_N)
    lo2, mid2, hi2 = _tile_blocks(q_pos0, first_q + 2 * BLOCK_M, q_count, kv_len, window, CAUSAL, BLOCK_M, BLOCK_N)
    if CONSUMERS == 2:  # no third tile
        lo2, mid2, hi2 = lo2 * 0, mid2 * 0, hi2 * 0
    glo, ghi = _ring_range(lo0, hi0, lo1, hi1, lo2, hi2)
    lo0, mid0, hi0 = _or_drain(lo0, mid0, hi0, glo)
    lo1, mid1, hi1 = _or_drain(lo1, mid1, hi1, glo)
    lo2, mid2, hi2 = _or_drain(lo2, mid2, hi2, glo)
    q_col = head * HEAD_DIM
    kv_col = (head // group) * HEAD_DIM

    q0 = gl.allocate_shared_memory(desc_q.dtype, desc_q.block_type.shape, desc_q.layout)
    q1 = gl.allocate_shared_memory(desc_q.dtype, desc_q.block_type.shape, desc_q.layout)
    do0 = gl.allocate_shared_memory(desc_do.dtype, desc_do.block_type.shape, desc_do.layout)
    do1 = gl.allocate_shared_memory(desc_do.dtype, desc_do.block_type.shape, desc_do.layout)
    k_bufs = gl.allocate_shared_memory(desc_k.dtype, [STAGES] + desc_k.block_type.shape, desc_k.layout)
    v_bufs = gl.allocate_shared_memory(desc_v.dtype, [STAGES] + desc_v.block_type.shape, desc_v.layout)
    k_tails = gl.allocate_shared_memory(desc_k.dtype, [CONSUMERS] + desc_k.block_type.shape, desc_k.layout)
    q_bars = gl.allocate_shared_memory(gl.int64, [3, 1], mbarrier.MBarrierLayout())
    kv_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    kv_empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for c in gl.static_range(3):
        mbarrier.init(q_bars.index(c), count=1)
    for s in gl.static_range(STAGES):
        mbarrier.init(kv_ready.index(s), count=1)
        mbarrier.init(kv_empty.index(s), count=CONSUMERS)  # each consumer releases each stage
    nbytes: gl.constexpr = desc_q.block_type.nbytes + desc_do.block_type.nbytes
    mbarrier.expect(q_bars.index(0), nbytes)
    async_load(desc_q, [q_row0 + first_q, q_col], q_bars.index(0), q0)
    async_load(desc_do, [q_row0 + first_q, q_col], q_bars.index(0), do0)
    mbarrier.expect(q_bars.index(1), nbytes)
    async_load(desc_q, [q_row0 + first_q + BLOCK_M, q_col], q_bars.index(1), q1)
    async_load(desc_do, [q_row0 + first_q + BLOCK_M, q_col], q_bars.index(1), do1)
    if CONSUMERS == 2:
        gl.warp_specialize([
            (_dq_consumer, (q0, do0, q_bars.index(0), k_bufs, v_bufs, k_tails.index(0), kv_ready, kv_empty, DQ, LSE,
                            DELTA, stride_qr, stride_qh, stride_lr, qk_scale, scale, head, q_row0, q_count, q_pos0,
                            first_q, kv_len, window, lo0, mid0, hi0, glo, ghi,
                            BLOCK_M, BLOCK_N, HEAD_DIM, STAGES, CAUSAL)),
            (_dq_consumer, (q1, do1, q_bars.index(1), k_bufs, v_bufs, k_tails.index(1), kv_ready, kv_empty, DQ, LSE,
                            DELTA, stride_qr, stride_qh, stride_lr, qk_scale, scale, head, q_row0, q_count, q_pos0,
                            first_q + BLOCK_M, kv_len, window, lo1, mid1, hi1, glo, ghi,
                            BLOCK_M, BLOCK_N, HEAD_DIM, STAGES, CAUSAL)),
            (_producer, (desc_k, desc_v, k_bufs, v_bufs, kv_ready, kv_empty, k_row0, kv_col, glo, ghi, BLOCK_N,
                         STAGES)),
        ], [4, 1], [REGS, 24])
    else:
        q2 = gl.allocate_shared_memory(desc_q.dtype, desc_q.block_type.shape, desc_q.layout)
        do2 = gl.allocate_shared_memory(desc_do.dtype, desc_do.block_type.shape, desc_do.layout)
        mbarrier.expect(q_bars.index(2), nbytes)
        async_load(desc_q, [q_row0 + first_q + 2 * BLOCK_M, q_col], q_bars.index(2), q2)
        async_load(desc_do, [q_row0 + first_q + 2 * BLOCK_M, q_col], q_bars.index(2), do2)
        gl.warp_specialize([
            (_dq_consumer, (q0, do0, q_bars.index(0), k_bufs, v_bufs, k_tails.index(0), kv_ready, kv_empty, DQ, LSE,
                            DELTA, stride_qr, stride_qh, stride_lr, qk_scale, scale, head, q_row0, q_count, q_pos0,
                            first_q, kv_len, window, lo0, mid0, hi0, glo, ghi,
                            BLOCK_M, BLOCK_N, HEAD_DIM, STAGES, CAUSAL)),
            (_dq_consumer, (q1, do1, q_bars.index(1), k_bufs, v_bufs, k_tails.index(1), kv_ready, kv_empty, DQ, LSE,
                            DELTA, stride_qr, stride_qh, stride_lr, qk_scale, scale, head, q_row0, q_count, q_pos0,
                            first_q + BLOCK_M, kv_len, window, lo1, mid1, hi1, glo, ghi,
                            BLOCK_M, BLOCK_N, HEAD_DIM, STAGES, CAUSAL)),
            (_dq_consumer, (q2, do2, q_bars.index(2), k_bufs, v_bufs, k_tails.index(2), kv_ready, kv_empty, DQ, LSE,
                            DELTA, stride_qr, stride_qh, stride_lr, qk_scale, scale, head, q_row0, q_count, q_pos0,
                            first_q + 2 * BLOCK_M, kv_len, window, lo2, mid2, hi2, glo, ghi,
                            BLOCK_M, BLOCK_N, HEAD_DIM, STAGES, CAUSAL)),
            (_producer, (desc_k, desc_v, k_bufs, v_bufs, kv_ready, kv_empty, k_row0, kv_col, glo, ghi, BLOCK_N,
                         STAGES)),
        ], [4, 4, 1], [REGS, REGS, 24])


@gluon.jit
def _qdo_producer(desc_q, desc_do, desc_lse, desc_delta, q_bufs, do_bufs, lse_bufs, delta_bufs, ready, empty, q_row0,
                  kv_head, group, glo, ghi, BLOCK_M: gl.constexpr, HEAD_DIM: gl.constexpr, STAGES: gl.constexpr):
    """Streams the query blocks [glo, ghi) of each head of the group, in order, into the ring: Q and dO rows
    and their LSE and delta (one 128-byte TMA box each, from `shifted_rows`' copies)."""
    nb = ghi - glo
    n_heads = group * gl.num_programs(1)
    nbytes: gl.constexpr = (desc_q.block_type.nbytes + desc_do.block_type.nbytes + desc_lse.block_type.nbytes
                            + desc_delta.block_type.nbytes)
    for g in range(0, group):
        head = kv_head * group + g
        col = head * HEAD_DIM
        for m in range(glo, ghi):
            t = g * nb + m - glo
            st = t % STAGES
            row = q_row0 + m * BLOCK_M
            mbarrier.wait(empty.index(st), ((t // STAGES) & 1) ^ 1)  # a fresh barrier passes parity 1
            mbarrier.expect(ready.index(st), nbytes)
            async_load(desc_q, [row, col], ready.index(st), q_bufs.index(st))
            async_load(desc_do, [row, col], ready.index(st), do_bufs.index(st))
            shift = row % 4  # `shifted_rows`
            row_c = [shift * n_heads + head, row - shift]
            async_load(desc_lse, row_c, ready.index(st), lse_bufs.index(st))
            async_load(desc_delta, row_c, ready.index(st), delta_bufs.index(st))


@gluon.jit
def _dkdv_block(k_smem, v_smem, q_smem, do_smem, lse_smem, delta_smem, dk, dv, q_pos0, q_count, m, start_n,
                kv_len, window, qk_scale, s_zero,
                BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, MASKED: gl.constexpr, CAUSAL: gl.constexpr,
                ROLE: gl.constexpr, s_layout: gl.constexpr, o_layout: gl.constexpr):
    """flash.py's `_dkdv_block` for query block m: dV += Pᵀ·dO and dK += dSᵀ·Q, sᵀ = K·Qᵀ and dpᵀ = V·dOᵀ
    issued together; ROLE DV_ONLY / DK_ONLY forms one of the two (the other is passed through). MASKED: causal,
    window, kv_len and q_count by `where` on p and ds (a block with rows past q_count comes here with those Q and
    dO rows zeroed by the caller)."""
    p_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=2)
    col_s: gl.constexpr = gl.SliceLayout(0, s_layout)
    q_idx = m * BLOCK_M + gl.arange(0, BLOCK_M, col_s)
    rows_ok = q_idx < q_count
    s_t = warpgroup_mma(k_smem, q_smem.permute((1, 0)), s_zero, use_acc=False, is_async=True)
    if ROLE == DV_ONLY:
        s_t = warpgroup_mma_wait(num_outstanding=0, deps=(s_t, ))
    else:
        dp_t = warpgroup_mma(v_smem, do_smem.permute((1, 0)), s_zero, use_acc=False, is_async=True)
        s_t, dp_t = warpgroup_mma_wait(num_outstanding=0, deps=(s_t, dp_t))
    # [1, BLOCK_M] rows of the ring, broadcast over the keys (rows past q_count: only in masked blocks, zeroed below)
    p_t = gl.exp2(gl.fma(s_t, qk_scale, -lse_smem.load(s_layout)))
    if ROLE != DV_ONLY:
        ds_t = p_t * (dp_t - delta_smem.load(s_layout))
    if MASKED:
        k_pos = start_n + gl.arange(0, BLOCK_N, gl.SliceLayout(1, s_layout))
        q_pos = q_pos0 + q_idx
        visible = (gl.expand_dims(k_pos < kv_len, 1) & gl.expand_dims(rows_ok, 0)
                   & (gl.expand_dims(k_pos, 1) > gl.expand_dims(q_pos - window, 0)))
        if CAUSAL:
            visible = visible & (gl.expand_dims(k_pos, 1) <= gl.expand_dims(q_pos, 0))
        if ROLE != DK_ONLY:
            p_t = gl.where(visible, p_t, 0.0)
        if ROLE != DV_ONLY:
            ds_t = gl.where(visible, ds_t, 0.0)
    if ROLE == DV_ONLY:
        p_op = gl.convert_layout(p_t.to(gl.bfloat16), p_layout, assert_trivial=True)
        dv = warpgroup_mma(p_op, do_smem, dv, is_async=True)
        dv = warpgroup_mma_wait(num_outstanding=0, deps=(dv, ))
    elif ROLE == DK_ONLY:
        ds_op = gl.convert_layout(ds_t.to(gl.bfloat16), p_layout, assert_trivial=True)
        dk = warpgroup_mma(ds_op, q_smem, dk, is_async=True)
        dk = warpgroup_mma_wait(num_outstanding=0, deps=(dk, ))
    else:
        p_op = gl.convert_layout(p_t.to(gl.bfloat16), p_layout, assert_trivial=True)
        ds_op = gl.convert_layout(ds_t.to(gl.bfloat16), p_layout, assert_trivial=True)
        dv = warpgroup_mma(p_op, do_smem, dv, is_async=True)
        dk = warpgroup_mma(ds_op, q_smem, dk, is_async=True)
        dv, dk = warpgroup_mma_wait(num_outstanding=0, deps=(dv, dk))
    return dk, dv


@gluon.jit
def _dkdv_walk(k_smem, v_smem, q_bufs, do_bufs, lse_bufs, delta_bufs, ready, empty, dk, dv, q_pos0,
               q_count, first, last, t0, start_n, kv_len, window, qk_scale, s_zero,
               BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr, MASKED: gl.constexpr,
               CAUSAL: gl.constexpr, ROLE: gl.constexpr, s_layout: gl.constexpr, o_layout: gl.constexpr):
    """Query blocks [first, last) of one head, ring slots t0 + m. In a block with rows past q_count (the
    sequence's last) those Q and dO rows are zeroed in the ring slot itself first (a neighbour's rows could hold
    anything, and 0·NaN is NaN): the CTA's consumers read the same block and write the same zeros."""
    # 8 rows x 128 columns a tile of it: 4 registers a thread at head_dim <= 128, 8 at 256
    chunk: gl.constexpr = gl.BlockedLayout([1, 8], [2, 16], [4, 1], [1, 0])
    for m in range(first, last):
        t = t0 + m
        st = t % STAGES
        mbarrier.wait(ready.index(st), (t // STAGES) & 1)
        if MASKED:
            if (m + 1) * BLOCK_M > q_count:
                for r in gl.static_range(0, BLOCK_M, 8):  # in 8-row pieces: a whole block would cost 32 registers
                    if m * BLOCK_M + r + 8 > q_count:
                        rows = m * BLOCK_M + r + gl.arange(0, 8, gl.SliceLayout(1, chunk))
                        keep = gl.expand_dims(rows < q_count, 1)
                        q_piece = q_bufs.index(st).slice(r, 8)
                        do_piece = do_bufs.index(st).slice(r, 8)
                        q_piece.store(gl.where(keep, q_piece.load(chunk), 0.0))
                        do_piece.store(gl.where(keep, do_piece.load(chunk), 0.0))
                fence_async_shared()
            dk, dv = _dkdv_block(k_smem, v_smem, q_bufs.index(st), do_bufs.index(st), lse_bufs.index(st),
                                 delta_bufs.index(st), dk, dv, q_pos0, q_count, m, start_n, kv_len, window, qk_scale,
                                 s_zero, BLOCK_M, BLOCK_N, True, CAUSAL, ROLE, s_layout, o_layout)
        else:
            dk, dv = _dkdv_block(k_smem, v_smem, q_bufs.index(st), do_bufs.index(st), lse_bufs.index(st),
                                 delta_bufs.index(st), dk, dv, q_pos0, q_count, m, start_n, kv_len, window, qk_scale,
                                 s_zero, BLOCK_M, BLOCK_N, False, CAUSAL, ROLE, s_layout, o_layout)
        mbarrier.arrive(empty.index(st), count=1)
    return dk, dv


@gluon.jit
def _dkdv_consumer(k_smem, v_smem, kv_bar, q_bufs, do_bufs, lse_bufs, delta_bufs, ready, empty, DK,
                   DV, stride_kr, stride_kh, qk_scale, scale, kv_head, group, q_count, q_pos0,
                   k_row0, kv_len, window, start_n, lo_b, mid_b, full_b, hi_b, glo, ghi,
                   BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, HEAD_DIM: gl.constexpr, STAGES: gl.constexpr,
                   CAUSAL: gl.constexpr, ROLE: gl.constexpr):
    """dK and/or dV (ROLE) of one 64-key tile on one warpgroup: for each head of the group in order, query blocks
    [lo_b, mid_b) masked, [mid_b, full_b) unmasked, [full_b, hi_b) masked (flash.py's ranges); the other
    blocks of the CTA's ring drained."""
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                       instr_shape=[16, BLOCK_M, 16])
    o_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                       instr_shape=[16, HEAD_DIM, 16])
    unused: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, 16, 16])
    row_o: gl.constexpr = gl.SliceLayout(1, o_layout)
    mbarrier.wait(kv_bar, 0)  # also for a tile without work: no copy may be in flight when the CTA exits
    s_zero = gl.zeros([BLOCK_N, BLOCK_M], gl.float32, s_layout)
    if ROLE == DV_ONLY:  # the gradient a consumer does not form is a small stand-in, passed through
        dk = gl.zeros([BLOCK_N, 16], gl.float32, unused)
    else:
        dk = gl.zeros([BLOCK_N, HEAD_DIM], gl.float32, o_layout)
    if ROLE == DK_ONLY:
        dv = gl.zeros([BLOCK_N, 16], gl.float32, unused)
    else:
        dv = gl.zeros([BLOCK_N, HEAD_DIM], gl.float32, o_layout)
    nb = ghi - glo
    for g in range(0, group):  # the group's query heads, summed in a fixed order (no atomics)
        t0 = g * nb - glo
        _drain(ready, empty, glo, lo_b, glo - g * nb, STAGES)
        dk, dv = _dkdv_walk(k_smem, v_smem, q_bufs, do_bufs, lse_bufs, delta_bufs, ready, empty, dk,
                            dv, q_pos0, q_count, lo_b, mid_b, t0, start_n, kv_len, window, qk_scale,
                            s_zero, BLOCK_M, BLOCK_N, STAGES, True, CAUSAL, ROLE, s_layout, o_layout)
        dk, dv = _dkdv_walk(k_smem, v_smem, q_bufs, do_bufs, lse_bufs, delta_bufs, ready, empty, dk,
                            dv, q_pos0, q_count, mid_b, full_b, t0, start_n, kv_len, window, qk_scale,
                            s_zero, BLOCK_M, BLOCK_N, STAGES, False, CAUSAL, ROLE, s_layout, o_layout)
        dk, dv = _dkdv_walk(k_smem, v_smem, q_bufs, do_bufs, lse_bufs, delta_bufs, ready, empty, dk,
                            dv, q_pos0, q_count, full_b, hi_b, t0, start_n, kv_len, window, qk_scale,
                            s_zero, BLOCK_M, BLOCK_N, STAGES, True, CAUSAL, ROLE, s_layout, o_layout)
        _drain(ready, empty, hi_b, ghi, glo - g * nb, STAGES)
    k_idx = start_n + gl.arange(0, BLOCK_N, row_o)
    d = gl.arange(0, HEAD_DIM, gl.SliceLayout(0, o_layout))
    off = gl.expand_dims((k_row0 + k_idx).to(gl.int64) * stride_kr + kv_head * stride_kh, 1) + gl.expand_dims(d, 0)
    keep = gl.expand_dims(k_idx < kv_len, 1)
    if ROLE != DV_ONLY:
        gl.store(DK + off, (dk * scale).to(gl.bfloat16), mask=keep)
    if ROLE != DK_ONLY:
        gl.store(DV + off, dv.to(gl.bfloat16), mask=keep)


@gluon.jit
def _dkdv_ranges(start_n, q_pos0, q_count, kv_len, window, CAUSAL: gl.constexpr, BLOCK_M: gl.constexpr,
                 BLOCK_N: gl.constexpr):
    """flash.py's dK/dV query ranges for the key block at start_n, in blocks of BLOCK_M queries counted from
    the sequence's first: [lo_b, mid_b) masked, [mid_b, full_b) unmasked, [full_b, hi_b) masked."""
    lo = 0
    if CAUSAL:
        lo = (gl.maximum(start_n - q_pos0, 0) // BLOCK_M) * BLOCK_M
    hi = gl.where(start_n < kv_len, q_count, 0)
    hi = gl.minimum(hi, start_n + BLOCK_N - 1 + window - q_pos0)  # the window's last query
    mid = lo
    if CAUSAL:
        mid = gl.maximum(lo, lo + gl.cdiv(start_n + BLOCK_N - 1 - q_pos0 - lo, BLOCK_M) * BLOCK_M)
    full = gl.where(window == NO_WINDOW_C, gl.maximum(q_count // BLOCK_M * BLOCK_M, mid), mid)
    lo_b = lo // BLOCK_M
    hi_b = gl.maximum(gl.cdiv(gl.maximum(hi, 0), BLOCK_M), lo_b)
    mid_b = gl.minimum(mid // BLOCK_M, hi_b)
    full_b = gl.minimum(gl.maximum(full // BLOCK_M, mid_b), hi_b)
    return lo_b, mid_b, full_b, hi_b


@gluon.jit
def gluon_dkdv_kernel(desc_q, desc_do, desc_k, desc_v, desc_lse, desc_delta, DK, DV, SEQ_INFO,
                      stride_kr, stride_kh, qk_scale, scale, group,
                      BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, HEAD_DIM: gl.constexpr, STAGES: gl.constexpr,
                      CAUSAL: gl.constexpr, REGS: gl.constexpr, SPLIT: gl.constexpr):
    # grid (cdiv(max kv_len, keys per CTA), Hkv, sequences): under a causal mask the first key blocks do the most
    # work. A CTA's two consumers take a 64-key tile each and form its dK and dV, or with SPLIT (_splits_tile)
    # share one tile, one forming dV, the other dK.
    kv_head = gl.program_id(1)
    q_row0, q_count, q_pos0, k_row0, kv_len, window = _sequence(SEQ_INFO)
    if SPLIT:
        start_n = gl.program_id(0) * BLOCK_N
        start_n1 = start_n
    else:
        start_n = gl.program_id(0) * 2 * BLOCK_N
        start_n1 = start_n + BLOCK_N
    lo0, mid0, full0, hi0 = _dkdv_ranges(start_n, q_pos0, q_count, kv_len, window, CAUSAL, BLOCK_M, BLOCK_N)
    lo1, mid1, full1, hi1 = _dkdv_ranges(start_n1, q_pos0, q_count, kv_len, window, CAUSAL, BLOCK_M, BLOCK_N)
    glo, ghi = _ring_range(lo0, hi0, lo1, hi1, lo1, hi1)
    full0 = gl.where(hi0 > lo0, full0, glo)  # _or_drain's, for the fourth bound
    full1 = gl.where(hi1 > lo1, full1, glo)
    lo0, mid0, hi0 = _or_drain(lo0, mid0, hi0, glo)
    lo1, mid1, hi1 = _or_drain(lo1, mid1, hi1, glo)
    kv_col = kv_head * HEAD_DIM

    k0 = gl.allocate_shared_memory(desc_k.dtype, desc_k.block_type.shape, desc_k.layout)
    v0 = gl.allocate_shared_memory(desc_v.dtype, desc_v.block_type.shape, desc_v.layout)
    q_bufs = gl.allocate_shared_memory(desc_q.dtype, [STAGES] + desc_q.block_type.shape, desc_q.layout)
    do_bufs = gl.allocate_shared_memory(desc_do.dtype, [STAGES] + desc_do.block_type.shape, desc_do.layout)
    lse_bufs = gl.allocate_shared_memory(gl.float32, [STAGES] + desc_lse.block_type.shape, desc_lse.layout)
    delta_bufs = gl.allocate_shared_memory(gl.float32, [STAGES] + desc_delta.block_type.shape, desc_delta.layout)
    kv_bars = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for c in gl.static_range(2):
        mbarrier.init(kv_bars.index(c), count=1)
    for s in gl.static_range(STAGES):
        mbarrier.init(ready.index(s), count=1)
        mbarrier.init(empty.index(s), count=2)  # each consumer releases each stage
    nbytes: gl.constexpr = desc_k.block_type.nbytes + desc_v.block_type.nbytes
    mbarrier.expect(kv_bars.index(0), nbytes)
    async_load(desc_k, [k_row0 + start_n, kv_col], kv_bars.index(0), k0)
    async_load(desc_v, [k_row0 + start_n, kv_col], kv_bars.index(0), v0)
    if SPLIT:  # one tile: the consumers share its K and V, one forming dV, the other dK
        k1 = k0
        v1 = v0
        kv_bar1 = kv_bars.index(0)
    else:
        k1 = gl.allocate_shared_memory(desc_k.dtype, desc_k.block_type.shape, desc_k.layout)
        v1 = gl.allocate_shared_memory(desc_v.dtype, desc_v.block_type.shape, desc_v.layout)
        kv_bar1 = kv_bars.index(1)
        mbarrier.expect(kv_bar1, nbytes)
        async_load(desc_k, [k_row0 + start_n1, kv_col], kv_bar1, k1)
        async_load(desc_v, [k_row0 + start_n1, kv_col], kv_bar1, v1)
    gl.warp_specialize([
        (_dkdv_consumer, (k0, v0, kv_bars.index(0), q_bufs, do_bufs, lse_bufs, delta_bufs, ready, empty, DK, DV,
                          stride_kr, stride_kh, qk_scale, scale, kv_head, group, q_count, q_pos0, k_row0, kv_len,
                          window, start_n, lo0, mid0, full0, hi0, glo, ghi,
                          BLOCK_M, BLOCK_N, HEAD_DIM, STAGES, CAUSAL, DV_ONLY if SPLIT else BOTH)),
        (_dkdv_consumer, (k1, v1, kv_bar1, q_bufs, do_bufs, lse_bufs, delta_bufs, ready, empty, DK, DV,
                          stride_kr, stride_kh, qk_scale, scale, kv_head, group, q_count, q_pos0, k_row0, kv_len,
                          window, start_n1, lo1, mid1, full1, hi1, glo, ghi,
                          BLOCK_M, BLOCK_N, HEAD_DIM, STAGES, CAUSAL, DK_ONLY if SPLIT else BOTH)),
        (_qdo_producer, (desc_q, desc_do, desc_lse, desc_delta, q_bufs, do_bufs, lse_bufs, delta_bufs, ready,
                         empty, q_row0, kv_head, group, glo, ghi, BLOCK_M, HEAD_DIM, STAGES)),
    ], [4, 1], [REGS, 24])


def covers(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> bool:
    """gluon_forward.covers for this backward's head dims, looked up at each call: bound once at import, it kept
    whatever stood in for it then (a gpu test's stand-in for flash.py's forward turned the Gluon backward off for
    the rest of the session when that test imported this module first)."""
    return gluon_forward.covers(q, k, v, HEAD_DIMS)


def shifted_rows(x: torch.Tensor) -> torch.Tensor:
    """[R, Hq] per-row values (LSE, delta) -> [4·Hq, R'] for the dK/dV producer's TMA: a block's rows [r, r + n) of
    head h would be one box of a [Hq, R] copy, but a box's innermost coordinate must be 16-byte aligned and a block
    of a packed batch starts on any row, so the copy is kept four times, shifted by 0-3 rows: row k·Hq + h, columns
    [r - k, r - k + n) with k = r % 4 (R' = R rounded up to 4: TMA needs 16-byte row strides)."""
    rows, heads = x.shape
    cols = triton.cdiv(rows, 4) * 4
    padded = torch.nn.functional.pad(x, (0, 0, 0, cols + 3 - rows))  # rows past R read as zeros (masked anyway)
    # One copy (two launches, not eight): copy k's element [h, c] is padded[c + k, h].
    return padded.as_strided((4, heads, cols), (heads, 1, heads)).contiguous().view(4 * heads, cols)


def _shifted_rows_descriptor(x):
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    t = shifted_rows(x)
    return TensorDescriptor(t, [t.shape[0], x.shape[0]], list(t.stride()), [1, DKDV_BLOCK_Q], ROW_LAYOUT)


def gluon_dq(do, q, k, v, lse, delta, table, *, causal: bool, scale: float, out=None) -> torch.Tensor:
    """flash.py's dQ kernel's contract (dO, q [R,Hq,D]; k, v [Rk,Hkv,D] bf16 rows; lse, delta [R,Hq] fp32; a
    SequenceTable) -> dq [R,Hq,D], written into `out` when given (flash_backward allocates it on its own
    stream, before the side stream runs this); rows no sequence covers are left as they were."""
    check_rows(q, k, v, HEAD_DIMS)
    if do.shape != q.shape or not do.is_contiguous() or do.dtype != q.dtype:
        raise ValueError(f"do: expected contiguous {q.dtype} rows {tuple(q.shape)}, got {tuple(do.shape)}")
    rows, hq, d = q.shape
    dq = torch.empty_like(q) if out is None else out
    if table.num_sequences == 0 or rows == 0:
        return dq
    block_n = attention_config(q.dtype, d).backward_dq.block_n
    consumers, stages, regs = DQ_SHAPES[d]
    grid = (triton.cdiv(max(table.max_q_count, 1), consumers * BLOCK_M), hq, table.num_sequences)
    gluon_dq_kernel[grid](
        row_descriptor(q, BLOCK_M), row_descriptor(do, BLOCK_M), row_descriptor(k, block_n), row_descriptor(v, block_n),
        dq, lse, delta, table.info, dq.stride(0), dq.stride(1), lse.stride(0), scale * LOG2_E, scale,
        hq // k.shape[1], BLOCK_M, block_n, d, stages, causal, regs, consumers, num_warps=4)
    return dq


def gluon_dkdv(do, q, k, v, lse, delta, table, *, causal: bool, scale: float, out=None):
    """flash.py's dK/dV kernel's contract (the arguments of `gluon_dq`) -> (dk, dv) [Rk,Hkv,D], written into
    `out` = (dk, dv) when given; rows no sequence covers are left as they were."""
    check_rows(q, k, v, HEAD_DIMS)
    rows, hq, d = q.shape
    dk, dv = (torch.empty_like(k), torch.empty_like(v)) if out is None else out
    if table.num_sequences == 0 or rows == 0:
        return dk, dv
    hkv = k.shape[1]
    split = _splits_tile(d)
    keys_per_cta = BLOCK_M if split else 2 * BLOCK_M
    grid = (triton.cdiv(max(table.max_kv_len, 1), keys_per_cta), hkv, table.num_sequences)
    gluon_dkdv_kernel[grid](
        row_descriptor(q, DKDV_BLOCK_Q), row_descriptor(do, DKDV_BLOCK_Q), row_descriptor(k, BLOCK_M),
        row_descriptor(v, BLOCK_M), _shifted_rows_descriptor(lse), _shifted_rows_descriptor(delta), dk, dv, table.info,
        dk.stride(0), dk.stride(1), scale * LOG2_E, scale, hq // hkv, DKDV_BLOCK_Q, BLOCK_M, d, DKDV_STAGES, causal,
        REGS, split, num_warps=4)
    return dk, dv


def _splits_tile(head_dim: int) -> bool:
    """Whether gluon_dkdv_kernel's two consumers share one key tile: past head_dim 128 a 64-key tile's dK and dV
    would take a consumer's 256 registers."""
    return head_dim > 128


def compile_for_sm90(causal: bool, kernel: str = "dq", head_dim: int = 128):
    """A kernel ("dq" or "dkdv") compiled for sm_90a with no GPU present, bound to stand-ins of a B·S = 8192,
    32/8-head problem."""
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor
    from triton.runtime.jit import MockTensor

    block_n = attention_config(torch.bfloat16, head_dim).backward_dq.block_n

    desc = functools.partial(mock_row_descriptor, head_dim=head_dim)
    f32 = MockTensor("float32", [8192, 32])
    rows = MockTensor("bfloat16", [8192, 32, head_dim])
    info = MockTensor("int32", [4, 6])
    if kernel == "dq":
        fn = gluon_dq_kernel
        consumers, stages, regs = DQ_SHAPES[head_dim]
        args = (desc(BLOCK_M, 32), desc(BLOCK_M, 32), desc(block_n, 8), desc(block_n, 8), rows, f32, f32, info,
                32 * head_dim, head_dim, 32, 0.1, 0.1, 4, BLOCK_M, block_n, head_dim, stages, causal, regs, consumers)
    else:
        fn = gluon_dkdv_kernel
        row = TensorDescriptor(MockTensor("float32", [32, 8192]), [32, 8192], [8192, 1], [1, DKDV_BLOCK_Q], ROW_LAYOUT)
        args = (desc(DKDV_BLOCK_Q, 32), desc(DKDV_BLOCK_Q, 32), desc(BLOCK_M, 8), desc(BLOCK_M, 8), row, row, rows,
                rows, info, 8 * head_dim, head_dim, 0.1, 0.1, 4, DKDV_BLOCK_Q, BLOCK_M, head_dim, DKDV_STAGES, causal,
                REGS, _splits_tile(head_dim))
    return compile_sm90a(fn, args)
