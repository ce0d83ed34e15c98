"""The pieces a family's Hugging Face config.json tables are built from.

A config.json field either sets the math, and then rl_engine accepts only the values it implements
(a family's `hf_math_fields`), or is known not to touch the logprobs of given tokens (its
`hf_inert_fields`). Every other field is refused, fail closed: a transformers release or a fine-tune
may add a key that changes the function (a bias, a RoPE scaling, a quantization), and dropping it
silently gives wrong numbers with no error.

A math field is `field -> (default, check, why)`: the value transformers assumes when the field is
absent (or REQUIRED), check(value, config) returning None when rl_engine computes that value for
`config` and otherwise what it accepts, and why the field matters.
"""

from __future__ import annotations

import json

REQUIRED = object()  # a field that must be present: no default would be right


def same(value, accepted) -> bool:
    """== that keeps JSON booleans apart from numbers (true is not 1)."""
    return isinstance(value, bool) == isinstance(accepted, bool) and value == accepted


def one_of(*accepted):
    def check(value, config):
        return None if any(same(value, a) for a in accepted) else " or ".join(json.dumps(a) for a in accepted)

    return check


def ours(attr):
    def check(value, config):
        expected = getattr(config, attr)
        return None if same(value, expected) else f"{expected!r} for {config.name}"

    return check


def layers(value, config):
    # A truncated config (--layers N) loads the first N layers of a deeper checkpoint.
    ok = isinstance(value, int) and not isinstance(value, bool) and value >= config.num_layers
    return None if ok else f">= {config.num_layers} for {config.name}"


def head_dim(value, config):
    """transformers' rule: head_dim when given, else hidden_size // num_attention_heads."""
    derived = config.hidden_size // config.num_heads
    ok = same(value, config.head_dim) if value is not None else derived == config.head_dim
    return None if ok else f"{config.head_dim} for {config.name} (absent or null: hidden_size // heads = {derived})"


_ROPE_KEYS = {"rope_type", "type", "rope_theta", "partial_rotary_factor"}
LLAMA3_KEYS = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")


def rope(value, config):
    """RoPE over the whole head with our theta: plain, or Llama 3 scaling with our parameters."""
    scaling = config.rope_scaling
    if scaling is None:
        keys, kind = set(), "default"
        expected = f'null or {{"rope_type": "default", "rope_theta": {config.rope_theta}}}'
        if value is None:
            return None
    else:
        wanted = {k: getattr(scaling, k) for k in LLAMA3_KEYS}
        expected, keys, kind = json.dumps({"rope_type": "llama3", **wanted}), set(LLAMA3_KEYS), "llama3"
    if not isinstance(value, dict) or set(value) - _ROPE_KEYS - keys:
        return expected
    kinds_ok = value.get("rope_type", value.get("type", "default")) == kind and value.get("type", kind) == kind
    theta_ok = same(value.get("rope_theta", config.rope_theta), config.rope_theta)
    rotary_ok = same(value.get("partial_rotary_factor", 1.0), 1.0)
    params_ok = all(k in value and same(value[k], getattr(scaling, k)) for k in keys)
    return None if kinds_ok and theta_ok and rotary_ok and params_ok else expected


def full_attention_layers(value, config):
    ok = value is None or (isinstance(value, list) and all(t == "full_attention" for t in value))
    return None if ok else 'null or a list of "full_attention"'


def decoder_math_fields(model_types: tuple[str, ...], tied_embeddings: bool) -> dict:
    """The fields every family here reads the same way (transformers' defaults for Qwen2, Qwen3, Llama)."""
    return {
        "model_type": (REQUIRED, one_of(*model_types), "the decoder family"),
        "vocab_size": (REQUIRED, ours("vocab_size"), "embedding and lm_head rows"),
        "hidden_size": (REQUIRED, ours("hidden_size"), "model width"),
        "intermediate_size": (REQUIRED, ours("intermediate_size"), "MLP width"),
        "num_hidden_layers": (REQUIRED, layers, "depth"),
        "num_attention_heads": (REQUIRED, ours("num_heads"), "query heads"),
        "num_key_value_heads": (REQUIRED, ours("num_kv_heads"), "key/value heads (GQA)"),
        "head_dim": (None, head_dim, "head width"),
        "rms_norm_eps": (1e-6, ours("rms_norm_eps"), "RMSNorm epsilon"),
        "rope_theta": (10000.0, ours("rope_theta"), "RoPE base (transformers' default when absent)"),
        "rope_parameters": (None, rope, "RoPE type and parameters"),
        "rope_scaling": (None, rope, "RoPE scaling (the transformers < 5 name of rope_parameters)"),
        "partial_rotary_factor": (1.0, one_of(1.0), "RoPE over part of the head is not implemented"),
        "hidden_act": ("silu", one_of("silu"), "the MLP is SwiGLU"),
        "tie_word_embeddings": (
            False,
            ours("tie_word_embeddings") if tied_embeddings else one_of(False),
            "whether lm_head is the embedding matrix",
        ),
        # Dropout acts only in training mode in transformers, and rl_engine has none: a trainer that
        # honoured it would compute other logprobs than the rollout, the mismatch rl_engine exists to remove.
        "attention_dropout": (0.0, one_of(0.0), "rl_engine computes attention without dropout"),
        "quantization_config": (None, one_of(None), "quantized weights are not implemented"),
        "is_encoder_decoder": (False, one_of(False), "the model is a decoder only"),
    }


# field -> why it cannot change the logprobs of given tokens.
DECODER_INERT_FIELDS = {
    "architectures": "names the transformers class; model_type is checked",
    "transformers_version": "provenance",
    "torch_dtype": "storage dtype: weights are cast to the profile's dtype and hashed",
    "dtype": "storage dtype (transformers >= 5 name of torch_dtype)",
    "use_cache": "a generation switch",
    "bos_token_id": "a generation token id",
    "eos_token_id": "a generation token id",
    "pad_token_id": "a generation token id",
    "initializer_range": "initialisation only",
    "max_position_embeddings": "neither default nor llama3 RoPE reads it; positions are computed",
    "_name_or_path": "provenance",
    "id2label": "classification heads only",
    "label2id": "classification heads only",
    "problem_type": "classification heads only",
    "output_hidden_states": "what transformers returns, not what it computes",
    "output_attentions": "what transformers returns, not what it computes",
    "return_dict": "what transformers returns, not what it computes",
    "chunk_size_feed_forward": "the decoder MLP does not read it",
}
