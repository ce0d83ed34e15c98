"""The attention dispatch shared by every entry point (prefill, packed, KV cache): `flash_forward` and
`flash_backward` run the rows given on the Gluon kernels (gluon_forward.py, gluon_backward.py, gluon_decode.py:
sm_90, bf16, where they cover the rows, with the same bits) or else on flash.py's Triton kernels;
`flash_attention` is their torch custom op, differentiable in out.

Layers, no cycle: contract.py (constants, tile configurations, the sequence table) <- flash.py and the Gluon
kernels <- this module, which imports both (the Gluon modules late: they import Gluon).
"""

from __future__ import annotations

import torch
import triton

from rl_engine.kernels.ops.triton.attention.contract import (
    COMBINE_BLOCK_R,
    LOG2_E,
    SequenceTable,
    attention_config,
    block_d,
)
from rl_engine.kernels.ops.triton.attention.flash import (
    _flash_backward_delta_kernel,
    _flash_backward_dkdv_kernel,
    _flash_backward_dq_kernel,
    _flash_forward_kernel,
    _split_combine_kernel,
)
from rl_engine.kernels.ops.triton.runtime import (
    SideStream,
    dot_fp32,
    dot_precision,
    ensure_cuda_context,
    host_descriptor,
    interpreting,
    register_autograd,
)


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
        from rl_engine.kernels.ops.triton.attention import gluon_decode  # imports Gluon

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
    # (SideStream), joined before returning; forward + backward 3-5.5% faster on the H200.
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
