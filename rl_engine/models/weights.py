"""Qwen3 weights: synthetic from a seed, or a Hugging Face checkpoint directory (safetensors).

Synthetic tensors are drawn per name (seed mixed with the tensor's name), so the first N layers of
a truncated model (`--layers N`) are the same tensors as in the full one. Linear weights are
N(0, 1/fan_in) (activations stay O(1) through depth), embeddings N(0, 1), norm weights 1 + N(0, 0.05²).

The content hash runs where the tensors live: each tensor's raw bits, as integers, enter a
position-weighted sum modulo the prime 2^31 - 1 under two multipliers (exact int64 arithmetic, so
CPU and GPU give the same number for the same bits); the per-tensor sums, names, shapes and dtypes
then go through sha256 on the host. 16 GB of bf16 weights never cross to the CPU.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import replace
from pathlib import Path

import torch

from rl_engine.models.qwen3 import Qwen3Config

HASH_ALGORITHM = "bits-weighted-sum-mod-2^31-1-x2/sha256-v1"
_PRIME = 2**31 - 1
_MULTIPLIERS = (2654435761, 2246822519)
_CHUNK = 1 << 24


def weight_shapes(config: Qwen3Config) -> dict[str, tuple[int, ...]]:
    c = config
    shapes = {"model.embed_tokens.weight": (c.vocab_size, c.hidden_size)}
    for i in range(c.num_layers):
        p = f"model.layers.{i}"
        shapes[f"{p}.input_layernorm.weight"] = (c.hidden_size,)
        shapes[f"{p}.self_attn.q_proj.weight"] = (c.num_heads * c.head_dim, c.hidden_size)
        shapes[f"{p}.self_attn.k_proj.weight"] = (c.num_kv_heads * c.head_dim, c.hidden_size)
        shapes[f"{p}.self_attn.v_proj.weight"] = (c.num_kv_heads * c.head_dim, c.hidden_size)
        shapes[f"{p}.self_attn.o_proj.weight"] = (c.hidden_size, c.num_heads * c.head_dim)
        shapes[f"{p}.self_attn.q_norm.weight"] = (c.head_dim,)
        shapes[f"{p}.self_attn.k_norm.weight"] = (c.head_dim,)
        shapes[f"{p}.post_attention_layernorm.weight"] = (c.hidden_size,)
        shapes[f"{p}.mlp.gate_proj.weight"] = (c.intermediate_size, c.hidden_size)
        shapes[f"{p}.mlp.up_proj.weight"] = (c.intermediate_size, c.hidden_size)
        shapes[f"{p}.mlp.down_proj.weight"] = (c.hidden_size, c.intermediate_size)
    shapes["model.norm.weight"] = (c.hidden_size,)
    shapes["lm_head.weight"] = (c.vocab_size, c.hidden_size)
    return shapes


def _name_seed(seed: int, name: str) -> int:
    return int.from_bytes(hashlib.sha256(f"{seed}:{name}".encode()).digest()[:7], "little")


def synthetic_weights(config: Qwen3Config, seed: int, *, device="cpu", dtype=torch.bfloat16) -> dict:
    """Weights drawn on `device` with its own generator (CPU and CUDA draws differ; the hash says which)."""
    device = torch.device(device)
    weights = {}
    for name, shape in weight_shapes(config).items():
        gen = torch.Generator(device=device).manual_seed(_name_seed(seed, name))
        t = torch.randn(shape, generator=gen, device=device, dtype=torch.float32)
        if name.endswith("norm.weight"):
            t = 1.0 + 0.05 * t
        elif name != "model.embed_tokens.weight":
            t = t * shape[1] ** -0.5
        weights[name] = t.to(dtype)
    return weights


def _bits(t: torch.Tensor) -> torch.Tensor:
    flat = t.detach().contiguous().view(-1)
    as_int = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[flat.element_size()]
    bits = flat.view(as_int).to(torch.int64)
    return bits & ((1 << (8 * flat.element_size())) - 1) if flat.element_size() < 8 else bits


def tensor_digest(t: torch.Tensor) -> list[int]:
    bits = _bits(t)
    sums = [0, 0]
    for start in range(0, bits.numel(), _CHUNK):
        x = (bits[start : start + _CHUNK] % _PRIME) + 1
        idx = torch.arange(start, start + x.numel(), device=x.device, dtype=torch.int64)
        for j, mult in enumerate(_MULTIPLIERS):
            w = (idx * (mult % _PRIME) + 1) % _PRIME
            sums[j] = (sums[j] + int((x * w % _PRIME).sum())) % _PRIME
    return sums


def content_hash(weights: dict) -> str:
    h = hashlib.sha256(HASH_ALGORITHM.encode())
    for name in sorted(weights):
        t = weights[name]
        h.update(json.dumps([name, list(t.shape), str(t.dtype), tensor_digest(t)]).encode())
    return h.hexdigest()


# -- Hugging Face checkpoints ---------------------------------------------------------------------
#
# A config.json field either sets the math, and then rl_engine accepts only the values it implements
# (HF_MATH_FIELDS), or is known not to touch the logprobs of given tokens (HF_INERT_FIELDS). Every
# other field is refused, fail closed: a transformers release or a fine-tune may add a key that
# changes the function (a bias, a RoPE scaling, a quantization), and dropping it silently gives
# wrong numbers with no error. The key set is that of transformers.Qwen3Config plus the published
# Qwen/Qwen3-8B config.json (a test keeps the two in step).

REQUIRED = object()  # a field that must be present: no default would be right


class CheckpointError(ValueError):
    """A checkpoint rl_engine cannot load faithfully; the message is one line naming the file."""


def _same(value, accepted) -> bool:
    """== that keeps JSON booleans apart from numbers (true is not 1)."""
    return isinstance(value, bool) == isinstance(accepted, bool) and value == accepted


def _one_of(*accepted):
    def check(value, config):
        return None if any(_same(value, a) for a in accepted) else " or ".join(json.dumps(a) for a in accepted)

    return check


def _ours(attr):
    def check(value, config):
        ours = getattr(config, attr)
        return None if _same(value, ours) else f"{ours!r} for {config.name}"

    return check


def _layers(value, config):
    # A truncated config (--layers N) loads the first N layers of a deeper checkpoint.
    ok = isinstance(value, int) and not isinstance(value, bool) and value >= config.num_layers
    return None if ok else f">= {config.num_layers} for {config.name}"


def _default_rope(value, config):
    """Plain RoPE with our theta over the whole head (no YaRN, linear, dynamic, llama3, partial rotary)."""
    expected = f'null or {{"rope_type": "default", "rope_theta": {config.rope_theta}}}'
    if value is None:
        return None
    if not isinstance(value, dict) or set(value) - {"rope_type", "type", "rope_theta", "partial_rotary_factor"}:
        return expected
    kinds_ok = value.get("rope_type", "default") == "default" and value.get("type", "default") == "default"
    theta_ok = _same(value.get("rope_theta", config.rope_theta), config.rope_theta)
    rotary_ok = _same(value.get("partial_rotary_factor", 1.0), 1.0)
    return None if kinds_ok and theta_ok and rotary_ok else expected


def _full_attention_layers(value, config):
    ok = value is None or (isinstance(value, list) and all(t == "full_attention" for t in value))
    return None if ok else 'null or a list of "full_attention"'


# field -> (value transformers assumes when the field is absent, or REQUIRED; check(value, config)
# returning None when rl_engine computes that value, else what it accepts; why the field matters).
HF_MATH_FIELDS = {
    "model_type": (REQUIRED, _one_of("qwen3"), "the decoder family"),
    "vocab_size": (REQUIRED, _ours("vocab_size"), "embedding and lm_head rows"),
    "hidden_size": (REQUIRED, _ours("hidden_size"), "model width"),
    "intermediate_size": (REQUIRED, _ours("intermediate_size"), "MLP width"),
    "num_hidden_layers": (REQUIRED, _layers, "depth"),
    "num_attention_heads": (REQUIRED, _ours("num_heads"), "query heads"),
    "num_key_value_heads": (REQUIRED, _ours("num_kv_heads"), "key/value heads (GQA)"),
    "head_dim": (REQUIRED, _ours("head_dim"), "head width (older configs derive it; we do not guess)"),
    "rms_norm_eps": (1e-6, _ours("rms_norm_eps"), "RMSNorm epsilon"),
    "rope_theta": (10000.0, _ours("rope_theta"), "RoPE base (transformers' default when absent)"),
    "rope_parameters": (None, _default_rope, "RoPE type; only default RoPE is implemented"),
    "rope_scaling": (None, _default_rope, "RoPE scaling (YaRN, linear, ...) is not implemented"),
    "partial_rotary_factor": (1.0, _one_of(1.0), "RoPE over part of the head is not implemented"),
    "hidden_act": ("silu", _one_of("silu"), "the MLP is SwiGLU"),
    "attention_bias": (False, _one_of(False), "q/k/v/o biases are not implemented"),
    "mlp_bias": (False, _one_of(False), "MLP biases are not implemented"),
    "tie_word_embeddings": (False, _one_of(False), "a tied lm_head is not supported yet"),
    "use_sliding_window": (False, _one_of(False), "sliding-window attention is not implemented"),
    "layer_types": (None, _full_attention_layers, "sliding-attention layers are not implemented"),
    # Dropout acts only in training mode in transformers, and rl_engine has none: a trainer that
    # honoured it would compute other logprobs than the rollout, the mismatch rl_engine exists to remove.
    "attention_dropout": (0.0, _one_of(0.0), "rl_engine computes attention without dropout"),
    "quantization_config": (None, _one_of(None), "quantized weights are not implemented"),
    "is_encoder_decoder": (False, _one_of(False), "Qwen3 is a decoder only"),
}

# field -> why it cannot change the logprobs of given tokens.
HF_INERT_FIELDS = {
    "architectures": "names the transformers class; model_type is checked",
    "transformers_version": "provenance",
    "torch_dtype": "storage dtype: weights are cast to the profile's dtype and hashed",
    "dtype": "storage dtype (transformers >= 5 name of torch_dtype)",
    "use_cache": "a generation switch",
    "bos_token_id": "a generation token id",
    "eos_token_id": "a generation token id",
    "pad_token_id": "a generation token id",
    "initializer_range": "initialisation only",
    "max_position_embeddings": "default RoPE has no length-dependent term; positions are computed",
    "sliding_window": "read only when use_sliding_window is true, which is refused",
    "max_window_layers": "read only when use_sliding_window is true, which is refused",
    "_name_or_path": "provenance",
    "id2label": "classification heads only",
    "label2id": "classification heads only",
    "problem_type": "classification heads only",
    "output_hidden_states": "what transformers returns, not what it computes",
    "output_attentions": "what transformers returns, not what it computes",
    "return_dict": "what transformers returns, not what it computes",
    "chunk_size_feed_forward": "the Qwen3 MLP does not read it",
}


def check_hf_config(hf, config: Qwen3Config, source: str = "config.json") -> None:
    """Raise CheckpointError, one line naming `source` and every field rl_engine would not compute as stated."""
    if not isinstance(hf, dict):
        raise CheckpointError(f"{source}: expected a JSON object, got a {type(hf).__name__}")
    if "rope_theta" not in hf and isinstance(hf.get("rope_parameters"), dict) and "rope_theta" in hf["rope_parameters"]:
        hf = {**hf, "rope_theta": hf["rope_parameters"]["rope_theta"]}  # transformers >= 5 keeps it there
    wrong = []
    for field, (default, check, why) in HF_MATH_FIELDS.items():
        if field not in hf and default is REQUIRED:
            wrong.append(f"{field} missing ({why})")
            continue
        value = hf.get(field, default)
        expected = check(value, config)
        if expected is not None:
            shown = json.dumps(value, default=str) + ("" if field in hf else " (absent)")
            wrong.append(f"{field}={shown} (expected {expected}: {why})")
    unknown = sorted(set(hf) - set(HF_MATH_FIELDS) - set(HF_INERT_FIELDS))
    if unknown:
        wrong.append(f"unknown fields {', '.join(unknown)} (refused: they may change the math)")
    if wrong:
        raise CheckpointError(f"{source}: not loadable as {config.name}: " + "; ".join(wrong))


def _one_line(exc: Exception) -> str:
    return " ".join(str(exc).split())


def read_hf_config(config_file: Path) -> dict:
    try:
        hf = json.loads(config_file.read_text())
    except (OSError, ValueError) as exc:  # ValueError: invalid JSON or bytes that are not UTF-8
        raise CheckpointError(f"{config_file}: not a readable JSON file ({_one_line(exc)})") from None
    if not isinstance(hf, dict):
        raise CheckpointError(f"{config_file}: expected a JSON object, got a {type(hf).__name__}")
    return hf


def load_hf_checkpoint(path, config: Qwen3Config, *, device="cpu", dtype=None) -> dict:
    """Load a Qwen3 checkpoint directory (config.json + *.safetensors), after checking its config.

    A tensor the model does not use is refused rather than dropped (a bias would change the math),
    except the layers beyond a truncated config's depth.
    """
    from safetensors import SafetensorError, safe_open

    path = Path(path)
    config_file = path / "config.json"
    if not config_file.is_file():
        raise CheckpointError(f"weights_path: {path} has no config.json")
    hf = read_hf_config(config_file)
    check_hf_config(hf, config, source=str(config_file))
    wanted = weight_shapes(config)
    known = weight_shapes(replace(config, num_layers=hf["num_hidden_layers"]))
    weights = {}
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise CheckpointError(f"weights_path: {path} has no *.safetensors files")
    for file in files:
        try:
            with safe_open(str(file), framework="pt", device=str(device)) as f:
                for name in f.keys():
                    if name not in known:
                        raise CheckpointError(f"{file}: tensor {name} is not part of a Qwen3 model rl_engine "
                                              "computes (refused rather than dropped)")
                    if name in wanted:
                        t = f.get_tensor(name)
                        weights[name] = t if dtype is None else t.to(dtype)
        except (SafetensorError, OSError) as exc:
            raise CheckpointError(f"{file}: not a readable safetensors file ({_one_line(exc)})") from None
    missing = [n for n in wanted if n not in weights]
    if missing:
        raise CheckpointError(f"weights_path: {path} lacks {len(missing)} tensors, e.g. {missing[:3]}")
    for name, shape in wanted.items():
        if tuple(weights[name].shape) != shape:
            raise CheckpointError(f"weights_path: {name} has shape {tuple(weights[name].shape)}, expected {shape}")
    return weights
