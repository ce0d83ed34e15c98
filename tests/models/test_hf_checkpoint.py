"""Loading a Hugging Face checkpoint: every config.json field that changes the math is checked
against what rl_engine computes, unknown fields are refused, and broken files are one-line errors.
The Qwen3 family stands for all here; tests/models/test_families.py covers what differs per family."""

import json

import pytest
import torch
from safetensors.torch import save_file

from rl_engine import cli
from rl_engine.models.families import CONFIGS, FAMILIES
from rl_engine.models.weights import (
    CheckpointError,
    check_hf_config,
    load_hf_checkpoint,
    synthetic_weights,
)

TINY = CONFIGS["tiny"]
QWEN3_8B = CONFIGS["qwen3-8b"]
HF_MATH_FIELDS = FAMILIES["qwen3"].hf_math_fields
HF_INERT_FIELDS = FAMILIES["qwen3"].hf_inert_fields

# https://huggingface.co/Qwen/Qwen3-8B/blob/main/config.json, as published.
QWEN3_8B_CONFIG = {
    "architectures": ["Qwen3ForCausalLM"],
    "attention_bias": False,
    "attention_dropout": 0.0,
    "bos_token_id": 151643,
    "eos_token_id": 151645,
    "head_dim": 128,
    "hidden_act": "silu",
    "hidden_size": 4096,
    "initializer_range": 0.02,
    "intermediate_size": 12288,
    "max_position_embeddings": 40960,
    "max_window_layers": 36,
    "model_type": "qwen3",
    "num_attention_heads": 32,
    "num_hidden_layers": 36,
    "num_key_value_heads": 8,
    "rms_norm_eps": 1e-06,
    "rope_scaling": None,
    "rope_theta": 1000000,
    "sliding_window": None,
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
    "transformers_version": "4.51.0",
    "use_cache": True,
    "use_sliding_window": False,
    "vocab_size": 151936,
}
TINY_DIMS = {"vocab_size": 257, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
             "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16}
YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768}

# (field, value; None deletes the field) -> refused. Every field of HF_MATH_FIELDS has a case here.
REFUSED = [
    ("model_type", "qwen2"),
    ("model_type", None),
    ("vocab_size", 151937),
    ("hidden_size", 5120),
    ("intermediate_size", 25600),
    ("num_hidden_layers", 35),
    ("num_attention_heads", 40),
    ("num_key_value_heads", 32),
    ("head_dim", 64),
    ("rms_norm_eps", 1e-5),
    ("rope_theta", 10000.0),
    ("rope_theta", None),  # transformers then uses 10000
    ("rope_scaling", YARN),
    ("rope_scaling", {"type": "linear", "factor": 2.0}),
    ("rope_scaling", {"rope_type": "default", "factor": 2.0}),
    ("rope_parameters", {**YARN, "rope_theta": 1000000.0}),
    ("rope_parameters", {"rope_type": "default", "rope_theta": 10000.0}),
    ("rope_parameters", {"rope_type": "default", "rope_theta": 1000000.0, "partial_rotary_factor": 0.5}),
    ("rope_parameters", {"full_attention": {"rope_type": "default", "rope_theta": 1000000.0}}),
    ("partial_rotary_factor", 0.5),
    ("hidden_act", "gelu"),
    ("attention_bias", True),
    ("mlp_bias", True),
    ("tie_word_embeddings", True),
    ("use_sliding_window", True),
    ("layer_types", ["full_attention"] * 28 + ["sliding_attention"] * 8),
    ("attention_dropout", 0.1),
    ("quantization_config", {"quant_method": "fp8", "fmt": "e4m3"}),
    ("is_encoder_decoder", True),
    ("some_new_scaling", 2.0),  # unknown: refused, fail closed
]


def _without(d, key):
    return {k: v for k, v in d.items() if k != key}


def test_the_published_qwen3_8b_config_passes():
    check_hf_config(QWEN3_8B_CONFIG, QWEN3_8B)
    check_hf_config(QWEN3_8B_CONFIG, QWEN3_8B.with_layers(2))  # the first layers of the full checkpoint


def test_a_transformers_5_qwen3_8b_config_passes():
    """transformers >= 5 writes rope_parameters, dtype and layer_types instead of rope_theta and torch_dtype."""
    import transformers  # a dev dependency: its absence is a failure, not a skip

    dims = {k: QWEN3_8B_CONFIG[k] for k in TINY_DIMS}
    hf = transformers.Qwen3Config(**dims, rope_theta=1e6, max_window_layers=36).to_dict()
    assert "rope_parameters" in hf and "layer_types" in hf
    check_hf_config(hf, QWEN3_8B)


