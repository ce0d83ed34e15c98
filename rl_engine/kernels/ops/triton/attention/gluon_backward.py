"""The attention backward's dQ on Hopper in Gluon (Triton 3.6), warp-specialised as the forward is
(gluon_forward.py): flash_backward runs it, on its side stream, for the launches the Gluon forward covers.

Per CTA: two 64-row query tiles of one sequence and head (Q and dO in shared memory), each on its own
consumer warpgroup, and the forward's 1-warp producer streaming the union of their K/V blocks (64 keys) into
a ring by TMA. A consumer issues block j's s = q·kᵀ and dp = dO·vᵀ together with block j-1's dq += ds·k,
and forms block j's ds while that runs. Per row it is flash.py's `_dq_block`, block after block in the same
order (p = exp2(fma(s, scale·log2 e, -lse)), ds = p·(dp - delta) rounded to bf16, dq accumulated in fp32,
scaled once at the end), so dq should get the Triton kernel's bits; invisible pairs' ds are zeroed with
`where` (not only p), so a NaN in a neighbour's V rows cannot leak in. Keys past kv_len: the tile's last K
block is copied into the consumer's own buffer with those rows zeroed (TMA zero-fills only at the tensor's
edge). NOT YET RUN ON A GPU: `tests/kernels/ops/triton/test_attention_gluon.py`'s gpu tests are the check.
Scope: bf16, head_dim 128.
"""

from __future__ import annotations

import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared,
    mbarrier,
    tma,
    warpgroup_mma,
    warpgroup_mma_wait,
)

from rl_engine.kernels.ops.triton.attention.flash import LOG2_E, attention_config
from rl_engine.kernels.ops.triton.attention.gluon_forward import (
    BLOCK_M,
    _drain,
    _producer,
    _tile_blocks,
    check_rows,
)

