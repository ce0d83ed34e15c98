"""A warp-specialised attention forward for Hopper in Gluon (Triton 3.6-3.9): the route to the overlap that
flash.py's kernel cannot express. flash_forward hands it the launches it covers (`covers`): whole query
tiles (not decode's split programs), one query head per tile, bf16, head_dim 64, 128 and 256, on sm_90 with
a Triton release of gluon_compat.SUPPORTED (the names its releases spell apart come from there).

Per CTA: three (head_dim 64, 128) or two (256) 64-row query tiles of one sequence and head, each on its own
consumer warpgroup, and a 1-warp producer that streams the union of their K/V blocks into rings of shared
buffers by TMA (one ring of K/V stages at head_dim 64, separate K and V rings at 128 and 256: `SHAPES`). A consumer
issues block j's q·kᵀ and block j-1's p·v together and runs block j's softmax while p·v is in flight (FA3's
intra-warpgroup overlap; p goes to the tensor cores straight from registers). In the SASS ptxas moves that softmax
below the wait for p·v (docs/kernels.md), so what overlaps a consumer's softmax is the other warpgroups' MMAs, except
where the wait sits in a basic block of its own (head_dim 256, `SHAPES`). The
per-row arithmetic is flash.py's instruction for instruction and in flash.py's order (its key blocks from the
sequence's first key, exp2 of an explicit fma, p rounded to bf16 before its products, l a product too (p·1, beside
p·v), masks by `where`, acc += p·v then acc *= alpha, the KV-split folds with the same fmas, the same accumulator
layouts), so every row gets flash.py's bits and the decode, packed and chunked paths need not move.

It takes flash.py's sequence tables (padded, left-padded, packed, chunked), reads keys past kv_len as zeros (a
consumer copies a tail block into its Q buffer, free by then), drains the ring for tiles without queries, writes
the LSE, and folds KV splits as flash.py does. The running fold of a tile that spans splits does not fit the
consumers' registers beside their accumulators: it lives in shared memory where that fits (every consumer at
head_dim 64, two of three at 128) and in an fp32 workspace otherwise.

Outputs and LSE equal flash.py's on every table tried; on the H200 (B·S = 16k, 32/8 heads, causal) 8-11% faster
than flash.py at head_dim 128 and 16-26% at 256 (measurements: docs/kernels.md, docs/evidence/README.md).
Scope: bf16, forward only.
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

from rl_engine.kernels.ops.triton.attention import contract, gluon_compat
from rl_engine.kernels.ops.triton.attention.contract import LOG2_E, NO_WINDOW, attention_config, default_scale
from rl_engine.kernels.ops.triton.attention.gluon_compat import async_load

M_INIT = gl.constexpr(-1.0e30)
RESCALE_ABOVE = gl.constexpr(contract.RESCALE_ABOVE.value)
NO_WINDOW_C = gl.constexpr(NO_WINDOW)
BLOCK_M = 64  # rows per consumer warpgroup; keys per block are flash.py's forward BLOCK_N for the head_dim
# head_dim -> (consumer warpgroups, K ring depth, V ring depth, registers per consumer thread, consumers whose running
# fold lives in shared memory, the wait for p·v apart). V ring depth 0: one ring, a block's K and V in one stage,
# released after its p·v, so a consumer holds blocks j-1 and j while the producer fills the next. Else K_j's stage is
# released once its q·kᵀ is done and V_{j-1}'s after its p·v, so the producer refills K a trip earlier: at head_dim 256
# that made 64-key blocks (two 32 KiB stages each) 1.06-1.11x faster than the 32-key blocks of one 4-deep ring, where
# one ring of 64-key blocks was 0.86-0.89x; at 128 1.00-1.06x; at 64 0.94-0.95x, so one ring stays there (same SASS as
# before). consumers x 128 x regs + 128 x 24 <= 64 Ki registers, and the CTA's Q tiles, rings and fold buffers fit
# 227 KiB. Chosen on the H200: at head_dim 128 three consumers beat two (8-10%), and a 2-deep single ring is slower;
# folds through the workspace cost 5-7%, so they stay in shared memory where the buffers fit. At head_dim 64 p is
# rounded two elements at a time (than flash.py 5-6% faster at S >= 4k, 8% slower at 2k); no ring depth or
# consumer count did better.
# The wait for p·v apart, in a basic block of its own: ptxas otherwise hoists it above block j's softmax (it packs
# the new p into the registers the in-flight p·v reads); apart, all 32 exp2s of a block precede it in the SASS. Worth
# it only with two consumers, where no third warpgroup's MMAs cover a softmax: head_dim 256 1.04 / 1.08x at S = 4k /
# 8k, 128 0.96-1.01x, 64 0.94-0.95x (same bits).
SHAPES = {64: (3, 3, 0, 160, 3, False), 128: (3, 3, 3, 160, 2, False), 256: (2, 2, 2, 240, 0, True)}
# l_acc: a consumer's [64, 16] fp32 tile of p·1 (8 registers a thread), each column the row's l.
L_LAYOUT = gl.constexpr(gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, 16, 16]))


@gluon.jit
def _producer(desc_k, desc_v, k_bufs, v_bufs, kv_ready, kv_empty, k_row0, kv_col, glo, ghi,
              BLOCK_N: gl.constexpr, STAGES: gl.constexpr, V_STAGES: gl.constexpr = 0):
    """K/V blocks [glo, ghi) into the ring(s) (V_STAGES = 0: one ring, as the dQ kernel also streams them)."""
    if V_STAGES == 0:  # one ring: a block's K and V in one stage
        for j in range(glo, ghi):
            t = j - glo
            s = t % STAGES
            mbarrier.wait(kv_empty.index(s), ((t // STAGES) & 1) ^ 1)  # a fresh barrier passes parity 1
            ready = kv_ready.index(s)
            mbarrier.expect(ready, desc_k.block_type.nbytes + desc_v.block_type.nbytes)
            async_load(desc_k, [k_row0 + j * BLOCK_N, kv_col], ready, k_bufs.index(s))
            async_load(desc_v, [k_row0 + j * BLOCK_N, kv_col], ready, v_bufs.index(s))
    else:  # K_j before V_{j-1}, which its consumers read after K_j
        for j in range(glo, ghi + 1):
            if j < ghi:
                t = j - glo
                s = t % STAGES
                mbarrier.wait(kv_empty.index(s), ((t // STAGES) & 1) ^ 1)
                mbarrier.expect(kv_ready.index(s), desc_k.block_type.nbytes)
                async_load(desc_k, [k_row0 + j * BLOCK_N, kv_col], kv_ready.index(s),
                                                k_bufs.index(s))
            if j > glo:
                buf, bar, parity = _v_stage(j - 1 - glo, STAGES, V_STAGES)
                mbarrier.wait(kv_empty.index(bar), parity ^ 1)
                mbarrier.expect(kv_ready.index(bar), desc_v.block_type.nbytes)
                async_load(desc_v, [k_row0 + (j - 1) * BLOCK_N, kv_col], kv_ready.index(bar),
                                                v_bufs.index(buf))


@gluon.jit
def _v_stage(t, STAGES: gl.constexpr, V_STAGES: gl.constexpr):
    """Ring block t's V: its buffer, the index of its ready / empty barriers and their parity. With one ring
    (V_STAGES = 0) that is K's stage; else V's own ring, whose barriers follow K's."""
    buf = t % STAGES
    bar = t % STAGES
    parity = (t // STAGES) & 1
    if V_STAGES > 0:
        buf = t % V_STAGES
        bar = STAGES + t % V_STAGES
        parity = (t // V_STAGES) & 1
    return buf, bar, parity


@gluon.jit
def _to_bf16(x):
    """x.to(bf16) (round to nearest even), two elements per instruction: cvt.rn.bf16x2.f32, one F2FP on the ALU.
    Triton 3.6 converted p one element at a time (F2F, on the MUFU pipe beside the exp2s) while l summed p back in
    fp32; with l a product it packs the conversion itself, but in this layout with ~100 more PRMTs per kernel than
    this instruction's (sm_90a SASS, head_dim 128; flash.py's kernel compiles the same either way)."""
    return gl.inline_asm_elementwise("cvt.rn.bf16x2.f32 $0, $2, $1;", "=r,f,f", [x], dtype=gl.bfloat16, is_pure=True,
                                     pack=2)


@gluon.jit
def _softmax_block(qk, m, j, q_pos, k_base, kv_len, window, qk_scale, BLOCK_N: gl.constexpr, MASKED: gl.constexpr,
                   CAUSAL: gl.constexpr):
    """flash.py's `_online_softmax_block` up to its products (p·v and l's p·1), on the wgmma accumulator layout;
    a masked block's visibility is `_masked_kv_block`'s."""
    if MASKED:
        k_pos = j * BLOCK_N + k_base
        visible = gl.expand_dims(k_pos < kv_len, 0) & (gl.expand_dims(k_pos, 0) > gl.expand_dims(q_pos - window, 1))
        if CAUSAL:
            visible = visible & (gl.expand_dims(k_pos, 0) <= gl.expand_dims(q_pos, 1))
        qk = gl.where(visible, qk, float("-inf"))
    m_max = gl.maximum(m, gl.max(qk, 1) * qk_scale)
    m_new = gl.where(m_max - m > RESCALE_ABOVE, m_max, m)  # flash.py's `_lazy_max`
    alpha = gl.exp2(m - m_new)
    p_v = _to_bf16(gl.exp2(gl.fma(qk, qk_scale, -gl.expand_dims(m_new, 1))))
    return m_new, p_v, alpha


@triton.constexpr_function
def _rescale_asm(n):
    """PTX for n accumulator elements of one thread ($0..: outputs, tied to the inputs $n..; $2n..: each element's
    alpha; $3n: the thread's flag): x·alpha, branched around when the flag is 0."""
    muls = "".join(f"mul.f32 ${i}, ${n + i}, ${2 * n + i};" for i in range(n))
    return f"{{ .reg .pred keep; setp.eq.f32 keep, ${3 * n}, 0f00000000; @keep bra DONE; {muls} DONE: }}"


@triton.constexpr_function
def _rescale_constraints(n):
    return ",".join(["=f"] * n + [str(i) for i in range(n)] + ["f"] * (2 * n))


@gluon.jit
def _moved(alpha):
    """1.0 for both rows a thread holds of a row vector (rows r and r + 8 of the wgmma layout) where either
    row's alpha is not 1, else 0.0: one flag a thread, whatever the order of its accumulator elements."""
    return gl.inline_asm_elementwise(
        "{ .reg .pred a, b; setp.neu.f32 a, $2, 0f3F800000; setp.neu.f32 b, $3, 0f3F800000; or.pred a, a, b; "
        "selp.f32 $0, 0f3F800000, 0f00000000, a; mov.f32 $1, $0; }",
        "=f,=f,f,f", [alpha], dtype=gl.float32, is_pure=True, pack=2)


@gluon.jit
def _rescaled(acc, alpha, o_layout: gl.constexpr):
    """acc · alpha (a row vector), the 64 FMULs a thread (head_dim 128) skipped where its rows' alpha is 1: with
    flash.py's lazy max that is almost every block after a split's first (x·1 = x, the same bits)."""
    row_o: gl.constexpr = gl.SliceLayout(1, o_layout)
    a = gl.expand_dims(gl.convert_layout(alpha, row_o, assert_trivial=True), 1)
    moved = gl.expand_dims(gl.convert_layout(_moved(alpha), row_o, assert_trivial=True), 1)
    n: gl.constexpr = acc.shape[1] // 2  # a thread's elements of a 64-row tile on 128 threads
    return gl.inline_asm_elementwise(_rescale_asm(n), _rescale_constraints(n), [acc, a, moved], dtype=gl.float32,
                                     is_pure=True, pack=n)


@gluon.jit
def _l_rows(l_acc, row_s: gl.constexpr):
    """flash.py's `_l_rows` in row_s: the rows' l from l_acc (its columns are equal: the max of them is any of them)."""
    return gl.convert_layout(gl.max(l_acc, 1), row_s)


@gluon.jit
def _merge_split(m_t, l_t, acc_t, m, l, acc, row_o: gl.constexpr):
    """flash.py's `_merge_split`: (m_t, l_t, acc_t) ⊕ (m, l, acc) with the same explicit fmas."""
    m_new = gl.maximum(m_t, m)
    a_t = gl.exp2(m_t - m_new)
    a = gl.exp2(m - m_new)
    l_new = gl.fma(l, a, l_t * a_t)
    acc_new = gl.fma(acc, gl.expand_dims(gl.convert_layout(a, row_o, assert_trivial=True), 1),
                     acc_t * gl.expand_dims(gl.convert_layout(a_t, row_o, assert_trivial=True), 1))
    return m_new, l_new, acc_new


@gluon.jit
def _drain(kv_ready, kv_empty, first, last, glo, STAGES: gl.constexpr, V_STAGES: gl.constexpr = 0):
    """Release ring blocks [first, last) this consumer does not read: each stage needs every consumer's
    release before the producer refills it, and a release must follow that block's arrival."""
    for j in range(first, last):
        t = j - glo
        mbarrier.wait(kv_ready.index(t % STAGES), (t // STAGES) & 1)
        mbarrier.arrive(kv_empty.index(t % STAGES), count=1)
        if V_STAGES > 0:
            _, bar, parity = _v_stage(t, STAGES, V_STAGES)
            mbarrier.wait(kv_ready.index(bar), parity)
            mbarrier.arrive(kv_empty.index(bar), count=1)


@gluon.jit
def _last_product(a_op, bufs, tail, acc, kv_ready, kv_empty, hi_b, glo, kv_len, BLOCK_N: gl.constexpr,
                  STAGES: gl.constexpr, V_STAGES: gl.constexpr = 0):
    """acc += a_op · (the tile's last block's V, or K for dQ, hi_b - 1), then its ring slot released. Keys past
    kv_len (a neighbour's rows) are read as zeros, as in flash.py, through the consumer's own copy `tail`. It waits
    for every product in flight, a caller's earlier ones too."""
    layout: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [4, 1], [1, 0])
    j = hi_b - 1
    s, bar, parity = _v_stage(j - glo, STAGES, V_STAGES)
    if V_STAGES > 0:  # with one ring, waited for with the block's K
        mbarrier.wait(kv_ready.index(bar), parity)
    if hi_b * BLOCK_N > kv_len:
        b = bufs.index(s).load(layout)
        k_rows = j * BLOCK_N + gl.arange(0, BLOCK_N, gl.SliceLayout(1, layout))
        tail.store(gl.where(gl.expand_dims(k_rows < kv_len, 1), b, 0.0))
        fence_async_shared()
        acc = warpgroup_mma(a_op, tail, acc, is_async=True)
        acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc, ))
    else:
        acc = warpgroup_mma(a_op, bufs.index(s), acc, is_async=True)
        acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc, ))
    mbarrier.arrive(kv_empty.index(bar), count=1)
    return acc


