"""Controller affine h = ((r · p) · α(n)) + b[n], forward and backward (oracle.controller_affine_*).

α(n) is α_pre for n < 4, α_post for n < 8, α_res otherwise. The backward's per-token reduction
(d_r, over the 24 outputs) is a tree over 24 values padded with +0.0 to 32; the parameter gradients
(d_alpha, d_bias) reduce over tokens with the lane fold, in one program (they are [3] and [24]).
"""

import torch
import triton
import triton.language as tl

from rl_engine.mhc.contract import LayerContract
from rl_engine.mhc.kernels import strict_fp32 as sf
from rl_engine.mhc.kernels.launch import STRICT, lanes

BLOCK_T = 32


@triton.jit
def _alpha_index(n):
    return tl.where(n < 4, 0, tl.where(n < 8, 1, 2))


@triton.jit
def _fwd_kernel(p_ptr, r_ptr, alpha_ptr, bias_ptr, h_ptr, T, BT: tl.constexpr):
    t = tl.program_id(0) * BT + tl.arange(0, BT)
    n = tl.arange(0, 32)
    ok = (t < T)[:, None] & (n < 24)[None, :]
    idx = t[:, None].to(tl.int64) * 24 + n[None, :]
    p = tl.load(p_ptr + idx, mask=ok, other=0.0)
    r = tl.load(r_ptr + t, mask=t < T, other=0.0)
    alpha = tl.load(alpha_ptr + _alpha_index(n))
    bias = tl.load(bias_ptr + n, mask=n < 24, other=0.0)
    h = ((r[:, None] * p) * alpha[None, :]) + bias[None, :]
    tl.store(h_ptr + idx, h, mask=ok)


def controller_affine_fwd(p, r, alpha, bias, contract: LayerContract) -> torch.Tensor:
    t = p.shape[0]
    h = torch.empty(t, 24, dtype=torch.float32, device=p.device)
    _fwd_kernel[(triton.cdiv(t, BLOCK_T),)](p.contiguous(), r.contiguous(), alpha.contiguous(), bias.contiguous(),
                                            h, t, BT=BLOCK_T, **STRICT)
    return h


@triton.jit
def _bwd_token_kernel(p_ptr, r_ptr, alpha_ptr, dh_ptr, dp_ptr, dr_ptr, T, BT: tl.constexpr):
    """g = d_h · α(n); d_p = g · r; d_r = tree_n(g · p)."""
    t = tl.program_id(0) * BT + tl.arange(0, BT)
    n = tl.arange(0, 32)
    ok = (t < T)[:, None] & (n < 24)[None, :]
    idx = t[:, None].to(tl.int64) * 24 + n[None, :]
    p = tl.load(p_ptr + idx, mask=ok, other=0.0)
    d_h = tl.load(dh_ptr + idx, mask=ok, other=0.0)
    r = tl.load(r_ptr + t, mask=t < T, other=0.0)
    alpha = tl.load(alpha_ptr + _alpha_index(n))
    g = d_h * alpha[None, :]
    tl.store(dp_ptr + idx, g * r[:, None], mask=ok)
    tl.store(dr_ptr + t, sf.pairwise_tree(g * p, BT, 32, 5), mask=t < T)


@triton.jit
def _segment(p_ptr, dh_ptr, r, t, t_ok, START: tl.constexpr, WIDTH: tl.constexpr, LOG2_W: tl.constexpr,
             L: tl.constexpr):
    """Per token: tree over n in [START, START + WIDTH) of d_h · (r · p)  → [L]."""
    n = START + tl.arange(0, WIDTH)
    idx = t[:, None].to(tl.int64) * 24 + n[None, :]
    p = tl.load(p_ptr + idx, mask=t_ok[:, None], other=0.0)
    d_h = tl.load(dh_ptr + idx, mask=t_ok[:, None], other=0.0)
    return sf.pairwise_tree(d_h * (r[:, None] * p), L, WIDTH, LOG2_W)


@triton.jit
def _bwd_param_kernel(p_ptr, r_ptr, dh_ptr, dalpha_ptr, dbias_ptr, T,
                      L: tl.constexpr, LOG2_L: tl.constexpr):
    """One program: d_alpha[s] = lane_sum_t(segment sums), d_bias[n] = lane_sum_t(d_h[:, n])."""
    j = tl.arange(0, L)
    n = tl.arange(0, 32)
    acc_pre = tl.zeros([L], tl.float32)
    acc_post = tl.zeros([L], tl.float32)
    acc_res = tl.zeros([L], tl.float32)
    acc_bias = tl.zeros([32, L], tl.float32)
    for t0 in range(0, T, L):
        t = t0 + j
        t_ok = t < T
        r = tl.load(r_ptr + t, mask=t_ok, other=0.0)
        acc_pre += _segment(p_ptr, dh_ptr, r, t, t_ok, 0, 4, 2, L)
        acc_post += _segment(p_ptr, dh_ptr, r, t, t_ok, 4, 4, 2, L)
        acc_res += _segment(p_ptr, dh_ptr, r, t, t_ok, 8, 16, 4, L)
        acc_bias += tl.load(dh_ptr + t[None, :].to(tl.int64) * 24 + n[:, None],
                            mask=t_ok[None, :] & (n < 24)[:, None], other=0.0)
    one = tl.arange(0, 1)
    tl.store(dalpha_ptr + 0 + one, sf.pairwise_tree(tl.reshape(acc_pre, [1, L]), 1, L, LOG2_L))
    tl.store(dalpha_ptr + 1 + one, sf.pairwise_tree(tl.reshape(acc_post, [1, L]), 1, L, LOG2_L))
    tl.store(dalpha_ptr + 2 + one, sf.pairwise_tree(tl.reshape(acc_res, [1, L]), 1, L, LOG2_L))
    tl.store(dbias_ptr + n, sf.pairwise_tree(acc_bias, 32, L, LOG2_L), mask=n < 24)


def controller_affine_bwd(p, r, alpha, d_h, contract: LayerContract):
    """oracle.controller_affine_bwd → (d_p [T, 24], d_r [T], d_alpha [3] or None, d_bias [24] or None)."""
    t = p.shape[0]
    p, r, alpha, d_h = p.contiguous(), r.contiguous(), alpha.contiguous(), d_h.to(torch.float32).contiguous()
    d_p = torch.empty(t, 24, dtype=torch.float32, device=p.device)
    d_r = torch.empty(t, dtype=torch.float32, device=p.device)
    _bwd_token_kernel[(triton.cdiv(t, BLOCK_T),)](p, r, alpha, d_h, d_p, d_r, t, BT=BLOCK_T, **STRICT)
    if contract.trainability != "full":
        return d_p, d_r, None, None
    lane_count, log2_l = lanes(contract)
    d_alpha = torch.empty(3, dtype=torch.float32, device=p.device)
    d_bias = torch.empty(24, dtype=torch.float32, device=p.device)
    _bwd_param_kernel[(1,)](p, r, d_h, d_alpha, d_bias, t, L=lane_count, LOG2_L=log2_l, **STRICT)
    return d_p, d_r, d_alpha, d_bias
