"""A warp-specialised attention forward for Hopper in Gluon (Triton 3.6): the route to the overlap that
flash.py's kernel cannot express. EXPERIMENTAL: not routed; nothing calls it but its tests and probes.

Per CTA: three 64-row query tiles of one head, each on its own consumer warpgroup, and a 1-warp producer
that streams the head's K/V blocks (64 keys) into a ring of shared buffers by TMA. A consumer issues the
next block's q·kᵀ on the tensor cores before this block's softmax, and p·v takes p straight from
registers; while one warpgroup runs its softmax the others' MMAs run. The per-row arithmetic is
flash.py's instruction for instruction (64-key blocks, exp2 with an explicit fma, p rounded to the
value dtype before its row sum and its product, the scale folded into the exp2's fma, the same
accumulator layouts), so a row gets the bits of `triton_attention` while its keys fit one KV split
(H200: equal bits at S = 1536, causal and not, `docs/evidence/h200_probe_gluon_attention_1bccfca.log`).

Scope today: [B,S,H,D] bf16, head_dim 128, S a multiple of 192, one KV split (S <= kv_split), no
padding, no packing, no LSE (forward only). What routing it needs: the split folds, sequence tables
(packed and padded rows, masked tails that load zeros), the LSE for the backward, other head sizes.
"""

from __future__ import annotations

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared,
    mbarrier,
    tma,
    warpgroup_mma,
    warpgroup_mma_wait,
)

from rl_engine.kernels.ops.triton.attention.flash import LOG2_E, attention_config, default_scale

M_INIT = gl.constexpr(-1.0e30)
BLOCK_M, BLOCK_N, HEAD_DIM = 64, 64, 128  # rows per consumer, keys per block: flash.py's bf16 forward tile
CONSUMERS = 3
CTA_ROWS = CONSUMERS * BLOCK_M
STAGES = 3  # K/V ring depth: the next block's q·kᵀ holds one more stage than the walk
CONSUMER_REGS = 160  # 3 x 128 threads x 160 + 128 x 24 <= 64 Ki registers