CONSUMERS, STAGES, REGS = 2, 4, 240  # a consumer holds block j-1 (its dq product in flight) and block j


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
    k_layout: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [4, 1], [1, 0])
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
        # the last block's dq product
        j = hi_b - 1
        st = (j - glo) % STAGES
        if hi_b * BLOCK_N > kv_len:  # keys past kv_len (a neighbour's rows) read as zeros, as in flash.py
            kb = k_bufs.index(st).load(k_layout)
            k_rows = j * BLOCK_N + gl.arange(0, BLOCK_N, gl.SliceLayout(1, k_layout))
            k_tail.store(gl.where(gl.expand_dims(k_rows < kv_len, 1), kb, 0.0))
            fence_async_shared()
            dq = warpgroup_mma(ds_op, k_tail, dq, is_async=True)
            dq = warpgroup_mma_wait(num_outstanding=0, deps=(dq, ))
        else:
            dq = warpgroup_mma(ds_op, k_bufs.index(st), dq, is_async=True)
            dq = warpgroup_mma_wait(num_outstanding=0, deps=(dq, ))
        mbarrier.arrive(kv_empty.index(st), count=1)
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
                    CAUSAL: gl.constexpr, REGS: gl.constexpr):
    # grid (cdiv(max q_count, 128), Hq, sequences), the heaviest CTAs first; under a causal mask aligned to
    # the sequence's end, as the forward's (a row's dq does not depend on where its tile starts).
    head = gl.program_id(1)
    info = SEQ_INFO + gl.program_id(2) * 6
    q_row0 = gl.load(info + 0)
    q_count = gl.load(info + 1)
    q_pos0 = gl.load(info + 2)
    k_row0 = gl.load(info + 3)
    kv_len = gl.load(info + 4)
    window = gl.load(info + 5)
    if CAUSAL:
        first_q = q_count - (gl.program_id(0) + 1) * 2 * BLOCK_M
    else:
        first_q = (gl.num_programs(0) - 1 - gl.program_id(0)) * 2 * BLOCK_M
    lo0, mid0, hi0 = _tile_blocks(q_pos0, first_q, q_count, kv_len, window, CAUSAL, BLOCK_M, BLOCK_N)
    lo1, mid1, hi1 = _tile_blocks(q_pos0, first_q + BLOCK_M, q_count, kv_len, window, CAUSAL, BLOCK_M, BLOCK_N)
    big: gl.constexpr = 1 << 30
    glo = gl.minimum(gl.where(hi0 > lo0, lo0, big), gl.where(hi1 > lo1, lo1, big))
    ghi = gl.maximum(hi0, hi1)
    glo = gl.minimum(glo, ghi)
    lo0, mid0, hi0 = gl.where(hi0 > lo0, lo0, glo), gl.where(hi0 > lo0, mid0, glo), gl.where(hi0 > lo0, hi0, glo)
    lo1, mid1, hi1 = gl.where(hi1 > lo1, lo1, glo), gl.where(hi1 > lo1, mid1, glo), gl.where(hi1 > lo1, hi1, glo)
    q_col = head * HEAD_DIM
    kv_col = (head // group) * HEAD_DIM

    q0 = gl.allocate_shared_memory(desc_q.dtype, desc_q.block_type.shape, desc_q.layout)
    q1 = gl.allocate_shared_memory(desc_q.dtype, desc_q.block_type.shape, desc_q.layout)
    do0 = gl.allocate_shared_memory(desc_do.dtype, desc_do.block_type.shape, desc_do.layout)
    do1 = gl.allocate_shared_memory(desc_do.dtype, desc_do.block_type.shape, desc_do.layout)
    k_bufs = gl.allocate_shared_memory(desc_k.dtype, [STAGES] + desc_k.block_type.shape, desc_k.layout)
    v_bufs = gl.allocate_shared_memory(desc_v.dtype, [STAGES] + desc_v.block_type.shape, desc_v.layout)
    k_tails = gl.allocate_shared_memory(desc_k.dtype, [2] + desc_k.block_type.shape, desc_k.layout)
    q_bars = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    kv_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    kv_empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for c in gl.static_range(2):
        mbarrier.init(q_bars.index(c), count=1)
    for s in gl.static_range(STAGES):
        mbarrier.init(kv_ready.index(s), count=1)
        mbarrier.init(kv_empty.index(s), count=2)  # each consumer releases each stage
    nbytes: gl.constexpr = desc_q.block_type.nbytes + desc_do.block_type.nbytes
    mbarrier.expect(q_bars.index(0), nbytes)
    tma.async_copy_global_to_shared(desc_q, [q_row0 + first_q, q_col], q_bars.index(0), q0)
    tma.async_copy_global_to_shared(desc_do, [q_row0 + first_q, q_col], q_bars.index(0), do0)
    mbarrier.expect(q_bars.index(1), nbytes)
    tma.async_copy_global_to_shared(desc_q, [q_row0 + first_q + BLOCK_M, q_col], q_bars.index(1), q1)
    tma.async_copy_global_to_shared(desc_do, [q_row0 + first_q + BLOCK_M, q_col], q_bars.index(1), do1)
    gl.warp_specialize([
        (_dq_consumer, (q0, do0, q_bars.index(0), k_bufs, v_bufs, k_tails.index(0), kv_ready, kv_empty, DQ, LSE,
                        DELTA, stride_qr, stride_qh, stride_lr, qk_scale, scale, head, q_row0, q_count, q_pos0,
                        first_q, kv_len, window, lo0, mid0, hi0, glo, ghi,
                        BLOCK_M, BLOCK_N, HEAD_DIM, STAGES, CAUSAL)),
        (_dq_consumer, (q1, do1, q_bars.index(1), k_bufs, v_bufs, k_tails.index(1), kv_ready, kv_empty, DQ, LSE,
                        DELTA, stride_qr, stride_qh, stride_lr, qk_scale, scale, head, q_row0, q_count, q_pos0,
                        first_q + BLOCK_M, kv_len, window, lo1, mid1, hi1, glo, ghi,
                        BLOCK_M, BLOCK_N, HEAD_DIM, STAGES, CAUSAL)),
        (_producer, (desc_k, desc_v, k_bufs, v_bufs, kv_ready, kv_empty, k_row0, kv_col, glo, ghi, BLOCK_N, STAGES)),
    ], [4, 1], [REGS, 24])


def _descriptor(x, block_rows):
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    two_d = x.view(x.shape[0], x.shape[1] * x.shape[2])
    block = [block_rows, x.shape[2]]
    return TensorDescriptor(two_d, list(two_d.shape), list(two_d.stride()), block,
                            gl.NVMMASharedLayout.get_default_for(block, gl.bfloat16))


def gluon_dq(do, q, k, v, lse, delta, table, *, causal: bool, scale: float, out=None) -> torch.Tensor:
    """flash.py's dQ kernel's contract (dO, q [R,Hq,D]; k, v [Rk,Hkv,D] bf16 rows; lse, delta [R,Hq] fp32; a
    SequenceTable) -> dq [R,Hq,D], written into `out` when given (flash_backward allocates it on its own
    stream, before the side stream runs this); rows no sequence covers are left as they were."""
    check_rows(q, k, v)
    if do.shape != q.shape or not do.is_contiguous() or do.dtype != q.dtype:
        raise ValueError(f"do: expected contiguous {q.dtype} rows {tuple(q.shape)}, got {tuple(do.shape)}")
    rows, hq, d = q.shape
    dq = torch.empty_like(q) if out is None else out
    if table.num_sequences == 0 or rows == 0:
        return dq
    block_n = attention_config(q.dtype, d).backward_dq.block_n
    grid = (triton.cdiv(max(table.max_q_count, 1), CONSUMERS * BLOCK_M), hq, table.num_sequences)
    gluon_dq_kernel[grid](
        _descriptor(q, BLOCK_M), _descriptor(do, BLOCK_M), _descriptor(k, block_n), _descriptor(v, block_n),
        dq, lse, delta, table.info, dq.stride(0), dq.stride(1), lse.stride(0), scale * LOG2_E, scale,
        hq // k.shape[1], BLOCK_M, block_n, d, STAGES, causal, REGS, num_warps=4)
    return dq


def compile_for_sm90(causal: bool, head_dim: int = 128):
    """The kernel compiled for sm_90a with no GPU present, bound to stand-ins of a B·S = 8192, 32/8-head problem."""
    from triton import compile as triton_compile
    from triton.backends.compiler import GPUTarget
    from triton.compiler import make_backend
    from triton.experimental.gluon._runtime import GluonASTSource
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor
    from triton.runtime.jit import MockTensor, create_function_from_signature

    target = GPUTarget("cuda", 90, 32)
    backend = make_backend(target)
    block_n = attention_config(torch.bfloat16, head_dim).backward_dq.block_n

    def desc(rows, heads):
        t = MockTensor("bfloat16", [8192, heads * head_dim])
        block = [rows, head_dim]
        return TensorDescriptor(t, [8192, heads * head_dim], [heads * head_dim, 1], block,
                                gl.NVMMASharedLayout.get_default_for(block, gl.bfloat16))

    kernel = gluon_dq_kernel
    f32 = MockTensor("float32", [8192, 32])
    args = (desc(BLOCK_M, 32), desc(BLOCK_M, 32), desc(block_n, 8), desc(block_n, 8),
            MockTensor("bfloat16", [8192, 32, head_dim]), f32, f32, MockTensor("int32", [4, 6]),
            32 * head_dim, head_dim, 32, 0.1, 0.1, 4, BLOCK_M, block_n, head_dim, STAGES, causal, REGS)
    bound, specialization, options = create_function_from_signature(kernel.signature, kernel.params, backend)(
        *args, num_warps=4)
    options, signature, constexprs, attrs = kernel._pack_args(backend, {"num_warps": 4}, bound, specialization,
                                                              options)
    return triton_compile(GluonASTSource(kernel, signature, constexprs, attrs), target=target,
                          options=options.__dict__)
