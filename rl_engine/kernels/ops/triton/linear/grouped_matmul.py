"""Batch-invariant grouped GEMM for Mixture-of-Experts: every expert's rows times its own weight.

    out = grouped_matmul(rows [R,K], weight [E,N,K], counts)   # rows sorted by expert, counts[e] rows each
    out[rows of e] = rows[rows of e] @ weight[e]^T              # [R,N], weight stored as HF stores experts

One launch for all experts, replacing a loop of E `matmul` calls. Why a row's bits depend only on
that row and its expert's weight (DESIGN.md's MoE rule), never on which or how many rows share the
expert:
- a program owns one [BLOCK_M, BLOCK_N] tile of ONE expert's rows (a tile never straddles two
  experts: the host cuts each expert's rows into tiles of its own); a row of a `tl.dot` result depends
  only on that row of its left operand;
- K is walked from 0 upwards in BLOCK_K steps into one fp32 accumulator, no split-K, with the tiles
  of the `matmul` op's table for the dtype (`matmul_config`), so a row's K order and instruction
  shapes are the ones the `matmul` op uses on the same row: the loop of `matmul` calls is the
  reference this kernel is tested against bit for bit.
Backward, deterministic and without atomics:
- d_rows = d_out @ weight[e] is the same kernel with the weight read transposed;
- d_weight[e] = d_out[rows of e]^T @ rows[rows of e]: one program per [BLOCK_N, BLOCK_K] tile of one
  expert's gradient walks that expert's rows in order (a fixed-order sum over its tokens; an expert
  without rows gets zeros).
The tile table (expert, first row, end row of each tile) is built on the device from the device
tensor `counts`, never read back: the grid is a bound known on the host (cdiv(R, BLOCK_M) + E tiles)
and the programs past the last tile return at once. So a call does not wait for the GPU.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from rl_engine.kernels.ops.pytorch.linear.grouped_matmul import NativeGroupedMatmulOp
from rl_engine.kernels.ops.triton.linear.matmul import matmul_config
from rl_engine.kernels.ops.triton.runtime import (
    cast_rne,
    check_devices,
    dot_fp32,
    dot_precision,
    ensure_cuda_context,
    host_descriptor,
    interpreting,
)

TILE_TABLE_BLOCK = 64  # tiles located by one program of the table kernel


@triton.jit
def _grouped_matmul_kernel(
    a_ptr, w_ptr, c_ptr, a_desc, w_desc, tiles_ptr, N, K, w_rows,
    stride_am, stride_ak, stride_we, stride_wk, stride_wn, stride_cm, stride_cn,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    DOT_FP32: tl.constexpr, INPUT_PRECISION: tl.constexpr, TMA: tl.constexpr, TRANSPOSE_W: tl.constexpr,
):  # fmt: skip
    # c[r, n] = sum_k a[r, k] w[e, k, n] for the rows r of one expert's tile (w given by strides, so
    # the stored [E,N,K] weight reads as [E,K,N] forward and as itself, transposed, in backward).
    # TMA: a through a_desc ([R, K] in [BLOCK_M, BLOCK_K] blocks) and w through w_desc, the stored weight
    # seen as [E·w_rows, K'] in [BLOCK_N, BLOCK_K] blocks (forward: its rows are n) or [BLOCK_K, BLOCK_N]
    # blocks (TRANSPOSE_W, backward: its rows are k). A tile's rows past its expert's end, and weight rows
    # past N, read the next expert's rows: they only feed outputs that are never stored. The host takes
    # this path only when no reduction step reads past K (where the next expert's weight rows would be
    # multiplied by a's zero-filled columns).
    # One program per (tile, column block), column blocks fastest: the programs running together share
    # a tile's rows and an expert's weight, so both are read from HBM about once (with tiles fastest,
    # every column block re-read all the rows from HBM: N / BLOCK_N times the rows' bytes).
    num_n = tl.cdiv(N, BLOCK_N)
    tile = tiles_ptr + (tl.program_id(0) // num_n) * 3
    n0 = (tl.program_id(0) % num_n) * BLOCK_N
    expert = tl.load(tile + 0)
    row0 = tl.load(tile + 1)
    row_end = tl.load(tile + 2)
    if row_end <= row0:  # past the last tile (the grid is a bound): nothing to do
        return
    offs_m = row0 + tl.arange(0, BLOCK_M)
    offs_n = n0 + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    m_ok = offs_m < row_end
    n_ok = offs_n < N
    # Rows past the tile's end re-read its first row (never stored), as the matmul op's kernel does.
    # Columns past N are masked, not redirected: backward reads w along n (stride 1), and a
    # tl.where on the column offsets hid that contiguity from Triton (on the H200 this kernel's six
    # calls in a Qwen3-30B-A3B layer's forward + backward took 9.8 ms, about 1 ms of it the forward's
    # three). A masked column only feeds an output column that is never stored.
    safe_m = tl.where(m_ok, offs_m, row0)
    a_ptrs = a_ptr + safe_m.to(tl.int64)[:, None] * stride_am + offs_k[None, :] * stride_ak
    w_ptrs = (w_ptr + expert.to(tl.int64) * stride_we + offs_n.to(tl.int64)[None, :] * stride_wn
              + offs_k[:, None] * stride_wk)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for ki in range(tl.cdiv(K, BLOCK_K)):
        if TMA:
            a = a_desc.load([row0, ki * BLOCK_K])
            if TRANSPOSE_W:
                w = w_desc.load([expert * w_rows + ki * BLOCK_K, n0])
            else:
                w = w_desc.load([expert * w_rows + n0, ki * BLOCK_K]).T
        else:
            k_left = K - ki * BLOCK_K
            a = tl.load(a_ptrs, mask=offs_k[None, :] < k_left, other=0.0)
            w = tl.load(w_ptrs, mask=(offs_k[:, None] < k_left) & n_ok[None, :], other=0.0)
            a_ptrs += BLOCK_K * stride_ak
            w_ptrs += BLOCK_K * stride_wk
        if DOT_FP32:
            a = a.to(tl.float32)
            w = w.to(tl.float32)
        acc = tl.dot(a, w, acc, input_precision=INPUT_PRECISION)
    c_ptrs = c_ptr + offs_m.to(tl.int64)[:, None] * stride_cm + offs_n[None, :] * stride_cn
    tl.store(c_ptrs, cast_rne(acc, c_ptr.dtype.element_ty), mask=m_ok[:, None] & n_ok[None, :])


@triton.jit
def _grouped_weight_grad_kernel(
    g_ptr, a_ptr, dw_ptr, counts_ptr, num_experts, N, K,
    stride_gm, stride_gn, stride_am, stride_ak, stride_de, stride_dn, stride_dk,
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_R: tl.constexpr, E_PAD: tl.constexpr,
    DOT_FP32: tl.constexpr, INPUT_PRECISION: tl.constexpr,
):  # fmt: skip
    # dw[e, n, k] = sum over the rows r of expert e, in order, of g[r, n] a[r, k].
    # One program per (expert, n block, k block), an expert's blocks adjacent: its rows of g and a stay
    # in L2 while every block of its gradient reads them (experts fastest re-read them per block).
    num_k = tl.cdiv(K, BLOCK_K)
    blocks = tl.cdiv(N, BLOCK_N) * num_k
    expert = tl.program_id(0) // blocks
    block = tl.program_id(0) % blocks
    offs_n = (block // num_k) * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = (block % num_k) * BLOCK_K + tl.arange(0, BLOCK_K)
    n_ok = offs_n < N
    k_ok = offs_k < K
    # The expert's rows start after those of the experts before it (E counts: cheaper than a launch).
    e = tl.arange(0, E_PAD)
    counts = tl.load(counts_ptr + e, mask=e < num_experts, other=0)
    first = tl.sum(tl.where(e < expert, counts, 0), axis=0)
    last = first + tl.sum(tl.where(e == expert, counts, 0), axis=0)
    offs_r = tl.arange(0, BLOCK_R)
    acc = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
    for r0 in range(first, last, BLOCK_R):
        r = r0 + offs_r
        r_ok = r < last
        g_t = tl.load(g_ptr + r.to(tl.int64)[None, :] * stride_gm + offs_n[:, None] * stride_gn,
                      mask=r_ok[None, :] & n_ok[:, None], other=0.0)  # [BLOCK_N, BLOCK_R]
        a = tl.load(a_ptr + r.to(tl.int64)[:, None] * stride_am + offs_k[None, :] * stride_ak,
                    mask=r_ok[:, None] & k_ok[None, :], other=0.0)  # [BLOCK_R, BLOCK_K]
        if DOT_FP32:
            g_t = g_t.to(tl.float32)
            a = a.to(tl.float32)
        acc = tl.dot(g_t, a, acc, input_precision=INPUT_PRECISION)
    d_ptrs = dw_ptr + expert.to(tl.int64) * stride_de + offs_n[:, None] * stride_dn + offs_k[None, :] * stride_dk
    tl.store(d_ptrs, cast_rne(acc, dw_ptr.dtype.element_ty), mask=n_ok[:, None] & k_ok[None, :])


@triton.jit
def _tile_table_kernel(counts_ptr, tiles_ptr, num_experts, num_tiles,
                       BLOCK_M: tl.constexpr, E_PAD: tl.constexpr, BLOCK_T: tl.constexpr):
    # One program per BLOCK_T tiles (each re-derives the experts' tile counts: E numbers). The experts
    # before tile t's expert are those whose tiles all end at or before t: counting them, and summing
    # their rows and tiles, locates tile t. Past the last tile: (0, 0, 0).
    e = tl.arange(0, E_PAD)
    counts = tl.load(counts_ptr + e, mask=e < num_experts, other=0).to(tl.int32)
    per = (counts + (BLOCK_M - 1)) // BLOCK_M  # tiles of each expert
    tile_ends = tl.cumsum(per, 0)
    t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    before = tile_ends[None, :] <= t[:, None]  # [BLOCK_T, E_PAD]
    expert = tl.sum(before.to(tl.int32), 1)
    rows_before = tl.sum(tl.where(before, counts[None, :], 0), 1)
    first = rows_before + (t - tl.sum(tl.where(before, per[None, :], 0), 1)) * BLOCK_M
    count = tl.sum(tl.where(e[None, :] == expert[:, None], counts[None, :], 0), 1)
    end = tl.minimum(first + BLOCK_M, rows_before + count)
    used = expert < num_experts
    out = tiles_ptr + t * 3
    ok = t < num_tiles
    tl.store(out + 0, tl.where(used, expert, 0), mask=ok)
    tl.store(out + 1, tl.where(used, first, 0), mask=ok)
    tl.store(out + 2, tl.where(used, end, 0), mask=ok)


def _tile_table(counts: torch.Tensor, block_m: int, rows: int) -> torch.Tensor:
    """int32 [cdiv(rows, block_m) + E, 3]: (expert, first row, end row) of every block_m tile of every
    expert's rows, experts in order, then empty tiles (0, 0, 0): the size is a bound on the tiles that
    needs no count on the host. One launch on the device counts (no host sync)."""
    e = counts.numel()
    tiles = torch.empty(triton.cdiv(rows, block_m) + e, 3, dtype=torch.int32, device=counts.device)
    _tile_table_kernel[(triton.cdiv(tiles.shape[0], TILE_TABLE_BLOCK),)](
        counts, tiles, e, tiles.shape[0], BLOCK_M=block_m, E_PAD=triton.next_power_of_2(e), BLOCK_T=TILE_TABLE_BLOCK)
    return tiles


def _descriptors(a: torch.Tensor, w: torch.Tensor, cfg, transpose_w: bool, k: int):
    """Host TMA descriptors of a [R,K] and of the weight [E,N',K'] seen as [E·N', K'], or None (pointer
    loads): when the config asks for pointers, a layout is not row-major and 16-byte aligned, or the
    backward's reduction (over the stored weight's rows) would step past an expert's rows."""
    size = a.element_size()
    rows_ok = all(t.is_contiguous() and t.data_ptr() % 16 == 0 and (t.shape[-1] * size) % 16 == 0 for t in (a, w))
    if not cfg.tma or not rows_ok or (transpose_w and k % cfg.block_k):
        return None
    if a.is_cuda and not interpreting():
        ensure_cuda_context(a.device.index)  # autograd's backward thread may have no context yet
    e, n_w, k_w = w.shape
    w_block = [cfg.block_k, cfg.block_n] if transpose_w else [cfg.block_n, cfg.block_k]
    return (host_descriptor(a, list(a.shape), [a.stride(0), 1], [cfg.block_m, cfg.block_k]),
            host_descriptor(w, [e * n_w, k_w], [k_w, 1], w_block))


