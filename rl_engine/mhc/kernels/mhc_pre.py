"""mhc_pre (h_aggregate): u = bf16(tree4_i(H_pre[i] · X_i)), forward and backward (oracle.mhc_pre_*).

Forward is elementwise per (token, channel). The backward writes d_streams = H_pre[i] · d_u and, in the
same pass over the channels, lane-folds d_h_pre[i] = Σ_c d_u · X_i (lanes over the channel axis).
"""

import torch
import triton
import triton.language as tl

from rl_engine.kernels.ops.triton.runtime import cast_rne
from rl_engine.mhc.contract import LayerContract
from rl_engine.mhc.kernels import strict_fp32 as sf
from rl_engine.mhc.kernels.launch import STRICT, lanes


@triton.jit
def aggregate(x_ptr, hp_ptr, t, c, t_ok, c_ok, C):
    """fp32 tree4_i(H_pre[t, i] · X[t, i, c]) for a [BT, BC] tile (the value before the bf16 cast)."""
    base = x_ptr + t[:, None].to(tl.int64) * (4 * C) + c[None, :]
    ok = t_ok[:, None] & c_ok[None, :]
    x0 = tl.load(base, mask=ok, other=0.0).to(tl.float32)
    x1 = tl.load(base + C, mask=ok, other=0.0).to(tl.float32)
    x2 = tl.load(base + 2 * C, mask=ok, other=0.0).to(tl.float32)
    x3 = tl.load(base + 3 * C, mask=ok, other=0.0).to(tl.float32)
    h = hp_ptr + t.to(tl.int64) * 4
    h0 = tl.load(h, mask=t_ok, other=0.0)[:, None]
    h1 = tl.load(h + 1, mask=t_ok, other=0.0)[:, None]
    h2 = tl.load(h + 2, mask=t_ok, other=0.0)[:, None]
    h3 = tl.load(h + 3, mask=t_ok, other=0.0)[:, None]
    return (h0 * x0 + h1 * x1) + (h2 * x2 + h3 * x3)


@triton.jit
def _fwd_kernel(x_ptr, hp_ptr, u_ptr, T, C, BT: tl.constexpr, BC: tl.constexpr):
    t = tl.program_id(0) * BT + tl.arange(0, BT)
    c = tl.program_id(1) * BC + tl.arange(0, BC)
    t_ok, c_ok = t < T, c < C
    u = aggregate(x_ptr, hp_ptr, t, c, t_ok, c_ok, C)
    tl.store(u_ptr + t[:, None].to(tl.int64) * C + c[None, :], cast_rne(u, tl.bfloat16),
             mask=t_ok[:, None] & c_ok[None, :])


def mhc_pre_fwd(streams: torch.Tensor, h_pre: torch.Tensor, contract: LayerContract) -> torch.Tensor:
    t, c = streams.shape[0], contract.hidden
    u = torch.empty(t, c, dtype=torch.bfloat16, device=streams.device)
    bt, bc = 4, 256
    _fwd_kernel[(triton.cdiv(t, bt), triton.cdiv(c, bc))](streams.contiguous(), h_pre.contiguous(), u, t, c,
                                                         BT=bt, BC=bc, **STRICT)
    return u


@triton.jit
def _bwd_kernel(x_ptr, hp_ptr, du_ptr, dx_ptr, dhp_ptr, T, C,
                L: tl.constexpr, LOG2_L: tl.constexpr, BT: tl.constexpr):
    """d_streams[t, i, c] = H_pre[t, i] · d_u[t, c]; d_h_pre[t, i] = lane_sum_c(d_u · X_i)."""
    t = tl.program_id(0) * BT + tl.arange(0, BT)
    t_ok = t < T
    j = tl.arange(0, L)
    h = hp_ptr + t.to(tl.int64) * 4
    h0 = tl.load(h, mask=t_ok, other=0.0)[:, None]
    h1 = tl.load(h + 1, mask=t_ok, other=0.0)[:, None]
    h2 = tl.load(h + 2, mask=t_ok, other=0.0)[:, None]
    h3 = tl.load(h + 3, mask=t_ok, other=0.0)[:, None]
    acc0 = tl.zeros([BT, L], tl.float32)
    acc1 = tl.zeros([BT, L], tl.float32)
    acc2 = tl.zeros([BT, L], tl.float32)
    acc3 = tl.zeros([BT, L], tl.float32)
    row = t[:, None].to(tl.int64)
    for c0 in range(0, C, L):
        c = c0 + j
        ok = t_ok[:, None] & (c < C)[None, :]
        g = tl.load(du_ptr + row * C + c[None, :], mask=ok, other=0.0).to(tl.float32)
        xb = x_ptr + row * (4 * C) + c[None, :]
        db = dx_ptr + row * (4 * C) + c[None, :]
        tl.store(db, h0 * g, mask=ok)
        tl.store(db + C, h1 * g, mask=ok)
        tl.store(db + 2 * C, h2 * g, mask=ok)
        tl.store(db + 3 * C, h3 * g, mask=ok)
        acc0 += g * tl.load(xb, mask=ok, other=0.0).to(tl.float32)
        acc1 += g * tl.load(xb + C, mask=ok, other=0.0).to(tl.float32)
        acc2 += g * tl.load(xb + 2 * C, mask=ok, other=0.0).to(tl.float32)
        acc3 += g * tl.load(xb + 3 * C, mask=ok, other=0.0).to(tl.float32)
    out = dhp_ptr + t.to(tl.int64) * 4
    tl.store(out, sf.pairwise_tree(acc0, BT, L, LOG2_L), mask=t_ok)
    tl.store(out + 1, sf.pairwise_tree(acc1, BT, L, LOG2_L), mask=t_ok)
    tl.store(out + 2, sf.pairwise_tree(acc2, BT, L, LOG2_L), mask=t_ok)
    tl.store(out + 3, sf.pairwise_tree(acc3, BT, L, LOG2_L), mask=t_ok)


BLOCK_T_BWD = 4


def mhc_pre_bwd(streams: torch.Tensor, h_pre: torch.Tensor, d_u: torch.Tensor, contract: LayerContract):
    """oracle.mhc_pre_bwd → (d_streams [T, 4, C], d_h_pre [T, 4]), fp32. d_u may be bf16 or fp32."""
    t, c = streams.shape[0], contract.hidden
    lane_count, log2_l = lanes(contract)
    d_x = torch.empty(t, 4, c, dtype=torch.float32, device=streams.device)
    d_hp = torch.empty(t, 4, dtype=torch.float32, device=streams.device)
    _bwd_kernel[(triton.cdiv(t, BLOCK_T_BWD),)](streams.contiguous(), h_pre.contiguous(), d_u.contiguous(),
                                                d_x, d_hp, t, c, L=lane_count, LOG2_L=log2_l, BT=BLOCK_T_BWD,
                                                **STRICT)
    return d_x, d_hp
