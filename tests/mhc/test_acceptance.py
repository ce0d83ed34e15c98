"""The acceptance checker passes the reference and catches every planted bug, naming the boundary."""

import dataclasses
import json
import sys

import pytest
import torch

from rl_engine.checks.mhc_acceptance import check_provider
from rl_engine.cli import main
from rl_engine.errors import UsageError
from rl_engine.mhc import oracle
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


# --- the contract judges, and a provider can neither pick its judgment nor end the run ----------------------

class OnePercentOff(ReferenceProvider):
    """mhc_post's output 1% too large, declaring the strict profile."""

    def mhc_post_fwd(self, *args):
        return (oracle.mhc_post_fwd(*args).float() * 1.01).to(torch.bfloat16)


class OnePercentOffNoProfile(OnePercentOff):
    numeric_profile = None


class OnePercentOffUnknownProfile(OnePercentOff):
    numeric_profile = "fp32-fast"


class ExitsQuietly(ReferenceProvider):
    def mhc_pre_fwd(self, *args):
        raise SystemExit(0)


class RaisesValueError(ReferenceProvider):
    def mhc_post_bwd(self, *args):
        raise ValueError("bad tile")


class Interrupted(ReferenceProvider):
    def mhc_pre_fwd(self, *args):
        raise KeyboardInterrupt


class TwoOfThree(ReferenceProvider):
    def hc_split_sinkhorn_fwd(self, h, contract):
        return oracle.hc_split_sinkhorn_fwd(h, contract)[:2]


class ReturnsNone(ReferenceProvider):
    def mhc_post_fwd(self, *args):
        return None


class WrongShape(ReferenceProvider):
    def mhc_pre_fwd(self, *args):
        return oracle.mhc_pre_fwd(*args)[:, :-1]


class WrongDtype(ReferenceProvider):
    def mhc_pre_fwd(self, *args):
        return oracle.mhc_pre_fwd(*args).float()


class NoWeightGrad(ReferenceProvider):
    def fp32_gemm_rms_bwd(self, *args):
        return oracle.fp32_gemm_rms_bwd(*args)[0], None


class OneNaN(ReferenceProvider):
    def hc_split_sinkhorn_fwd(self, h, contract):
        pre, post, res = oracle.hc_split_sinkhorn_fwd(h, contract)
        res = res.clone()
        res.view(-1)[5] = float("nan")
        return pre, post, res


def cli(capsys, provider_class, case="one_row", *flags):
    """(exit code, last stdout line) of check-p1 on a provider class of this module (run in its own process)."""
    capsys.readouterr()
    code = main(["check-p1", "--provider", f"{__name__}:{provider_class.__name__}", "--cases", case, *flags])
    captured = capsys.readouterr()
    assert "Traceback" not in captured.err
    return code, captured.out.strip().splitlines()[-1]


@pytest.mark.parametrize("profile", [None, "", "  ", "fp32-fast", "fp32_relaxed", "strict-fp32-v2", 1])
def test_a_profile_the_contract_does_not_name_fails_before_any_operator(profile):
    calls = []

    class Planted(OnePercentOff):
        numeric_profile = profile

        def fp32_gemm_rms_fwd(self, *args):
            calls.append(1)
            return oracle.fp32_gemm_rms_fwd(*args)

    report = run(Planted(), names=("one_row",))
    case = report["cases"][0]
    assert not report["passed"] and report["tolerance"] is None and not calls
    assert case["failures"] == [case["failures"][0]] and case["failures"][0].startswith("judgment: provider declares")
    assert repr(profile) in case["failures"][0] and repr(profile) in report["judgment"]


def test_one_percent_off_under_the_strict_profile_fails_bitwise():
    report = run(OnePercentOff(), names=("one_row",))
    assert not report["passed"] and report["judgment"].startswith("bitwise")
    assert first(report)["boundary"] == "fwd.post.out"


def test_cli_a_missing_or_unknown_profile_is_a_named_failure(capsys):
    code, line = cli(capsys, OnePercentOffNoProfile)
    assert code == 1 and line.startswith("check-p1 FAILED: 0/1 cases")
    assert "provider declares no numeric_profile (got None)" in line
    code, line = cli(capsys, OnePercentOffUnknownProfile)
    assert code == 1 and "numeric_profile 'fp32-fast', which the contract does not know" in line


def test_cli_says_which_judgment_passed(capsys, tmp_path):
    code, line = cli(capsys, ReferenceProvider)
    assert code == 0 and line.startswith("check-p1 PASSED bitwise: 1/1 cases")
    code, line = cli(capsys, RelaxedSinkhorn)  # a tolerance pass is not a bitwise pass: exit 1 unless accepted
    assert code == 1 and line.startswith("check-p1 PASSED under tolerance fp32-relaxed (not bitwise), not accepted "
                                         "(exit 1; --accept-tolerance accepts it): 1/1 cases")
    out = tmp_path / "r.json"
    code, line = cli(capsys, RelaxedSinkhorn, "one_row", "--accept-tolerance", "--json", str(out))
    report = json.loads(out.read_text())
    assert code == 0 and line.startswith("check-p1 PASSED under tolerance fp32-relaxed (not bitwise): 1/1 cases")
    assert report["accepted"] and report["accepted_under"] == "tolerance fp32-relaxed (--accept-tolerance)"
    code, line = cli(capsys, RelaxedButWrongScale, "odd_t7", "--accept-tolerance")
    assert code == 1 and line.startswith("check-p1 FAILED under tolerance fp32-relaxed (not bitwise): 0/1")
    assert "first boundary outside tolerance fp32-relaxed fwd.sinkhorn.h_post" in line


