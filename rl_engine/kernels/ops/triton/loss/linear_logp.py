"""Fused linear + selected-token log-probability in Triton, never materializing [tokens, V] logits.

logp[n] = z[n, t_n] - logsumexp_v z[n, v], with z = hidden @ W^T (+ bias), fp32 accumulation.

Forward (two kernels):
  1. `_partials_kernel`: for each [BLOCK_T tokens, BLOCK_V vocab] tile, the logits tile with
     `tl.dot` on TMA loads (fixed K loop over H), then per token the tile's max and sum of exp, and
     the target logit where the target falls in the tile. Partials go to [N, cdiv(V, BLOCK_V)].
     Persistent (one program per SM striding over the tiles, the loops flattened), so a tile's
     epilogue overlaps the next tile's loads: 8.74 -> 7.73 ms at N = 4096 on the H200 (1.05x a cuBLAS
     GEMM of the same shape). The epilogue's exps are single ex2.approx.ftz ops (logp.exp2_ftz).
  2. `_combine_kernel`: one program per token folds its partials in vocabulary order -> lse, logp.
Backward, for each vocabulary chunk (`backward_chunk`: VOCAB_CHUNK columns from CHUNK_ROWS tokens up,
proportionally wider below; no bit depends on the width), in vocabulary order:
  1. `_dlogits_kernel` (persistent, as the forward) recomputes the logits tile exactly as the forward did and writes
     dlogits = g * (onehot - exp(z - lse)) for the chunk ([N, chunk], compute dtype);
  2. `_matmul_kernel`: grad_hidden (fp32 accumulator) += dlogits @ W[chunk];
  3. grad_W[chunk] = dlogits^T @ hidden, a [BLOCK_M, BLOCK_N] tile of grad_W looping over all tokens
     in order: matmul.py's persistent TMA GEMM, or `_matmul_kernel` when grad_bias[chunk] (column
     sums, same loop) rides along.

Batch invariance: a token's logp and hidden gradient depend only on its own row - a row of a
`tl.dot` tile does not depend on the other rows, tile shapes and K order are fixed per dtype,
vocabulary tiles and chunks are folded in a fixed order - never on the number of tokens or the
tile row the token landed in. The weight and bias gradients are sums over tokens: deterministic
(fixed order, no atomics) but, by nature, dependent on the batch.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from rl_engine.kernels.ops.pytorch.base import expect_rank, expect_shape
from rl_engine.kernels.ops.pytorch.loss.linear_logp import NativeLinearLogpOp
from rl_engine.kernels.ops.triton.linear.matmul import MatmulConfig, batch_invariant_mm, writable_rows
from rl_engine.kernels.ops.triton.loss.logp import LOG2E, exp2_ftz, fold_lse, max_nan
from rl_engine.kernels.ops.triton.runtime import (
    cast_rne,
    check_devices,
    dot_fp32,
    ensure_cuda_context,
    host_descriptor,
    interpreting,
    register_autograd,
    sm_count,
)


def _gemm(block_m, block_n, block_k, num_warps, num_stages, group=16) -> dict:
    return dict(BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, GROUP=group,
                num_warps=num_warps, num_stages=num_stages)


# One fixed configuration per dtype (never keyed on the number of tokens). The top-level tiles are
# the logits tiles of the forward and of the backward's recompute (which must match the forward's
# tile shapes and K order bit for bit); DH and DW are the backward's gradient GEMMs, with their own
# tiles (they change no forward bit). `benchmarks/linear_logp.py --tile-sweep / --bwd-sweep`.
_GPU_CONFIGS = {
    # 2026-11-30 H200 sweep (benchmarks/results/linear_logp_sweeps.json, N = 4096, H = 4096, V = 151936):
    # 128x256 logits tiles with 4 stages and 128x256 gradient GEMMs took forward + backward from 5.63x
    # to about 4.8x a cuBLAS GEMM. 8192-column chunks gained another 2% for 64 MB more at N = 4096: no.
    # 2026-12-01: the persistent TMA logits kernels: the recompute runs at 0.185 ms per chunk, cuBLAS's
    # speed for that GEMM; DH / DW (0.22 / 0.19 ms, cuBLAS 0.175 / 0.179) are what is left. Making
    # `_matmul_kernel` persistent with pointer loads made them 4-35x slower: not that way. DW runs on matmul.py's
    # persistent TMA GEMM instead (3 stages: its TMA-store epilogue does not fit beside 4), 7-13% faster
    # with the same bits, in groups of 8 row-tiles
    # (alone 0.378 vs 0.428 ms a chunk at N = 8192; in the whole step, ABBA, equal at 1024 and 8192 and 3.5%
    # faster at 4096). DH's fp32 accumulator read and
    # write is what remains (0.468 vs 0.403 ms a chunk at N = 8192); no other DH tile is faster.
    "16bit": dict(BLOCK_T=128, BLOCK_V=256, BLOCK_H=64, GROUP=16, num_warps=8, num_stages=4, VOCAB_CHUNK=4096,
                  CHUNK_ROWS=4096, DH=_gemm(128, 256, 64, 8, 3), DW=_gemm(128, 256, 64, 8, 3, group=8)),
    "fp32": dict(BLOCK_T=64, BLOCK_V=64, BLOCK_H=32, GROUP=16, num_warps=4, num_stages=2, VOCAB_CHUNK=4096,
                 CHUNK_ROWS=4096, DH=_gemm(64, 64, 32, 4, 2), DW=_gemm(64, 64, 32, 4, 2)),
}
# Small tiles under the CPU interpreter, so tests at V ~ 100, H ~ 32 cross tile and chunk borders.
_INTERPRETER_CONFIG = dict(BLOCK_T=16, BLOCK_V=16, BLOCK_H=16, GROUP=2, num_warps=1, num_stages=1, VOCAB_CHUNK=32,
                           CHUNK_ROWS=16, DH=_gemm(16, 16, 16, 1, 1, group=2),
                           DW=_gemm(16, 16, 16, 1, 1, group=2))


# The stored fp32 logits tile (128 KB at 128 x 256) is staged through shared memory beside the load pipeline: with
# two stages of it the kernel fits sm_90's 227 KB (four need 320 KB).
STORE_LOGITS_STAGES = 2
INTERPRETER_PROGRAMS = 3  # stands in for the SM count: several tiles per program, as on the GPU


def config(dtype: torch.dtype) -> dict:
    if interpreting():
        return dict(_INTERPRETER_CONFIG)
    return dict(_GPU_CONFIGS["fp32" if dtype == torch.float32 else "16bit"])


def backward_chunk(cfg: dict, rows: int) -> int:
    """Vocabulary columns per backward chunk for `rows` tokens: VOCAB_CHUNK from CHUNK_ROWS rows up, a
    whole multiple of it below, so the [rows, chunk] dlogits buffer is never larger than at CHUNK_ROWS
    rows while a short batch launches fewer kernels (three per chunk; at N = 1024 the H200 backward
    waited on the host). No bit depends on
    the width: chunks start on BLOCK_V and BLOCK_K borders, the hidden gradient's fp32 accumulator
    continues its K loop exactly from one chunk into the next, and every other value belongs to one
    vocabulary row or one tile (test_linear_logp checks widths 1x and 16x)."""
    return cfg["VOCAB_CHUNK"] * max(1, cfg["CHUNK_ROWS"] // max(rows, 1))


@triton.jit
def _grouped_tile(pid, num_m, num_n, GROUP: tl.constexpr):
    # Launch order only (for L2 reuse): GROUP row-tiles sweep all column-tiles together.
    # It never changes what a tile computes.
    per_group = GROUP * num_n
    first_m = (pid // per_group) * GROUP
    size = tl.minimum(num_m - first_m, GROUP)
    tile_m = first_m + (pid % per_group) % size
    tile_n = (pid % per_group) // size
    return tile_m, tile_n


@triton.jit
def _logits_tile(
    h_desc, w_desc, off_t, off_v, H, BLOCK_T: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_H: tl.constexpr,
    DOT_FP32: tl.constexpr, INPUT_PRECISION: tl.constexpr,
):
    # fp32 [BLOCK_T, BLOCK_V] tile of hidden @ W^T from TMA loads of hidden [N,H] and W [V,H] (rows and
    # columns past the tensors' ends load as zeros); the K loop walks H from 0 in BLOCK_H steps.
    acc = tl.zeros([BLOCK_T, BLOCK_V], tl.float32)
    for k in range(0, tl.cdiv(H, BLOCK_H)):
        h = h_desc.load([off_t, k * BLOCK_H])
        w = w_desc.load([off_v, k * BLOCK_H]).T
        if DOT_FP32:
            h = h.to(tl.float32)
            w = w.to(tl.float32)
        acc = tl.dot(h, w, acc, input_precision=INPUT_PRECISION)
    return acc


@triton.jit(do_not_specialize=["N"])
def _partials_kernel(
    h_desc, w_desc, bias_ptr, target_ptr, part_max_ptr, part_sum_ptr, target_logit_ptr, logits_ptr, N, V, H,
    num_vtiles, HAS_BIAS: tl.constexpr, STORE_LOGITS: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_V: tl.constexpr,
    BLOCK_H: tl.constexpr, GROUP: tl.constexpr, NUM_PROGRAMS: tl.constexpr, DOT_FP32: tl.constexpr,
    INPUT_PRECISION: tl.constexpr,
):
    # Persistent: NUM_PROGRAMS programs stride over the [BLOCK_T, BLOCK_V] tiles, so a tile's epilogue
    # (exps, sums, stores) overlaps the next tile's first loads. Which program runs a tile changes no bit.
    # STORE_LOGITS: also the fp32 logits [N, V] (a sampler's input; `sampling_logits`).
    num_ttiles = tl.cdiv(N, BLOCK_T)
    tile_id_c = tl.program_id(0) - NUM_PROGRAMS  # the epilogue's tile, from its own counter (as matmul.py)
    for tile_id in tl.range(tl.program_id(0), num_ttiles * num_vtiles, NUM_PROGRAMS, flatten=True):
        tile_t, tile_v = _grouped_tile(tile_id, num_ttiles, num_vtiles, GROUP)
        acc = _logits_tile(h_desc, w_desc, tile_t * BLOCK_T, tile_v * BLOCK_V, H,
                           BLOCK_T, BLOCK_V, BLOCK_H, DOT_FP32, INPUT_PRECISION)
        tile_id_c += NUM_PROGRAMS
        tile_t, tile_v = _grouped_tile(tile_id_c, num_ttiles, num_vtiles, GROUP)
        rows = tile_t * BLOCK_T + tl.arange(0, BLOCK_T)
        cols = tile_v * BLOCK_V + tl.arange(0, BLOCK_V)
        if HAS_BIAS:
            acc += tl.load(bias_ptr + cols, mask=cols < V, other=0.0).to(tl.float32)[None, :]
        row_ok = rows < N
        rows64 = rows.to(tl.int64)
        if STORE_LOGITS:
            tl.store(logits_ptr + rows64[:, None] * V + cols[None, :], acc, mask=row_ok[:, None] & (cols < V)[None, :])
        acc = tl.where((cols < V)[None, :], acc, float("-inf"))
        # NaN if any logit of the row's tile is NaN (fold_lse then makes the lse NaN); -inf if all are
        # -inf (e.g. a -inf bias): then shift by 0, so that the sum is 0, not -inf - -inf = NaN.
        tile_max = max_nan(acc, 1)
        shift = tl.where(tile_max == float("-inf"), 0.0, tile_max)
        # exp(acc - max) as 2^(acc log2e - max log2e): one FFMA and one MUFU.EX2 per element.
        tile_sum = tl.sum(exp2_ftz(acc * LOG2E - (shift * LOG2E)[:, None]), axis=1)
        tl.store(part_max_ptr + rows64 * num_vtiles + tile_v, tile_max, mask=row_ok)
        tl.store(part_sum_ptr + rows64 * num_vtiles + tile_v, tile_sum, mask=row_ok)
        target = tl.load(target_ptr + rows, mask=row_ok, other=-1).to(tl.int32)
        in_tile = (target >= tile_v * BLOCK_V) & (target < tile_v * BLOCK_V + BLOCK_V) & (target < V)
        # Every tile picks (a branch on whether any target is in the tile breaks the loop flattening).
        picked = tl.sum(tl.where(cols[None, :] == target[:, None], acc, 0.0), axis=1)
        tl.store(target_logit_ptr + rows, picked, mask=row_ok & in_tile)


@triton.jit
def _combine_kernel(
    part_max_ptr, part_sum_ptr, target_logit_ptr, logp_ptr, lse_ptr, num_vtiles,
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    mask = offs < num_vtiles
    m = tl.load(part_max_ptr + row * num_vtiles + offs, mask=mask, other=float("-inf"))
    s = tl.load(part_sum_ptr + row * num_vtiles + offs, mask=mask, other=0.0)
    lse = fold_lse(m, s)  # tiles in vocabulary order, as logp folds its lanes; NaN and +inf as in logp
    tl.store(logp_ptr + row, tl.load(target_logit_ptr + row) - lse)
    tl.store(lse_ptr + row, lse)


@triton.jit(do_not_specialize=["N"])
def _dlogits_kernel(
    h_desc, w_desc, bias_ptr, target_ptr, lse_ptr, grad_out_ptr, dlogits_ptr,
    N, V, H, v_start, v_stop, stride_dn,
    HAS_BIAS: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_H: tl.constexpr,
    GROUP: tl.constexpr, NUM_PROGRAMS: tl.constexpr, DOT_FP32: tl.constexpr, INPUT_PRECISION: tl.constexpr,
):
    # dlogits[:, v_start:v_stop] = g * (onehot - softmax), from logits recomputed bit for bit as in
    # the forward (same tile shapes, same K order; v_start is a multiple of BLOCK_V). Persistent, as
    # the forward's partials.
    num_ttiles = tl.cdiv(N, BLOCK_T)
    num_vtiles = tl.cdiv(v_stop - v_start, BLOCK_V)
    tile_id_c = tl.program_id(0) - NUM_PROGRAMS
    for tile_id in tl.range(tl.program_id(0), num_ttiles * num_vtiles, NUM_PROGRAMS, flatten=True):
        tile_t, tile_v = _grouped_tile(tile_id, num_ttiles, num_vtiles, GROUP)
        acc = _logits_tile(h_desc, w_desc, tile_t * BLOCK_T, v_start + tile_v * BLOCK_V, H,
                           BLOCK_T, BLOCK_V, BLOCK_H, DOT_FP32, INPUT_PRECISION)
        tile_id_c += NUM_PROGRAMS
        tile_t, tile_v = _grouped_tile(tile_id_c, num_ttiles, num_vtiles, GROUP)
        rows = tile_t * BLOCK_T + tl.arange(0, BLOCK_T)
        local = tile_v * BLOCK_V + tl.arange(0, BLOCK_V)
        cols = v_start + local
        if HAS_BIAS:
            acc += tl.load(bias_ptr + cols, mask=cols < V, other=0.0).to(tl.float32)[None, :]
        row_ok = rows < N
        lse = tl.load(lse_ptr + rows, mask=row_ok, other=0.0)
        g = tl.load(grad_out_ptr + rows, mask=row_ok, other=0.0)
        target = tl.load(target_ptr + rows, mask=row_ok, other=-1).to(tl.int32)
        onehot = tl.where(cols[None, :] == target[:, None], 1.0, 0.0)
        dlogits = g[:, None] * (onehot - exp2_ftz(acc * LOG2E - (lse * LOG2E)[:, None]))
        ptrs = dlogits_ptr + rows.to(tl.int64)[:, None] * stride_dn + local[None, :]
        tl.store(ptrs, cast_rne(dlogits, dlogits_ptr.dtype.element_ty),
                 mask=row_ok[:, None] & (cols < v_stop)[None, :])


@triton.jit
def _matmul_kernel(
    a_ptr, b_ptr, c_ptr, a_desc, b_desc, row_sum_ptr, M, N, K,
    stride_am, stride_ak, stride_bk, stride_bn, stride_cm, stride_cn,
    ACCUMULATE: tl.constexpr, ROW_SUM: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP: tl.constexpr,
    EVEN_K: tl.constexpr, DOT_FP32: tl.constexpr, INPUT_PRECISION: tl.constexpr,
    TMA: tl.constexpr, A_TRANS: tl.constexpr,
):
    # C[M, N] (+)= A[M, K] @ B[K, N] in fp32 with a fixed K order; one program owns one C tile, so
    # a row of C depends only on that row of A, and sums over K need no atomics.
    # ACCUMULATE reads C into the accumulator before the loop: reading it after the loop instead
    # measured worse on sm_90 (ptxas: 186 vs 173 registers at 128x128, spills at 128x256).
    # ROW_SUM: programs of the first column-tile also write sum_k A[m, k] (the bias gradient).
    # TMA: A and B through descriptors (A_TRANS: a_desc holds A^T as stored, [K, M]); their exact shapes
    # zero-fill every row, column and K step past the end, as the masked loads do: the same operands.
    tile_m, tile_n = _grouped_tile(tl.program_id(0), tl.cdiv(M, BLOCK_M), tl.cdiv(N, BLOCK_N), GROUP)
    rows = tile_m * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tile_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    # Masks, not index wrapping, on M and N: `rows % M` would hide the contiguity of the unit-stride
    # side (A is read transposed for the weight gradient) and stop vectorized, pipelined loads.
    row_ok = rows < M
    col_ok = cols < N
    a_ptrs = a_ptr + rows.to(tl.int64)[:, None] * stride_am + offs_k.to(tl.int64)[None, :] * stride_ak
    b_ptrs = b_ptr + offs_k.to(tl.int64)[:, None] * stride_bk + cols[None, :] * stride_bn
    c_ptrs = c_ptr + rows.to(tl.int64)[:, None] * stride_cm + cols[None, :] * stride_cn
    c_mask = row_ok[:, None] & col_ok[None, :]
    if ACCUMULATE:
        acc = tl.load(c_ptrs, mask=c_mask, other=0.0).to(tl.float32)
    else:
        acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    row_sum = tl.zeros([BLOCK_M], tl.float32)
    for k in range(0, tl.cdiv(K, BLOCK_K)):
        if TMA:
            if A_TRANS:
                a = a_desc.load([k * BLOCK_K, tile_m * BLOCK_M]).T
            else:
                a = a_desc.load([tile_m * BLOCK_M, k * BLOCK_K])
            b = b_desc.load([k * BLOCK_K, tile_n * BLOCK_N])
        elif EVEN_K:
            a = tl.load(a_ptrs, mask=row_ok[:, None], other=0.0)
            b = tl.load(b_ptrs, mask=col_ok[None, :], other=0.0)
        else:
            k_ok = offs_k < K - k * BLOCK_K
            a = tl.load(a_ptrs, mask=row_ok[:, None] & k_ok[None, :], other=0.0)
            b = tl.load(b_ptrs, mask=k_ok[:, None] & col_ok[None, :], other=0.0)
        if ROW_SUM:
            row_sum += tl.sum(a.to(tl.float32), axis=1)
        if DOT_FP32:
            a = a.to(tl.float32)
            b = b.to(tl.float32)
        acc = tl.dot(a, b, acc, input_precision=INPUT_PRECISION)
        a_ptrs += BLOCK_K * stride_ak
        b_ptrs += BLOCK_K * stride_bk
    tl.store(c_ptrs, cast_rne(acc, c_ptr.dtype.element_ty), mask=c_mask)
    if ROW_SUM:
        # A block comparison, not `row_ok & (tile_n == 0)`: Triton 3.9's interpreter broadcasts a scalar
        # comparison into an integer array, which store rejects as a mask.
        tl.store(row_sum_ptr + rows, cast_rne(row_sum, row_sum_ptr.dtype.element_ty),
                 mask=rows < tl.where(tile_n == 0, M, 0))


def _dot_options(dtype: torch.dtype) -> dict:
    # fp32 operands: IEEE fp32 products (TF32 would break the fp32 reference); 16-bit: tensor cores.
    return dict(DOT_FP32=dot_fp32(dtype), INPUT_PRECISION="ieee" if dtype == torch.float32 else "tf32")


def gemm_descriptors(a, b, gemm):
    """(a_desc, b_desc, a_trans): TMA descriptors of 16-bit a [M,K] (row-major, or the transpose of a
    row-major [K,M]: a_trans) and b [K,N] (row-major), or None (pointer loads: fp32, other layouts)."""
    if a.element_size() != 2:
        return None
    a_trans = a.stride(1) != 1
    stored = a.t() if a_trans else a
    if stored.stride(1) != 1 or b.stride(1) != 1:
        return None
    if any(t.data_ptr() % 16 or (t.stride(0) * t.element_size()) % 16 for t in (stored, b)):
        return None
    if a.is_cuda and not interpreting():
        ensure_cuda_context(a.device.index)  # autograd's backward thread may have no context yet
    bm, bn, bk = gemm["BLOCK_M"], gemm["BLOCK_N"], gemm["BLOCK_K"]
    return (host_descriptor(stored, list(stored.shape), [stored.stride(0), 1], [bk, bm] if a_trans else [bm, bk]),
            host_descriptor(b, list(b.shape), [b.stride(0), 1], [bk, bn]), a_trans)


def _matmul(a, b, c, *, accumulate=False, row_sum=None, gemm) -> None:
    """c (+)= a @ b with the tiles of `gemm` (a _gemm(...) dict)."""
    if c.dtype == a.dtype != torch.float32 and not accumulate and row_sum is None and writable_rows(c):
        # A plain 16-bit product (the weight gradient): matmul.py's persistent TMA GEMM, whose epilogue
        # overlaps the next tile's loads, with the same tiles and K order, so the same bits (H200,
        # 2026-12-01: 0.204 vs 0.234 ms at K = 1024 tokens, 0.402 vs 0.435 at 8192, bitwise equal).
        config = MatmulConfig(gemm["BLOCK_M"], gemm["BLOCK_N"], gemm["BLOCK_K"], gemm["GROUP"],
                              gemm["num_warps"], gemm["num_stages"])
        batch_invariant_mm(a, b, config=config, out=c)
        return
    m, k = a.shape
    n = b.shape[1]
    grid = (triton.cdiv(m, gemm["BLOCK_M"]) * triton.cdiv(n, gemm["BLOCK_N"]),)
    descs = gemm_descriptors(a, b, gemm)
    _matmul_kernel[grid](
        a, b, c, *(descs[:2] if descs else (a, b)), row_sum if row_sum is not None else c, m, n, k,
        a.stride(0), a.stride(1), b.stride(0), b.stride(1), c.stride(0), c.stride(1),
        ACCUMULATE=accumulate, ROW_SUM=row_sum is not None, EVEN_K=k % gemm["BLOCK_K"] == 0,
        TMA=descs is not None, A_TRANS=bool(descs and descs[2]), **gemm, **_dot_options(a.dtype),
    )


def _tile_options(cfg, dtype) -> dict:
    return dict(BLOCK_T=cfg["BLOCK_T"], BLOCK_V=cfg["BLOCK_V"], BLOCK_H=cfg["BLOCK_H"], GROUP=cfg["GROUP"],
                num_warps=cfg["num_warps"], num_stages=cfg["num_stages"], **_dot_options(dtype))


def num_programs(device: torch.device) -> int:
    """Programs of the persistent logits kernels: one per SM (a fixed few under the interpreter)."""
    return INTERPRETER_PROGRAMS if interpreting() else sm_count(device.index or 0)


def tma_descriptor(t: torch.Tensor, block: list[int]) -> TensorDescriptor:
    """A TMA descriptor of the row-major 2-D `t`. TMA needs a unit column stride and a 16-byte aligned
    base and row stride; anything else (H not a multiple of 8 in 16 bits: no real model) is read
    from a zero-padded copy, with the same bits (the padding lies past H: zero products)."""
    rows, cols = t.shape
    size = t.element_size()
    stride = t.stride(0) if rows > 1 else cols
    if (cols > 1 and t.stride(1) != 1) or stride < cols or (stride * size) % 16 or t.data_ptr() % 16:
        stride = -(-cols * size // 16) * 16 // size
        padded = t.new_zeros(rows, stride)
        padded[:, :cols] = t
        t = padded
    return TensorDescriptor(t, [rows, cols], [stride, 1], block)


def logits_descriptors(hidden, weight, cfg) -> tuple[TensorDescriptor, TensorDescriptor]:
    """TMA descriptors of hidden [N,H] and W [V,H] with the logits tiles' block shapes."""
    return (tma_descriptor(hidden, [cfg["BLOCK_T"], cfg["BLOCK_H"]]),
            tma_descriptor(weight, [cfg["BLOCK_V"], cfg["BLOCK_H"]]))