def test_every_transformers_qwen3_field_is_in_the_table():
    """A field a new transformers release adds is refused until someone classifies it here."""
    import transformers

    assert not set(HF_MATH_FIELDS) & set(HF_INERT_FIELDS)
    assert set(transformers.Qwen3Config().to_dict()) <= set(HF_MATH_FIELDS) | set(HF_INERT_FIELDS)
    assert set(QWEN3_8B_CONFIG) <= set(HF_MATH_FIELDS) | set(HF_INERT_FIELDS)


def test_every_math_field_has_a_refusal_case():
    assert set(HF_MATH_FIELDS) <= {field for field, _ in REFUSED}


@pytest.mark.parametrize(("field", "value"), REFUSED, ids=[f"{f}={json.dumps(v)}" for f, v in REFUSED])
def test_a_field_rl_engine_does_not_compute_is_refused(field, value):
    hf = _without(QWEN3_8B_CONFIG, field) if value is None else {**QWEN3_8B_CONFIG, field: value}
    with pytest.raises(CheckpointError) as info:
        check_hf_config(hf, QWEN3_8B, source="/ckpt/config.json")
    message = str(info.value)
    assert message.startswith("/ckpt/config.json: ") and "\n" not in message
    assert field in message


def test_an_absent_head_dim_is_hidden_size_over_heads_as_in_transformers():
    check_hf_config(_without(QWEN3_8B_CONFIG, "head_dim"), QWEN3_8B)  # 4096 // 32 = 128
    small = {**QWEN3_8B_CONFIG, "hidden_size": 1024, "intermediate_size": 3072, "num_hidden_layers": 28,
             "num_attention_heads": 16, "tie_word_embeddings": True}
    check_hf_config(small, CONFIGS["qwen3-0.6b"])
    with pytest.raises(CheckpointError, match=r"head_dim=null \(absent\) \(expected 128 for qwen3-0.6b"):
        check_hf_config(_without(small, "head_dim"), CONFIGS["qwen3-0.6b"])  # 1024 // 16 = 64


def test_rope_theta_inside_rope_parameters_is_checked():
    hf = {**_without(QWEN3_8B_CONFIG, "rope_theta"), "rope_parameters": {"rope_type": "default", "rope_theta": 1e4}}
    with pytest.raises(CheckpointError, match="rope_theta=10000.0"):
        check_hf_config(hf, QWEN3_8B)


# -- whole checkpoint directories ------------------------------------------------------------------


def _checkpoint(tmp_path, config_text=None, weights=None):
    config = {**QWEN3_8B_CONFIG, **TINY_DIMS}
    (tmp_path / "config.json").write_text(json.dumps(config) if config_text is None else config_text)
    save_file(weights or synthetic_weights(TINY, 0), str(tmp_path / "model.safetensors"))
    return tmp_path


def _check_invariance_exit(capsys, path):
    code = cli.main(["check-invariance", "--profile", "reference_fp32", "--weights-path", str(path)])
    out, err = capsys.readouterr()
    return code, out, err


def test_a_tiny_checkpoint_in_the_published_format_loads(tmp_path):
    weights = load_hf_checkpoint(_checkpoint(tmp_path), TINY)
    assert all(torch.equal(weights[n], t) for n, t in synthetic_weights(TINY, 0).items())


def test_attention_bias_checkpoint_is_refused_end_to_end(tmp_path, capsys):
    """The reported bug: transformers' attention_bias=True loaded silently, biases dropped."""
    import transformers

    hf_config = transformers.Qwen3Config(**TINY_DIMS, rope_theta=1e6, tie_word_embeddings=False, attention_bias=True)
    transformers.Qwen3ForCausalLM(hf_config).save_pretrained(tmp_path, safe_serialization=True)
    capsys.readouterr()  # transformers' progress bar
    with pytest.raises(CheckpointError, match="attention_bias=true"):
        load_hf_checkpoint(tmp_path, TINY)
    code, out, err = _check_invariance_exit(capsys, tmp_path)
    assert code == 2 and not out and len(err.splitlines()) == 1
    assert str(tmp_path / "config.json") in err and "attention_bias=true" in err


def test_a_tensor_the_model_does_not_use_is_refused_not_dropped(tmp_path):
    weights = {**synthetic_weights(TINY, 0), "model.layers.0.self_attn.q_proj.bias": torch.zeros(64)}
    with pytest.raises(CheckpointError, match=r"model\.safetensors: tensor model\.layers\.0\.self_attn\.q_proj\.bias"):
        load_hf_checkpoint(_checkpoint(tmp_path, weights=weights), TINY)


