"""rmsnorm_residual: y = bf16((h · r) · γ), r = rsqrt(lane_sum_c(h²) ÷ C + eps), h = x or bf16(x + residual);
forward and backward (oracle.rmsnorm_residual_*).

Per token the forward makes two passes over the channels: the lane fold of h² (writing the fork h when
there is a residual), then y. The backward's per-token pass folds h² and g·h (g = d_y · γ) together,
then writes d_x; d_gamma reduces over tokens (lanes over the token axis) in a second kernel.
"""

import torch
import triton
import triton.language as tl

from rl_engine.kernels.ops.triton.runtime import cast_rne
from rl_engine.mhc.contract import LayerContract
from rl_engine.mhc.kernels import strict_fp32 as sf
from rl_engine.mhc.kernels.launch import STRICT, lanes

BLOCK_T = 4
BLOCK_C_GAMMA = 32


@triton.jit
def norm_factor(s, C, eps):
    """r = rsqrt(s ÷ C + eps) (the RMSNorm eps is always inside the root)."""
    return sf.rsqrt(sf.div(s, tl.zeros_like(s) + C) + eps)


@triton.jit
def _fwd_kernel(x_ptr, res_ptr, gamma_ptr, y_ptr, h_ptr, T, C, eps, HAS_RESIDUAL: tl.constexpr,
                L: tl.constexpr, LOG2_L: tl.constexpr, BT: tl.constexpr):
    t = tl.program_id(0) * BT + tl.arange(0, BT)
    t_ok = t < T
    j = tl.arange(0, L)
    row = t[:, None].to(tl.int64) * C
    acc = tl.zeros([BT, L], tl.float32)
    for c0 in range(0, C, L):
        c = c0 + j
        ok = t_ok[:, None] & (c < C)[None, :]
        h = tl.load(x_ptr + row + c[None, :], mask=ok, other=0.0).to(tl.float32)
        if HAS_RESIDUAL:
            hb = cast_rne(h + tl.load(res_ptr + row + c[None, :], mask=ok, other=0.0).to(tl.float32), tl.bfloat16)
            tl.store(h_ptr + row + c[None, :], hb, mask=ok)
            h = hb.to(tl.float32)
        acc += h * h
    r = norm_factor(sf.pairwise_tree(acc, BT, L, LOG2_L), C, eps)[:, None]
    if HAS_RESIDUAL:
        tl.debug_barrier()  # the second pass reads the fork this program just wrote
    src = h_ptr if HAS_RESIDUAL else x_ptr
    for c0 in range(0, C, L):
        c = c0 + j
        ok = t_ok[:, None] & (c < C)[None, :]
        h = tl.load(src + row + c[None, :], mask=ok, other=0.0).to(tl.float32)
        gamma = tl.load(gamma_ptr + c, mask=c < C, other=0.0)[None, :]
        tl.store(y_ptr + row + c[None, :], cast_rne((h * r) * gamma, tl.bfloat16), mask=ok)


def rmsnorm_residual_fwd(x: torch.Tensor, gamma: torch.Tensor, residual, contract: LayerContract):
    """oracle.rmsnorm_residual_fwd: x [T, C] bf16 (+ residual) → (y, h) [T, C] bf16."""
    t, c = x.shape
    lane_count, log2_l = lanes(contract)
    x = x.contiguous()
    y = torch.empty_like(x)
    h = x if residual is None else torch.empty_like(x)
    res = x if residual is None else residual.contiguous()
    _fwd_kernel[(triton.cdiv(t, BLOCK_T),)](x, res, gamma.contiguous(), y, h, t, c, contract.rmsnorm_eps,
                                            HAS_RESIDUAL=residual is not None, L=lane_count, LOG2_L=log2_l,
                                            BT=BLOCK_T, **STRICT)
    return y, h