def _forward(hidden, weight, bias, targets, cfg):
    return combine(*partials(hidden, weight, bias, targets, cfg))


def partials(hidden, weight, bias, targets, cfg, logits=None):
    """Per token and vocabulary tile: (max, sum of exp(logit - max)) [N, tiles], and the target logit [N]
    (NaN where no tile of `weight` holds the target). Each tile's values depend on that tile alone.
    `logits`: an fp32 [N, V] tensor the kernel also writes the logits into."""
    n, h = hidden.shape
    v = weight.shape[0]
    num_vtiles = triton.cdiv(v, cfg["BLOCK_V"])
    part_max = torch.empty(n, num_vtiles, dtype=torch.float32, device=hidden.device)
    part_sum = torch.empty_like(part_max)
    target_logit = torch.full((n,), float("nan"), dtype=torch.float32, device=hidden.device)
    h_desc, w_desc = logits_descriptors(hidden, weight, cfg)
    tiles = triton.cdiv(n, cfg["BLOCK_T"]) * num_vtiles
    programs = num_programs(hidden.device)
    _partials_kernel[(min(programs, tiles),)](
        h_desc, w_desc, bias if bias is not None else weight, targets, part_max, part_sum, target_logit,
        logits if logits is not None else part_max, n, v, h, num_vtiles, HAS_BIAS=bias is not None,
        STORE_LOGITS=logits is not None, NUM_PROGRAMS=programs, **_tile_options(cfg, hidden.dtype),
    )
    return part_max, part_sum, target_logit


