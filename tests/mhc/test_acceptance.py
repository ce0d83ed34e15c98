"""The acceptance checker passes the reference and catches every planted bug, naming the boundary."""

import dataclasses
import json

import pytest
import torch

from rl_engine.cli import main
from rl_engine.errors import UsageError
from rl_engine.mhc import oracle
from rl_engine.mhc.acceptance import check_provider
from rl_engine.mhc.fixtures import CASES_BY_NAME
from rl_engine.mhc.provider import ReferenceProvider, StubProvider, check_capability, resolve_provider

SMALL = [CASES_BY_NAME[n] for n in ("one_row", "odd_t7", "eps_outside")]


def run(provider, names=("odd_t7",), **kw):
    return check_provider(provider, [CASES_BY_NAME[n] for n in names], progress=None, **kw)


def first(report, case=0):
    return report["cases"][case]["first_divergence"]


# --- planted providers ---------------------------------------------------------------------------------

def one_ulp_up(t: torch.Tensor) -> torch.Tensor:
    t = t.clone()
    flat = t.view(-1)
    flat[0] = torch.nextafter(flat[0], torch.tensor(float("inf")))
    return t


class OneUlpSinkhorn(ReferenceProvider):
    """H_res moved by one ulp in one element."""

    def hc_split_sinkhorn_fwd(self, h, contract):
        pre, post, res = oracle.hc_split_sinkhorn_fwd(h, contract)
        return pre, post, one_ulp_up(res)


class OneUlpWeightGrad(ReferenceProvider):
    """d_phi moved by one ulp in one element: a backward, non-per-token boundary."""

    def fp32_gemm_rms_bwd(self, *args):
        d_x, d_phi = oracle.fp32_gemm_rms_bwd(*args)
        return d_x, one_ulp_up(d_phi)


class SerialReduction(ReferenceProvider):
    """The controller GEMM and RMS with a serial left fold (one lane) instead of the lane fold."""

    def fp32_gemm_rms_fwd(self, streams, phi, contract):
        return oracle.fp32_gemm_rms_fwd(streams, phi, dataclasses.replace(contract, lanes=1))


class RowAloneDiffers(ReferenceProvider):
    """Right on the batch, but a token run alone takes another reduction order (forward)."""

    def fp32_gemm_rms_fwd(self, streams, phi, contract):
        lanes = 32 if streams.shape[0] == 1 else contract.lanes
        return oracle.fp32_gemm_rms_fwd(streams, phi, dataclasses.replace(contract, lanes=lanes))


class RowAloneDiffersBackward(ReferenceProvider):
    """Right on the batch; a token alone gets d_h_res one ulp off (backward only)."""

    def mhc_post_bwd(self, *args):
        d_o, d_x, d_post, d_res = oracle.mhc_post_bwd(*args)
        return (d_o, d_x, d_post, one_ulp_up(d_res)) if d_res.shape[0] == 1 else (d_o, d_x, d_post, d_res)


class LiesAboutFusion(ReferenceProvider):
    """Declares fused_pre_norm but does not implement it."""

    def mhc_pre_rmsnorm_fwd(self, *args):
        raise NotImplementedError("fused path not written yet")


class CountingUnfusedOnly(ReferenceProvider):
    """Declares only the unfused mode; counts operator calls."""

    calls = 0

    def capabilities(self):
        return {**super().capabilities(), "fusion_modes": ["unfused"]}

    def fp32_gemm_rms_fwd(self, *args):
        type(self).calls += 1
        return oracle.fp32_gemm_rms_fwd(*args)


