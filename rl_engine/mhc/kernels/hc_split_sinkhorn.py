"""hc_split_sinkhorn: H_pre, H_post and the Sinkhorn-normalised H_res per token, forward and backward.

Per token everything is a handful of 4-vectors and one 4×4 matrix, held as [BT, 4] / [BT, 4, 4]
tensors (row i, column j). colsum/rowsum are numerics.tree4 over the row/column axis; every
normalisation divides by the broadcast divisor with div_rn, as the oracle does.
The backward replays the forward and keeps every Sinkhorn input M_s in a scratch buffer
[T, 2·iters, 16] (read back in reverse), rather than recomputing the trajectory per step.
"""

import torch
import triton
import triton.language as tl

from rl_engine.mhc.contract import LayerContract
from rl_engine.mhc.kernels import strict_fp32 as sf
from rl_engine.mhc.kernels.launch import STRICT

BLOCK_T = 32


@triton.jit
def _colsum(m, BT: tl.constexpr):
    """[BT, 4, 4] → [BT, 1, 4]: tree4 over rows i."""
    return tl.reshape(sf.tree4_middle(m, BT, 4), [BT, 1, 4])


@triton.jit
def _rowsum(m, BT: tl.constexpr):
    """[BT, 4, 4] → [BT, 4, 1]: tree4 over columns j."""
    return tl.reshape(sf.tree4_last(m, BT, 4), [BT, 4, 1])


@triton.jit
def _load_controller(h_ptr, t, t_ok, BT: tl.constexpr):
    c4 = tl.arange(0, 4)
    row = t.to(tl.int64) * 24
    pre = tl.load(h_ptr + row[:, None] + c4[None, :], mask=t_ok[:, None], other=0.0)
    post = tl.load(h_ptr + row[:, None] + 4 + c4[None, :], mask=t_ok[:, None], other=0.0)
    res_idx = row[:, None, None] + 8 + c4[None, :, None] * 4 + c4[None, None, :]
    logits = tl.load(h_ptr + res_idx, mask=t_ok[:, None, None], other=0.0)
    return pre, post, logits


@triton.jit
def _softmax_rows(logits, BT: tl.constexpr):
    """numerics.softmax4 on each row: m = max((l0, l1), (l2, l3)); e = exp(l − m); e ÷ tree4(e)."""
    m = tl.max(logits, axis=2)  # max is exact whatever the order
    e = sf.exp(logits - m[:, :, None])
    return sf.div(e, _rowsum(e, BT))


@triton.jit
def _fwd_kernel(h_ptr, pre_ptr, post_ptr, res_ptr, T, eps, ITERS: tl.constexpr, BT: tl.constexpr):
    t = tl.program_id(0) * BT + tl.arange(0, BT)
    t_ok = t < T
    pre, post, logits = _load_controller(h_ptr, t, t_ok, BT)
    m = _softmax_rows(logits, BT) + eps
    m = sf.div(m, _colsum(m, BT) + eps)
    for _ in range(ITERS - 1):
        m = sf.div(m, _rowsum(m, BT) + eps)
        m = sf.div(m, _colsum(m, BT) + eps)
    c4 = tl.arange(0, 4)
    tl.store(pre_ptr + t[:, None].to(tl.int64) * 4 + c4[None, :], sf.sigmoid(pre) + eps, mask=t_ok[:, None])
    tl.store(post_ptr + t[:, None].to(tl.int64) * 4 + c4[None, :], sf.sigmoid(post) * 2.0, mask=t_ok[:, None])
    res_idx = t[:, None, None].to(tl.int64) * 16 + c4[None, :, None] * 4 + c4[None, None, :]
    tl.store(res_ptr + res_idx, m, mask=t_ok[:, None, None])


def hc_split_sinkhorn_fwd(h: torch.Tensor, contract: LayerContract):
    """oracle.hc_split_sinkhorn_fwd: h [T, 24] → (H_pre [T, 4], H_post [T, 4], H_res [T, 4, 4]) fp32."""
    t = h.shape[0]
    pre = torch.empty(t, 4, dtype=torch.float32, device=h.device)
    post = torch.empty_like(pre)
    res = torch.empty(t, 4, 4, dtype=torch.float32, device=h.device)
    _fwd_kernel[(triton.cdiv(t, BLOCK_T),)](h.contiguous(), pre, post, res, t, contract.mhc_eps,
                                            ITERS=contract.sinkhorn_iters, BT=BLOCK_T, **STRICT)
    return pre, post, res