# The sampler's tiles for 16-bit weights on the GPU: a decode batch fills few of 128 token rows, so 64 rows on one
# warpgroup, and the shared memory that frees goes to a third stage. A row's m64n256k16 wgmma chain over the same H
# steps and its partials' reduction within a warp are the trainer's tiles' (`--sampling-sweep` compares the bits).
SAMPLING_TILES_16BIT = dict(BLOCK_T=64, num_warps=4, num_stages=3)


def trainer_read_config(dtype: torch.dtype) -> dict:
    """The trainer's tiles (`config`) at most STORE_LOGITS_STAGES pipeline stages: the tiles whose bits a sampler's
    logits and partials must have."""
    cfg = config(dtype)
    cfg["num_stages"] = min(cfg["num_stages"], STORE_LOGITS_STAGES)
    return cfg


def sampling_config(dtype: torch.dtype) -> dict:
    """`sampling_logits`' tiles: SAMPLING_TILES_16BIT over the trainer's for 16-bit weights on the GPU (bit-equal, as
    `benchmarks/linear_logp.py --sampling-sweep` shows), else the trainer's."""
    cfg = trainer_read_config(dtype)
    if dtype != torch.float32 and not interpreting():
        cfg.update(SAMPLING_TILES_16BIT)
    return cfg


