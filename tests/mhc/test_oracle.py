"""Every hand-written backward of the oracle against float64 autograd of the same formulas, plus the
edge cases: all-zero rows, large logits, the eps paths (no NaN where the true gradient is finite)."""

import dataclasses

import pytest
import torch

from rl_engine.mhc import oracle
from rl_engine.mhc.contract import LayerContract
from rl_engine.mhc.fixtures import CASES_BY_NAME, build_inputs

D = torch.float64
T, C = 5, 64


def contract(**kw) -> LayerContract:
    return LayerContract(hidden=C, **kw)


def gen(seed=0):
    return torch.Generator().manual_seed(seed)


def randn(*shape, seed=0, scale=1.0):
    return torch.randn(*shape, generator=gen(seed)) * scale


def assert_close64(got: torch.Tensor, want: torch.Tensor, rtol=2e-5):
    """Normwise: max |got − want| ≤ rtol · max |want| (fp32 arithmetic vs the float64 truth)."""
    assert torch.isfinite(got).all(), "non-finite gradient where float64 is finite"
    assert torch.isfinite(want).all()
    assert got.shape == want.shape
    err = float((got.double() - want).abs().max())
    assert err <= rtol * max(float(want.abs().max()), 1e-30), f"error {err:.3g} vs scale {float(want.abs().max()):.3g}"


def grads64(fn, inputs, cotangents):
    """Float64 autograd of fn(*inputs) against the given output cotangents."""
    leaves = [t.detach().to(D).requires_grad_(True) for t in inputs]
    outs = fn(*leaves)
    outs = outs if isinstance(outs, tuple) else (outs,)
    loss = sum((o * g.to(D)).sum() for o, g in zip(outs, cotangents))
    return torch.autograd.grad(loss, leaves, allow_unused=True)


# --- float64 formulas (plain torch, any order) -------------------------------------------------------

def gemm_rms64(x, phi, placement, eps=1e-6):
    xf = x.reshape(x.shape[0], -1)
    q = (xf * xf).sum(-1) / xf.shape[1]
    r = 1 / torch.sqrt(q + eps) if placement == "inside" else 1 / (torch.sqrt(q) + eps)
    return xf @ phi.T, r


def affine64(p, r, alpha, bias):
    a = torch.cat([alpha[0].expand(4), alpha[1].expand(4), alpha[2].expand(16)])
    return r[:, None] * p * a + bias


def sinkhorn64(h, iters=20, eps=1e-6):
    pre = torch.sigmoid(h[:, :4]) + eps
    post = 2 * torch.sigmoid(h[:, 4:8])
    m = torch.softmax(h[:, 8:].reshape(-1, 4, 4), dim=-1) + eps
    m = m / (m.sum(1, keepdim=True) + eps)
    for _ in range(iters - 1):
        m = m / (m.sum(2, keepdim=True) + eps)
        m = m / (m.sum(1, keepdim=True) + eps)
    return pre, post, m


def rmsnorm64(h, gamma, eps=1e-6):
    return h * torch.rsqrt((h * h).mean(-1, keepdim=True) + eps) * gamma


def post64(x, o, h_post, h_res):
    return h_post[..., None] * o[:, None] + torch.einsum("tij,tic->tjc", h_res, x)


# --- per-operator checks -----------------------------------------------------------------------------

@pytest.mark.parametrize("placement", ["inside", "outside"])
@pytest.mark.parametrize("trainability", ["full", "mixer_frozen"])
def test_fp32_gemm_rms_bwd(placement, trainability):
    c = contract(rms_eps_placement=placement, trainability=trainability)
    x = randn(T, 4, C, seed=1).to(torch.bfloat16)
    phi = randn(24, c.k, seed=2, scale=c.k**-0.5)
    d_p, d_r = randn(T, 24, seed=3), randn(T, seed=4)
    p, r = oracle.fp32_gemm_rms_fwd(x, phi, c)
    want_p, want_r = gemm_rms64(x.to(D), phi.to(D), placement)
    assert_close64(p, want_p)
    assert_close64(r, want_r)
    d_x, d_phi = oracle.fp32_gemm_rms_bwd(x, phi, r, d_p, d_r, c)
    gx, gphi = grads64(lambda a, b: gemm_rms64(a, b, placement), (x, phi), (d_p, d_r))
    assert_close64(d_x, gx)
    if trainability == "full":
        assert_close64(d_phi, gphi)
    else:
        assert d_phi is None


