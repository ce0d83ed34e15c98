"""LayerContract validation, fingerprint and production geometry; input validation."""

import dataclasses

import pytest
import torch

from rl_engine.mhc.contract import ControllerParams, LayerContract, NormParams, ResidualBatch


def test_fingerprint_moves_with_every_field():
    base = LayerContract(hidden=128)
    changed = {"hidden": 256, "sinkhorn_iters": 19, "mhc_eps": 1e-5, "rmsnorm_eps": 1e-5,
               "rms_eps_placement": "outside", "lanes": 32, "fusion_mode": "fused_pre_norm",
               "trainability": "mixer_frozen", "numeric_profile": "fp32-relaxed"}
    prints = {base.fingerprint()}
    for name, value in changed.items():
        prints.add(dataclasses.replace(base, **{name: value}).fingerprint())
    assert len(prints) == len(changed) + 1
    assert LayerContract(hidden=128).fingerprint() == base.fingerprint()
    # every field is hashed: the fields not varied above are pinned by validation
    assert set(base.to_dict()) - set(changed) == {"hc_mult", "controller_n", "placement", "schema_version"}


@pytest.mark.parametrize("field,value,message", [
    ("hidden", 0, "hidden"), ("hc_mult", 3, "hc_mult"), ("controller_n", 20, "controller_n"),
    ("sinkhorn_iters", 0, "sinkhorn_iters"), ("mhc_eps", 0.0, "mhc_eps"), ("lanes", 48, "power of two"),
    ("rms_eps_placement", "middle", "rms_eps_placement"), ("fusion_mode", "fused_everything", "fusion_mode"),
    ("trainability", "frozen", "trainability"), ("placement", "tp", "placement"),
    ("schema_version", "v0", "schema_version"),
])
def test_validation_names_the_field(field, value, message):
    with pytest.raises(ValueError, match=message):
        LayerContract(**{"hidden": 64, field: value})


def test_assert_production():
    LayerContract(hidden=4096).assert_production()
    LayerContract(hidden=7168).assert_production("deepseek-v4-pro")
    with pytest.raises(ValueError, match="hidden 128"):
        LayerContract(hidden=128).assert_production()
    with pytest.raises(ValueError, match="hidden 4096"):
        LayerContract(hidden=4096).assert_production("deepseek-v4-pro")
    with pytest.raises(ValueError, match="sinkhorn_iters"):
        LayerContract(hidden=4096, sinkhorn_iters=10).assert_production()


def test_inputs_are_validated_with_shapes():
    c = LayerContract(hidden=8)
    good = torch.zeros(2, 4, 8, dtype=torch.bfloat16)
    ResidualBatch(good, good).validate(c)
    with pytest.raises(ValueError, match=r"grad_out must have shape \[2, 4, 8\] and dtype torch.bfloat16"):
        ResidualBatch(good, good.float()).validate(c)
    with pytest.raises(ValueError, match="streams must be finite"):
        ResidualBatch(torch.full_like(good, float("nan")), good).validate(c)
    with pytest.raises(ValueError, match=r"phi must have shape \[24, 32\]"):
        ControllerParams(torch.zeros(24, 16), torch.zeros(3), torch.zeros(24)).validate(c)
    with pytest.raises(ValueError, match="gamma"):
        NormParams(torch.zeros(7), torch.zeros(8)).validate(c)
    assert torch.equal(ResidualBatch(good, good).row(1).streams, good[1:2])


def test_the_contract_names_every_judgment():
    from rl_engine.mhc.contract import JUDGMENTS, judgment_for
    from rl_engine.mhc.numerics import PROFILE

    assert judgment_for(PROFILE)["mode"] == "bitwise"
    relaxed = judgment_for("fp32-relaxed")
    assert relaxed["mode"] == "allclose" and relaxed["rtol"] > 0 and relaxed["profile"] == "fp32-relaxed"
    assert all(j["mode"] in ("bitwise", "allclose") and j["rationale"] for j in JUDGMENTS.values())
    for bad, message in [(None, "declares no numeric_profile"), ("", "declares no numeric_profile"),
                         ("fp32-fast", "'fp32-fast', which the contract does not know"),
                         (["strict-fp32-v1"], "which the contract does not know")]:
        with pytest.raises(ValueError, match=message):
            judgment_for(bad)


def test_compare_counts_elements_not_nan_comparisons():
    from rl_engine.mhc.trace import compare

    ref = torch.arange(6, dtype=torch.float32).reshape(2, 3)
    cand = ref.clone()
    cand[1, 2] = float("nan")
    diff = compare(ref, cand)
    assert (diff["mismatched"], diff["nan_mismatched"], diff["worst_index"]) == (1, 1, [1, 2])
    assert diff["max_abs_error"] == float("inf") and diff["max_ulp"] == 0  # no ulp distance to a NaN
    cand[0, 1] = torch.nextafter(ref[0, 1], torch.tensor(9.0))
    diff = compare(ref, cand)
    assert (diff["mismatched"], diff["max_ulp"], diff["worst_index"]) == (2, 1, [1, 2])
    both = ref.clone()
    both[0, 0] = -0.0  # +0 and -0: one element whose bytes differ, zero ulp apart
    assert compare(ref, both)["mismatched"] == 1 and compare(ref, both)["max_ulp"] == 0
    nan = torch.full((2,), float("nan"), dtype=torch.bfloat16)
    assert compare(nan, nan.clone())["equal"]
