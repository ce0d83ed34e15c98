"""The strict-fp32 oracle of one mHC site (DeepSeek-V4 form): forward and backward of every operator.

Each function's docstring gives its exact order; the primitives (pinned exp, lane_sum, tree4, IEEE
division, correctly rounded sqrt) are in `numerics`. Activations are bf16 at operator outputs (one
round-to-nearest-even cast); controller values, H matrices and all gradients are fp32 (the site's
input gradient is cast once to bf16). Gradients through a bf16 output cast are straight-through.

Shapes: T tokens, streams X [T, 4, C] bf16, x = vec(X) [T, K] (K = 4C, stream-major), controller
outputs [T, 24] split as pre [0:4], post [4:8], res [8:24] (a row-major 4×4 matrix, row i, column j).

The operator names (`OPERATORS` in `trace`) are the provider protocol: a provider implements the
same functions with the same signatures. Every backward recomputes its cheap forward intermediates.
"""

from __future__ import annotations

import sys

import torch

from rl_engine.mhc.contract import ControllerParams, LayerContract, NormParams, ResidualBatch
from rl_engine.mhc.numerics import (
    div,
    lane_dot,
    lane_sum,
    rsqrt,
    sigmoid,
    softmax4,
    sqrt_rn,
    sum_of_squares,
    to_bf16,
    tree4,
)
from rl_engine.mhc.trace import check_outputs

F32 = torch.float32


# --- fixed-K GEMM: the controller projection's reduction, batch invariant by construction -------------

def fixed_k_gemm_fwd(a: torch.Tensor, w: torch.Tensor, contract: LayerContract) -> torch.Tensor:
    """out[t, n] = lane_sum_k(a[t, k] · w[n, k]): a [T, K], w [N, K] → [T, N] fp32. The order over K
    is the lane fold, fixed by K and L alone, so a row's bits never depend on T."""
    return lane_dot(a.to(F32).unsqueeze(1), w.to(F32).unsqueeze(0), contract.lanes, dim=-1)


def fixed_k_gemm_bwd(a: torch.Tensor, w: torch.Tensor, d_out: torch.Tensor, contract: LayerContract,
                     need_w_grad: bool = True):
    """d_a[t, k] = lane_sum_n(d_out[t, n] · w[n, k]); d_w[n, k] = lane_sum_t(d_out[t, n] · a[t, k])
    (None when `need_w_grad` is false). The weight gradient reduces over tokens: it is the one
    boundary that depends on the batch, by definition."""
    a32, w32, g = a.to(F32), w.to(F32), d_out.to(F32)
    d_a = lane_dot(g.unsqueeze(2), w32.unsqueeze(0), contract.lanes, dim=1)
    d_w = lane_dot(g.unsqueeze(2), a32.unsqueeze(1), contract.lanes, dim=0) if need_w_grad else None
    return d_a, d_w


# --- fp32_gemm_rms: P = φ x and the RMS factor r -------------------------------------------------------

def _rms_factor(s: torch.Tensor, k: int, contract: LayerContract):
    """From s = Σ x²: q = s ÷ K; inside: r = 1 ÷ sqrt_rn(q + eps); outside: r = 1 ÷ (sqrt_rn(q) + eps)."""
    q = div(s, k)
    if contract.rms_eps_placement == "inside":
        return rsqrt(q + contract.mhc_eps)
    root = sqrt_rn(q) + contract.mhc_eps
    return div(torch.ones_like(root), root)


def fp32_gemm_rms_fwd(streams: torch.Tensor, phi: torch.Tensor, contract: LayerContract):
    """streams [T, 4, C] bf16, phi [24, K] fp32 → (p [T, 24], r [T]) fp32.

    x = vec(X) upcast; p = fixed_k_gemm(x, φ); s = lane_sum(x·x); r = `_rms_factor(s)`.
    """
    x = streams.reshape(streams.shape[0], -1).to(F32)
    p = fixed_k_gemm_fwd(x, phi, contract)
    r = _rms_factor(sum_of_squares(x, contract.lanes), x.shape[1], contract)
    return p, r


