"""Every check of the harness catches a planted bug, and a failing candidate never crashes the suite."""

import copy

import pytest
import torch

from rl_engine.checks.operators.op_checks import CandidateSpec, compare_tensor, run_operator_suite
from rl_engine.checks.operators.operator_specs import make_candidate, make_operator_case
from rl_engine.checks.operators.tolerance import Tolerance, load_contract


def gold(op):
    return make_candidate(op, "pytorch").fn


def check(op, fn, dtype="fp32", contract=None, **options):
    case = make_operator_case(op, dtype=dtype)
    candidates = [CandidateSpec("planted", fn, "test"), make_candidate(op, "pytorch")]
    report = run_operator_suite(op, candidates=candidates, cases=[case], contract=contract, **options)
    planted, smoke = report.candidates
    assert smoke.passed, smoke.to_text()  # the suite goes on and the honest candidate still passes
    assert not report.passed and not planted.passed
    return planted


def failed(report, judgment=None, role=None):
    return [o for o in report.outputs if not o.passed and judgment in (None, o.judgment) and role in (None, o.role)]


def one_ulp_up(t):
    """The next representable value away from zero, in t's own dtype."""
    ints = {2: torch.int16, 4: torch.int32}[t.element_size()]
    return (t.detach().contiguous().view(ints) + 1).view(t.dtype)


class ScaledBackward(torch.autograd.Function):
    """Identity forward; backward multiplies the upstream gradient by `scale`."""

    @staticmethod
    def forward(ctx, x, scale):
        ctx.scale = scale
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return grad * ctx.scale, None


class OnesBackward(torch.autograd.Function):
    """Identity forward; backward ignores the upstream gradient and pretends it was all ones."""

    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return torch.ones_like(grad)


class BatchDependentBackward(torch.autograd.Function):
    """Identity forward; backward nudges by one ulp when the batch has more than one row."""

    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return one_ulp_up(grad) if grad.shape[0] > 1 else grad


@pytest.mark.parametrize("op, dtype", [("silu", "fp32"), ("rms_norm", "bf16"), ("logp", "bf16"), ("matmul", "fp16"),
                                       ("attention", "bf16")])
def test_a_scaled_output_fails_forward_accuracy(op, dtype):
    g = gold(op)
    report = check(op, lambda **kw: g(**kw) * 1.05, dtype=dtype)
    assert failed(report, "forward_accuracy", "output")


def test_a_dropped_token_fails():
    g = gold("logp")

    def drop_last_token(**kw):
        out = g(**kw)
        return torch.cat([out[:, :-1], torch.zeros_like(out[:, -1:])], dim=1)

    report = check("logp", drop_last_token, check_grad=True)
    assert failed(report, "forward_accuracy") and failed(report, "gradient_accuracy", "gradient:logits")


def test_swapped_gate_and_up_fail_forward_and_gradient():
    g = gold("swiglu")
    report = check("swiglu", lambda gate, up: g(gate=up, up=gate), check_grad=True)
    assert failed(report, "forward_accuracy")
    assert failed(report, "gradient_accuracy", "gradient:gate") and failed(report, "gradient_accuracy", "gradient:up")


@pytest.mark.parametrize("op", ["rms_norm", "linear_logp"])
def test_a_disconnected_gradient_fails_with_its_message(op):
    g = gold(op)
    report = check(op, lambda **kw: g(**kw).detach(), check_grad=True)
    grads = [o for o in report.outputs if o.role.startswith("gradient:")]
    assert grads and all(not o.passed and "not connected to autograd" in o.message for o in grads)
    assert all(o.passed for o in report.outputs if o.role == "output")


def test_an_input_left_out_of_the_graph_is_named():
    g = gold("swiglu")
    report = check("swiglu", lambda gate, up: g(gate=gate, up=up.detach()), check_grad=True)
    (bad,) = failed(report)
    assert bad.role == "gradient:up" and "not connected to autograd through up" in bad.message


@pytest.mark.parametrize("op, dtype", [("rms_norm", "fp32"), ("lm_head", "bf16"), ("embedding", "fp16")])
def test_a_wrong_gradient_fails_gradient_accuracy_only(op, dtype):
    g = gold(op)
    report = check(op, lambda **kw: ScaledBackward.apply(g(**kw), 1.5), dtype=dtype, check_grad=True)
    assert failed(report, "gradient_accuracy")
    assert all(o.passed for o in report.outputs if o.judgment == "forward_accuracy")