@triton.jit
def _col_step_bwd(g, m, eps, BT: tl.constexpr):
    """Y = M ÷ (colsum(M) + eps): c = colsum(G · Y); dM = (G − c) ÷ d."""
    d = _colsum(m, BT) + eps
    y = sf.div(m, d)
    return sf.div(g - _colsum(g * y, BT), d)


@triton.jit
def _row_step_bwd(g, m, eps, BT: tl.constexpr):
    d = _rowsum(m, BT) + eps
    y = sf.div(m, d)
    return sf.div(g - _rowsum(g * y, BT), d)


@triton.jit
def _bwd_kernel(h_ptr, dpre_ptr, dpost_ptr, dres_ptr, dh_ptr, scratch_ptr, T, eps,
                ITERS: tl.constexpr, BT: tl.constexpr):
    t = tl.program_id(0) * BT + tl.arange(0, BT)
    t_ok = t < T
    c4 = tl.arange(0, 4)
    pre, post, logits = _load_controller(h_ptr, t, t_ok, BT)
    prob = _softmax_rows(logits, BT)
    # forward replay: M_0 = P + eps, then every normalisation's input, kept for the reverse pass
    mat = c4[None, :, None] * 4 + c4[None, None, :]
    scratch = scratch_ptr + t[:, None, None].to(tl.int64) * (2 * ITERS * 16) + mat
    m = prob + eps
    tl.store(scratch, m, mask=t_ok[:, None, None])
    m = sf.div(m, _colsum(m, BT) + eps)
    for it in range(1, ITERS):
        tl.store(scratch + (2 * it - 1) * 16, m, mask=t_ok[:, None, None])
        m = sf.div(m, _rowsum(m, BT) + eps)
        tl.store(scratch + (2 * it) * 16, m, mask=t_ok[:, None, None])
        m = sf.div(m, _colsum(m, BT) + eps)
    tl.debug_barrier()  # the reverse pass reads what this program just wrote
    res_idx = t[:, None, None].to(tl.int64) * 16 + mat
    g = tl.load(dres_ptr + res_idx, mask=t_ok[:, None, None], other=0.0)
    for k in range(0, ITERS - 1):
        it = ITERS - 1 - k
        g = _col_step_bwd(g, tl.load(scratch + (2 * it) * 16, mask=t_ok[:, None, None], other=1.0), eps, BT)
        g = _row_step_bwd(g, tl.load(scratch + (2 * it - 1) * 16, mask=t_ok[:, None, None], other=1.0), eps, BT)
    g = _col_step_bwd(g, tl.load(scratch, mask=t_ok[:, None, None], other=1.0), eps, BT)
    d_logits = prob * (g - _rowsum(g * prob, BT))
    s_pre = sf.sigmoid(pre)
    s_post = sf.sigmoid(post)
    v4 = t[:, None].to(tl.int64) * 4 + c4[None, :]
    d_pre = (tl.load(dpre_ptr + v4, mask=t_ok[:, None], other=0.0) * s_pre) * (1.0 - s_pre)
    d_post = ((tl.load(dpost_ptr + v4, mask=t_ok[:, None], other=0.0) * 2.0) * s_post) * (1.0 - s_post)
    row = t.to(tl.int64) * 24
    tl.store(dh_ptr + row[:, None] + c4[None, :], d_pre, mask=t_ok[:, None])
    tl.store(dh_ptr + row[:, None] + 4 + c4[None, :], d_post, mask=t_ok[:, None])
    tl.store(dh_ptr + row[:, None, None] + 8 + mat, d_logits, mask=t_ok[:, None, None])


def hc_split_sinkhorn_bwd(h, d_h_pre, d_h_post, d_h_res, contract: LayerContract) -> torch.Tensor:
    """oracle.hc_split_sinkhorn_bwd → d_h [T, 24] fp32, unrolled through every Sinkhorn step."""
    t = h.shape[0]
    iters = contract.sinkhorn_iters
    d_h = torch.empty(t, 24, dtype=torch.float32, device=h.device)
    scratch = torch.empty(t, 2 * iters, 16, dtype=torch.float32, device=h.device)
    f32 = torch.float32
    _bwd_kernel[(triton.cdiv(t, BLOCK_T),)](
        h.contiguous(), d_h_pre.to(f32).contiguous(), d_h_post.to(f32).contiguous(),
        d_h_res.to(f32).contiguous(), d_h, scratch, t, contract.mhc_eps, ITERS=iters, BT=BLOCK_T, **STRICT)
    return d_h