def fp32_gemm_rms_bwd(streams: torch.Tensor, phi: torch.Tensor, r: torch.Tensor, d_p: torch.Tensor,
                      d_r: torch.Tensor, contract: LayerContract):
    """→ (d_streams [T, 4, C] fp32, d_phi [24, K] fp32 or None when the mixer is frozen).

    ds (the gradient of s = Σ x²):
      inside:  ds = ((((d_r · r) · r) · r) · −0.5) ÷ K
      outside: q = sqrt_rn(s ÷ K); ds = −((d_r · r) · r) ÷ ((q + q) · K), and 0 where q = 0 (an
               all-zero row: sqrt is not differentiable there; 0 is the subgradient, never NaN)
    d_x = d_x_gemm + (ds + ds) · x, with d_x_gemm from `fixed_k_gemm_bwd`.
    """
    t, k = streams.shape[0], contract.k
    x = streams.reshape(t, k).to(F32)
    need_w = contract.trainability == "full"
    d_x, d_phi = fixed_k_gemm_bwd(x, phi, d_p, contract, need_w_grad=need_w)
    d_r = d_r.to(F32)
    if contract.rms_eps_placement == "inside":
        ds = div(((d_r * r) * r) * r * -0.5, k)
    else:
        q = sqrt_rn(div(sum_of_squares(x, contract.lanes), k))
        den = (q + q) * float(k)
        safe_den = torch.where(q > 0, den, torch.ones_like(den))
        ds = torch.where(q > 0, -div((d_r * r) * r, safe_den), torch.zeros_like(den))
    d_x = d_x + (ds + ds).unsqueeze(1) * x
    return d_x.reshape(streams.shape), d_phi


# --- controller affine: h = (r · p) · α + b ------------------------------------------------------------

def _alpha_per_output(alpha: torch.Tensor, contract: LayerContract) -> torch.Tensor:
    """[α_pre ×4, α_post ×4, α_res ×16]: exact copies of the three scalars."""
    n = contract.hc_mult
    return torch.cat([alpha[0:1].expand(n), alpha[1:2].expand(n), alpha[2:3].expand(n * n)])


def controller_affine_fwd(p: torch.Tensor, r: torch.Tensor, alpha: torch.Tensor, bias: torch.Tensor,
                          contract: LayerContract) -> torch.Tensor:
    """h[t, n] = ((r[t] · p[t, n]) · α(n)) + b[n] → [T, 24] fp32."""
    return ((r.unsqueeze(1) * p) * _alpha_per_output(alpha, contract)) + bias


def controller_affine_bwd(p: torch.Tensor, r: torch.Tensor, alpha: torch.Tensor, d_h: torch.Tensor,
                          contract: LayerContract):
    """→ (d_p [T, 24], d_r [T], d_alpha [3] or None, d_bias [24] or None).

    g = d_h · α(n); d_p = g · r; d_r = lane_sum_n(g · p);
    d_alpha[s] = lane_sum_t(lane_sum over segment s of d_h · (r · p))   (segments 0:4, 4:8, 8:24);
    d_bias = lane_sum_t(d_h). The frozen mixer skips d_alpha and d_bias.
    """
    lanes = contract.lanes
    g = d_h * _alpha_per_output(alpha, contract)
    d_p = g * r.unsqueeze(1)
    d_r = lane_dot(g, p, lanes, dim=-1)
    if contract.trainability != "full":
        return d_p, d_r, None, None
    e = d_h * (r.unsqueeze(1) * p)
    n = contract.hc_mult
    per_token = [lane_sum(e[:, a:b], lanes) for a, b in ((0, n), (n, 2 * n), (2 * n, e.shape[1]))]
    d_alpha = torch.stack([lane_sum(seg, lanes, dim=0) for seg in per_token])
    return d_p, d_r, d_alpha, lane_sum(d_h, lanes, dim=0)


