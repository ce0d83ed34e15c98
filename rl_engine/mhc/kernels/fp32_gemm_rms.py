"""fp32_gemm_rms: the controller projection p = φ x and the RMS factor r, forward and backward.

The oracle's reduction over K is a lane fold over L lanes (lane j: elements j, j+L, …) and a pairwise
tree over the lanes. Lanes are independent, and the first log2(L/G) tree levels only combine lanes
inside a group of L/G adjacent lanes, so the work splits exactly: program (token block, lane group g)
folds the K columns whose lane is in group g and trees its lanes to one partial; a second kernel
trees the G partials. The same split serves d_φ, whose reduction runs over tokens.
No tensor cores: every product is one fp32 multiply, every sum one fp32 add.
Controller rows are processed as 16 + 8 (24 = controller_n): a tree over 24 values equals
tree16(v0..15) + tree8(v16..23), the oracle's tree padded with +0.0 to 32.
"""

import torch
import triton
import triton.language as tl

from rl_engine.mhc.contract import LayerContract
from rl_engine.mhc.kernels import strict_fp32 as sf
from rl_engine.mhc.kernels.launch import INTERPRET, STRICT, lanes, log2

BLOCK_T = 32  # tokens per program (amortises the φ reads)
GROUP_LANES = 16  # lanes per program; L / GROUP_LANES groups run in parallel
BLOCK_K = 128 if INTERPRET else 32  # columns per program of the d_phi kernel
BLOCK_K_DX = 128 if INTERPRET else 32  # columns per program of the d_x kernel


@triton.jit
def _fwd_partial_kernel(x_ptr, phi_ptr, part_p_ptr, part_s_ptr, T, K,
                        L: tl.constexpr, GL: tl.constexpr, LOG2_GL: tl.constexpr, G: tl.constexpr,
                        BT: tl.constexpr):
    """part_p[t, g, n] = tree over group g's lanes of the lane-folded x[t, k]·φ[n, k]; part_s likewise
    for x[t, k]². Grid (token blocks, G)."""
    pid_t, g = tl.program_id(0), tl.program_id(1)
    t = pid_t * BT + tl.arange(0, BT)
    j = g * GL + tl.arange(0, GL)
    na = tl.arange(0, 16)
    nb = 16 + tl.arange(0, 8)
    acc_a = tl.zeros([BT, 16, GL], tl.float32)
    acc_b = tl.zeros([BT, 8, GL], tl.float32)
    acc_s = tl.zeros([BT, GL], tl.float32)
    t_ok = t < T
    for k0 in range(0, K, L):
        k = k0 + j
        k_ok = k < K
        x = tl.load(x_ptr + t[:, None].to(tl.int64) * K + k[None, :], mask=t_ok[:, None] & k_ok[None, :],
                    other=0.0).to(tl.float32)
        wa = tl.load(phi_ptr + na[:, None] * K + k[None, :], mask=k_ok[None, :], other=0.0)
        wb = tl.load(phi_ptr + nb[:, None] * K + k[None, :], mask=k_ok[None, :], other=0.0)
        acc_a += x[:, None, :] * wa[None, :, :]
        acc_b += x[:, None, :] * wb[None, :, :]
        acc_s += x * x
    pa = tl.reshape(sf.pairwise_tree(tl.reshape(acc_a, [BT * 16, GL]), BT * 16, GL, LOG2_GL), [BT, 16])
    pb = tl.reshape(sf.pairwise_tree(tl.reshape(acc_b, [BT * 8, GL]), BT * 8, GL, LOG2_GL), [BT, 8])
    s = sf.pairwise_tree(acc_s, BT, GL, LOG2_GL)
    row = (t.to(tl.int64) * G + g) * 24
    tl.store(part_p_ptr + row[:, None] + na[None, :], pa, mask=t_ok[:, None])
    tl.store(part_p_ptr + row[:, None] + nb[None, :], pb, mask=t_ok[:, None])
    tl.store(part_s_ptr + t.to(tl.int64) * G + g, s, mask=t_ok)


