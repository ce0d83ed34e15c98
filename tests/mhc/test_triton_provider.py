"""TritonProvider against the strict-fp32 oracle: every operator byte-identical, forward and backward.

On the CPU the kernels run under the Triton interpreter (tests/conftest.py), at the small fixture
geometries; the `gpu` tests run the acceptance check on CUDA at fixture and production geometry.
"""

import pytest
import torch
import triton
import triton.language as tl

from rl_engine.checks.mhc_acceptance import check_provider
from rl_engine.mhc import numerics, oracle
from rl_engine.mhc.fixtures import CASES, CASES_BY_NAME, build_inputs
from rl_engine.mhc.kernels import strict_fp32 as sf
from rl_engine.mhc.kernels.launch import STRICT
from rl_engine.mhc.provider import check_capability
from rl_engine.mhc.trace import compare
from rl_engine.mhc.triton_provider import TritonProvider

PROVIDER = TritonProvider()


@triton.jit
def _exp_sigmoid_kernel(x_ptr, e_ptr, s_ptr, N: tl.constexpr):
    i = tl.arange(0, N)
    x = tl.load(x_ptr + i)
    tl.store(e_ptr + i, sf.exp(x))
    tl.store(s_ptr + i, sf.sigmoid(x))


def assert_same(expected, actual, what):
    expected = expected if isinstance(expected, tuple) else (expected,)
    actual = actual if isinstance(actual, tuple) else (actual,)
    assert len(expected) == len(actual), what
    for i, (e, a) in enumerate(zip(expected, actual)):
        if e is None:
            assert a is None, f"{what}[{i}]"
            continue
        diff = compare(e, a)
        assert diff["equal"], f"{what}[{i}]: {diff}"


def site_inputs(name, device="cpu"):
    contract, batch, controller, norm = build_inputs(CASES_BY_NAME[name], device)
    return contract, batch, controller, norm


@pytest.mark.parametrize("name", ["odd_t7", "eps_outside", "mixer_frozen"])
def test_each_operator_matches_the_oracle(name):
    """Each operator on the oracle's own inputs (so a divergence is pinned to that operator)."""
    c, batch, ctl, norm = site_inputs(name)
    x, gen = batch.streams, torch.Generator().manual_seed(7)

    def randn_like(t):
        return torch.randn(t.shape, generator=gen).to(t.dtype)

    p, r = oracle.fp32_gemm_rms_fwd(x, ctl.phi, c)
    assert_same((p, r), PROVIDER.fp32_gemm_rms_fwd(x, ctl.phi, c), "fp32_gemm_rms_fwd")
    d_p, d_r = randn_like(p), randn_like(r)
    assert_same(oracle.fp32_gemm_rms_bwd(x, ctl.phi, r, d_p, d_r, c),
                PROVIDER.fp32_gemm_rms_bwd(x, ctl.phi, r, d_p, d_r, c), "fp32_gemm_rms_bwd")

    h = oracle.controller_affine_fwd(p, r, ctl.alpha, ctl.bias, c)
    assert_same(h, PROVIDER.controller_affine_fwd(p, r, ctl.alpha, ctl.bias, c), "controller_affine_fwd")
    d_h = randn_like(h)
    assert_same(oracle.controller_affine_bwd(p, r, ctl.alpha, d_h, c),
                PROVIDER.controller_affine_bwd(p, r, ctl.alpha, d_h, c), "controller_affine_bwd")

    h = h * 4.0  # sharper logits: more of the exp range and of the Sinkhorn iterations matter
    h_pre, h_post, h_res = oracle.hc_split_sinkhorn_fwd(h, c)
    assert_same((h_pre, h_post, h_res), PROVIDER.hc_split_sinkhorn_fwd(h, c), "hc_split_sinkhorn_fwd")
    grads = (randn_like(h_pre), randn_like(h_post), randn_like(h_res))
    assert_same(oracle.hc_split_sinkhorn_bwd(h, *grads, c), PROVIDER.hc_split_sinkhorn_bwd(h, *grads, c),
                "hc_split_sinkhorn_bwd")

    u = oracle.mhc_pre_fwd(x, h_pre, c)
    assert_same(u, PROVIDER.mhc_pre_fwd(x, h_pre, c), "mhc_pre_fwd")
    d_u = randn_like(u).float()
    assert_same(oracle.mhc_pre_bwd(x, h_pre, d_u, c), PROVIDER.mhc_pre_bwd(x, h_pre, d_u, c), "mhc_pre_bwd")

    residual = randn_like(u)
    for res in (None, residual):
        y, fork = oracle.rmsnorm_residual_fwd(u, norm.gamma, res, c)
        assert_same((y, fork), PROVIDER.rmsnorm_residual_fwd(u, norm.gamma, res, c), "rmsnorm_residual_fwd")
    d_y, d_fork = randn_like(u).float(), randn_like(u).float()
    for d_h_fork in (None, d_fork):
        assert_same(oracle.rmsnorm_residual_bwd(fork, norm.gamma, d_y, d_h_fork, c),
                    PROVIDER.rmsnorm_residual_bwd(fork, norm.gamma, d_y, d_h_fork, c), "rmsnorm_residual_bwd")

    assert_same(oracle.mhc_pre_rmsnorm_fwd(x, h_pre, norm.gamma, c),
                PROVIDER.mhc_pre_rmsnorm_fwd(x, h_pre, norm.gamma, c), "mhc_pre_rmsnorm_fwd")
    assert_same(oracle.mhc_pre_rmsnorm_bwd(x, h_pre, norm.gamma, u, d_y, c),
                PROVIDER.mhc_pre_rmsnorm_bwd(x, h_pre, norm.gamma, u, d_y, c), "mhc_pre_rmsnorm_bwd")

    o = randn_like(u)
    assert_same(oracle.mhc_post_fwd(x, o, h_post, h_res, c), PROVIDER.mhc_post_fwd(x, o, h_post, h_res, c),
                "mhc_post_fwd")
    assert_same(oracle.mhc_post_bwd(x, o, h_post, h_res, batch.grad_out, c),
                PROVIDER.mhc_post_bwd(x, o, h_post, h_res, batch.grad_out, c), "mhc_post_bwd")