def _launch(a: torch.Tensor, w: torch.Tensor, counts: torch.Tensor, *, transpose_w: bool, tables: dict):
    """a [R,K'] @ (w[e]^T if not transpose_w else w[e]) per expert; w stored [E,N,K]. `tables`: tile
    tables by BLOCK_M, filled here; the backward reuses the forward's (the same counts and rows)."""
    e, n_w, k_w = w.shape
    n, k = (k_w, n_w) if transpose_w else (n_w, k_w)
    out = torch.empty(a.shape[0], n, dtype=a.dtype, device=a.device)
    cfg = matmul_config(a.dtype, n, k)
    if a.shape[0] == 0 or n == 0:
        return out
    if cfg.block_m not in tables:
        tables[cfg.block_m] = _tile_table(counts, cfg.block_m, a.shape[0])
    tiles = tables[cfg.block_m]
    # Forward reads w[e] as [K,N]: k steps along w's last dim; backward reads it as stored [N',K'].
    stride_wk, stride_wn = (w.stride(1), w.stride(2)) if transpose_w else (w.stride(2), w.stride(1))
    descs = _descriptors(a, w, cfg, transpose_w, k)
    _grouped_matmul_kernel[(tiles.shape[0] * triton.cdiv(n, cfg.block_n),)](
        a, w, out, *(descs or (a, w)), tiles, n, k, w.shape[1],
        a.stride(0), a.stride(1), w.stride(0), stride_wk, stride_wn, out.stride(0), out.stride(1),
        BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k,
        DOT_FP32=dot_fp32(a.dtype), INPUT_PRECISION=dot_precision(a.dtype), TMA=descs is not None,
        TRANSPOSE_W=transpose_w, num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )
    return out