def sampling_logits(hidden: torch.Tensor, weight: torch.Tensor, cfg: dict | None = None) -> tuple[torch.Tensor, tuple]:
    """fp32 logits [N, V] = hidden [N, H] @ W^T for a sampler, and the partials `linear_logp` folds: with them
    `logp_of_drawn` gives drawn tokens the bits of linear_logp(hidden, W, tokens) without a second read of W (one
    kernel writes both: the logits are its fp32 accumulator tiles). Pipeline depth changes no bit. `cfg`: other
    tiles than `sampling_config`'s (a benchmark's; the bits are the trainer's only where its sweep shows so)."""
    dtype = torch.promote_types(hidden.dtype, weight.dtype)
    rows, weight = hidden.to(dtype), weight.to(dtype)
    cfg = sampling_config(dtype) if cfg is None else cfg
    logits = torch.empty(rows.shape[0], weight.shape[0], dtype=torch.float32, device=rows.device)
    no_target = torch.full((rows.shape[0],), -1, dtype=torch.int64, device=rows.device)
    part_max, part_sum, _ = partials(rows, weight, None, no_target, cfg, logits=logits)
    return logits, (part_max, part_sum)


def logp_of_drawn(logits: torch.Tensor, parts: tuple, targets: torch.Tensor) -> torch.Tensor:
    """fp32 [N]: log-probabilities of targets [N] (in [0, V)) from `sampling_logits`' results, as linear_logp's."""
    # The partials kernel picks a target logit as a sum of it and zeros: + 0.0 does the same (-0.0 becomes +0.0).
    target_logit = logits.gather(1, targets.reshape(-1, 1).long())[:, 0] + 0.0
    return combine(*parts, target_logit)[0]