def test_a_gradient_wrong_only_for_non_unit_upstream_needs_random_grad_mode():
    g = gold("silu")
    fn = lambda **kw: OnesBackward.apply(g(**kw))
    case = make_operator_case("silu")
    ones = run_operator_suite("silu", candidates=[CandidateSpec("c", fn, "test")], cases=[case], check_grad=True,
                              grad_mode="ones")
    assert ones.passed  # all-ones upstream hides the bug ...
    assert failed(check("silu", fn, check_grad=True), "gradient_accuracy")  # ... the default random one does not


def test_a_batch_size_dependent_result_fails_forward_invariance_only():
    g = gold("rms_norm")

    def batch_dependent(**kw):
        out = g(**kw)
        return out * (1 + 1e-6) if out.shape[0] > 1 else out  # inside fp32 allclose

    report = check("rms_norm", batch_dependent, check_invariance=True)
    (bad,) = failed(report)
    assert bad.judgment == "forward_invariance" and "rows [0, 1]" in bad.message


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_a_one_ulp_batch_dependence_fails_the_bitwise_invariance_row(dtype):
    g = gold("silu")

    def nudged_in_batches(**kw):
        out = g(**kw)
        return ScaledBackward.apply(out, 1.0) + (one_ulp_up(out) - out).detach() if out.shape[0] > 1 else out

    report = check("silu", nudged_in_batches, dtype=dtype, check_invariance=True)
    (bad,) = failed(report)
    assert bad.judgment == "forward_invariance" and bad.max_ulp == 1 and bad.mismatches > 0
    assert bad.tolerance.mode == "bitwise"


def test_a_batch_dependent_gradient_fails_gradient_invariance():
    g = gold("swiglu")
    report = check("swiglu", lambda **kw: BatchDependentBackward.apply(g(**kw)), check_grad=True,
                   check_invariance=True)
    bad = failed(report)
    assert bad and {o.judgment for o in bad} == {"gradient_invariance"}
    assert all(o.max_ulp >= 1 for o in bad)


def _bitwise_elementwise_contract():
    contract = copy.deepcopy(load_contract())
    for row in contract["rows"]:
        if (row["judgment"], row["op_class"], row["dtype"]) == ("forward_accuracy", "elementwise", "fp32") and (
            "arch_key" not in row
        ):
            row.update(mode="bitwise", rationale="test: the fp32 reference is reproduced exactly")
            del row["atol"], row["rtol"]
    return contract


def test_a_one_ulp_change_fails_a_bitwise_accuracy_row():
    g = gold("silu")

    def one_element_nudged(**kw):
        out = g(**kw)
        return out + torch.nextafter(out, torch.full_like(out, float("inf"))).sub(out).detach() * (
            torch.arange(out.numel()).reshape(out.shape) == 5)

    report = check("silu", one_element_nudged, contract=_bitwise_elementwise_contract())
    (bad,) = failed(report)
    assert (bad.mismatches, bad.max_ulp) == (1, 1) and "1 elements differ" in bad.message


def test_a_candidate_that_raises_is_reported():
    def broken(**kw):
        raise RuntimeError("kernel launch failed\nwith detail")

    report = check("logp", broken, check_grad=True, check_invariance=True)
    message = failed(report, "forward_accuracy")[0].message
    assert message == "candidate raised RuntimeError: kernel launch failed with detail"
    assert failed(report, "gradient_accuracy", "gradient:logits")


def test_wrong_shape_wrong_count_and_non_tensor_outputs_are_reported():
    g = gold("rms_norm")
    wrong_shape = check("rms_norm", lambda **kw: g(**kw)[:, :-1], check_grad=True, check_invariance=True)
    assert "wrong shape" in failed(wrong_shape, "forward_accuracy")[0].message
    assert "no backward" in failed(wrong_shape, "gradient_accuracy")[0].message
    two = check("rms_norm", lambda **kw: (g(**kw), g(**kw)))
    assert "returned 2 outputs, expected 1" in failed(two)[0].message
    not_tensor = check("rms_norm", lambda **kw: 3.0)
    assert "not a tensor" in failed(not_tensor)[0].message