# --- hc_split_sinkhorn -------------------------------------------------------------------------------

def _colsum(m: torch.Tensor) -> torch.Tensor:
    """[T, 4, 4] → [T, 1, 4]: tree4 over rows i of m[i, j]."""
    return tree4(m[:, 0], m[:, 1], m[:, 2], m[:, 3]).unsqueeze(1)


def _rowsum(m: torch.Tensor) -> torch.Tensor:
    """[T, 4, 4] → [T, 4, 1]: tree4 over columns j of m[i, j]."""
    return tree4(m[..., 0], m[..., 1], m[..., 2], m[..., 3]).unsqueeze(2)


def _sinkhorn_trajectory(h: torch.Tensor, contract: LayerContract):
    """Forward of the split; returns (s_pre, s_post, softmax P, [(M_in, divisor, axis), ...], H_res)."""
    n, eps = contract.hc_mult, contract.mhc_eps
    s_pre = sigmoid(h[:, :n])
    s_post = sigmoid(h[:, n : 2 * n])
    logits = h[:, 2 * n :].reshape(h.shape[0], n, n)
    prob = softmax4(logits)
    m = prob + eps
    steps = []
    for step in range(2 * contract.sinkhorn_iters - 1):
        axis = "col" if step % 2 == 0 else "row"  # first col, then (row, col) × (iters − 1)
        d = (_colsum(m) if axis == "col" else _rowsum(m)) + eps
        steps.append((m, d, axis))
        m = div(m, d.expand_as(m))
    return s_pre, s_post, prob, steps, m


def hc_split_sinkhorn_fwd(h: torch.Tensor, contract: LayerContract):
    """h [T, 24] → (H_pre [T, 4], H_post [T, 4], H_res [T, 4, 4]), all fp32.

    H_pre = sigmoid(h[0:4]) + eps; H_post = sigmoid(h[4:8]) · 2;
    M = softmax4 over each row of h[8:24] as 4×4, + eps; M = M ÷ (colsum(M) + eps);
    then (iters − 1) × [M = M ÷ (rowsum(M) + eps); M = M ÷ (colsum(M) + eps)].
    colsum/rowsum are tree4; every division is an IEEE division by the broadcast divisor.
    """
    s_pre, s_post, _, _, h_res = _sinkhorn_trajectory(h, contract)
    return s_pre + contract.mhc_eps, s_post * 2.0, h_res


def hc_split_sinkhorn_bwd(h: torch.Tensor, d_h_pre: torch.Tensor, d_h_post: torch.Tensor,
                          d_h_res: torch.Tensor, contract: LayerContract) -> torch.Tensor:
    """→ d_h [T, 24] fp32, unrolled through every Sinkhorn step (the trajectory is recomputed).

    sigmoid: d = (g · s) · (1 − s), with g = d_H_pre, and g = d_H_post · 2 for the post part.
    Normalisation Y = M ÷ d along an axis: c = tree4 along that axis of (G · Y); dM = (G − c) ÷ d.
    softmax (the +eps passes the gradient unchanged): c = tree4_j(G · P); dL = P · (G − c).
    """
    s_pre, s_post, prob, steps, h_res = _sinkhorn_trajectory(h, contract)
    g = d_h_res.to(F32)
    y = h_res
    for m, d, axis in reversed(steps):
        c = _colsum(g * y) if axis == "col" else _rowsum(g * y)
        g = div(g - c, d.expand_as(g))
        y = m
    c = _rowsum(g * prob)
    d_logits = prob * (g - c)
    d_pre = (d_h_pre.to(F32) * s_pre) * (1.0 - s_pre)
    d_post = ((d_h_post.to(F32) * 2.0) * s_post) * (1.0 - s_post)
    return torch.cat([d_pre, d_post, d_logits.reshape(h.shape[0], -1)], dim=1)


# --- mhc_pre (h_aggregate): u = Σ_i H_pre[i] · X_i -----------------------------------------------------