@gluon.jit
def _producer(desc_k, desc_v, k_bufs, v_bufs, kv_ready, kv_empty, kv_row0, kv_col, n_blocks,
              BLOCK_N: gl.constexpr, STAGES: gl.constexpr):
    for i in range(n_blocks):
        s = i % STAGES
        mbarrier.wait(kv_empty.index(s), ((i // STAGES) & 1) ^ 1)  # a fresh barrier passes parity 1
        ready = kv_ready.index(s)
        mbarrier.expect(ready, desc_k.block_type.nbytes + desc_v.block_type.nbytes)
        tma.async_copy_global_to_shared(desc_k, [kv_row0 + i * BLOCK_N, kv_col], ready, k_bufs.index(s))
        tma.async_copy_global_to_shared(desc_v, [kv_row0 + i * BLOCK_N, kv_col], ready, v_bufs.index(s))


@gluon.jit
def _softmax_block(qk, m, l, i, q_pos, k_base, qk_scale, BLOCK_N: gl.constexpr, MASKED: gl.constexpr):
    """flash.py's `_online_softmax_block` up to the p·v product, on the wgmma accumulator layout."""
    if MASKED:
        k_pos = i * BLOCK_N + k_base
        qk = gl.where(gl.expand_dims(k_pos, 0) <= gl.expand_dims(q_pos, 1), qk, float("-inf"))
    m_new = gl.maximum(m, gl.max(qk, 1) * qk_scale)
    alpha = gl.exp2(m - m_new)
    p_v = gl.exp2(gl.fma(qk, qk_scale, -gl.expand_dims(m_new, 1))).to(gl.bfloat16)
    l = l * alpha + gl.sum(p_v.to(gl.float32), 1)
    return m_new, l, p_v, alpha


@gluon.jit
def _consumer(desc_o, q_smem, q_bar, k_bufs, v_bufs, kv_ready, kv_empty, qk_scale, q_row0, q_col, q_pos0, n_blocks,
              BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, HEAD_DIM: gl.constexpr, STAGES: gl.constexpr,
              CAUSAL: gl.constexpr):
    """One 64-row query tile on one warpgroup. With 64-row tiles and 64-key blocks only a causal tile's
    last block is masked; the last block is peeled. Q's buffer holds the output at the end."""
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                       instr_shape=[16, BLOCK_N, 16])
    o_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                       instr_shape=[16, HEAD_DIM, 16])
    p_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=2)
    row_o: gl.constexpr = gl.SliceLayout(1, o_layout)
    m = gl.full([BLOCK_M], M_INIT, gl.float32, gl.SliceLayout(1, s_layout))
    l = gl.full([BLOCK_M], 0.0, gl.float32, gl.SliceLayout(1, s_layout))
    acc = gl.zeros([BLOCK_M, HEAD_DIM], gl.float32, o_layout)
    s_zero = gl.zeros([BLOCK_M, BLOCK_N], gl.float32, s_layout)
    q_pos = q_pos0 + gl.arange(0, BLOCK_M, gl.SliceLayout(1, s_layout))
    k_base = gl.arange(0, BLOCK_N, gl.SliceLayout(0, s_layout))

    mbarrier.wait(q_bar, 0)
    mbarrier.wait(kv_ready.index(0), 0)
    qk = warpgroup_mma(q_smem, k_bufs.index(0).permute((1, 0)), s_zero, use_acc=False, is_async=True)
    qk = warpgroup_mma_wait(num_outstanding=0, deps=(qk, ))
    for i in range(n_blocks - 1):
        s = i % STAGES
        nxt = (i + 1) % STAGES
        # The next block's scores go to the tensor cores before this block's softmax.
        mbarrier.wait(kv_ready.index(nxt), ((i + 1) // STAGES) & 1)
        qk_next = warpgroup_mma(q_smem, k_bufs.index(nxt).permute((1, 0)), s_zero, use_acc=False, is_async=True)
        m, l, p_v, alpha = _softmax_block(qk, m, l, i, q_pos, k_base, qk_scale, BLOCK_N, False)
        acc = acc * gl.expand_dims(gl.convert_layout(alpha, row_o, assert_trivial=True), 1)
        acc = warpgroup_mma(gl.convert_layout(p_v, p_layout, assert_trivial=True), v_bufs.index(s), acc,
                            is_async=True)
        qk = warpgroup_mma_wait(num_outstanding=1, deps=(qk_next, ))
        acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc, ))
        mbarrier.arrive(kv_empty.index(s), count=1)
    i = n_blocks - 1
    s = i % STAGES
    m, l, p_v, alpha = _softmax_block(qk, m, l, i, q_pos, k_base, qk_scale, BLOCK_N, CAUSAL)
    acc = acc * gl.expand_dims(gl.convert_layout(alpha, row_o, assert_trivial=True), 1)
    acc = warpgroup_mma(gl.convert_layout(p_v, p_layout, assert_trivial=True), v_bufs.index(s), acc, is_async=True)
    acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc, ))
    mbarrier.arrive(kv_empty.index(s), count=1)

    l_safe = gl.where(l == 0.0, 1.0, l)
    out = acc / gl.expand_dims(gl.convert_layout(l_safe, row_o, assert_trivial=True), 1)
    q_smem.store(out.to(gl.bfloat16))
    fence_async_shared()
    tma.async_copy_shared_to_global(desc_o, [q_row0, q_col], q_smem)
    tma.store_wait(0)