def combine(part_max, part_sum, target_logit):
    """(logp, lse) [N] from the partials of every vocabulary tile, folded in vocabulary order."""
    n, num_vtiles = part_max.shape
    logp = torch.empty(n, dtype=torch.float32, device=part_max.device)
    lse = torch.empty_like(logp)
    _combine_kernel[(n,)](
        part_max, part_sum, target_logit, logp, lse, num_vtiles,
        BLOCK=triton.next_power_of_2(num_vtiles), num_warps=4 if not interpreting() else 1,
    )
    return logp, lse


def _dlogits(descs, hidden, weight, bias, targets, lse, grad_out, d, v_start, v_stop, cfg) -> None:
    n, h = hidden.shape
    v = weight.shape[0]
    tiles = triton.cdiv(n, cfg["BLOCK_T"]) * triton.cdiv(v_stop - v_start, cfg["BLOCK_V"])
    programs = num_programs(hidden.device)
    _dlogits_kernel[(min(programs, tiles),)](
        *descs, bias if bias is not None else weight, targets, lse, grad_out, d,
        n, v, h, v_start, v_stop, d.stride(0), HAS_BIAS=bias is not None, NUM_PROGRAMS=programs,
        **_tile_options(cfg, hidden.dtype),
    )


def hidden_grad(hidden, weight, targets, lse, grad_out, cfg, *, init=None):
    """The fp32 hidden gradient from `weight`'s vocabulary rows, its accumulator continued from `init`
    (the fp32 accumulator after the vocabulary rows before these, as a tensor-parallel rank gets it)."""
    return _backward(hidden, weight, None, targets, lse, grad_out, cfg, True, False, False, init=init)[0]