def mhc_pre_fwd(streams: torch.Tensor, h_pre: torch.Tensor, contract: LayerContract) -> torch.Tensor:
    """u[t, c] = bf16(tree4_i(H_pre[t, i] · X[t, i, c])) → [T, C] bf16."""
    terms = h_pre.unsqueeze(2) * streams.to(F32)
    return to_bf16(tree4(*terms.unbind(1)))


def mhc_pre_bwd(streams: torch.Tensor, h_pre: torch.Tensor, d_u: torch.Tensor, contract: LayerContract):
    """→ (d_streams [T, 4, C] = H_pre[t, i] · d_u[t, c], d_h_pre [T, 4] = lane_sum_c(d_u · X_i)), fp32."""
    g = d_u.to(F32).unsqueeze(1)
    return h_pre.unsqueeze(2) * g, lane_dot(g, streams.to(F32), contract.lanes, dim=-1)


# --- rmsnorm_residual ---------------------------------------------------------------------------------

def _rms_norm_factor(h32: torch.Tensor, contract: LayerContract) -> torch.Tensor:
    """r = rsqrt(lane_sum_c(h·h) ÷ C + eps) → [T, 1]. (The RMSNorm eps is always inside the root.)"""
    return rsqrt(div(sum_of_squares(h32, contract.lanes), h32.shape[-1]) + contract.rmsnorm_eps).unsqueeze(1)


def rmsnorm_residual_fwd(x: torch.Tensor, gamma: torch.Tensor, residual: torch.Tensor | None,
                         contract: LayerContract):
    """x [T, C] bf16 (+ residual bf16) → (y, h), both [T, C] bf16.

    h = x, or bf16(x + residual) (the un-normalised residual fork); y = bf16((h · r) · γ), r from
    `_rms_norm_factor`. In the mHC site residual is None: the streams carry the residual.
    """
    h = x if residual is None else to_bf16(x.to(F32) + residual.to(F32))
    h32 = h.to(F32)
    return to_bf16((h32 * _rms_norm_factor(h32, contract)) * gamma), h


def rmsnorm_residual_bwd(h: torch.Tensor, gamma: torch.Tensor, d_y: torch.Tensor,
                         d_h: torch.Tensor | None, contract: LayerContract):
    """h is the fork output (the normalised input) → (d_x [T, C], d_gamma [C]), fp32; d_residual = d_x.

    g = d_y · γ; c = lane_sum_c(g · h); d_x = (g · r) − h · ((((c · r) · r) · r) ÷ C) [+ d_h];
    d_gamma = lane_sum_t(d_y · (h · r)).
    """
    h32, dy = h.to(F32), d_y.to(F32)
    r = _rms_norm_factor(h32, contract)
    g = dy * gamma
    c = lane_dot(g, h32, contract.lanes, dim=-1).unsqueeze(1)
    coef = div(((c * r) * r) * r, h32.shape[-1])
    d_x = (g * r) - h32 * coef
    if d_h is not None:
        d_x = d_x + d_h.to(F32)
    d_gamma = lane_dot(dy, h32 * r, contract.lanes, dim=0)
    return d_x, d_gamma


# --- fused_pre_norm: mhc_pre + rmsnorm in one operator, the same bytes as the pair ---------------------

def mhc_pre_rmsnorm_fwd(streams: torch.Tensor, h_pre: torch.Tensor, gamma: torch.Tensor,
                        contract: LayerContract):
    """→ (y, u) [T, C] bf16, byte-identical to mhc_pre then rmsnorm_residual (u is still cast to
    bf16 before it is normalised: fusion may not move a downcast)."""
    u = mhc_pre_fwd(streams, h_pre, contract)
    y, _ = rmsnorm_residual_fwd(u, gamma, None, contract)
    return y, u