def test_the_tolerance_comes_from_the_contract(monkeypatch):
    from rl_engine.mhc import contract

    report = run(RelaxedSinkhorn(), names=("one_row",))
    assert report["passed"] and report["tolerance"] == {"profile": "fp32-relaxed", **contract.JUDGMENTS["fp32-relaxed"]}
    tight = {**contract.JUDGMENTS["fp32-relaxed"], "rtol": 0.0, "atol_rel": 0.0}
    monkeypatch.setitem(contract.JUDGMENTS, "fp32-relaxed", tight)
    assert not run(RelaxedSinkhorn(), names=("one_row",))["passed"]


class ReturnsAString(ReferenceProvider):
    def mhc_pre_fwd(self, *args):
        return "u"


@pytest.mark.parametrize("provider_class,operator,message,via_cli", [
    (ExitsQuietly, "mhc_pre_fwd", "mhc_pre_fwd raised SystemExit: 0", True),
    (RaisesValueError, "mhc_post_bwd", "mhc_post_bwd raised ValueError: bad tile", False),
    (TwoOfThree, "hc_split_sinkhorn_fwd",
     "hc_split_sinkhorn_fwd returned 2 values, expected 3 (h_pre, h_post, h_res)", False),
    (ReturnsNone, "mhc_post_fwd",
     "mhc_post_fwd output 0 (out): expected [T, n, C] = [1, 4, 128] bfloat16 on cpu, got None", False),
    (WrongShape, "mhc_pre_fwd", "mhc_pre_fwd output 0 (u): expected [T, C] = [1, 128] bfloat16 on cpu, "
                                "got [1, 127] bfloat16 on cpu", True),
    (WrongDtype, "mhc_pre_fwd", "got [1, 128] float32 on cpu", False),
    (ReturnsAString, "mhc_pre_fwd", "got a str", False),
    (NoWeightGrad, "fp32_gemm_rms_bwd", "fp32_gemm_rms_bwd output 1 (d_phi): expected [N, K] = [24, 512]", False),
])
def test_a_misbehaving_operator_fails_the_case_and_is_named(capsys, provider_class, operator, message, via_cli):
    case = run(provider_class(), names=("one_row",))["cases"][0]
    assert not case["passed"] and case["operator_error"]["operator"] == operator
    assert message in case["failures"][0]
    if via_cli:  # the same message through the provider's own process (each start costs seconds: two cases)
        code, line = cli(capsys, provider_class)
        assert code == 1 and line.startswith("check-p1 FAILED bitwise: 0/1 cases") and message in line


def test_a_mixer_gradient_may_be_none_when_the_mixer_is_frozen():
    assert run(NoWeightGrad(), names=("mixer_frozen",), batch_invariance=False)["passed"]


def test_keyboard_interrupt_still_interrupts():
    with pytest.raises(KeyboardInterrupt):
        run(Interrupted(), names=("one_row",))


def test_system_exit_outside_the_operators_is_a_failure_too():
    class ExitingCapabilities(ReferenceProvider):
        def capabilities(self):
            raise SystemExit(0)

    class ExitingProfile(ReferenceProvider):
        @property
        def numeric_profile(self):
            raise SystemExit(3)

    case = run(ExitingCapabilities(), names=("one_row",))["cases"][0]
    assert "capabilities() raised SystemExit" in case["failures"][0]
    case = run(ExitingProfile(), names=("one_row",))["cases"][0]
    assert case["failures"][0] == "judgment: reading numeric_profile raised SystemExit: 3"


def test_resolve_provider_turns_system_exit_into_a_usage_error(monkeypatch):
    import types

    class ExitsOnConstruction:
        def __init__(self):
            raise SystemExit(0)

    module = types.ModuleType("mhc_exits_on_construction")
    module.P = ExitsOnConstruction
    monkeypatch.setitem(sys.modules, module.__name__, module)
    with pytest.raises(UsageError, match="cannot construct provider .*SystemExit"):
        resolve_provider(f"{module.__name__}:P")


def test_a_single_nan_is_one_element():
    report = run(OneNaN(), names=("one_row",))
    div = first(report)
    assert div["boundary"] == "fwd.sinkhorn.h_res" and div["mismatched"] == 1 and div["nan_mismatched"] == 1
    assert div["worst_index"] == [0, 1, 1]
    assert "1 element differs (1 NaN against a number)" in report["cases"][0]["failures"][0]


def test_no_case_is_not_a_pass():
    assert not check_provider(ReferenceProvider(), [], progress=None)["passed"]


