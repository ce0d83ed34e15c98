"""Each family loads from a config.json + safetensors written by transformers itself and agrees with
transformers' own model: fp32 selected logprobs within 1e-5 (reference profile); bf16 within the
harness's baseline-relative rule, calibrated by transformers' own bf16 error. The planted bugs (the
bias dropped, the Llama 3 RoPE scaling dropped) show each recipe flag is what makes the agreement."""

import dataclasses
import json

import pytest
import torch
from safetensors.torch import save_file

from rl_engine import cli
from rl_engine.checks.forward_invariance.harness import model_accuracy_tolerance
from rl_engine.models.config import ModelConfig
from rl_engine.models.decoder import DecoderModel, rope_inv_freq
from rl_engine.models.families import CONFIGS, FAMILIES
from rl_engine.models.profiles import ProfileOps, get_profile
from rl_engine.models.weights import (
    CheckpointError,
    config_from_hf,
    load_hf_checkpoint,
    load_hf_config,
    synthetic_weights,
    weight_shapes,
)
from rl_engine.workload.manifest import MANIFEST_PATH

DIMS = {"vocab_size": 257, "hidden_size": 64, "intermediate_size": 128, "num_attention_heads": 4,
        "num_key_value_heads": 2}
LLAMA3 = {"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
          "original_max_position_embeddings": 8192}
# name -> (transformers class stem, config kwargs). head_dim 16 = 64 // 4, so Qwen2/Llama derive it.
HF_MODELS = {
    "qwen3": ("Qwen3", {"head_dim": 16, "rope_theta": 1e6, "tie_word_embeddings": False}),
    "qwen3-tied": ("Qwen3", {"head_dim": 16, "rope_theta": 1e6, "tie_word_embeddings": True}),
    "qwen2": ("Qwen2", {"rope_theta": 1e6, "tie_word_embeddings": False}),
    "llama-tied": ("Llama", {"rope_theta": 5e5, "rms_norm_eps": 1e-5, "rope_scaling": LLAMA3,
                             "max_position_embeddings": 131072, "tie_word_embeddings": True}),
}
# Positions 997 apart: query-key distances up to ~1e4, where Llama 3's scaled low frequencies turn.
POSITION_STRIDE = 997


def _hf_checkpoint(tmp_path, key, layers=2):
    """A transformers model (fp32, eval) with norms and biases perturbed off their init, saved to tmp_path."""
    import transformers  # a dev dependency: its absence is a failure, not a skip

    stem, kwargs = HF_MODELS[key]
    hf_config = getattr(transformers, f"{stem}Config")(**DIMS, num_hidden_layers=layers, **kwargs)
    torch.manual_seed(0)
    hf = getattr(transformers, f"{stem}ForCausalLM")(hf_config).float().eval()
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if name.endswith("norm.weight") or name.endswith(".bias"):  # HF inits them to 1 and 0
                p.add_(0.1 * torch.randn_like(p))
            elif name.endswith("proj.weight"):  # N(0, 1/fan_in): attention far from uniform, so RoPE matters
                p.normal_(0.0, p.shape[1] ** -0.5)
    hf.save_pretrained(tmp_path, safe_serialization=True)
    return hf


def _inputs(vocab, batch=2, seq=12):
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(1, vocab, (batch, seq), generator=gen)
    targets = torch.randint(0, vocab, (batch, seq), generator=gen)
    positions = (torch.arange(seq) * POSITION_STRIDE).expand(batch, seq)
    return ids, targets, positions


def _hf_logp(hf, ids, targets, positions):
    with torch.no_grad():
        logits = hf(input_ids=ids, position_ids=positions).logits.float()
    return torch.log_softmax(logits, -1).gather(-1, targets[..., None])[..., 0]


def _our_logp(config, weights, profile, ids, targets, positions):
    model = DecoderModel(config, weights, ProfileOps(get_profile(profile)))
    with torch.no_grad():
        return model.selected_logprobs(model.forward(ids, positions), targets)