def mhc_pre_rmsnorm_bwd(streams: torch.Tensor, h_pre: torch.Tensor, gamma: torch.Tensor, u: torch.Tensor,
                        d_y: torch.Tensor, contract: LayerContract):
    """→ (d_streams [T, 4, C], d_h_pre [T, 4], d_gamma [C]), fp32: rmsnorm_residual_bwd then mhc_pre_bwd."""
    d_u, d_gamma = rmsnorm_residual_bwd(u, gamma, d_y, None, contract)
    d_streams, d_h_pre = mhc_pre_bwd(streams, h_pre, d_u, contract)
    return d_streams, d_h_pre, d_gamma


# --- mhc_post: X'_j = H_post[j] · o + Σ_i H_res[i, j] · X_i ----------------------------------------------

def mhc_post_fwd(streams: torch.Tensor, o: torch.Tensor, h_post: torch.Tensor, h_res: torch.Tensor,
                 contract: LayerContract) -> torch.Tensor:
    """out[t, j, c] = bf16((H_post[t, j] · o[t, c]) + tree4_i(H_res[t, i, j] · X[t, i, c])) → [T, 4, C]."""
    x = streams.to(F32)
    terms = h_res.unsqueeze(3) * x.unsqueeze(2)  # [T, i, j, C]
    mixed = tree4(*terms.unbind(1))  # [T, j, C]
    return to_bf16((h_post.unsqueeze(2) * o.to(F32).unsqueeze(1)) + mixed)


def mhc_post_bwd(streams: torch.Tensor, o: torch.Tensor, h_post: torch.Tensor, h_res: torch.Tensor,
                 d_out: torch.Tensor, contract: LayerContract):
    """→ (d_o [T, C], d_streams [T, 4, C], d_h_post [T, 4], d_h_res [T, 4, 4]), fp32. With G = d_out:
    d_o = tree4_j(H_post[j] · G_j); d_streams[i] = tree4_j(H_res[i, j] · G_j);
    d_h_post[j] = lane_sum_c(G_j · o); d_h_res[i, j] = lane_sum_c(G_j · X_i)."""
    g, x, o32 = d_out.to(F32), streams.to(F32), o.to(F32)
    d_o = tree4(*(h_post.unsqueeze(2) * g).unbind(1))
    d_streams = tree4(*(h_res.unsqueeze(3) * g.unsqueeze(1)).unbind(2))  # [T, i, j, C] over j
    d_h_post = lane_dot(g, o32.unsqueeze(1), contract.lanes, dim=-1)
    d_h_res = lane_dot(g.unsqueeze(1), x.unsqueeze(2), contract.lanes, dim=-1)
    return d_o, d_streams, d_h_post, d_h_res


# --- the sublayer stand-in (oracle glue, no provider operator) -----------------------------------------