@pytest.mark.parametrize("placement", ["inside", "outside"])
def test_fp32_gemm_rms_zero_row_and_tiny_row(placement):
    c = contract(rms_eps_placement=placement)
    x = randn(T, 4, C, seed=1)
    x[0] = 0.0
    x[1] *= 1e-12  # s/K far below eps: the eps path dominates
    x = x.to(torch.bfloat16)
    phi = randn(24, c.k, seed=2, scale=c.k**-0.5)
    d_p, d_r = randn(T, 24, seed=3), randn(T, seed=4)
    p, r = oracle.fp32_gemm_rms_fwd(x, phi, c)
    d_x, d_phi = oracle.fp32_gemm_rms_bwd(x, phi, r, d_p, d_r, c)
    assert torch.isfinite(r).all() and torch.isfinite(d_x).all() and torch.isfinite(d_phi).all()
    gemm_only, _ = oracle.fixed_k_gemm_bwd(x.reshape(T, -1), phi, d_p, c)
    assert torch.equal(d_x[0].reshape(-1), gemm_only[0])  # x = 0: the RMS leg contributes exactly 0
    rows = slice(1, None) if placement == "outside" else slice(None)  # sqrt'(0) is infinite in float64
    gx, _ = grads64(lambda a, b: gemm_rms64(a, b, placement), (x[rows], phi), (d_p[rows], d_r[rows]))
    assert_close64(d_x[rows], gx)


def test_controller_affine_bwd():
    c = contract()
    p, r = randn(T, 24, seed=1), randn(T, seed=2).abs() + 0.5
    alpha, bias, d_h = randn(3, seed=3), randn(24, seed=4), randn(T, 24, seed=5)
    want_h = affine64(p.to(D), r.to(D), alpha.to(D), bias.to(D))
    assert_close64(oracle.controller_affine_fwd(p, r, alpha, bias, c), want_h)
    got = oracle.controller_affine_bwd(p, r, alpha, d_h, c)
    want = grads64(affine64, (p, r, alpha, bias), (d_h,))
    for g, w in zip(got, want):
        assert_close64(g, w)
    frozen = oracle.controller_affine_bwd(p, r, alpha, d_h, contract(trainability="mixer_frozen"))
    assert frozen[2] is None and frozen[3] is None and torch.equal(frozen[0], got[0])


@pytest.mark.parametrize("scale", [1.0, 30.0, 120.0], ids=["moderate", "large", "huge_logits"])
def test_hc_split_sinkhorn_bwd(scale):
    c = contract()
    h = randn(T, 24, seed=1, scale=scale)
    cot = randn(T, 4, seed=2), randn(T, 4, seed=3), randn(T, 4, 4, seed=4)
    got = oracle.hc_split_sinkhorn_fwd(h, c)
    for g, w in zip(got, sinkhorn64(h.to(D))):
        assert_close64(g, w, rtol=1e-5)
    d_h = oracle.hc_split_sinkhorn_bwd(h, *cot, c)
    (want,) = grads64(sinkhorn64, (h,), cot)
    # Sinkhorn's 39 normalisations amplify fp32 rounding a little; saturated logits give tiny gradients
    assert_close64(d_h, want, rtol=1e-4)


def test_mhc_pre_bwd():
    c = contract()
    x, h_pre, d_u = randn(T, 4, C, seed=1).to(torch.bfloat16), randn(T, 4, seed=2), randn(T, C, seed=3)
    fn = lambda a, b: (b[..., None] * a).sum(1)
    assert_close64(oracle.mhc_pre_fwd(x, h_pre, c).float(), fn(x.to(D), h_pre.to(D)).float().double(), rtol=8e-3)
    got = oracle.mhc_pre_bwd(x, h_pre, d_u, c)
    for g, w in zip(got, grads64(fn, (x, h_pre), (d_u,))):
        assert_close64(g, w)


@pytest.mark.parametrize("zero_row", [False, True])
def test_rmsnorm_residual_bwd(zero_row):
    c = contract()
    h = randn(T, C, seed=1)
    if zero_row:
        h[2] = 0.0  # eps keeps r finite: the gradient exists and is finite
    h = h.to(torch.bfloat16)
    gamma, d_y, d_fork = 1 + 0.1 * randn(C, seed=2), randn(T, C, seed=3), randn(T, C, seed=4)
    d_x, d_gamma = oracle.rmsnorm_residual_bwd(h, gamma, d_y, d_fork, c)
    gh, gg = grads64(lambda a, b: (rmsnorm64(a, b), a), (h, gamma), (d_y, d_fork))
    assert_close64(d_x, gh)
    assert_close64(d_gamma, gg)