# --- the provider runs in its own process: it cannot patch the checker, change its profile or hang it --------

PROFILE_READS = []


class ProfileTurnsRelaxed(OnePercentOff):
    """Strict on the first read, relaxed on every later one; mhc_post 1% off."""

    @property
    def numeric_profile(self):
        PROFILE_READS.append(1)
        return "strict-fp32-v1" if len(PROFILE_READS) == 1 else "fp32-relaxed"


class PatchesTheChecker(ReferenceProvider):
    """Replaces the checker's functions in its own interpreter and returns zeros."""

    def __init__(self):
        from rl_engine.checks import mhc_acceptance as acceptance
        from rl_engine.mhc import trace

        passed = {"passed": True, "failures": [], "case": "one_row", "tokens": 1, "hidden": 128}
        acceptance.check_case = lambda *a, **k: dict(passed)
        acceptance.compare = trace.compare = lambda a, b: {"equal": True}
        acceptance.tensor_sha256 = trace.tensor_sha256 = lambda t: "0" * 64

    def mhc_post_fwd(self, *args):
        return torch.zeros_like(oracle.mhc_post_fwd(*args))


class Hangs(ReferenceProvider):
    def mhc_pre_fwd(self, *args):
        import time
        time.sleep(3600)


class DiesInAnOperator(ReferenceProvider):
    def mhc_pre_fwd(self, *args):
        import os
        os._exit(7)


class RaisesKeyboardInterrupt(ReferenceProvider):
    def mhc_pre_fwd(self, *args):
        raise KeyboardInterrupt


def test_a_profile_that_changes_after_its_first_read_is_judged_by_the_first(capsys, tmp_path):
    PROFILE_READS.clear()
    report = run(ProfileTurnsRelaxed(), names=("one_row",))  # a provider object: read once in this process too
    assert len(PROFILE_READS) == 1 and report["judgment"].startswith("bitwise") and not report["passed"]
    out = tmp_path / "r.json"
    code, line = cli(capsys, ProfileTurnsRelaxed, "one_row", "--json", str(out))
    report = json.loads(out.read_text())
    assert code == 1 and line.startswith("check-p1 FAILED bitwise: 0/1 cases")
    assert report["numeric_profile"] == "strict-fp32-v1" and not report["accepted"]
    assert report["cases"][0]["first_divergence"]["boundary"] == "fwd.post.out"
    assert "its own (pid" in report["provider_process"]


def test_a_provider_patching_the_checker_patches_only_its_own_process(capsys):
    from rl_engine.checks import mhc_acceptance as acceptance
    from rl_engine.mhc import trace

    before = (acceptance.check_case, acceptance.compare, acceptance.tensor_sha256, trace.compare)
    code, line = cli(capsys, PatchesTheChecker)
    assert code == 1 and "first diverging boundary fwd.post.out" in line
    assert (acceptance.check_case, acceptance.compare, acceptance.tensor_sha256, trace.compare) == before


def test_a_hung_provider_is_ended_at_the_case_time_limit(capsys):
    import time

    start = time.monotonic()
    code, line = cli(capsys, Hangs, "one_row", "--case-timeout", "1.5")
    assert code == 1 and "no answer within the per-case time limit of 1.5 s" in line
    assert "mhc_pre_fwd" in line and time.monotonic() - start < 60


def test_a_provider_that_dies_or_interrupts_itself_fails_its_case():
    from rl_engine.checks.mhc_acceptance import check_provider as check

    report = check(f"{__name__}:DiesInAnOperator", [CASES_BY_NAME["one_row"], CASES_BY_NAME["odd_t7"]],
                   progress=None)
    assert not report["passed"]
    assert "the provider's process ended while running mhc_pre_fwd (exit code 7)" in report["cases"][0]["failures"][0]
    assert report["cases"][1]["failures"][0].startswith("not run: the provider's process ended")
    case = check(f"{__name__}:RaisesKeyboardInterrupt", [CASES_BY_NAME["one_row"]], progress=None)["cases"][0]
    assert "mhc_pre_fwd raised KeyboardInterrupt" in case["failures"][0]


def test_a_bit_survives_the_trip_from_the_providers_process():
    report = check_provider(f"{__name__}:OneUlpSinkhorn", [CASES_BY_NAME["odd_t7"]], progress=None)
    assert not report["passed"] and first(report)["boundary"] == "fwd.sinkhorn.h_res"
    assert first(report)["max_ulp"] == 1 and first(report)["mismatched"] == 1


class ProfileRaises(ReferenceProvider):
    @property
    def numeric_profile(self):
        raise RuntimeError("no profile today")


class CapabilitiesExit(ReferenceProvider):
    def capabilities(self):
        raise SystemExit(4)


def test_a_provider_whose_profile_or_capabilities_raise_is_one_line_and_exit_1(capsys):
    code, line = cli(capsys, ProfileRaises)
    assert code == 1 and "judgment: reading numeric_profile raised RuntimeError: no profile today" in line
    code, line = cli(capsys, CapabilitiesExit)
    assert code == 1 and "capability: CapabilitiesExit.capabilities() raised SystemExit: 4" in line