def _backward(hidden, weight, bias, targets, lse, grad_out, cfg, need_hidden, need_weight, need_bias, init=None):
    n, h = hidden.shape
    v = weight.shape[0]
    chunk = backward_chunk(cfg, n)
    dlogits = torch.empty(n, min(chunk, v), dtype=hidden.dtype, device=hidden.device)
    # fp32 accumulator across vocabulary chunks (it is the output itself for fp32 hidden).
    if init is not None:
        grad_hidden = init
    else:
        grad_hidden = torch.zeros(n, h, dtype=torch.float32, device=hidden.device) if need_hidden else None
    grad_weight = torch.empty_like(weight) if need_weight else None
    grad_bias = torch.empty_like(bias) if need_bias else None
    descs = logits_descriptors(hidden, weight, cfg)
    for v_start in range(0, v, chunk):
        v_stop = min(v_start + chunk, v)
        d = dlogits[:, : v_stop - v_start]
        _dlogits(descs, hidden, weight, bias, targets, lse, grad_out, d, v_start, v_stop, cfg)
        if need_hidden:
            _matmul(d, weight[v_start:v_stop], grad_hidden, accumulate=v_start > 0 or init is not None,
                    gemm=cfg["DH"])
        if need_weight or need_bias:
            out = grad_weight[v_start:v_stop] if need_weight else torch.empty(
                v_stop - v_start, h, dtype=hidden.dtype, device=hidden.device
            )
            row_sum = grad_bias[v_start:v_stop] if need_bias else None
            _matmul(d.t(), hidden, out, row_sum=row_sum, gemm=cfg["DW"])
    return grad_hidden, grad_weight, grad_bias