@pytest.mark.parametrize("key", list(HF_MODELS))
def test_fp32_reference_agrees_with_transformers(tmp_path, key):
    hf = _hf_checkpoint(tmp_path, key)
    config = load_hf_config(tmp_path)
    assert config.family == HF_MODELS[key][0].lower() and config.name == tmp_path.name
    weights = load_hf_checkpoint(tmp_path, config)
    assert set(weights) == set(weight_shapes(config))
    ids, targets, positions = _inputs(config.vocab_size)
    expected = _hf_logp(hf, ids, targets, positions)
    got = _our_logp(config, weights, "reference_fp32", ids, targets, positions)
    assert got.dtype == torch.float32
    assert float((got - expected).abs().max()) <= 1e-5


def test_planted_bugs_break_the_agreement(tmp_path):
    """Without the q/k/v biases, or without Llama 3's RoPE scaling, the same test fails by far."""
    for key, plant in (("qwen2", "bias"), ("llama-tied", "rope")):
        path = tmp_path / key
        hf = _hf_checkpoint(path, key, layers=1)
        config = load_hf_config(path)
        weights = load_hf_checkpoint(path, config)
        if plant == "bias":
            weights = {n: torch.zeros_like(t) if n.endswith(".bias") else t for n, t in weights.items()}
        else:
            config = dataclasses.replace(config, rope_scaling=None)
        ids, targets, positions = _inputs(config.vocab_size)
        got = _our_logp(config, weights, "reference_fp32", ids, targets, positions)
        assert float((got - _hf_logp(hf, ids, targets, positions)).abs().max()) > 1e-3, plant


@pytest.mark.parametrize(("key", "profile", "layers"), [
    ("qwen3-tied", "torch_bf16", 2),
    ("qwen2", "torch_bf16", 2),
    ("llama-tied", "torch_bf16", 2),
    ("qwen2", "triton_bf16", 1),  # q/k/v bias after the Triton matmul
    ("llama-tied", "triton_bf16", 1),  # inv_freq through the Triton rope, tied lm_head
])
def test_bf16_within_transformers_own_bf16_error(tmp_path, key, profile, layers):
    hf = _hf_checkpoint(tmp_path, key, layers=layers)
    config = load_hf_config(tmp_path)
    weights = load_hf_checkpoint(tmp_path, config, dtype=torch.bfloat16)
    ids, targets, positions = _inputs(config.vocab_size, seq=8)
    reference = _hf_logp(hf, ids, targets, positions)
    hf_error = float((_hf_logp(hf.to(torch.bfloat16), ids, targets, positions) - reference).abs().max())
    ours = _our_logp(config, weights, profile, ids, targets, positions)
    error = float((ours - reference).abs().max())
    assert 0 < hf_error and error <= model_accuracy_tolerance(torch.bfloat16).max_abs_bound(hf_error), (error, hf_error)


@pytest.mark.parametrize("name", ["llama-3.1-8b", "llama-3.2-1b", "tiny-llama"])
def test_llama3_inv_freq_is_transformers_bit_for_bit(name):
    import transformers
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    c = CONFIGS[name]
    s = c.rope_scaling
    hf_config = transformers.LlamaConfig(
        hidden_size=c.hidden_size, num_attention_heads=c.num_heads, head_dim=c.head_dim, rope_theta=c.rope_theta,
        max_position_embeddings=131072, rope_scaling={"rope_type": "llama3", **{
            k: getattr(s, k) for k in ("factor", "low_freq_factor", "high_freq_factor",
                                       "original_max_position_embeddings")}})
    expected, attention_factor = ROPE_INIT_FUNCTIONS["llama3"](hf_config, "cpu")
    got = rope_inv_freq(c)
    assert attention_factor == 1.0 and got.dtype == torch.float32
    assert torch.equal(got, expected)
    plain = 1.0 / (c.rope_theta ** (torch.arange(0, c.head_dim, 2).float() / c.head_dim))
    assert not torch.equal(got, plain)  # the scaling changes the low frequencies
    assert rope_inv_freq(CONFIGS["qwen3-8b"]) is None


# -- named configs are the published ones -----------------------------------------------------------