def sublayer_standin_fwd(y: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """o = bf16(y · scale): a per-channel sublayer so gradients reach every mHC operator."""
    return to_bf16(y.to(F32) * scale)


def sublayer_standin_bwd(d_o: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    return d_o.to(F32) * scale


# --- one mHC site, forward and backward -----------------------------------------------------------------

class OperatorError(RuntimeError):
    """A provider operator raised, or returned something other than the protocol's outputs; `operator`
    names it and the message says what happened."""

    def __init__(self, operator: str, message: str):
        super().__init__(message)
        self.operator = operator


def _call(ops, name: str, *args):
    """ops.<name>(*args), its outputs checked against `trace.OPERATOR_OUTPUTS` (args[0] carries T and the
    device, args[-1] is the contract), so a bad output is blamed on the operator that produced it."""
    try:
        result = getattr(ops, name)(*args)
    except KeyboardInterrupt:
        raise  # the person at the terminal still stops the run
    except BaseException as exc:  # noqa: BLE001 - SystemExit included: a provider never ends the run, it fails
        raise OperatorError(name, f"{name} raised {type(exc).__name__}: {exc}") from exc
    try:
        return check_outputs(name, result, args[-1], args[0].shape[0], args[0].device)
    except ValueError as exc:
        raise OperatorError(name, str(exc)) from None


def mhc_site(batch: ResidualBatch, controller: ControllerParams, norm: NormParams, contract: LayerContract,
             ops=None) -> dict[str, torch.Tensor]:
    """Forward and backward of one site through `ops` (a provider; default: this oracle). Returns every
    boundary (names in `trace.BOUNDARIES`) in execution order. The site's input gradient is
    bf16((d_streams_post + d_streams_pre) + d_streams_controller)."""
    ops = sys.modules[__name__] if ops is None else ops
    batch.validate(contract)
    controller.validate(contract)
    norm.validate(contract)
    x, c = batch.streams, contract
    out: dict[str, torch.Tensor] = {}

    p, r = _call(ops, "fp32_gemm_rms_fwd", x, controller.phi, c)
    out["fwd.gemm_rms.p"], out["fwd.gemm_rms.r"] = p, r
    h = out["fwd.affine.h"] = _call(ops, "controller_affine_fwd", p, r, controller.alpha, controller.bias, c)
    h_pre, h_post, h_res = _call(ops, "hc_split_sinkhorn_fwd", h, c)
    out["fwd.sinkhorn.h_pre"], out["fwd.sinkhorn.h_post"], out["fwd.sinkhorn.h_res"] = h_pre, h_post, h_res
    if c.fusion_mode == "fused_pre_norm":
        y, u = _call(ops, "mhc_pre_rmsnorm_fwd", x, h_pre, norm.gamma, c)
    else:
        u = _call(ops, "mhc_pre_fwd", x, h_pre, c)
        y, _ = _call(ops, "rmsnorm_residual_fwd", u, norm.gamma, None, c)
    out["fwd.pre.u"], out["fwd.norm.y"] = u, y
    o = out["fwd.sublayer.o"] = sublayer_standin_fwd(y, norm.sublayer_scale)
    out["fwd.post.out"] = _call(ops, "mhc_post_fwd", x, o, h_post, h_res, c)

    d_o, d_x_post, d_h_post, d_h_res = _call(ops, "mhc_post_bwd", x, o, h_post, h_res, batch.grad_out, c)
    out["bwd.post.d_o"], out["bwd.post.d_streams"] = d_o, d_x_post
    out["bwd.post.d_h_post"], out["bwd.post.d_h_res"] = d_h_post, d_h_res
    d_y = out["bwd.sublayer.d_y"] = sublayer_standin_bwd(d_o, norm.sublayer_scale)
    if c.fusion_mode == "fused_pre_norm":
        d_x_pre, d_h_pre, d_gamma = _call(ops, "mhc_pre_rmsnorm_bwd", x, h_pre, norm.gamma, u, d_y, c)
    else:
        d_u, d_gamma = _call(ops, "rmsnorm_residual_bwd", u, norm.gamma, d_y, None, c)
        out["bwd.norm.d_u"] = d_u
        d_x_pre, d_h_pre = _call(ops, "mhc_pre_bwd", x, h_pre, d_u, c)
    out["bwd.norm.d_gamma"], out["bwd.pre.d_streams"], out["bwd.pre.d_h_pre"] = d_gamma, d_x_pre, d_h_pre
    d_h = out["bwd.sinkhorn.d_h"] = _call(ops, "hc_split_sinkhorn_bwd", h, d_h_pre, d_h_post, d_h_res, c)
    d_p, d_r, d_alpha, d_bias = _call(ops, "controller_affine_bwd", p, r, controller.alpha, d_h, c)
    out["bwd.affine.d_p"], out["bwd.affine.d_r"] = d_p, d_r
    if c.trainability == "full":
        out["bwd.affine.d_alpha"], out["bwd.affine.d_bias"] = d_alpha, d_bias
    d_x_ctrl, d_phi = _call(ops, "fp32_gemm_rms_bwd", x, controller.phi, r, d_p, d_r, c)
    out["bwd.gemm_rms.d_streams"] = d_x_ctrl
    if c.trainability == "full":
        out["bwd.gemm_rms.d_phi"] = d_phi
    out["bwd.site.d_streams"] = to_bf16((d_x_post + d_x_pre) + d_x_ctrl)
    return out