class RelaxedSinkhorn(ReferenceProvider):
    """A non-strict provider: library sigmoid and softmax (not the pinned exp)."""

    numeric_profile = "fp32-relaxed"

    def hc_split_sinkhorn_fwd(self, h, contract):
        pre = torch.sigmoid(h[:, :4]) + contract.mhc_eps
        post = torch.sigmoid(h[:, 4:8]) * 2
        m = torch.softmax(h[:, 8:].reshape(-1, 4, 4), dim=-1) + contract.mhc_eps
        m = m / (m.sum(1, keepdim=True) + contract.mhc_eps)
        for _ in range(contract.sinkhorn_iters - 1):
            m = m / (m.sum(2, keepdim=True) + contract.mhc_eps)
            m = m / (m.sum(1, keepdim=True) + contract.mhc_eps)
        return pre, post, m


class RelaxedButWrongScale(RelaxedSinkhorn):
    def hc_split_sinkhorn_fwd(self, h, contract):
        pre, post, res = super().hc_split_sinkhorn_fwd(h, contract)
        return pre, post * 1.05, res


# --- tests ----------------------------------------------------------------------------------------------

def test_reference_provider_passes_bitwise_with_batch_invariance():
    report = check_provider(ReferenceProvider(), SMALL + [CASES_BY_NAME["fused_pre_norm"],
                                                          CASES_BY_NAME["mixer_frozen"]], progress=None)
    assert report["passed"], [c["failures"] for c in report["cases"]]
    assert report["judgment"].startswith("bitwise")
    for case in report["cases"]:
        assert case["oracle_matches_golden"]
        assert all(r["equal"] and r["golden_equal"] for r in case["boundaries"])
        if case["tokens"] > 1:
            assert case["batch_invariance"]["passed"]


def test_one_ulp_in_a_forward_boundary_is_caught_and_named():
    report = run(OneUlpSinkhorn())
    assert not report["passed"]
    div = first(report)
    assert div["boundary"] == "fwd.sinkhorn.h_res" and div["max_ulp"] == 1 and div["mismatched"] == 1
    assert 0 < div["max_abs_error"] < 1e-6 and div["golden_equal"] is False
    assert "fwd.sinkhorn.h_res" in report["cases"][0]["failures"][0]


def test_one_ulp_in_a_weight_gradient_is_caught():
    div = first(run(OneUlpWeightGrad()))
    assert div["boundary"] == "bwd.gemm_rms.d_phi" and div["max_ulp"] == 1


def test_another_reduction_order_is_caught_at_the_controller():
    div = first(run(SerialReduction()))
    assert div["boundary"] == "fwd.gemm_rms.p" and div["max_ulp"] >= 1


def test_stub_fails_closed_before_any_operator():
    report = run(StubProvider(), names=("one_row", "fused_pre_norm"))
    assert not report["passed"]
    assert all("capability" in c["failures"][0] and "boundaries" not in c for c in report["cases"])


def test_stub_operators_raise_even_if_forced():
    class StubClaimingEverything(StubProvider):
        capabilities = ReferenceProvider.capabilities

    case = run(StubClaimingEverything())["cases"][0]
    assert case["operator_error"]["operator"] == "fp32_gemm_rms_fwd"


def test_a_provider_lying_about_a_capability_is_caught_with_its_operator():
    report = run(LiesAboutFusion(), names=("fused_pre_norm", "odd_t7"))
    fused, unfused = report["cases"]
    assert not fused["passed"] and fused["operator_error"]["operator"] == "mhc_pre_rmsnorm_fwd"
    assert unfused["passed"]


def test_an_undeclared_mode_is_rejected_before_any_operator_runs():
    CountingUnfusedOnly.calls = 0
    report = run(CountingUnfusedOnly(), names=("fused_pre_norm",))
    assert "does not declare fusion_mode 'fused_pre_norm'" in report["cases"][0]["failures"][0]
    assert CountingUnfusedOnly.calls == 0
    with pytest.raises(UsageError, match="trainability 'mixer_frozen'"):
        class NoFrozen(ReferenceProvider):
            def capabilities(self):
                return {**super().capabilities(), "trainability": ["full"]}
        check_capability(NoFrozen(), CASES_BY_NAME["mixer_frozen"].contract())