@gluon.jit
def gluon_forward_kernel(desc_q, desc_k, desc_v, desc_o, qk_scale, S, group,
                         BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, HEAD_DIM: gl.constexpr,
                         STAGES: gl.constexpr, CAUSAL: gl.constexpr, REGS: gl.constexpr):
    # grid (S / 192, Hq, B); causal: the last (heaviest) query tiles first, as in flash.py.
    if CAUSAL:
        pid_m = gl.num_programs(0) - 1 - gl.program_id(0)
    else:
        pid_m = gl.program_id(0)
    row0 = pid_m * 3 * BLOCK_M
    kv_row0 = gl.program_id(2) * S
    q_col = gl.program_id(1) * HEAD_DIM
    kv_col = (gl.program_id(1) // group) * HEAD_DIM
    if CAUSAL:
        n0 = (row0 + BLOCK_M) // BLOCK_N
        n1 = (row0 + 2 * BLOCK_M) // BLOCK_N
        n2 = (row0 + 3 * BLOCK_M) // BLOCK_N
    else:
        n0 = S // BLOCK_N
        n1 = n0
        n2 = n0
    q0 = gl.allocate_shared_memory(desc_q.dtype, desc_q.block_type.shape, desc_q.layout)
    q1 = gl.allocate_shared_memory(desc_q.dtype, desc_q.block_type.shape, desc_q.layout)
    q2 = gl.allocate_shared_memory(desc_q.dtype, desc_q.block_type.shape, desc_q.layout)
    k_bufs = gl.allocate_shared_memory(desc_k.dtype, [STAGES] + desc_k.block_type.shape, desc_k.layout)
    v_bufs = gl.allocate_shared_memory(desc_v.dtype, [STAGES] + desc_v.block_type.shape, desc_v.layout)
    q_bars = gl.allocate_shared_memory(gl.int64, [3, 1], mbarrier.MBarrierLayout())
    kv_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    kv_empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for c in gl.static_range(3):
        mbarrier.init(q_bars.index(c), count=1)
    for s in gl.static_range(STAGES):
        mbarrier.init(kv_ready.index(s), count=1)
        mbarrier.init(kv_empty.index(s), count=3)  # each consumer releases each stage
    mbarrier.expect(q_bars.index(0), desc_q.block_type.nbytes)
    tma.async_copy_global_to_shared(desc_q, [kv_row0 + row0, q_col], q_bars.index(0), q0)
    mbarrier.expect(q_bars.index(1), desc_q.block_type.nbytes)
    tma.async_copy_global_to_shared(desc_q, [kv_row0 + row0 + BLOCK_M, q_col], q_bars.index(1), q1)
    mbarrier.expect(q_bars.index(2), desc_q.block_type.nbytes)
    tma.async_copy_global_to_shared(desc_q, [kv_row0 + row0 + 2 * BLOCK_M, q_col], q_bars.index(2), q2)
    gl.warp_specialize([
        (_consumer, (desc_o, q0, q_bars.index(0), k_bufs, v_bufs, kv_ready, kv_empty, qk_scale, kv_row0 + row0,
                     q_col, row0, n0, BLOCK_M, BLOCK_N, HEAD_DIM, STAGES, CAUSAL)),
        (_consumer, (desc_o, q1, q_bars.index(1), k_bufs, v_bufs, kv_ready, kv_empty, qk_scale,
                     kv_row0 + row0 + BLOCK_M, q_col, row0 + BLOCK_M, n1, BLOCK_M, BLOCK_N, HEAD_DIM, STAGES, CAUSAL)),
        (_consumer, (desc_o, q2, q_bars.index(2), k_bufs, v_bufs, kv_ready, kv_empty, qk_scale,
                     kv_row0 + row0 + 2 * BLOCK_M, q_col, row0 + 2 * BLOCK_M, n2, BLOCK_M, BLOCK_N, HEAD_DIM, STAGES,
                     CAUSAL)),
        (_producer, (desc_k, desc_v, k_bufs, v_bufs, kv_ready, kv_empty, kv_row0, kv_col, n2, BLOCK_N, STAGES)),
    ], [4, 4, 1], [REGS, REGS, 24])


def descriptors(q, k, v, o):
    """[B,S,H,D] tensors as 2-D [B·S, H·D] TMA descriptors; a tile is BLOCK rows of one head's D columns."""
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    def desc(x, rows):
        two_d = x.reshape(x.shape[0] * x.shape[1], x.shape[2] * x.shape[3])
        block = [rows, x.shape[3]]
        layout = gl.NVMMASharedLayout.get_default_for(block, gl.bfloat16)
        return TensorDescriptor(two_d, list(two_d.shape), list(two_d.stride()), block, layout)

    return desc(q, BLOCK_M), desc(k, BLOCK_N), desc(v, BLOCK_N), desc(o, BLOCK_M)


def check_inputs(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_split: int) -> None:
    """ValueError (one line) for what this kernel does not cover yet."""
    if q.dim() != 4 or k.shape != v.shape or k.dim() != 4:
        raise ValueError(f"q, k, v: expected [B,S,H,D] with k and v alike, got {tuple(q.shape)}, {tuple(k.shape)}, "
                         f"{tuple(v.shape)}")
    b, s, hq, d = q.shape
    if any(t.dtype != torch.bfloat16 or not t.is_contiguous() for t in (q, k, v)):
        raise ValueError("q, k, v: expected contiguous bf16 tensors")
    if d != HEAD_DIM or k.shape[3] != d or k.shape[0] != b or k.shape[1] != s or hq % k.shape[2]:
        raise ValueError(f"q, k: expected head_dim {HEAD_DIM}, equal B and S, Hq a multiple of Hkv; got "
                         f"{tuple(q.shape)} and {tuple(k.shape)}")
    if s == 0 or s % CTA_ROWS or s > kv_split:
        raise ValueError(f"q: S must be a positive multiple of {CTA_ROWS} up to one KV split ({kv_split}), got {s}")


def gluon_flash_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, causal: bool = True,
                        scale: float | None = None) -> torch.Tensor:
    """q [B,S,Hq,D], k/v [B,S,Hkv,D] -> out [B,S,Hq,D] (see the module docstring for the scope)."""
    check_inputs(q, k, v, attention_config(q.dtype, q.shape[3]).kv_split)
    b, s, hq, d = q.shape
    out = torch.empty_like(q)
    gluon_forward_kernel[(s // CTA_ROWS, hq, b)](
        *descriptors(q, k, v, out), default_scale(d, scale) * LOG2_E, s, hq // k.shape[2],
        BLOCK_M, BLOCK_N, HEAD_DIM, STAGES, causal, CONSUMER_REGS, num_warps=4)
    return out


def compile_for_sm90(causal: bool):
    """The kernel compiled for sm_90a with no GPU present (the interpreter must be off: Gluon has none),
    bound through the launcher's own argument binding to stand-in tensors of a B·S = 8192, 32/8-head problem."""
    from triton import compile as triton_compile
    from triton.backends.compiler import GPUTarget
    from triton.compiler import make_backend
    from triton.experimental.gluon._runtime import GluonASTSource
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor
    from triton.runtime.jit import MockTensor, create_function_from_signature

    target = GPUTarget("cuda", 90, 32)
    backend = make_backend(target)

    def desc(rows, heads):
        t = MockTensor("bfloat16", [8192, heads * HEAD_DIM])
        block = [rows, HEAD_DIM]
        return TensorDescriptor(t, [8192, heads * HEAD_DIM], [heads * HEAD_DIM, 1], block,
                                gl.NVMMASharedLayout.get_default_for(block, gl.bfloat16))

    kernel = gluon_forward_kernel
    args = (desc(BLOCK_M, 32), desc(BLOCK_N, 8), desc(BLOCK_N, 8), desc(BLOCK_M, 32), 0.1, 2048, 4,
            BLOCK_M, BLOCK_N, HEAD_DIM, STAGES, causal, CONSUMER_REGS)
    bound, specialization, options = create_function_from_signature(kernel.signature, kernel.params, backend)(
        *args, num_warps=4)
    options, signature, constexprs, attrs = kernel._pack_args(backend, {"num_warps": 4}, bound, specialization,
                                                              options)
    return triton_compile(GluonASTSource(kernel, signature, constexprs, attrs), target=target,
                          options=options.__dict__)