@gluon.jit
def _fold(T_M, T_L, t_ptr, t_smem, ml_smem, rows_s, rows_ok_s, rows_ok_o, head, stride_lr, has_t, m, l, acc,
          row_s: gl.constexpr, o_layout: gl.constexpr, T_SMEM: gl.constexpr):
    """The running fold ⊕ this split's state, as flash.py folds every split, the first into a fresh state
    (not quite the identity: fma(-0, 1, 0) is +0). A fresh state's products are formed per row
    (0·a_t is the same for every column), so no second accumulator lives in registers for it. The running fold
    lives in the consumer's shared buffers (T_SMEM) or in the fp32 workspace T_M / T_L / T_ACC."""
    row_o: gl.constexpr = gl.SliceLayout(1, o_layout)
    if has_t:
        if T_SMEM:
            m_t = ml_smem.slice(0, m.shape[0]).load(row_s)
            l_t = ml_smem.slice(m.shape[0], m.shape[0]).load(row_s)
            acc_t = t_smem.load(o_layout)
        else:
            m_t = gl.load(T_M + rows_s * stride_lr + head, mask=rows_ok_s)
            l_t = gl.load(T_L + rows_s * stride_lr + head, mask=rows_ok_s)
            acc_t = gl.load(t_ptr, mask=gl.expand_dims(rows_ok_o, 1))
        m, l, acc = _merge_split(m_t, l_t, acc_t, m, l, acc, row_o)
    else:
        m_new = gl.maximum(gl.full(m.shape, M_INIT, gl.float32, row_s), m)
        a_t = gl.exp2(M_INIT - m_new)
        a = gl.exp2(m - m_new)
        zero_t = gl.full(l.shape, 0.0, gl.float32, row_s) * a_t
        l = gl.fma(l, a, zero_t)
        acc = gl.fma(acc, gl.expand_dims(gl.convert_layout(a, row_o, assert_trivial=True), 1),
                     gl.expand_dims(gl.convert_layout(zero_t, row_o, assert_trivial=True), 1))
        m = m_new
    return m, l, acc


