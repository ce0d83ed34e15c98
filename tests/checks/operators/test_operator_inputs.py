"""Operator inputs: semantic shapes, reproducible per-tensor streams, constant mode, dims validation."""

import dataclasses

import pytest
import torch

from rl_engine.checks.operators.operator_inputs import QWEN3_8B, OperatorDims, make_operator_inputs
from rl_engine.kernels.records import OPS
from rl_engine.loading import load_callable

DIMS = OperatorDims(batch=2, seq=3, vocab=11, normalized_dim=8, intermediate=6, n_heads=4, n_kv_heads=2,
                    head_dim=4, k_dim=5, n_dim=7)

EXPECTED_SHAPES = {
    "logp": {"logits": (2, 3, 11), "target_ids": (2, 3)},
    "linear_logp": {"hidden": (2, 3, 8), "lm_head_weight": (11, 8), "target_ids": (2, 3)},
    "rms_norm": {"x": (2, 3, 8), "weight": (8,)},
    "matmul": {"a": (2, 3, 5), "b": (5, 7)},
    "lm_head": {"hidden": (2, 3, 8), "weight": (11, 8)},
    "grouped_matmul": {"x": (2, 3, 5), "weight": (4, 7, 5), "expert_ids": (2, 3)},
    "attention": {"q": (2, 3, 4, 4), "k": (2, 3, 2, 4), "v": (2, 3, 2, 4)},
    "kv_cache_attention": {"q": (2, 3, 4, 4), "k_cache": (2, 16, 2, 4), "v_cache": (2, 16, 2, 4),
                           "cache_seqlens": (2,)},
    "silu": {"x": (2, 3, 6)},
    "swiglu": {"gate": (2, 3, 6), "up": (2, 3, 6)},
    "rope": {"x": (2, 3, 4, 4), "positions": (2, 3)},
    "embedding": {"token_ids": (2, 3), "weight": (11, 8)},
    "linear_policy_loss": {"hidden": (2, 3, 8), "lm_head_weight": (11, 8), "target_ids": (2, 3), "advantages": (2, 3),
                           "old_logprobs": (2, 3), "ref_logprobs": (2, 3), "mask": (2, 3)},
}


def test_every_declared_op_has_expected_inputs():
    assert set(EXPECTED_SHAPES) == set(OPS)


@pytest.mark.parametrize("op", list(EXPECTED_SHAPES))
@pytest.mark.parametrize("mode", ["random", "constant"])
def test_inputs_have_semantic_shapes_and_the_gold_accepts_them(op, mode):
    inputs = make_operator_inputs(op, DIMS, dtype=torch.bfloat16, input_mode=mode, token_value=5)
    assert {k: tuple(v.shape) for k, v in inputs.items()} == EXPECTED_SHAPES[op]
    for value in inputs.values():
        assert value.dtype == torch.bfloat16 or not value.is_floating_point()
    spec = OPS[op]
    gold = load_callable(spec.gold_path, "gold op", **{k: getattr(DIMS, k) for k in spec.constructor_dims})
    out = gold(**inputs)
    assert torch.isfinite(out).all()


@pytest.mark.parametrize("op", list(EXPECTED_SHAPES))
def test_random_inputs_reproduce_from_the_seed(op):
    first = make_operator_inputs(op, DIMS, seed=7)
    again = make_operator_inputs(op, DIMS, seed=7)
    other = make_operator_inputs(op, DIMS, seed=8)
    assert all(torch.equal(first[k], again[k]) for k in first)
    assert any(not torch.equal(first[k], other[k]) for k in first)


def test_each_tensor_draws_from_its_own_stream():
    small = make_operator_inputs("linear_logp", DIMS, seed=3)
    larger_vocab = make_operator_inputs("linear_logp", dataclasses.replace(DIMS, vocab=50), seed=3)
    assert torch.equal(small["hidden"], larger_vocab["hidden"])  # resizing the weight leaves hidden alone
    swiglu = make_operator_inputs("swiglu", DIMS, seed=3)
    assert not torch.equal(swiglu["gate"], swiglu["up"] * 3.0)


def test_constant_mode_fills_values_and_reduces_ids():
    inputs = make_operator_inputs("logp", DIMS, input_mode="constant", constant_value=0.5, token_value=13)
    assert (inputs["logits"] == 0.5).all()
    assert (inputs["target_ids"] == 13 % 11).all()
    kv = make_operator_inputs("kv_cache_attention", DIMS, input_mode="constant")
    assert (kv["cache_seqlens"] == DIMS.cache_len).all()


def test_kv_cache_lengths_hold_the_new_tokens():
    kv = make_operator_inputs("kv_cache_attention", DIMS, seed=1)
    assert kv["cache_seqlens"].dtype == torch.int32
    assert int(kv["cache_seqlens"].min()) >= DIMS.seq and int(kv["cache_seqlens"].max()) <= DIMS.cache_len


def test_qwen3_8b_preset_is_the_production_geometry():
    dims = dataclasses.replace(OperatorDims(), **QWEN3_8B)
    dims.validate()
    assert (dims.normalized_dim, dims.n_heads, dims.n_kv_heads, dims.head_dim) == (4096, 32, 8, 128)
    assert (dims.intermediate, dims.vocab) == (12288, 151936)


BAD_DIMS = [(dict(batch=0), "batch"), (dict(seq=-1), "seq"), (dict(n_kv_heads=3), "n_kv_heads"),
            (dict(head_dim=5), "head_dim"), (dict(theta=0.0), "theta")]


@pytest.mark.parametrize("bad, key", BAD_DIMS)
def test_bad_dims_name_the_dim(bad, key):
    with pytest.raises(ValueError, match=key):
        make_operator_inputs("rope", dataclasses.replace(DIMS, **bad))


def test_unknown_mode_and_op_are_rejected():
    with pytest.raises(ValueError, match="input_mode"):
        make_operator_inputs("silu", DIMS, input_mode="zeros")
    with pytest.raises(ValueError, match="unknown operator"):
        make_operator_inputs("conv", DIMS)
