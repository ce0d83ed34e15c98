"""fused_pre_norm: mhc_pre and RMSNorm as one operator, byte-identical to the pair (oracle.mhc_pre_rmsnorm_*).

Forward, one kernel per token block: pass 1 aggregates u, casts it to bf16 (the fusion may not move
that downcast), stores it and lane-folds u²; pass 2 normalises the stored u. The backward is the
composition the oracle defines (rmsnorm backward, then mhc_pre backward): two launches, with d_u in
fp32 between them.
"""

import torch
import triton
import triton.language as tl

from rl_engine.kernels.ops.triton.runtime import cast_rne
from rl_engine.mhc.contract import LayerContract
from rl_engine.mhc.kernels.launch import STRICT, lanes
from rl_engine.mhc.kernels.mhc_pre import aggregate, mhc_pre_bwd
from rl_engine.mhc.kernels.rmsnorm_residual import norm_factor, rmsnorm_residual_bwd
from rl_engine.mhc.kernels.strict_fp32 import pairwise_tree

BLOCK_T = 4


@triton.jit
def _fwd_kernel(x_ptr, hp_ptr, gamma_ptr, u_ptr, y_ptr, T, C, eps,
                L: tl.constexpr, LOG2_L: tl.constexpr, BT: tl.constexpr):
    t = tl.program_id(0) * BT + tl.arange(0, BT)
    t_ok = t < T
    j = tl.arange(0, L)
    row = t[:, None].to(tl.int64) * C
    acc = tl.zeros([BT, L], tl.float32)
    for c0 in range(0, C, L):
        c = c0 + j
        c_ok = c < C
        u = cast_rne(aggregate(x_ptr, hp_ptr, t, c, t_ok, c_ok, C), tl.bfloat16)
        tl.store(u_ptr + row + c[None, :], u, mask=t_ok[:, None] & c_ok[None, :])
        u32 = u.to(tl.float32)
        acc += u32 * u32
    r = norm_factor(pairwise_tree(acc, BT, L, LOG2_L), C, eps)[:, None]
    tl.debug_barrier()  # pass 2 reads the u this program just wrote
    for c0 in range(0, C, L):
        c = c0 + j
        ok = t_ok[:, None] & (c < C)[None, :]
        u = tl.load(u_ptr + row + c[None, :], mask=ok, other=0.0).to(tl.float32)
        gamma = tl.load(gamma_ptr + c, mask=c < C, other=0.0)[None, :]
        tl.store(y_ptr + row + c[None, :], cast_rne((u * r) * gamma, tl.bfloat16), mask=ok)


def mhc_pre_rmsnorm_fwd(streams, h_pre, gamma, contract: LayerContract):
    """→ (y, u) [T, C] bf16, the bytes of mhc_pre_fwd then rmsnorm_residual_fwd."""
    t, c = streams.shape[0], contract.hidden
    lane_count, log2_l = lanes(contract)
    u = torch.empty(t, c, dtype=torch.bfloat16, device=streams.device)
    y = torch.empty_like(u)
    _fwd_kernel[(triton.cdiv(t, BLOCK_T),)](streams.contiguous(), h_pre.contiguous(), gamma.contiguous(), u, y, t, c,
                                            contract.rmsnorm_eps, L=lane_count, LOG2_L=log2_l, BT=BLOCK_T, **STRICT)
    return y, u


def mhc_pre_rmsnorm_bwd(streams, h_pre, gamma, u, d_y, contract: LayerContract):
    """→ (d_streams [T, 4, C], d_h_pre [T, 4], d_gamma [C]), fp32."""
    d_u, d_gamma = rmsnorm_residual_bwd(u, gamma, d_y, None, contract)
    d_streams, d_h_pre = mhc_pre_bwd(streams, h_pre, d_u, contract)
    return d_streams, d_h_pre, d_gamma