def test_rmsnorm_residual_fork_adds_the_residual():
    c = contract()
    x, res = randn(T, C, seed=1).to(torch.bfloat16), randn(T, C, seed=2).to(torch.bfloat16)
    gamma = torch.ones(C)
    y, h = oracle.rmsnorm_residual_fwd(x, gamma, res, c)
    assert torch.equal(h, (x.float() + res.float()).to(torch.bfloat16))
    assert torch.equal(y, oracle.rmsnorm_residual_fwd(h, gamma, None, c)[0])


def test_mhc_post_bwd():
    c = contract()
    x, o = randn(T, 4, C, seed=1).to(torch.bfloat16), randn(T, C, seed=2).to(torch.bfloat16)
    h_post, h_res, d_out = randn(T, 4, seed=3), randn(T, 4, 4, seed=4).abs(), randn(T, 4, C, seed=5)
    d_o, d_x, d_h_post, d_h_res = oracle.mhc_post_bwd(x, o, h_post, h_res, d_out, c)
    for g, w in zip((d_x, d_o, d_h_post, d_h_res), grads64(post64, (x, o, h_post, h_res), (d_out,))):
        assert_close64(g, w)


def test_fused_pre_norm_is_byte_identical_to_the_pair():
    c = contract()
    x, h_pre = randn(T, 4, C, seed=1).to(torch.bfloat16), randn(T, 4, seed=2).abs()
    gamma, d_y = 1 + 0.1 * randn(C, seed=3), randn(T, C, seed=4)
    y, u = oracle.mhc_pre_rmsnorm_fwd(x, h_pre, gamma, c)
    u2 = oracle.mhc_pre_fwd(x, h_pre, c)
    assert torch.equal(u, u2) and torch.equal(y, oracle.rmsnorm_residual_fwd(u2, gamma, None, c)[0])
    d_u, d_gamma = oracle.rmsnorm_residual_bwd(u2, gamma, d_y, None, c)
    fused = oracle.mhc_pre_rmsnorm_bwd(x, h_pre, gamma, u, d_y, c)
    for a, b in zip(fused, (*oracle.mhc_pre_bwd(x, h_pre, d_u, c), d_gamma)):
        assert torch.equal(a, b)


def test_fixed_k_gemm_rows_do_not_depend_on_the_batch():
    c = contract()
    a, w = randn(9, 300, seed=1), randn(24, 300, seed=2)
    full = oracle.fixed_k_gemm_fwd(a, w, c)
    assert all(torch.equal(full[t : t + 1], oracle.fixed_k_gemm_fwd(a[t : t + 1], w, c)) for t in range(9))


def test_site_gradients_follow_float64_autograd_of_the_whole_site():
    """The composition's wiring (every gradient path summed), against float64 autograd with the bf16
    casts as identities; loose, because the oracle rounds u, y, o and out to bf16."""
    c, batch, ctl, norm = build_inputs(dataclasses.replace(CASES_BY_NAME["odd_t7"], tokens=3))
    out = oracle.mhc_site(batch, ctl, norm, c)

    def site64(x, phi, alpha, bias, gamma):
        p, r = gemm_rms64(x, phi, "inside")
        pre, post, res = sinkhorn64(affine64(p, r, alpha, bias))
        u = (pre[..., None] * x).sum(1)
        o = rmsnorm64(u, gamma) * norm.sublayer_scale.to(D)
        return post64(x, o, post, res)

    want = grads64(site64, (batch.streams, ctl.phi, ctl.alpha, ctl.bias, norm.gamma), (batch.grad_out,))
    got = (out["bwd.site.d_streams"], out["bwd.gemm_rms.d_phi"], out["bwd.affine.d_alpha"],
           out["bwd.affine.d_bias"], out["bwd.norm.d_gamma"])
    for g, w in zip(got, want):
        assert_close64(g.float(), w, rtol=3e-2)


def test_site_is_deterministic_and_finite_for_every_fixture_case():
    for name in ("packed_t16", "eps_outside", "mixer_frozen", "fused_pre_norm"):
        c, batch, ctl, norm = build_inputs(CASES_BY_NAME[name])
        a, b = oracle.mhc_site(batch, ctl, norm, c), oracle.mhc_site(batch, ctl, norm, c)
        assert a.keys() == b.keys()
        for k in a:
            assert torch.equal(a[k], b[k]) and torch.isfinite(a[k].float()).all(), (name, k)