def test_exp_and_sigmoid_match_the_oracle_over_their_range():
    """The pinned exp and sigmoid, element for element, including the flush, overflow and n = 128 paths."""
    gen = torch.Generator().manual_seed(3)
    x = torch.cat([torch.rand(1 << 14, generator=gen) * 200 - 100, torch.randn(1 << 14, generator=gen) * 4])
    x[:10] = torch.tensor([0.0, -0.0, 88.72, 88.73, 89.0, -87.3, -87.4, -88.0, 1e-30, -1e-30])
    e, s = torch.empty_like(x), torch.empty_like(x)
    _exp_sigmoid_kernel[(1,)](x, e, s, x.numel(), **STRICT)
    assert compare(numerics.exp(x), e)["equal"]
    assert compare(numerics.sigmoid(x), s)["equal"]


@pytest.mark.parametrize("name", ["eps_outside"])
def test_acceptance_with_batch_invariance(name):
    report = check_provider(PROVIDER, [CASES_BY_NAME[name]], progress=None)
    assert report["passed"], report["cases"][0]["failures"]
    assert report["cases"][0]["batch_invariance"]["passed"]


@pytest.mark.parametrize("name", ["one_row", "odd_t7", "fused_pre_norm", "mixer_frozen"])
def test_acceptance_against_the_golden_hashes(name):
    report = check_provider(PROVIDER, [CASES_BY_NAME[name]], progress=None, batch_invariance=False)
    assert report["passed"], report["cases"][0]["failures"]


def test_declares_every_mode_it_implements_and_refuses_short_lane_counts():
    import dataclasses

    for case in CASES:
        check_capability(PROVIDER, case.contract())
    contract, batch, controller, _ = site_inputs("one_row")
    with pytest.raises(ValueError, match="lanes"):
        PROVIDER.fp32_gemm_rms_fwd(batch.streams, controller.phi, dataclasses.replace(contract, lanes=16))


def test_checker_catches_a_fused_multiply_add():
    """Planted bug: the controller affine computed with an FMA (one rounding instead of two) is caught."""

    class FusedAffine(TritonProvider):
        def controller_affine_fwd(self, p, r, alpha, bias, contract):
            a = oracle._alpha_per_output(alpha, contract)
            exact = (r.unsqueeze(1) * p).double() * a.double() + bias.double()  # one rounding, like an FMA
            return exact.float()

    report = check_provider(FusedAffine(), [CASES_BY_NAME["eps_outside"]], progress=None, batch_invariance=False)
    assert not report["passed"]
    assert report["cases"][0]["first_divergence"]["boundary"] == "fwd.affine.h"


@pytest.mark.gpu
@pytest.mark.parametrize("name", [c.name for c in CASES])
def test_acceptance_on_cuda(name):
    """Every case, fixture and production geometry, byte-identical to the oracle and the golden hashes."""
    report = check_provider(PROVIDER, [CASES_BY_NAME[name]], device="cuda", progress=None)
    assert report["passed"], report["cases"][0]["failures"]


@pytest.mark.gpu
def test_production_pro_geometry_matches_the_oracle_on_cuda():
    """DeepSeek-V4-Pro (hidden 7168): no golden row, so the oracle on CUDA is the judge."""
    from rl_engine.mhc.contract import ControllerParams, LayerContract, NormParams, ResidualBatch

    contract = LayerContract(hidden=7168)
    contract.assert_production()
    gen = torch.Generator().manual_seed(11)
    t, k = 40, contract.k
    batch = ResidualBatch(torch.randn(t, 4, 7168, generator=gen).bfloat16(),
                          (torch.randn(t, 4, 7168, generator=gen) * 0.5).bfloat16()).to("cuda")
    controller = ControllerParams(torch.randn(24, k, generator=gen) / k ** 0.5, torch.tensor([0.8, 0.6, 1.5]),
                                  0.5 * torch.randn(24, generator=gen)).to("cuda")
    norm = NormParams(1.0 + 0.1 * torch.randn(7168, generator=gen), 0.5 * torch.randn(7168, generator=gen)).to("cuda")
    expected = oracle.mhc_site(batch, controller, norm, contract)
    actual = oracle.mhc_site(batch, controller, norm, contract, ops=PROVIDER)
    for name, tensor in expected.items():
        assert compare(tensor, actual[name])["equal"], name