@triton.jit
def _fwd_finish_kernel(part_p_ptr, part_s_ptr, p_ptr, r_ptr, T, K, eps,
                       G: tl.constexpr, LOG2_G: tl.constexpr, EPS_INSIDE: tl.constexpr, BT: tl.constexpr):
    """The last log2(G) tree levels over the group partials, then r from s."""
    t = tl.program_id(0) * BT + tl.arange(0, BT)
    t_ok = t < T
    gg = tl.arange(0, G)
    n = tl.arange(0, 32)
    n_ok = n < 24
    # [BT, 32, G] → tree over G
    pp = tl.load(part_p_ptr + ((t[:, None, None].to(tl.int64) * G + gg[None, None, :]) * 24 + n[None, :, None]),
                 mask=t_ok[:, None, None] & n_ok[None, :, None], other=0.0)
    p = tl.reshape(sf.pairwise_tree(tl.reshape(pp, [BT * 32, G]), BT * 32, G, LOG2_G), [BT, 32])
    tl.store(p_ptr + t[:, None].to(tl.int64) * 24 + n[None, :], p, mask=t_ok[:, None] & n_ok[None, :])
    ps = tl.load(part_s_ptr + t[:, None].to(tl.int64) * G + gg[None, :], mask=t_ok[:, None], other=0.0)
    s = sf.pairwise_tree(ps, BT, G, LOG2_G)
    q = sf.div(s, tl.zeros_like(s) + K)
    if EPS_INSIDE:
        r = sf.rsqrt(q + eps)
    else:
        root = tl.math.sqrt_rn(q) + eps
        r = tl.math.div_rn(tl.zeros_like(root) + 1.0, root)
    tl.store(r_ptr + t, r, mask=t_ok)


def fp32_gemm_rms_fwd(streams: torch.Tensor, phi: torch.Tensor, contract: LayerContract):
    """oracle.fp32_gemm_rms_fwd: streams [T, 4, C] bf16, phi [24, K] fp32 → (p [T, 24], r [T]) fp32."""
    t, k = streams.shape[0], contract.k
    lane_count, _ = lanes(contract)
    gl = min(GROUP_LANES, lane_count)
    groups = lane_count // gl
    x = streams.reshape(t, k).contiguous()
    phi = phi.contiguous()
    part_p = torch.empty(t, groups, 24, dtype=torch.float32, device=x.device)
    part_s = torch.empty(t, groups, dtype=torch.float32, device=x.device)
    _fwd_partial_kernel[(triton.cdiv(t, BLOCK_T), groups)](
        x, phi, part_p, part_s, t, k, L=lane_count, GL=gl, LOG2_GL=log2(gl), G=groups, BT=BLOCK_T,
        num_warps=8, **STRICT)
    p = torch.empty(t, 24, dtype=torch.float32, device=x.device)
    r = torch.empty(t, dtype=torch.float32, device=x.device)
    _fwd_finish_kernel[(triton.cdiv(t, 32),)](
        part_p, part_s, p, r, t, k, contract.mhc_eps, G=groups, LOG2_G=log2(groups),
        EPS_INSIDE=contract.rms_eps_placement == "inside", BT=32, **STRICT)
    return p, r