def _weight_grad(grad_out: torch.Tensor, a: torch.Tensor, w: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
    e, n, k = w.shape
    dw = torch.empty_like(w)
    cfg = matmul_config(a.dtype, n, k)
    # The row step is the matmul table's K step: the reduction over tokens walks them in BLOCK_K rows.
    block_n, block_k, block_r = min(cfg.block_m, 128), min(cfg.block_n, 128), cfg.block_k
    _grouped_weight_grad_kernel[(e * triton.cdiv(n, block_n) * triton.cdiv(k, block_k),)](
        grad_out, a, dw, counts, e, n, k,
        grad_out.stride(0), grad_out.stride(1), a.stride(0), a.stride(1), dw.stride(0), dw.stride(1), dw.stride(2),
        BLOCK_N=block_n, BLOCK_K=block_k, BLOCK_R=block_r, E_PAD=triton.next_power_of_2(e),
        DOT_FP32=dot_fp32(a.dtype), INPUT_PRECISION=dot_precision(a.dtype),
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )
    return dw


class _GroupedMatmul(torch.autograd.Function):
    @staticmethod
    def forward(ctx, rows, weight, counts):
        ctx.save_for_backward(rows, weight, counts)
        ctx.tables = {}
        return _launch(rows, weight, counts, transpose_w=False, tables=ctx.tables)

    @staticmethod
    def backward(ctx, grad_out):
        rows, weight, counts = ctx.saved_tensors
        grad_out = grad_out.contiguous()
        d_rows = (_launch(grad_out, weight, counts, transpose_w=True, tables=ctx.tables)
                  if ctx.needs_input_grad[0] else None)
        d_weight = _weight_grad(grad_out, rows, weight, counts) if ctx.needs_input_grad[1] else None
        return d_rows, d_weight, None


def grouped_matmul(rows: torch.Tensor, weight: torch.Tensor, counts) -> torch.Tensor:
    """[R,N]: rows [R,K] (sorted by expert, counts[e] rows of expert e) times weight[e]^T, weight [E,N,K].

    `counts`: an integer tensor [E] on the rows' device, trusted (checking its sum would wait for the
    GPU), or a host list of ints, checked and copied to the device."""
    if rows.dim() != 2 or weight.dim() != 3:
        raise ValueError(f"rows [R,K] and weight [E,N,K] expected, got {tuple(rows.shape)} and {tuple(weight.shape)}")
    if weight.shape[2] != rows.shape[1]:
        raise ValueError(f"weight: expected K = {rows.shape[1]} (rows' last dim), got {weight.shape[2]}")
    if not isinstance(counts, torch.Tensor):
        if len(counts) != weight.shape[0] or sum(counts) != rows.shape[0] or min(counts, default=0) < 0:
            raise ValueError(f"counts: expected {weight.shape[0]} non-negative counts summing to {rows.shape[0]}, "
                             f"got {len(counts)} summing to {sum(counts)}")
        counts = torch.tensor(counts, device=rows.device)
    if tuple(counts.shape) != (weight.shape[0],) or counts.is_floating_point() or counts.device != rows.device:
        raise ValueError(f"counts: expected an integer tensor [{weight.shape[0]}] on {rows.device}, "
                         f"got {counts.dtype} {tuple(counts.shape)} on {counts.device}")
    if rows.dtype != weight.dtype:
        raise ValueError(f"weight: expected rows' dtype {rows.dtype}, got {weight.dtype}")
    return _GroupedMatmul.apply(rows, weight, counts.to(torch.int64))


def triton_grouped_matmul(x: torch.Tensor, weight: torch.Tensor, expert_ids: torch.Tensor) -> torch.Tensor:
    """[B,S,N]: each row x[b,s] times weight[expert_ids[b,s]]^T. Rows are sorted by expert (stably: token
    order within an expert) for the grouped kernel and put back."""
    b, s, k = x.shape
    ids = expert_ids.reshape(-1)
    order = torch.sort(ids, stable=True).indices
    counts = torch.bincount(ids, minlength=weight.shape[0])
    out_sorted = grouped_matmul(x.reshape(-1, k)[order], weight, counts)
    # index_copy writes each row once (backward: a gather), so nothing is summed in an unknown order.
    out = out_sorted.new_empty(out_sorted.shape).index_copy(0, order, out_sorted)
    return out.reshape(b, s, weight.shape[1])


class TritonGroupedMatmulOp:
    """Triton candidate for NativeGroupedMatmulOp: op(x=[B,S,K], weight=[E,N,K], expert_ids=[B,S]), or
    counts=[E] for rows already grouped by expert: then they go straight to the kernel, no sort, no
    gather, no read-back (the MoE layer's call)."""

    input_names = NativeGroupedMatmulOp.input_names

    def __call__(self, *, x, weight, expert_ids=None, counts=None):
        check_devices("TritonGroupedMatmulOp", x=x, weight=weight, expert_ids=expert_ids, counts=counts)
        if counts is None:  # the checks of the ids' values read them back: only on this path
            NativeGroupedMatmulOp().validate(x=x, weight=weight, expert_ids=expert_ids)
        else:
            NativeGroupedMatmulOp.validate_shapes(x, weight, expert_ids, counts)
        if x.dtype != weight.dtype:
            raise ValueError(f"weight: expected x's dtype {x.dtype}, got {weight.dtype}")
        if counts is None:
            return triton_grouped_matmul(x, weight, expert_ids)
        return grouped_matmul(x.reshape(-1, x.shape[-1]), weight, counts).view(*x.shape[:2], weight.shape[1])