# As published on huggingface.co (config.json of meta-llama/Llama-3.1-8B, Qwen/Qwen2.5-7B, Qwen/Qwen3-4B).
PUBLISHED = {
    "llama-3.1-8b": {
        "architectures": ["LlamaForCausalLM"], "attention_bias": False, "attention_dropout": 0.0,
        "bos_token_id": 128000, "eos_token_id": 128001, "hidden_act": "silu", "hidden_size": 4096,
        "initializer_range": 0.02, "intermediate_size": 14336, "max_position_embeddings": 131072, "mlp_bias": False,
        "model_type": "llama", "num_attention_heads": 32, "num_hidden_layers": 32, "num_key_value_heads": 8,
        "pretraining_tp": 1, "rms_norm_eps": 1e-05,
        "rope_scaling": {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                         "original_max_position_embeddings": 8192, "rope_type": "llama3"},
        "rope_theta": 500000.0, "tie_word_embeddings": False, "torch_dtype": "bfloat16",
        "transformers_version": "4.43.0.dev0", "use_cache": True, "vocab_size": 128256,
    },
    "qwen2.5-7b": {
        "architectures": ["Qwen2ForCausalLM"], "attention_dropout": 0.0, "bos_token_id": 151643,
        "eos_token_id": 151643, "hidden_act": "silu", "hidden_size": 3584, "initializer_range": 0.02,
        "intermediate_size": 18944, "max_position_embeddings": 131072, "max_window_layers": 28, "model_type": "qwen2",
        "num_attention_heads": 28, "num_hidden_layers": 28, "num_key_value_heads": 4, "rms_norm_eps": 1e-06,
        "rope_theta": 1000000.0, "sliding_window": 131072, "tie_word_embeddings": False, "torch_dtype": "bfloat16",
        "transformers_version": "4.40.1", "use_cache": True, "use_mrope": False, "use_sliding_window": False,
        "vocab_size": 152064,
    },
    "qwen3-4b": {
        "architectures": ["Qwen3ForCausalLM"], "attention_bias": False, "attention_dropout": 0, "bos_token_id": 151643,
        "eos_token_id": 151645, "head_dim": 128, "hidden_act": "silu", "hidden_size": 2560,
        "initializer_range": 0.02, "intermediate_size": 9728, "max_position_embeddings": 40960,
        "max_window_layers": 36, "model_type": "qwen3", "num_attention_heads": 32, "num_hidden_layers": 36,
        "num_key_value_heads": 8, "rms_norm_eps": 0.000001, "rope_scaling": None, "rope_theta": 1000000,
        "sliding_window": None, "tie_word_embeddings": True, "torch_dtype": "bfloat16",
        "transformers_version": "4.51.2", "use_cache": False, "use_sliding_window": False, "vocab_size": 151936,
    },
}


@pytest.mark.parametrize("name", list(PUBLISHED))
def test_a_published_config_builds_the_named_config(name):
    assert config_from_hf(PUBLISHED[name], name) == CONFIGS[name]


def test_every_transformers_field_is_classified_for_every_family():
    """A field a new transformers release adds is refused until someone classifies it in the family."""
    import transformers

    for family in FAMILIES.values():
        stem = {"qwen3": "Qwen3", "qwen2": "Qwen2", "llama": "Llama", "qwen3_moe": "Qwen3Moe"}[family.name]
        fields = set(getattr(transformers, f"{stem}Config")().to_dict())
        assert fields <= set(family.hf_math_fields) | set(family.hf_inert_fields), family.name


def test_every_named_config_is_pinned_in_the_manifest():
    pins = json.loads(MANIFEST_PATH.read_text())["models"]
    assert set(pins) == set(CONFIGS)
    assert all(pins[n]["config_fingerprint"] == c.fingerprint() for n, c in CONFIGS.items())


