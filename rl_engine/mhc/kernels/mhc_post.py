"""mhc_post: X'_j = bf16((H_post[j] · o) + tree4_i(H_res[i, j] · X_i)), forward and backward
(oracle.mhc_post_*).

Forward is elementwise per (token, channel). The backward makes one pass over the channels per token
block: it writes d_o and d_streams (four-term trees over j) and lane-folds d_h_post[j] = Σ_c G_j · o
and d_h_res[i, j] = Σ_c G_j · X_i (20 lane accumulators per token, held as [BT, 4(, 4), L]).
"""

import torch
import triton
import triton.language as tl

from rl_engine.kernels.ops.triton.runtime import cast_rne
from rl_engine.mhc.contract import LayerContract
from rl_engine.mhc.kernels import strict_fp32 as sf
from rl_engine.mhc.kernels.launch import STRICT, lanes


@triton.jit
def _fwd_kernel(x_ptr, o_ptr, hpost_ptr, hres_ptr, out_ptr, T, C, BT: tl.constexpr, BC: tl.constexpr):
    t = tl.program_id(0) * BT + tl.arange(0, BT)
    c = tl.program_id(1) * BC + tl.arange(0, BC)
    t_ok, c_ok = t < T, c < C
    ok = t_ok[:, None] & c_ok[None, :]
    row = t[:, None].to(tl.int64)
    base = x_ptr + row * (4 * C) + c[None, :]
    x0 = tl.load(base, mask=ok, other=0.0).to(tl.float32)
    x1 = tl.load(base + C, mask=ok, other=0.0).to(tl.float32)
    x2 = tl.load(base + 2 * C, mask=ok, other=0.0).to(tl.float32)
    x3 = tl.load(base + 3 * C, mask=ok, other=0.0).to(tl.float32)
    o = tl.load(o_ptr + row * C + c[None, :], mask=ok, other=0.0).to(tl.float32)
    hres = hres_ptr + t.to(tl.int64) * 16
    for jj in tl.static_range(4):
        hp = tl.load(hpost_ptr + t.to(tl.int64) * 4 + jj, mask=t_ok, other=0.0)[:, None]
        r0 = tl.load(hres + jj, mask=t_ok, other=0.0)[:, None]
        r1 = tl.load(hres + 4 + jj, mask=t_ok, other=0.0)[:, None]
        r2 = tl.load(hres + 8 + jj, mask=t_ok, other=0.0)[:, None]
        r3 = tl.load(hres + 12 + jj, mask=t_ok, other=0.0)[:, None]
        mixed = (r0 * x0 + r1 * x1) + (r2 * x2 + r3 * x3)
        out = (hp * o) + mixed
        tl.store(out_ptr + row * (4 * C) + jj * C + c[None, :], cast_rne(out, tl.bfloat16), mask=ok)


def mhc_post_fwd(streams, o, h_post, h_res, contract: LayerContract) -> torch.Tensor:
    t, c = streams.shape[0], contract.hidden
    out = torch.empty_like(streams, memory_format=torch.contiguous_format)
    bt, bc = 4, 256
    _fwd_kernel[(triton.cdiv(t, bt), triton.cdiv(c, bc))](streams.contiguous(), o.contiguous(), h_post.contiguous(),
                                                         h_res.contiguous(), out, t, c, BT=bt, BC=bc, **STRICT)
    return out


@triton.jit
def _bwd_kernel(x_ptr, o_ptr, hpost_ptr, hres_ptr, g_ptr, do_ptr, dx_ptr, dhpost_ptr, dhres_ptr, T, C,
                L: tl.constexpr, LOG2_L: tl.constexpr, BT: tl.constexpr):
    t = tl.program_id(0) * BT + tl.arange(0, BT)
    t_ok = t < T
    j = tl.arange(0, L)
    c4 = tl.arange(0, 4)
    row = t[:, None, None].to(tl.int64)
    hp = tl.load(hpost_ptr + row * 4 + c4[None, :, None], mask=t_ok[:, None, None], other=0.0)  # [BT, 4(j), 1]
    acc_post = tl.zeros([BT, 4, L], tl.float32)
    acc_res = tl.zeros([BT, 4, 4, L], tl.float32)  # [t, i, j, lane]
    for c0 in range(0, C, L):
        c = c0 + j
        ok = t_ok[:, None, None] & (c < C)[None, None, :]
        stream_idx = row * (4 * C) + c4[None, :, None] * C + c[None, None, :]  # [BT, 4, L]
        g = tl.load(g_ptr + stream_idx, mask=ok, other=0.0).to(tl.float32)  # G_j
        x = tl.load(x_ptr + stream_idx, mask=ok, other=0.0).to(tl.float32)  # X_i
        o = tl.load(o_ptr + row * C + c[None, None, :], mask=ok, other=0.0).to(tl.float32)  # [BT, 1, L]
        c_ok2 = t_ok[:, None] & (c < C)[None, :]
        tl.store(do_ptr + t[:, None].to(tl.int64) * C + c[None, :], sf.tree4_middle(hp * g, BT, L), mask=c_ok2)
        for i in tl.static_range(4):
            hr = tl.load(hres_ptr + row * 16 + i * 4 + c4[None, :, None], mask=t_ok[:, None, None], other=0.0)
            tl.store(dx_ptr + t[:, None].to(tl.int64) * (4 * C) + i * C + c[None, :],
                     sf.tree4_middle(hr * g, BT, L), mask=c_ok2)
        acc_post += g * o
        acc_res += x[:, :, None, :] * g[:, None, :, :]
    d_post = tl.reshape(sf.pairwise_tree(tl.reshape(acc_post, [BT * 4, L]), BT * 4, L, LOG2_L), [BT, 4])
    d_res = tl.reshape(sf.pairwise_tree(tl.reshape(acc_res, [BT * 16, L]), BT * 16, L, LOG2_L), [BT, 16])
    c16 = tl.arange(0, 16)
    tl.store(dhpost_ptr + t[:, None].to(tl.int64) * 4 + c4[None, :], d_post, mask=t_ok[:, None])
    tl.store(dhres_ptr + t[:, None].to(tl.int64) * 16 + c16[None, :], d_res, mask=t_ok[:, None])


BLOCK_T_BWD = 4


def mhc_post_bwd(streams, o, h_post, h_res, d_out, contract: LayerContract):
    """oracle.mhc_post_bwd → (d_o [T, C], d_streams [T, 4, C], d_h_post [T, 4], d_h_res [T, 4, 4]), fp32."""
    t, c = streams.shape[0], contract.hidden
    lane_count, log2_l = lanes(contract)
    dev = streams.device
    d_o = torch.empty(t, c, dtype=torch.float32, device=dev)
    d_x = torch.empty(t, 4, c, dtype=torch.float32, device=dev)
    d_hp = torch.empty(t, 4, dtype=torch.float32, device=dev)
    d_hr = torch.empty(t, 4, 4, dtype=torch.float32, device=dev)
    _bwd_kernel[(triton.cdiv(t, BLOCK_T_BWD),)](streams.contiguous(), o.contiguous(), h_post.contiguous(),
                                                h_res.contiguous(), d_out.contiguous(), d_o, d_x, d_hp, d_hr, t, c,
                                                L=lane_count, LOG2_L=log2_l, BT=BLOCK_T_BWD, **STRICT)
    return d_o, d_x, d_hp, d_hr