@triton.jit
def _bwd_kernel(h_ptr, gamma_ptr, dy_ptr, dh_ptr, dx_ptr, r_ptr, T, C, eps, HAS_DH: tl.constexpr,
                L: tl.constexpr, LOG2_L: tl.constexpr, BT: tl.constexpr):
    """g = d_y · γ; c = lane_sum(g · h); d_x = (g · r) − h · ((((c · r) · r) · r) ÷ C) [+ d_h]; r saved."""
    t = tl.program_id(0) * BT + tl.arange(0, BT)
    t_ok = t < T
    j = tl.arange(0, L)
    row = t[:, None].to(tl.int64) * C
    acc_s = tl.zeros([BT, L], tl.float32)
    acc_c = tl.zeros([BT, L], tl.float32)
    for c0 in range(0, C, L):
        c = c0 + j
        ok = t_ok[:, None] & (c < C)[None, :]
        h = tl.load(h_ptr + row + c[None, :], mask=ok, other=0.0).to(tl.float32)
        g = tl.load(dy_ptr + row + c[None, :], mask=ok, other=0.0).to(tl.float32) * \
            tl.load(gamma_ptr + c, mask=c < C, other=0.0)[None, :]
        acc_s += h * h
        acc_c += g * h
    r = norm_factor(sf.pairwise_tree(acc_s, BT, L, LOG2_L), C, eps)
    dot = sf.pairwise_tree(acc_c, BT, L, LOG2_L)
    coef = sf.div(((dot * r) * r) * r, tl.zeros_like(r) + C)[:, None]
    tl.store(r_ptr + t, r, mask=t_ok)
    r = r[:, None]
    for c0 in range(0, C, L):
        c = c0 + j
        ok = t_ok[:, None] & (c < C)[None, :]
        h = tl.load(h_ptr + row + c[None, :], mask=ok, other=0.0).to(tl.float32)
        g = tl.load(dy_ptr + row + c[None, :], mask=ok, other=0.0).to(tl.float32) * \
            tl.load(gamma_ptr + c, mask=c < C, other=0.0)[None, :]
        d_x = (g * r) - h * coef
        if HAS_DH:
            d_x = d_x + tl.load(dh_ptr + row + c[None, :], mask=ok, other=0.0).to(tl.float32)
        tl.store(dx_ptr + row + c[None, :], d_x, mask=ok)


@triton.jit
def _dgamma_kernel(h_ptr, dy_ptr, r_ptr, dgamma_ptr, T, C, L: tl.constexpr, LOG2_L: tl.constexpr,
                   BC: tl.constexpr):
    """d_gamma[c] = lane_sum_t(d_y · (h · r)), lanes over the token axis."""
    c = tl.program_id(0) * BC + tl.arange(0, BC)
    c_ok = c < C
    j = tl.arange(0, L)
    acc = tl.zeros([BC, L], tl.float32)
    for t0 in range(0, T, L):
        t = t0 + j
        t_ok = t < T
        idx = t[None, :].to(tl.int64) * C + c[:, None]
        ok = c_ok[:, None] & t_ok[None, :]
        h = tl.load(h_ptr + idx, mask=ok, other=0.0).to(tl.float32)
        dy = tl.load(dy_ptr + idx, mask=ok, other=0.0).to(tl.float32)
        r = tl.load(r_ptr + t, mask=t_ok, other=0.0)[None, :]
        acc += dy * (h * r)
    tl.store(dgamma_ptr + c, sf.pairwise_tree(acc, BC, L, LOG2_L), mask=c_ok)


def rmsnorm_residual_bwd(h: torch.Tensor, gamma: torch.Tensor, d_y: torch.Tensor, d_h, contract: LayerContract):
    """oracle.rmsnorm_residual_bwd → (d_x [T, C], d_gamma [C]), fp32."""
    t, c = h.shape
    lane_count, log2_l = lanes(contract)
    h, gamma, d_y = h.contiguous(), gamma.contiguous(), d_y.contiguous()
    d_x = torch.empty(t, c, dtype=torch.float32, device=h.device)
    r = torch.empty(t, dtype=torch.float32, device=h.device)
    _bwd_kernel[(triton.cdiv(t, BLOCK_T),)](h, gamma, d_y, d_y if d_h is None else d_h.contiguous(), d_x, r, t, c,
                                            contract.rmsnorm_eps, HAS_DH=d_h is not None, L=lane_count,
                                            LOG2_L=log2_l, BT=BLOCK_T, **STRICT)
    d_gamma = torch.empty(c, dtype=torch.float32, device=h.device)
    _dgamma_kernel[(triton.cdiv(c, BLOCK_C_GAMMA),)](h, d_y, r, d_gamma, t, c, L=lane_count, LOG2_L=log2_l,
                                                     BC=BLOCK_C_GAMMA, **STRICT)
    return d_x, d_gamma