REFUSED = [
    ("llama-3.1-8b", {"attention_bias": True}, "attention_bias=true"),
    ("llama-3.1-8b", {"rope_scaling": {**LLAMA3, "original_max_position_embeddings": None}},
     "original_max_position_embeddings: expected a positive number"),
    ("llama-3.1-8b", {"rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, "rope_scaling="),
    ("llama-3.1-8b", {"pretraining_tp": 2}, "pretraining_tp=2"),
    ("qwen2.5-7b", {"attention_bias": False}, "unknown fields attention_bias"),  # Qwen2's bias is not optional
    ("qwen2.5-7b", {"use_mrope": True}, "use_mrope=true"),
    ("qwen2.5-7b", {"use_sliding_window": True}, "use_sliding_window=true"),
    ("qwen3-4b", {"rope_scaling": LLAMA3}, "no llama3 RoPE scaling"),
    ("qwen3-4b", {"model_type": "mistral"}, 'model_type="mistral" is not a supported family'),
    ("qwen3-4b", {"num_attention_heads": 0}, "num_heads: expected a positive integer"),
]


@pytest.mark.parametrize(("name", "edit", "message"), REFUSED, ids=[f"{n}:{m}" for n, _, m in REFUSED])
def test_a_config_rl_engine_does_not_compute_is_refused(name, edit, message):
    with pytest.raises(CheckpointError) as info:
        config_from_hf({**PUBLISHED[name], **edit}, name, source="/ckpt/config.json")
    assert str(info.value).startswith("/ckpt/config.json: ") and "\n" not in str(info.value)
    assert message in str(info.value)


def test_llama_rope_is_checked_against_the_named_config():
    from rl_engine.models.weights import check_hf_config

    hf = PUBLISHED["llama-3.1-8b"]
    check_hf_config(hf, CONFIGS["llama-3.1-8b"])
    for rope in ({**hf["rope_scaling"], "factor": 4.0}, None):
        with pytest.raises(CheckpointError, match="rope_scaling="):
            check_hf_config({**hf, "rope_scaling": rope}, CONFIGS["llama-3.1-8b"])
    # Llama 3.0 has no RoPE scaling: a llama config without it is plain RoPE, and is computed as such.
    assert config_from_hf({**hf, "rope_scaling": None}, "llama-3-8b").rope_scaling is None


def test_a_tied_checkpoint_with_a_different_lm_head_is_refused(tmp_path):
    config = CONFIGS["tiny-llama"]
    hf = {**PUBLISHED["llama-3.1-8b"], **DIMS, "num_hidden_layers": 2, "tie_word_embeddings": True,
          "rope_scaling": {**LLAMA3, "rope_type": "llama3"}}
    (tmp_path / "config.json").write_text(json.dumps(hf))
    weights = synthetic_weights(config, 0)
    embed = weights["model.embed_tokens.weight"]
    save_file({**weights, "lm_head.weight": embed.clone()}, str(tmp_path / "model.safetensors"))
    assert load_hf_checkpoint(tmp_path, config).keys() == weights.keys()  # equal: ignored, as transformers does
    save_file({**weights, "lm_head.weight": embed + 1}, str(tmp_path / "model.safetensors"))
    with pytest.raises(CheckpointError, match="lm_head.weight differs from model.embed_tokens.weight"):
        load_hf_checkpoint(tmp_path, config)


def test_a_family_refuses_a_config_it_does_not_compute():
    with pytest.raises(ValueError, match="no llama3 RoPE scaling"):
        FAMILIES["qwen3"].check(dataclasses.replace(CONFIGS["tiny"], rope_scaling=CONFIGS["tiny-llama"].rope_scaling))
    with pytest.raises(ValueError, match="head_dim"):
        ModelConfig("odd", "qwen3", 257, 64, 128, 2, 4, 2, 15)


def test_check_invariance_takes_a_transformers_checkpoint_and_a_config(tmp_path, capsys):
    """`--weights-path DIR` builds the model from DIR/config.json; `--config` from a config.json alone."""
    _hf_checkpoint(tmp_path / "Tiny-Qwen2", "qwen2", layers=1)
    raw = json.loads(MANIFEST_PATH.read_text())
    raw["matrix"], raw["parity"] = raw["matrix"][:1], ["b1"]  # one cell keeps the run short
    manifest = tmp_path / "manifest.json"
    manifest.write_text(json.dumps(raw))
    common = ["check-invariance", "--profile", "torch_bf16", "--no-gradients", "--manifest", str(manifest), "--json"]
    for extra in (["--weights-path", str(tmp_path / "Tiny-Qwen2")],
                  ["--config", str(tmp_path / "Tiny-Qwen2" / "config.json")]):
        capsys.readouterr()
        code = cli.main([*common, *extra])
        report = json.loads(capsys.readouterr().out)
        assert code in (0, 1) and report["model"] == "Tiny-Qwen2" and report["family"] == "qwen2"
        assert "accuracy" in report and not report["errors"], report["errors"]
    assert report["weights"]["source"].startswith("synthetic")
    capsys.readouterr()
    assert cli.main([*common, "--config", str(tmp_path / "absent.json")]) == 2
    assert "absent.json: no such file" in capsys.readouterr().err