@triton.jit
def _bwd_dx_kernel(x_ptr, phi_ptr, r_ptr, dp_ptr, dr_ptr, q_ptr, dx_ptr, T, K,
                   EPS_INSIDE: tl.constexpr, BT: tl.constexpr, BK: tl.constexpr):
    """d_x[t, k] = tree_n(d_p[t, n]·φ[n, k]) + (ds + ds)·x[t, k]; ds from d_r (see the oracle).
    q_ptr: q = sqrt_rn(s ÷ K) per token, read only by the outside-eps form."""
    t = tl.program_id(0) * BT + tl.arange(0, BT)
    k = tl.program_id(1) * BK + tl.arange(0, BK)
    t_ok, k_ok = t < T, k < K
    na = tl.arange(0, 16)
    nb = 16 + tl.arange(0, 8)
    dpa = tl.load(dp_ptr + t[:, None].to(tl.int64) * 24 + na[None, :], mask=t_ok[:, None], other=0.0)
    dpb = tl.load(dp_ptr + t[:, None].to(tl.int64) * 24 + nb[None, :], mask=t_ok[:, None], other=0.0)
    wa = tl.load(phi_ptr + na[:, None] * K + k[None, :], mask=k_ok[None, :], other=0.0)  # [16, BK]
    wb = tl.load(phi_ptr + nb[:, None] * K + k[None, :], mask=k_ok[None, :], other=0.0)
    prod_a = dpa[:, None, :] * tl.permute(wa, (1, 0))[None, :, :]  # [BT, BK, 16]
    prod_b = dpb[:, None, :] * tl.permute(wb, (1, 0))[None, :, :]
    dxa = tl.reshape(sf.pairwise_tree(tl.reshape(prod_a, [BT * BK, 16]), BT * BK, 16, 4), [BT, BK])
    dxb = tl.reshape(sf.pairwise_tree(tl.reshape(prod_b, [BT * BK, 8]), BT * BK, 8, 3), [BT, BK])
    d_x = dxa + dxb
    x = tl.load(x_ptr + t[:, None].to(tl.int64) * K + k[None, :], mask=t_ok[:, None] & k_ok[None, :],
                other=0.0).to(tl.float32)
    r = tl.load(r_ptr + t, mask=t_ok, other=1.0)
    d_r = tl.load(dr_ptr + t, mask=t_ok, other=0.0)
    kf = tl.zeros_like(r) + K
    if EPS_INSIDE:
        ds = sf.div((((d_r * r) * r) * r) * -0.5, kf)
    else:
        q = tl.load(q_ptr + t, mask=t_ok, other=0.0)
        den = (q + q) * kf
        safe_den = tl.where(q > 0, den, 1.0)
        ds = tl.where(q > 0, -tl.math.div_rn((d_r * r) * r, safe_den), 0.0)
    d_x = d_x + (ds + ds)[:, None] * x
    tl.store(dx_ptr + t[:, None].to(tl.int64) * K + k[None, :], d_x, mask=t_ok[:, None] & k_ok[None, :])


@triton.jit
def _bwd_dphi_partial_kernel(x_ptr, dp_ptr, part_ptr, T, K,
                             L: tl.constexpr, GL: tl.constexpr, LOG2_GL: tl.constexpr, G: tl.constexpr,
                             BK: tl.constexpr):
    """part[g, n, k] = tree over group g's token lanes of the lane-folded d_p[t, n]·x[t, k].
    Grid (column blocks, G)."""
    k = tl.program_id(0) * BK + tl.arange(0, BK)
    g = tl.program_id(1)
    j = g * GL + tl.arange(0, GL)
    k_ok = k < K
    na = tl.arange(0, 16)
    nb = 16 + tl.arange(0, 8)
    acc_a = tl.zeros([16, BK, GL], tl.float32)
    acc_b = tl.zeros([8, BK, GL], tl.float32)
    for t0 in range(0, T, L):
        t = t0 + j
        t_ok = t < T
        x = tl.load(x_ptr + t[None, :].to(tl.int64) * K + k[:, None], mask=k_ok[:, None] & t_ok[None, :],
                    other=0.0).to(tl.float32)  # [BK, GL]
        dpa = tl.load(dp_ptr + t[None, :].to(tl.int64) * 24 + na[:, None], mask=t_ok[None, :], other=0.0)
        dpb = tl.load(dp_ptr + t[None, :].to(tl.int64) * 24 + nb[:, None], mask=t_ok[None, :], other=0.0)
        acc_a += dpa[:, None, :] * x[None, :, :]
        acc_b += dpb[:, None, :] * x[None, :, :]
    pa = tl.reshape(sf.pairwise_tree(tl.reshape(acc_a, [16 * BK, GL]), 16 * BK, GL, LOG2_GL), [16, BK])
    pb = tl.reshape(sf.pairwise_tree(tl.reshape(acc_b, [8 * BK, GL]), 8 * BK, GL, LOG2_GL), [8, BK])
    base = part_ptr + g.to(tl.int64) * 24 * K
    tl.store(base + na[:, None] * K + k[None, :], pa, mask=k_ok[None, :])
    tl.store(base + nb[:, None] * K + k[None, :], pb, mask=k_ok[None, :])


@triton.jit
def _bwd_dphi_finish_kernel(part_ptr, dphi_ptr, NK, G: tl.constexpr, LOG2_G: tl.constexpr, BLOCK: tl.constexpr):
    """d_phi = the last log2(G) tree levels over the group partials [G, 24·K]."""
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    ok = i < NK
    gg = tl.arange(0, G)
    parts = tl.load(part_ptr + gg[None, :].to(tl.int64) * NK + i[:, None], mask=ok[:, None], other=0.0)
    tl.store(dphi_ptr + i, sf.pairwise_tree(parts, BLOCK, G, LOG2_G), mask=ok)


