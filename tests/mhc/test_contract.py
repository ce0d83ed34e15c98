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
