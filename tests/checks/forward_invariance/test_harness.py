import dataclasses

from rl_engine.checks.forward_invariance import harness
from rl_engine.checks.forward_invariance.harness import run_harness
from rl_engine.checks.operators.tolerance import contract_fingerprint, load_contract
from rl_engine.kernels.registry import Implementation


def _short(workload, *names, parity=("bn",)):
    """The workload restricted to some cells (the canonical one first), to keep CPU tests short."""
    cells = [c for c in workload.cells if c.name in ("bn_packed", *names)]
    return dataclasses.replace(workload, cells=cells, parity=list(parity))


def test_exact_profile_passes_every_check(tiny, make_exact_model):
    config, weights, workload = tiny
    report = run_harness(config, weights, workload, "reference_fp32", model=make_exact_model(config, weights))
    assert report["forward_invariance"]["passed"], report["forward_invariance"]
    assert report["gradient_invariance"]["passed"], report["gradient_invariance"]
    assert report["parity"]["passed"], report["parity"]
    assert report["provenance"]["passed"], report["provenance"]
    assert report["accuracy"]["passed"] and report["passed"]
    assert report["contract_fingerprint"] == contract_fingerprint(load_contract())
    for agg in report["parity"]["infer"].values():
        assert agg["max_abs_dlogp"] == agg["mean_abs_dlogp"] == agg["k3_kl"] == agg["clipfrac"] == 0.0
        assert agg["tokens"] == sum(s.length - s.prompt_len for s in workload.samples)


def test_torch_bf16_reports_its_aggregates(tiny_one_layer):
    config, weights, workload = tiny_one_layer
    report = run_harness(config, weights, _short(workload, "b1_full", parity=("b1",)), "torch_bf16", gradients=False)
    assert not report["passed"] and report["provenance"]["passed"]
    # On this CPU a bf16 B1 forward differs from the packed one; the aggregates say by how much.
    assert not report["forward_invariance"]["cells"]["b1_full"]["bitwise"]
    assert report["parity"]["infer"]["b1"]["max_abs_dlogp"] > 0


def test_planted_batch_dependent_op_fails_invariance(tiny_one_layer, make_exact_model, make_exact_registry):
    config, weights, workload = tiny_one_layer
    registry = make_exact_registry()
    honest = registry.lookup("rms_norm", "reference")

    def batch_dependent(kernel, params, inputs):
        out = honest.adapter(kernel, params, inputs)
        rows = inputs["x"].shape[0] * inputs["x"].shape[1]
        return out * (1 + 2.0**-12 * (rows % 3))  # a result that depends on how many rows share the call

    registry.register(dataclasses.replace(honest, adapter=batch_dependent))
    model = make_exact_model(config, weights, registry)
    report = run_harness(
        config, weights, _short(workload, "b1_full", "bn_pad_right"), "reference_fp32", model=model, gradients=False
    )
    cells = report["forward_invariance"]["cells"]
    assert not report["forward_invariance"]["passed"] and not report["passed"]
    assert not cells["b1_full"]["bitwise"] and cells["b1_full"]["mismatched_tokens"] > 0
    assert report["provenance"]["passed"]  # same kernel declared and run: only invariance can see it


def test_planted_restore_dropping_a_token_fails_closed(tiny_one_layer, make_exact_model, monkeypatch):
    config, weights, workload = tiny_one_layer
    honest_pack = harness.pack

    def lossy_pack(samples, pad_id=0):
        layout = honest_pack(samples, pad_id)
        layout.keys[0, -1] = -1  # the transform loses the last token's key
        return layout

    monkeypatch.setattr(harness, "pack", lossy_pack)
    report = run_harness(
        config,
        weights,
        _short(workload, "b1_full"),
        "reference_fp32",
        model=make_exact_model(config, weights),
        gradients=False,
    )
    assert not report["passed"]
    assert "is missing" in report["errors"]["cell bn_packed"]
    assert "error" in report["forward_invariance"]["cells"]["bn_packed"]


def test_planted_sign_flip_in_infer_fails_parity(tiny_one_layer, make_exact_model, monkeypatch):
    config, weights, workload = tiny_one_layer
    honest = harness.run_infer
    monkeypatch.setattr(harness, "run_infer", lambda *a: {k: -v for k, v in honest(*a).items()})
    report = run_harness(
        config,
        weights,
        _short(workload, parity=("b1", "bn")),
        "reference_fp32",
        model=make_exact_model(config, weights),
        gradients=False,
    )
    for agg in report["parity"]["infer"].values():
        assert not agg["bitwise"] and agg["clipfrac"] == 1.0 and agg["k3_kl"] > 1
    assert not report["parity"]["passed"] and not report["passed"]


def test_planted_silent_fallback_fails_provenance(tiny_one_layer, make_exact_model, make_exact_registry):
    config, weights, workload = tiny_one_layer
    registry = make_exact_registry()
    model = make_exact_model(config, weights, registry)  # the profile's declaration is fixed here
    # After the profile is declared, swap the matmul for plain torch: a silent fallback.
    registry.register(
        Implementation("matmul", "reference", "torch:matmul", lambda f, p, i: f(i["a"], i["b"].to(i["a"].dtype)))
    )
    report = run_harness(config, weights, _short(workload), "reference_fp32", model=model, gradients=False)
    failures = report["provenance"]["failures"]
    assert not report["provenance"]["passed"] and not report["passed"]
    assert (
        "node model.layers.0.self_attn.q_proj: op matmul ran reference:torch:matmul, profile reference_fp32 "
        "declares reference:rl_engine.kernels.ops.pytorch.linear.matmul:NativeMatmulOp" in failures
    )
    assert not report["errors"]  # the numbers ran: provenance alone fails it