@gluon.jit
def _keep_fold(T_M, T_L, t_ptr, t_smem, ml_smem, rows_s, rows_ok_s, rows_ok_o, head, stride_lr, m, l, acc,
               T_SMEM: gl.constexpr):
    """The running fold stored where `_fold` reads it."""
    if T_SMEM:
        ml_smem.slice(0, m.shape[0]).store(m)  # [m | l]
        ml_smem.slice(m.shape[0], m.shape[0]).store(l)
        t_smem.store(acc)
    else:
        gl.store(T_M + rows_s * stride_lr + head, m, mask=rows_ok_s)
        gl.store(T_L + rows_s * stride_lr + head, l, mask=rows_ok_s)
        gl.store(t_ptr, acc, mask=gl.expand_dims(rows_ok_o, 1))


@gluon.jit
def _step(p_prev, m, l_acc, acc, has_t, j, q_smem, k_bufs, v_bufs, ones, kv_ready, kv_empty, T_M, T_L, t_ptr, t_smem,
          ml_smem, rows_s, rows_ok_s, rows_ok_o, head, stride_lr, q_pos, k_base, kv_len, window, qk_scale, s_zero, glo,
          BLOCK_N: gl.constexpr, STAGES: gl.constexpr, V_STAGES: gl.constexpr, KV_SPLIT: gl.constexpr,
          MASKED: gl.constexpr, CAUSAL: gl.constexpr, s_layout: gl.constexpr, o_layout: gl.constexpr,
          T_SMEM: gl.constexpr, WAIT_APART: gl.constexpr):
    """Key block j (not the tile's first): its q·kᵀ and block j-1's p·v and p·1 issued together, block j's
    softmax run while they are in flight (FA3's intra-warpgroup overlap), then acc and l rescaled. The operations
    on a row are flash.py's in flash.py's order: acc += p_{j-1}·v_{j-1}, then acc *= alpha_j (l alike: l_acc
    holds the row's l in each of its 16 columns). When block j-1 ended a split, block j's softmax starts from a
    fresh state and the finished split is folded into the running fold (`_fold`, `_keep_fold`)."""
    p_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=2)
    row_s: gl.constexpr = gl.SliceLayout(1, s_layout)
    t = j - glo
    s = t % STAGES
    prv, prv_bar, prv_parity = _v_stage(t - 1, STAGES, V_STAGES)
    mbarrier.wait(kv_ready.index(s), (t // STAGES) & 1)
    if V_STAGES > 0:
        mbarrier.wait(kv_ready.index(prv_bar), prv_parity)
    qk = warpgroup_mma(q_smem, k_bufs.index(s).permute((1, 0)), s_zero, use_acc=False, is_async=True)
    acc = warpgroup_mma(p_prev, v_bufs.index(prv), acc, is_async=True)
    l_acc = warpgroup_mma(p_prev, ones, l_acc, is_async=True)
    qk = warpgroup_mma_wait(num_outstanding=2, deps=(qk, ))
    if V_STAGES > 0:  # K_j is read
        mbarrier.arrive(kv_empty.index(s), count=1)
    fresh = ((j * BLOCK_N) % KV_SPLIT) == 0
    m_in = gl.where(fresh, gl.full(m.shape, M_INIT, gl.float32, row_s), m)
    m_new, p_v, alpha = _softmax_block(qk, m_in, j, q_pos, k_base, kv_len, window, qk_scale, BLOCK_N, MASKED, CAUSAL)
    if WAIT_APART:  # kv_len >= 0 always: the wait in a basic block of its own, which ptxas leaves below the softmax
        if kv_len >= 0:
            acc_w, l_w, p_w = warpgroup_mma_wait(num_outstanding=0, deps=(acc, l_acc, p_prev))
        else:
            acc_w, l_w = warpgroup_mma_wait(num_outstanding=0, deps=(acc, l_acc))
            p_w = p_prev
        acc, l_acc, p_prev = acc_w, l_w, p_w
    else:
        acc, l_acc, p_prev = warpgroup_mma_wait(num_outstanding=0, deps=(acc, l_acc, p_prev))
    mbarrier.arrive(kv_empty.index(prv_bar), count=1)  # V_{j-1} is read (with one ring, its K too)
    if fresh:  # block j-1 ended a split: fold it, this block starts the next
        m_t, l_t, acc_t = _fold(T_M, T_L, t_ptr, t_smem, ml_smem, rows_s, rows_ok_s, rows_ok_o, head, stride_lr,
                                has_t, m, _l_rows(l_acc, row_s), acc, row_s, o_layout, T_SMEM)
        _keep_fold(T_M, T_L, t_ptr, t_smem, ml_smem, rows_s, rows_ok_s, rows_ok_o, head, stride_lr, m_t, l_t, acc_t,
                   T_SMEM)
        has_t = 1
        acc = gl.zeros_like(acc)
        l_acc = gl.zeros_like(l_acc)
    acc = _rescaled(acc, alpha, o_layout)
    l_acc = l_acc * gl.expand_dims(gl.convert_layout(alpha, gl.SliceLayout(1, L_LAYOUT), assert_trivial=True), 1)
    return m_new, l_acc, acc, gl.convert_layout(p_v, p_layout, assert_trivial=True), has_t


@gluon.jit
def _consumer(q_smem, q_bar, k_bufs, v_bufs, ones, t_smem, ml_smem, kv_ready, kv_empty, O, LSE, T_M, T_L, T_ACC,
              stride_or, stride_oh, stride_lr, stride_tr, stride_th, qk_scale, head, q_row0, q_count, q_pos0,
              first_q, kv_len, window, lo_b, mid_b, hi_b, glo, ghi,
              BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, HEAD_DIM: gl.constexpr, STAGES: gl.constexpr,
              V_STAGES: gl.constexpr, CAUSAL: gl.constexpr, KV_SPLIT: gl.constexpr, T_SMEM: gl.constexpr,
              WAIT_APART: gl.constexpr):
    """One 64-row query tile on one warpgroup: key blocks [lo_b, mid_b) unmasked, [mid_b, hi_b) masked,
    each block's softmax overlapping the previous block's p·v (`_step`); the other blocks of the CTA's ring
    drained. A split's state is folded into the tile's running fold (in t_smem / ml_smem when T_SMEM, else in
    T_M / T_L / T_ACC) when more blocks follow."""
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                       instr_shape=[16, BLOCK_N, 16])
    o_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                       instr_shape=[16, HEAD_DIM, 16])
    p_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=2)
    row_s: gl.constexpr = gl.SliceLayout(1, s_layout)
    row_o: gl.constexpr = gl.SliceLayout(1, o_layout)
    mbarrier.wait(q_bar, 0)  # also for a tile without work: no copy may be in flight when the CTA exits
    _drain(kv_ready, kv_empty, glo, lo_b, glo, STAGES, V_STAGES)
    if hi_b > lo_b:
        m = gl.full([BLOCK_M], M_INIT, gl.float32, row_s)
        l_acc = gl.zeros([BLOCK_M, 16], gl.float32, L_LAYOUT)
        acc = gl.zeros([BLOCK_M, HEAD_DIM], gl.float32, o_layout)
        s_zero = gl.zeros([BLOCK_M, BLOCK_N], gl.float32, s_layout)
        q_idx = first_q + gl.arange(0, BLOCK_M, row_s)
        q_pos = q_pos0 + q_idx
        k_base = gl.arange(0, BLOCK_N, gl.SliceLayout(0, s_layout))
        rows_o = (q_row0 + first_q + gl.arange(0, BLOCK_M, row_o)).to(gl.int64)
        q_idx_o = first_q + gl.arange(0, BLOCK_M, row_o)
        rows_ok_o = (q_idx_o >= 0) & (q_idx_o < q_count)
        d = gl.arange(0, HEAD_DIM, gl.SliceLayout(0, o_layout))
        t_ptr = T_ACC + gl.expand_dims(rows_o * stride_tr + head * stride_th, 1) + gl.expand_dims(d, 0)
        rows_s = (q_row0 + q_idx).to(gl.int64)
        rows_ok_s = (q_idx >= 0) & (q_idx < q_count)
        has_t = gl.to_tensor(0)
        # block lo_b: its scores and softmax (a split never starts inside a tile's first block)
        t = lo_b - glo
        mbarrier.wait(kv_ready.index(t % STAGES), (t // STAGES) & 1)
        qk = warpgroup_mma(q_smem, k_bufs.index(t % STAGES).permute((1, 0)), s_zero, use_acc=False, is_async=True)
        qk = warpgroup_mma_wait(num_outstanding=0, deps=(qk, ))
        if V_STAGES > 0:
            mbarrier.arrive(kv_empty.index(t % STAGES), count=1)
        if lo_b < mid_b:
            m, p_v, alpha = _softmax_block(qk, m, lo_b, q_pos, k_base, kv_len, window, qk_scale, BLOCK_N, False,
                                           CAUSAL)
        else:
            m, p_v, alpha = _softmax_block(qk, m, lo_b, q_pos, k_base, kv_len, window, qk_scale, BLOCK_N, True,
                                           CAUSAL)
        acc = acc * gl.expand_dims(gl.convert_layout(alpha, row_o, assert_trivial=True), 1)
        l_acc = l_acc * gl.expand_dims(gl.convert_layout(alpha, gl.SliceLayout(1, L_LAYOUT), assert_trivial=True), 1)
        p_op = gl.convert_layout(p_v, p_layout, assert_trivial=True)
        u = gl.maximum(mid_b, lo_b + 1)
        for j in range(lo_b + 1, u):  # unmasked blocks
            m, l_acc, acc, p_op, has_t = _step(p_op, m, l_acc, acc, has_t, j, q_smem, k_bufs, v_bufs, ones,
                                               kv_ready, kv_empty, T_M, T_L, t_ptr, t_smem, ml_smem, rows_s,
                                               rows_ok_s, rows_ok_o, head, stride_lr, q_pos, k_base, kv_len, window,
                                               qk_scale, s_zero, glo, BLOCK_N, STAGES, V_STAGES, KV_SPLIT, False,
                                               CAUSAL, s_layout, o_layout, T_SMEM, WAIT_APART)
        for j in range(u, hi_b):  # masked blocks
            m, l_acc, acc, p_op, has_t = _step(p_op, m, l_acc, acc, has_t, j, q_smem, k_bufs, v_bufs, ones,
                                               kv_ready, kv_empty, T_M, T_L, t_ptr, t_smem, ml_smem, rows_s,
                                               rows_ok_s, rows_ok_o, head, stride_lr, q_pos, k_base, kv_len, window,
                                               qk_scale, s_zero, glo, BLOCK_N, STAGES, V_STAGES, KV_SPLIT, True, CAUSAL,
                                               s_layout, o_layout, T_SMEM, WAIT_APART)
        l_acc = warpgroup_mma(p_op, ones, l_acc, is_async=True)  # the last block's p·1; done by _last_product's wait
        # its p·v; a tail block goes through the Q buffer, free after the tile's last q·kᵀ
        acc = _last_product(p_op, v_bufs, q_smem.slice(0, BLOCK_N), acc, kv_ready, kv_empty, hi_b, glo, kv_len,
                            BLOCK_N, STAGES, V_STAGES)
        l_acc = warpgroup_mma_wait(num_outstanding=0, deps=(l_acc, ))
        m, l, acc = _fold(T_M, T_L, t_ptr, t_smem, ml_smem, rows_s, rows_ok_s, rows_ok_o, head, stride_lr, has_t,
                          m, _l_rows(l_acc, row_s), acc, row_s, o_layout, T_SMEM)
        l_safe = gl.where(l == 0.0, 1.0, l)
        out = acc / gl.expand_dims(gl.convert_layout(l_safe, row_o, assert_trivial=True), 1)
        o_ptr = O + gl.expand_dims(rows_o * stride_or + head * stride_oh, 1) + gl.expand_dims(d, 0)
        gl.store(o_ptr, out.to(gl.bfloat16), mask=gl.expand_dims(rows_ok_o, 1))
        gl.store(LSE + rows_s * stride_lr + head, m + gl.log2(l_safe), mask=rows_ok_s)
    _drain(kv_ready, kv_empty, gl.maximum(hi_b, lo_b), ghi, glo, STAGES, V_STAGES)


@gluon.jit
def _tile_blocks(q_pos0, first_q, q_count, kv_len, window, CAUSAL: gl.constexpr, BLOCK_M: gl.constexpr,
                 BLOCK_N: gl.constexpr):
    """flash.py's `_key_blocks` in block units for the tile's rows [first_q, first_q + BLOCK_M) that are
    queries (first_q may be negative: CTAs are aligned to the sequence's end): [lo_b, mid_b) unmasked,
    [mid_b, hi_b) masked; an empty range (lo_b = hi_b) for a tile without queries."""
    hi = kv_len
    if CAUSAL:
        hi = gl.minimum(kv_len, q_pos0 + gl.minimum(first_q + BLOCK_M, q_count))
    hi = gl.where((first_q < q_count) & (first_q + BLOCK_M > 0), hi, 0)
    first_q = gl.maximum(first_q, 0)
    lo = (gl.maximum(q_pos0 + first_q - window + 1, 0) // BLOCK_N) * BLOCK_N
    mid = kv_len
    if CAUSAL:
        mid = gl.minimum(mid, q_pos0 + first_q + 1)
    mid = gl.where(window == NO_WINDOW_C, lo + gl.maximum(mid - lo, 0) // BLOCK_N * BLOCK_N, lo)
    mid = gl.minimum(mid, hi)
    lo_b = lo // BLOCK_N
    hi_b = gl.maximum(gl.cdiv(hi, BLOCK_N), lo_b)
    return lo_b, gl.maximum(mid // BLOCK_N, lo_b), hi_b


@gluon.jit
def _sequence(SEQ_INFO):
    """This CTA's row of flash.py's sequence table (program_id(2)): q_row0, q_count, q_pos0, k_row0, kv_len, window."""
    info = SEQ_INFO + gl.program_id(2) * 6
    return (gl.load(info + 0), gl.load(info + 1), gl.load(info + 2), gl.load(info + 3), gl.load(info + 4),
            gl.load(info + 5))


@gluon.jit
def _query_tiles_start(q_count, TILE: gl.constexpr, CAUSAL: gl.constexpr):
    """The first query of this CTA's TILE rows (program_id(0)): the last (heaviest) tiles first, as in flash.py;
    under a causal mask aligned to the sequence's end, so the first CTA may start before the sequence."""
    if CAUSAL:
        first_q = q_count - (gl.program_id(0) + 1) * TILE
    else:
        first_q = (gl.num_programs(0) - 1 - gl.program_id(0)) * TILE
    return first_q


@gluon.jit
def _ring_range(lo0, hi0, lo1, hi1, lo2, hi2):
    """[glo, ghi): the union of the consumers' block ranges, which the ring carries (a range lo = hi adds none)."""
    big: gl.constexpr = 1 << 30
    glo = gl.minimum(gl.minimum(gl.where(hi0 > lo0, lo0, big), gl.where(hi1 > lo1, lo1, big)),
                     gl.where(hi2 > lo2, lo2, big))
    ghi = gl.maximum(gl.maximum(hi0, hi1), hi2)
    return gl.minimum(glo, ghi), ghi


@gluon.jit
def _or_drain(lo, mid, hi, glo):
    """A consumer's ranges, or for a tile without blocks the empty range at glo: it drains the whole ring."""
    some = hi > lo
    return gl.where(some, lo, glo), gl.where(some, mid, glo), gl.where(some, hi, glo)


@gluon.jit
def gluon_forward_kernel(desc_q, desc_k, desc_v, O, LSE, T_M, T_L, T_ACC, SEQ_INFO,
                         stride_or, stride_oh, stride_lr, stride_tr, stride_th, qk_scale, group,
                         BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, HEAD_DIM: gl.constexpr,
                         STAGES: gl.constexpr, V_STAGES: gl.constexpr, CAUSAL: gl.constexpr, KV_SPLIT: gl.constexpr,
                         CONSUMERS: gl.constexpr, REGS: gl.constexpr, T_TILES: gl.constexpr, WAIT_APART: gl.constexpr):
    # grid (cdiv(max q_count, CONSUMERS * 64), Hq, sequences): the last (heaviest) query tiles first, as in
    # flash.py. Under a causal mask CTAs are aligned to the sequence's end, so a CTA with fewer query tiles
    # than consumers is the first, the lightest (a row's bits do not depend on where its tile starts: chunked
    # prefill relies on that too); its rows before the sequence are loaded (zeros or a neighbour's) and
    # never stored. H200: +2% causal, -1..2% without a mask.
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
    k_bufs = gl.allocate_shared_memory(desc_k.dtype, [STAGES] + desc_k.block_type.shape, desc_k.layout)
    if V_STAGES == 0:
        v_bufs = gl.allocate_shared_memory(desc_v.dtype, [STAGES] + desc_v.block_type.shape, desc_v.layout)
    else:
        v_bufs = gl.allocate_shared_memory(desc_v.dtype, [V_STAGES] + desc_v.block_type.shape, desc_v.layout)
    ones = gl.allocate_shared_memory(gl.bfloat16, [BLOCK_N, 16], gl.NVMMASharedLayout.get_default_for([BLOCK_N, 16],
                                     gl.bfloat16), gl.full([BLOCK_N, 16], 1.0, gl.bfloat16,
                                                           gl.BlockedLayout([1, 8], [16, 2], [4, 1], [1, 0])))
    fence_async_shared()  # the consumers' wgmma read it through the async proxy
    q_bars = gl.allocate_shared_memory(gl.int64, [3, 1], mbarrier.MBarrierLayout())
    kv_ready = gl.allocate_shared_memory(gl.int64, [STAGES + V_STAGES, 1], mbarrier.MBarrierLayout())
    kv_empty = gl.allocate_shared_memory(gl.int64, [STAGES + V_STAGES, 1], mbarrier.MBarrierLayout())
    for c in gl.static_range(3):
        mbarrier.init(q_bars.index(c), count=1)
    for s in gl.static_range(STAGES + V_STAGES):
        mbarrier.init(kv_ready.index(s), count=1)
        mbarrier.init(kv_empty.index(s), count=CONSUMERS)  # each consumer releases each stage
    mbarrier.expect(q_bars.index(0), desc_q.block_type.nbytes)
    async_load(desc_q, [q_row0 + first_q, q_col], q_bars.index(0), q0)
    mbarrier.expect(q_bars.index(1), desc_q.block_type.nbytes)
    async_load(desc_q, [q_row0 + first_q + BLOCK_M, q_col], q_bars.index(1), q1)
    if CONSUMERS == 2:  # no shared buffers for the running folds (T_TILES = 0): q0 stands in, never read
        T0, ML0, T1, ML1 = q0, q0, q0, q0
        gl.warp_specialize([
            (_consumer, (q0, q_bars.index(0), k_bufs, v_bufs, ones, T0, ML0, kv_ready, kv_empty, O, LSE, T_M,
                         T_L, T_ACC, stride_or, stride_oh, stride_lr, stride_tr, stride_th, qk_scale, head, q_row0,
                         q_count, q_pos0, first_q, kv_len, window, lo0, mid0, hi0, glo, ghi, BLOCK_M, BLOCK_N, HEAD_DIM,
                         STAGES, V_STAGES, CAUSAL, KV_SPLIT, T_TILES > 0, WAIT_APART)),
            (_consumer, (q1, q_bars.index(1), k_bufs, v_bufs, ones, T1, ML1, kv_ready, kv_empty, O, LSE, T_M,
                         T_L, T_ACC, stride_or, stride_oh, stride_lr, stride_tr, stride_th, qk_scale, head, q_row0,
                         q_count, q_pos0, first_q + BLOCK_M, kv_len, window, lo1, mid1, hi1, glo, ghi, BLOCK_M, BLOCK_N,
                         HEAD_DIM, STAGES, V_STAGES, CAUSAL, KV_SPLIT, T_TILES > 1, WAIT_APART)),
            (_producer, (desc_k, desc_v, k_bufs, v_bufs, kv_ready, kv_empty, k_row0, kv_col, glo, ghi, BLOCK_N,
                         STAGES, V_STAGES)),
        ], [4, 1], [REGS, 24])
    else:
        q2 = gl.allocate_shared_memory(desc_q.dtype, desc_q.block_type.shape, desc_q.layout)
        mbarrier.expect(q_bars.index(2), desc_q.block_type.nbytes)
        async_load(desc_q, [q_row0 + first_q + 2 * BLOCK_M, q_col], q_bars.index(2), q2)
        # the running folds of the last T_TILES consumers in shared memory, the first's (the lightest tile, done a
        # block before the others) in the workspace when T_TILES = 2; rows swizzled by 32-byte groups, so a warp's
        # stores and loads of its accumulator rows are conflict-free
        t_layout: gl.constexpr = gl.SwizzledSharedLayout(8, 1, 8, [1, 0])
        ml_layout: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, [0])  # [m | l]
        if T_TILES == 3:
            T0 = gl.allocate_shared_memory(gl.float32, [BLOCK_M, HEAD_DIM], t_layout)
            ML0 = gl.allocate_shared_memory(gl.float32, [2 * BLOCK_M], ml_layout)
        else:
            T0, ML0 = q0, q0
        T1 = gl.allocate_shared_memory(gl.float32, [BLOCK_M, HEAD_DIM], t_layout)
        ML1 = gl.allocate_shared_memory(gl.float32, [2 * BLOCK_M], ml_layout)
        T2 = gl.allocate_shared_memory(gl.float32, [BLOCK_M, HEAD_DIM], t_layout)
        ML2 = gl.allocate_shared_memory(gl.float32, [2 * BLOCK_M], ml_layout)
        gl.warp_specialize([
            (_consumer, (q0, q_bars.index(0), k_bufs, v_bufs, ones, T0, ML0, kv_ready, kv_empty, O, LSE, T_M,
                         T_L, T_ACC, stride_or, stride_oh, stride_lr, stride_tr, stride_th, qk_scale, head, q_row0,
                         q_count, q_pos0, first_q, kv_len, window, lo0, mid0, hi0, glo, ghi, BLOCK_M, BLOCK_N, HEAD_DIM,
                         STAGES, V_STAGES, CAUSAL, KV_SPLIT, T_TILES > 2, WAIT_APART)),
            (_consumer, (q1, q_bars.index(1), k_bufs, v_bufs, ones, T1, ML1, kv_ready, kv_empty, O, LSE, T_M,
                         T_L, T_ACC, stride_or, stride_oh, stride_lr, stride_tr, stride_th, qk_scale, head, q_row0,
                         q_count, q_pos0, first_q + BLOCK_M, kv_len, window, lo1, mid1, hi1, glo, ghi, BLOCK_M, BLOCK_N,
                         HEAD_DIM, STAGES, V_STAGES, CAUSAL, KV_SPLIT, T_TILES > 1, WAIT_APART)),
            (_consumer, (q2, q_bars.index(2), k_bufs, v_bufs, ones, T2, ML2, kv_ready, kv_empty, O, LSE, T_M,
                         T_L, T_ACC, stride_or, stride_oh, stride_lr, stride_tr, stride_th, qk_scale, head, q_row0,
                         q_count, q_pos0, first_q + 2 * BLOCK_M, kv_len, window, lo2, mid2, hi2, glo, ghi, BLOCK_M,
                         BLOCK_N, HEAD_DIM, STAGES, V_STAGES, CAUSAL, KV_SPLIT, T_TILES > 0, WAIT_APART)),
            (_producer, (desc_k, desc_v, k_bufs, v_bufs, kv_ready, kv_empty, k_row0, kv_col, glo, ghi, BLOCK_N,
                         STAGES, V_STAGES)),
        ], [4, 4, 1], [REGS, REGS, 24])


def routes(dtype: torch.dtype, head_dim: int, capability: tuple[int, int], triton_version: str,
           head_dims=tuple(SHAPES)) -> bool:
    """Whether a launch goes to a Gluon kernel written for `head_dims` (this forward's by default; the
    backward's are gluon_backward.HEAD_DIMS): bf16 on sm_90 under a Triton release whose Gluon API the kernels
    compile under (gluon_compat.SUPPORTED; the API moves between releases)."""
    return (dtype == torch.bfloat16 and head_dim in head_dims and capability == (9, 0)
            and gluon_compat.supported(triton_version))


@functools.cache
def _capability(index: int) -> tuple[int, int]:
    return torch.cuda.get_device_capability(index)


def covers(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, head_dims=tuple(SHAPES)) -> bool:
    """routes(...) for these CUDA rows: by dtype, head_dim and device only, never by layout or alignment, so
    every batch of a run takes the same kernels (whose bits equal flash.py's: the gpu tests check it). The caller
    hands over 16-byte aligned rows (TMA descriptors need them): flash.py copies the others."""
    index = q.device.index if q.device.index is not None else torch.cuda.current_device()
    return (routes(q.dtype, q.shape[2], _capability(index), triton.__version__, head_dims)
            and k.dtype == v.dtype == q.dtype)


def check_rows(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, head_dims=tuple(SHAPES)) -> None:
    """ValueError (one line) for what a kernel written for `head_dims` does not cover: rows [R,H,D] as flash.py
    takes them."""
    if q.dim() != 3 or k.dim() != 3 or k.shape != v.shape:
        raise ValueError(f"q, k, v: expected rows [R,H,D] with k and v alike, got {tuple(q.shape)}, {tuple(k.shape)}, "
                         f"{tuple(v.shape)}")
    if any(t.dtype != torch.bfloat16 or not t.is_contiguous() for t in (q, k, v)):
        raise ValueError("q, k, v: expected contiguous bf16 rows")
    if q.shape[2] not in head_dims or k.shape[2] != q.shape[2] or q.shape[1] % k.shape[1]:
        raise ValueError(f"q, k: expected head_dim {head_dims} and Hq a multiple of Hkv; got {tuple(q.shape)} and "
                         f"{tuple(k.shape)}")


@functools.cache
def _bf16_layout(rows: int, cols: int):
    """The shared layout of a bf16 [rows, cols] TMA box, built once: get_default_for costs 6-7 us of host time a call
    on the H200, and a forward + backward builds 11 descriptors."""
    return gl.NVMMASharedLayout.get_default_for([rows, cols], gl.bfloat16)


def row_descriptor(x: torch.Tensor, block_rows: int):
    """A TMA descriptor of bf16 rows [R, H, D] seen as [R, H·D], in boxes of block_rows rows of one head."""
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    two_d = x.view(x.shape[0], x.shape[1] * x.shape[2])
    return TensorDescriptor(two_d, list(two_d.shape), list(two_d.stride()), [block_rows, x.shape[2]],
                            _bf16_layout(block_rows, x.shape[2]))


def mock_row_descriptor(rows: int, heads: int, head_dim: int):
    """`row_descriptor` of a B·S = 8192-row stand-in with `heads` heads, for the compile-only paths (no GPU)."""
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor
    from triton.runtime.jit import MockTensor

    width = heads * head_dim
    return TensorDescriptor(MockTensor("bfloat16", [8192, width]), [8192, width], [width, 1], [rows, head_dim],
                            _bf16_layout(rows, head_dim))


def gluon_forward(q, k, v, table, *, causal: bool, scale: float | None = None):
    """dispatch.flash_forward's contract for the rows it covers (q [R,Hq,D], k/v [Rk,Hkv,D] bf16 rows, a
    SequenceTable) -> (out [R,Hq,D], lse [R,Hq] fp32 log2); rows no sequence covers are left uninitialised."""
    check_rows(q, k, v)
    rows, hq, d = q.shape
    out = torch.empty_like(q)
    lse = torch.empty((rows, hq), dtype=torch.float32, device=q.device)
    if table.num_sequences == 0 or rows == 0:
        return out, lse
    kv_split = attention_config(q.dtype, d).kv_split
    consumers, stages, v_stages, regs, t_tiles, wait_apart = SHAPES[d]
    if table.max_kv_len > kv_split and t_tiles < consumers:  # the running folds kept out of shared memory
        t_m, t_l = torch.empty_like(lse), torch.empty_like(lse)
        t_acc = torch.empty((rows, hq, d), dtype=torch.float32, device=q.device)
    else:
        t_m = t_l = t_acc = lse  # never read: no tile folds

    block_n = attention_config(q.dtype, d).forward.block_n  # flash.py's key blocks: its bits
    grid = (triton.cdiv(max(table.max_q_count, 1), consumers * BLOCK_M), hq, table.num_sequences)
    gluon_forward_kernel[grid](
        row_descriptor(q, BLOCK_M), row_descriptor(k, block_n), row_descriptor(v, block_n), out, lse, t_m, t_l, t_acc,
        table.info, out.stride(0), out.stride(1), lse.stride(0), t_acc.stride(0) if t_acc.dim() == 3 else 0,
        t_acc.stride(1) if t_acc.dim() == 3 else 0, default_scale(d, scale) * LOG2_E, hq // k.shape[1],
        BLOCK_M, block_n, d, stages, v_stages, causal, kv_split, consumers, regs, t_tiles, wait_apart,
        num_warps=4)
    return out, lse


def compile_sm90a(kernel, args):
    """A Gluon kernel compiled for sm_90a with no GPU present (the interpreter must be off: Gluon has none), bound to
    `args` (stand-in tensors and descriptors) through the launcher's own argument binding, 4 warps."""
    from triton import compile as triton_compile
    from triton.backends.compiler import GPUTarget
    from triton.compiler import make_backend
    from triton.experimental.gluon._runtime import GluonASTSource
    from triton.runtime.jit import create_function_from_signature

    target = GPUTarget("cuda", 90, 32)
    backend = make_backend(target)
    bound, specialization, options = create_function_from_signature(kernel.signature, kernel.params, backend)(
        *args, num_warps=4)
    options, signature, constexprs, attrs = kernel._pack_args(backend, {"num_warps": 4}, bound, specialization,
                                                              options)
    return triton_compile(GluonASTSource(kernel, signature, constexprs, attrs), target=target,
                          options=options.__dict__)


def compile_for_sm90(causal: bool, head_dim: int = 128):
    """The kernel compiled for sm_90a on the CPU (`compile_sm90a`), bound to stand-in tensors of a B·S = 8192,
    32/8-head problem."""
    from triton.runtime.jit import MockTensor

    consumers, stages, v_stages, regs, t_tiles, wait_apart = SHAPES[head_dim]
    block_n = attention_config(torch.bfloat16, head_dim).forward.block_n

    f32 = MockTensor("float32", [8192, 32])
    desc = functools.partial(mock_row_descriptor, head_dim=head_dim)
    args = (desc(BLOCK_M, 32), desc(block_n, 8), desc(block_n, 8), MockTensor("bfloat16", [8192, 32, head_dim]),
            f32, f32, f32, MockTensor("float32", [8192, 32, head_dim]), MockTensor("int32", [4, 6]),
            32 * head_dim, head_dim, 32, 32 * head_dim, head_dim, 0.1, 4,
            BLOCK_M, block_n, head_dim, stages, v_stages, causal, 2048, consumers, regs, t_tiles, wait_apart)
    return compile_sm90a(gluon_forward_kernel, args)