# Forward and backward are torch custom ops (fake + autograd registered), so torch.compile traces them.
@torch.library.custom_op("rl_engine::linear_logp", mutates_args=())
def linear_logp_op(hidden: torch.Tensor, weight: torch.Tensor, target_ids: torch.Tensor,
                   bias: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """(fp32 logp [B,S], fp32 logsumexp [B*S]) (torch.ops.rl_engine.linear_logp); differentiable in logp."""
    batch_shape, h = hidden.shape[:-1], hidden.shape[-1]
    dtype = torch.promote_types(hidden.dtype, weight.dtype)
    rows = hidden.reshape(-1, h).to(dtype)
    targets = target_ids.reshape(-1).contiguous()
    if rows.shape[0]:
        logp, lse = _forward(rows, weight.to(dtype), bias, targets, config(dtype))
    else:
        logp = lse = rows.new_empty(0, dtype=torch.float32)
    return logp.reshape(batch_shape), lse


@linear_logp_op.register_fake
def _(hidden, weight, target_ids, bias) -> tuple[torch.Tensor, torch.Tensor]:
    n = hidden.shape[:-1].numel()
    return hidden.new_empty(hidden.shape[:-1], dtype=torch.float32), hidden.new_empty(n, dtype=torch.float32)


@torch.library.custom_op("rl_engine::linear_logp_backward", mutates_args=())
def linear_logp_backward_op(
    grad_logp: torch.Tensor, hidden: torch.Tensor, weight: torch.Tensor, target_ids: torch.Tensor,
    bias: torch.Tensor | None, lse: torch.Tensor, need_hidden: bool, need_weight: bool, need_bias: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(grad_hidden, grad_weight, grad_bias); a gradient not asked for is an empty tensor (ops return no None)."""
    dtype = torch.promote_types(hidden.dtype, weight.dtype)
    rows = hidden.reshape(-1, hidden.shape[-1]).to(dtype)
    if rows.shape[0] == 0:
        return (
            hidden.new_zeros(hidden.shape) if need_hidden else hidden.new_empty(0),
            torch.zeros_like(weight) if need_weight else hidden.new_empty(0),
            torch.zeros_like(bias) if need_bias else hidden.new_empty(0),
        )
    grad_out = grad_logp.reshape(-1).to(torch.float32).contiguous()
    targets = target_ids.reshape(-1).contiguous()
    grad_hidden, grad_weight, grad_bias = _backward(
        rows, weight.to(dtype), bias, targets, lse, grad_out, config(dtype), need_hidden, need_weight, need_bias
    )
    return (  # separate empty tensors: a custom op's outputs may not alias each other
        grad_hidden.to(hidden.dtype).reshape(hidden.shape) if need_hidden else hidden.new_empty(0),
        grad_weight.to(weight.dtype) if need_weight else hidden.new_empty(0),
        grad_bias if need_bias else hidden.new_empty(0),
    )


@linear_logp_backward_op.register_fake
def _(grad_logp, hidden, weight, target_ids, bias, lse, need_hidden, need_weight, need_bias):
    return (  # grad_hidden is built contiguous; grad_weight and grad_bias by empty_like/zeros_like
        hidden.new_empty(hidden.shape) if need_hidden else hidden.new_empty(0),
        torch.empty_like(weight) if need_weight else hidden.new_empty(0),
        torch.empty_like(bias) if need_bias else hidden.new_empty(0),
    )


def _linear_logp_setup_context(ctx, inputs, output) -> None:
    hidden, weight, target_ids, bias = inputs
    ctx.save_for_backward(hidden, weight, target_ids, bias, output[1])


def _linear_logp_backward(ctx, grad_logp: torch.Tensor, _grad_lse):
    hidden, weight, target_ids, bias, lse = ctx.saved_tensors
    need_hidden, need_weight, _, need_bias = ctx.needs_input_grad
    grads = linear_logp_backward_op(grad_logp, hidden, weight, target_ids, bias, lse,
                                    need_hidden, need_weight, need_bias)
    grad_hidden, grad_weight, grad_bias = (g if need else None for g, need in
                                           zip(grads, (need_hidden, need_weight, need_bias), strict=True))
    return grad_hidden, grad_weight, None, grad_bias


linear_logp_autograd = register_autograd(linear_logp_op, _linear_logp_backward, _linear_logp_setup_context)


def _validate(hidden, lm_head_weight, target_ids, bias) -> None:
    expect_rank("hidden", hidden, 3, "[B,S,H]")
    b, s, h = hidden.shape
    expect_rank("lm_head_weight", lm_head_weight, 2, "[V,H]")
    expect_shape("lm_head_weight", lm_head_weight, (lm_head_weight.shape[0], h), "[V,H]")
    expect_shape("target_ids", target_ids, (b, s), "[B,S]")
    if target_ids.dtype.is_floating_point or target_ids.dtype == torch.bool:
        raise ValueError(f"target_ids: expected integer ids [B,S], got dtype {target_ids.dtype}")
    if bias is not None:
        expect_shape("bias", bias, (lm_head_weight.shape[0],), "[V]")


def linear_logp(hidden, lm_head_weight, target_ids, bias=None) -> torch.Tensor:
    """fp32 log-probabilities [B,S] of `target_ids` under hidden [B,S,H] @ lm_head_weight[V,H]^T (+ bias).

    Ids are not range-checked on the device path (that would synchronize); an id outside [0, V)
    gives NaN for that token.
    """
    _validate(hidden, lm_head_weight, target_ids, bias)
    return linear_logp_autograd(hidden, lm_head_weight, target_ids, bias)[0]


class TritonLinearLogpOp:
    """Triton candidate for NativeLinearLogpOp: op(hidden=, lm_head_weight=, target_ids=, bias=None)."""

    input_names = NativeLinearLogpOp.input_names

    def __call__(self, *, hidden, lm_head_weight, target_ids, bias=None) -> torch.Tensor:
        check_devices("TritonLinearLogpOp", hidden=hidden, lm_head_weight=lm_head_weight, target_ids=target_ids,
                      bias=bias)
        return linear_logp(hidden, lm_head_weight, target_ids, bias)