def test_missing_capability_declarations_fail_closed():
    class Partial(ReferenceProvider):
        def capabilities(self):
            return {"fusion_modes": ["unfused"]}

    with pytest.raises(UsageError, match="trainability 'full'.*None"):
        check_capability(Partial(), CASES_BY_NAME["one_row"].contract())


def test_batch_variance_is_caught_forward():
    report = run(RowAloneDiffers())
    case = report["cases"][0]
    assert all(r["passed"] for r in case["boundaries"])  # right on the batch...
    inv = case["batch_invariance"]
    assert not inv["passed"] and inv["first_divergence"]["boundary"] == "fwd.gemm_rms.p"  # ...not alone


def test_batch_variance_is_caught_backward():
    inv = run(RowAloneDiffersBackward())["cases"][0]["batch_invariance"]
    assert not inv["passed"] and inv["first_divergence"]["boundary"] == "bwd.post.d_h_res"
    assert inv["first_divergence"]["row"] == 0


def test_non_strict_provider_is_judged_by_tolerance_and_the_report_says_so():
    report = run(RelaxedSinkhorn(), names=("odd_t7", "packed_t16"))
    assert report["passed"], [c["failures"] for c in report["cases"]]
    assert report["judgment"].startswith("tolerance") and report["tolerance"]["mode"] == "allclose"
    assert any(not r["equal"] for r in report["cases"][0]["boundaries"])  # not bitwise, but within tolerance
    bad = run(RelaxedButWrongScale())
    assert not bad["passed"] and first(bad)["boundary"] == "fwd.sinkhorn.h_post"


def test_oracle_off_golden_is_reported(tmp_path):
    from rl_engine.mhc.fixtures import load_golden

    manifest = load_golden()
    manifest["cases"]["one_row"]["boundaries"]["fwd.norm.y"]["sha256"] = "0" * 64
    case = run(ReferenceProvider(), names=("one_row",), manifest=manifest)["cases"][0]
    assert not case["oracle_matches_golden"] and "fwd.norm.y" in case["failures"][0]


def test_resolve_provider():
    assert isinstance(resolve_provider("rl_engine.mhc.provider:ReferenceProvider"), ReferenceProvider)
    for spec, msg in [("no_colon", "module:Class"), ("no.such.module:X", "cannot import"),
                      ("rl_engine.mhc.provider:Nope", "no attribute"),
                      ("rl_engine.mhc.oracle:OperatorError", "cannot construct"),
                      ("rl_engine.mhc.contract:ResidualBatch", "cannot construct"),
                      ("rl_engine.mhc.numerics:PROFILE", "cannot construct")]:
        with pytest.raises(UsageError, match=msg):
            resolve_provider(spec)


def test_cli_exit_codes_and_json_report(tmp_path, capsys):
    out = tmp_path / "report.json"
    ref = "rl_engine.mhc.provider:ReferenceProvider"
    assert main(["check-p1", "--provider", ref, "--cases", "one_row", "eps_outside", "--json", str(out)]) == 0
    report = json.loads(out.read_text())
    assert report["passed"] and report["device"] == "cpu" and report["torch"] == torch.__version__
    assert [c["case"] for c in report["cases"]] == ["one_row", "eps_outside"]
    text = capsys.readouterr().out
    assert "one_row" in text and "PASSED" in text
    assert main(["check-p1", "--provider", "rl_engine.mhc.provider:StubProvider", "--cases", "one_row"]) == 1
    for argv in (["--provider", "does.not.exist:P"], ["--provider", ref, "--cases", "nope"]):
        capsys.readouterr()
        assert main(["check-p1", *argv]) == 2
        err = capsys.readouterr().err.strip()
        assert err and "\n" not in err and "Traceback" not in err


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-CUDA path")
def test_cuda_without_cuda_is_a_usage_error(capsys):
    assert main(["check-p1", "--provider", "rl_engine.mhc.provider:ReferenceProvider", "--device", "cuda"]) == 2
    assert "CUDA is not available" in capsys.readouterr().err