@pytest.mark.parametrize("poison", [float("nan"), float("inf")])
def test_nan_or_inf_where_the_reference_is_finite_fails(poison):
    g = gold("silu")

    def poisoned(**kw):
        out = g(**kw).clone()
        out.view(-1)[3] = poison
        return out

    (bad,) = failed(check("silu", poisoned))
    assert "NaN/Inf in 1 elements where the reference is finite" in bad.message


def test_matching_nan_positions_pass_and_mismatched_ones_fail():
    tol = Tolerance("forward_accuracy", "elementwise", "fp32", "allclose", "test", atol=0.0, rtol=0.0)
    ref = torch.tensor([1.0, float("nan"), float("inf")])
    where = dict(case="c", output_index=0, role="output")
    assert compare_tensor(ref.clone(), ref, tol, **where).passed
    assert not compare_tensor(torch.tensor([1.0, 2.0, float("inf")]), ref, tol, **where).passed
    assert not compare_tensor(torch.tensor([1.0, float("nan"), -float("inf")]), ref, tol, **where).passed


def test_ulp_distance_uses_sign_magnitude_order():
    tol = Tolerance("forward_invariance", "elementwise", "fp32", "bitwise", "test")
    where = dict(case="c", output_index=0, role="output")
    tiny = torch.tensor([1e-45])
    across_zero = compare_tensor(tiny, -tiny, tol, **where)
    assert (across_zero.mismatches, across_zero.max_ulp) == (1, 2)
    signed_zero = compare_tensor(torch.tensor([0.0]), torch.tensor([-0.0]), tol, **where)
    assert (signed_zero.mismatches, signed_zero.max_ulp, signed_zero.passed) == (1, 0, False)
    bf16 = compare_tensor(torch.tensor([1.0], dtype=torch.bfloat16), torch.tensor([1.0078125]), tol, **where)
    assert bf16.max_ulp == 1  # bf16 has 7 stored mantissa bits: 1 + 2^-7 is the next value


def test_baseline_relative_without_a_baseline_fails_with_a_message():
    case = make_operator_case("logp", dtype="bf16")
    case.baseline_fn = None
    report = run_operator_suite("logp", candidates=[make_candidate("logp", "pytorch")], cases=[case])
    assert "needs a baseline" in failed(report.candidates[0])[0].message


# -- attention layouts: the gold owns the meaning of seq_starts and cu_seqlens -------------------------

def _check_layout(layout, fn, **options):
    case = make_operator_case("attention", dtype="fp32", layout=layout)
    candidates = [CandidateSpec("planted", fn, "test"), make_candidate("attention", "pytorch")]
    report = run_operator_suite("attention", candidates=candidates, cases=[case], **options)
    planted, smoke = report.candidates
    assert smoke.passed, smoke.to_text()
    return planted


def test_a_packed_candidate_that_attends_across_sequences_fails_accuracy():
    def leaky(q, k, v, cu_seqlens=None, seq_starts=None):
        return gold("attention")(q=q, k=k, v=v)  # plain causal over the whole pack

    planted = _check_layout("packed", leaky)
    assert failed(planted, "forward_accuracy")


def test_a_candidate_that_ignores_left_padding_fails_accuracy():
    def unpadded(q, k, v, seq_starts=None, cu_seqlens=None):
        return gold("attention")(q=q, k=k, v=v)

    planted = _check_layout("left_padded", unpadded)
    assert failed(planted, "forward_accuracy")


def test_a_packed_candidate_whose_sequence_depends_on_the_pack_fails_invariance_only():
    def pack_dependent(q, k, v, cu_seqlens=None, seq_starts=None):
        out = gold("attention")(q=q, k=k, v=v, cu_seqlens=cu_seqlens)
        return out * (1 + 2.0**-20 * (cu_seqlens.numel() - 1))  # within fp32 tolerance, not bitwise

    planted = _check_layout("packed", pack_dependent, check_invariance=True)
    assert not failed(planted, "forward_accuracy")
    assert failed(planted, "forward_invariance")


def test_each_layout_of_the_honest_gold_passes_with_rows_per_sequence():
    for layout in ("padded", "left_padded", "packed"):
        case = make_operator_case("attention", dtype="fp32", layout=layout)
        rows = case.rows()
        assert len(rows) == 2  # OperatorDims.batch sequences, packed or not
        report = run_operator_suite("attention", candidates=[make_candidate("attention", "pytorch")], cases=[case],
                                    check_grad=True, check_invariance=True)
        assert report.passed, report.to_text()