def test_layers_beyond_a_truncated_config_are_not_refused(tmp_path):
    weights = load_hf_checkpoint(_checkpoint(tmp_path), TINY.with_layers(1))
    assert not any(n.startswith("model.layers.1.") for n in weights)


BROKEN = {
    "config.json is a list": ("config.json", b"[1, 2]", "config.json: expected a JSON object, got a list"),
    "config.json is not JSON": ("config.json", b'{"model_type": "qwen3",', "config.json: not a readable JSON file"),
    "config.json is not UTF-8": ("config.json", b"\xff\xfe{}", "config.json: not a readable JSON file"),
    "truncated safetensors": ("model.safetensors", "HALF", "model.safetensors: not a readable safetensors file"),
    "garbage safetensors": ("model.safetensors", b"garbage" * 10, "model.safetensors: not a readable safetensors file"),
    "empty safetensors": ("model.safetensors", b"", "model.safetensors: not a readable safetensors file"),
}


@pytest.mark.parametrize("name", list(BROKEN))
def test_a_broken_file_is_one_line_naming_it(tmp_path, capsys, name):
    file, content, expected = BROKEN[name]
    path = _checkpoint(tmp_path) / file
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2] if content == "HALF" else content)
    with pytest.raises(CheckpointError) as info:
        load_hf_checkpoint(tmp_path, TINY)
    assert str(tmp_path / expected) in str(info.value)
    code, out, err = _check_invariance_exit(capsys, tmp_path)
    assert code == 2 and not out and len(err.splitlines()) == 1 and "Traceback" not in err
    assert str(tmp_path / expected) in err


# -- dtypes and shards (#56) --------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype,found", [(torch.int32, "I32"), (torch.float8_e4m3fn, "F8_E4M3"),
                                         (torch.float64, "F64")])
def test_a_tensor_of_a_dtype_the_loader_would_misread_is_refused(tmp_path, dtype, found):
    weights = synthetic_weights(TINY, 0)
    name = "model.layers.0.mlp.up_proj.weight"
    weights[name] = weights[name].to(dtype)
    _checkpoint(tmp_path, json.dumps({**QWEN3_8B_CONFIG, **TINY_DIMS, "torch_dtype": "bfloat16"}), weights)
    message = rf"tensor {name} has dtype {found}; the loader takes BF16/F16/F32"
    with pytest.raises(CheckpointError, match=message):
        load_hf_checkpoint(tmp_path, TINY)


def test_without_a_config_dtype_a_non_float_tensor_is_still_refused(tmp_path):
    weights = synthetic_weights(TINY, 0)
    weights["model.norm.weight"] = weights["model.norm.weight"].to(torch.int32)
    config = {k: v for k, v in {**QWEN3_8B_CONFIG, **TINY_DIMS}.items() if k not in ("torch_dtype", "dtype")}
    _checkpoint(tmp_path, json.dumps(config), weights)
    with pytest.raises(CheckpointError, match=r"model.norm.weight has dtype I32; the loader takes BF16/F16/F32"):
        load_hf_checkpoint(tmp_path, TINY)


def test_a_float_tensor_under_another_float_torch_dtype_loads_cast_as_transformers_does(tmp_path):
    # the H200 gate's MoE test saves bf16 tensors under a config whose torch_dtype is float32
    weights = synthetic_weights(TINY, 0)
    name = "model.layers.0.mlp.up_proj.weight"
    weights[name] = weights[name].to(torch.float32)
    _checkpoint(tmp_path, json.dumps({**QWEN3_8B_CONFIG, **TINY_DIMS, "torch_dtype": "bfloat16"}), weights)
    loaded = load_hf_checkpoint(tmp_path, TINY, dtype=torch.bfloat16)
    assert torch.equal(loaded[name], weights[name].to(torch.bfloat16))


def test_a_tensor_in_two_shards_is_refused(tmp_path):
    weights = synthetic_weights(TINY, 0)
    _checkpoint(tmp_path, weights=weights)
    name = "model.norm.weight"
    save_file({name: weights[name] * 2}, str(tmp_path / "zz-extra.safetensors"))
    with pytest.raises(CheckpointError, match=rf"zz-extra.safetensors: tensor {name} is also in model.safetensors"):
        load_hf_checkpoint(tmp_path, TINY)