def fp32_gemm_rms_bwd(streams: torch.Tensor, phi: torch.Tensor, r: torch.Tensor, d_p: torch.Tensor,
                      d_r: torch.Tensor, contract: LayerContract):
    """oracle.fp32_gemm_rms_bwd → (d_streams [T, 4, C] fp32, d_phi [24, K] fp32 or None)."""
    t, k = streams.shape[0], contract.k
    x = streams.reshape(t, k).contiguous()
    phi, r = phi.contiguous(), r.contiguous()
    d_p, d_r = d_p.to(torch.float32).contiguous(), d_r.to(torch.float32).contiguous()
    inside = contract.rms_eps_placement == "inside"
    # The outside form needs q = sqrt_rn(s ÷ K); r = 1 ÷ (q + eps) does not give q back exactly, so
    # s is recomputed by the forward kernel (its projection half is discarded). Inside: r is a dummy.
    q = r if inside else _sum_of_squares_root(x, phi, contract)
    d_x = torch.empty(t, k, dtype=torch.float32, device=x.device)
    bt, bk = 16, BLOCK_K_DX
    _bwd_dx_kernel[(triton.cdiv(t, bt), triton.cdiv(k, bk))](
        x, phi, r, d_p, d_r, q, d_x, t, k, EPS_INSIDE=inside, BT=bt, BK=bk,
        num_warps=8, **STRICT)
    d_phi = None
    if contract.trainability == "full":
        lane_count, _ = lanes(contract)
        gl = min(GROUP_LANES, lane_count)
        groups = lane_count // gl
        part = torch.empty(groups, 24, k, dtype=torch.float32, device=x.device)
        _bwd_dphi_partial_kernel[(triton.cdiv(k, BLOCK_K), groups)](
            x, d_p, part, t, k, L=lane_count, GL=gl, LOG2_GL=log2(gl), G=groups, BK=BLOCK_K,
            num_warps=8, **STRICT)
        d_phi = torch.empty(24, k, dtype=torch.float32, device=x.device)
        _bwd_dphi_finish_kernel[(triton.cdiv(24 * k, 256),)](
            part, d_phi, 24 * k, G=groups, LOG2_G=log2(groups), BLOCK=256, **STRICT)
    return d_x.reshape(streams.shape), d_phi


@triton.jit
def _root_kernel(part_s_ptr, q_ptr, T, K, G: tl.constexpr, LOG2_G: tl.constexpr, BT: tl.constexpr):
    """q = sqrt_rn(s ÷ K) from the group partials of s (the outside-eps backward)."""
    t = tl.program_id(0) * BT + tl.arange(0, BT)
    t_ok = t < T
    gg = tl.arange(0, G)
    ps = tl.load(part_s_ptr + t[:, None].to(tl.int64) * G + gg[None, :], mask=t_ok[:, None], other=0.0)
    s = sf.pairwise_tree(ps, BT, G, LOG2_G)
    tl.store(q_ptr + t, tl.math.sqrt_rn(sf.div(s, tl.zeros_like(s) + K)), mask=t_ok)


def _sum_of_squares_root(x: torch.Tensor, phi: torch.Tensor, contract: LayerContract):
    t, k = x.shape
    lane_count, _ = lanes(contract)
    gl = min(GROUP_LANES, lane_count)
    groups = lane_count // gl
    part_p = torch.empty(t, groups, 24, dtype=torch.float32, device=x.device)
    part_s = torch.empty(t, groups, dtype=torch.float32, device=x.device)
    _fwd_partial_kernel[(triton.cdiv(t, BLOCK_T), groups)](
        x, phi, part_p, part_s, t, k, L=lane_count, GL=gl, LOG2_GL=log2(gl), G=groups, BT=BLOCK_T,
        num_warps=8, **STRICT)
    q = torch.empty(t, dtype=torch.float32, device=x.device)
    _root_kernel[(triton.cdiv(t, 32),)](part_s, q, t, k, G=groups, LOG2_G=log2(groups), BT=32, **STRICT)
    return q
