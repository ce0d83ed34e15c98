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

_HF_FIELDS = {
    "vocab_size": "vocab_size",
    "hidden_size": "hidden_size",
    "intermediate_size": "intermediate_size",
    "num_layers": "num_hidden_layers",
    "num_heads": "num_attention_heads",
    "num_kv_heads": "num_key_value_heads",
    "head_dim": "head_dim",
    "rms_norm_eps": "rms_norm_eps",
    "rope_theta": "rope_theta",
}


def check_hf_config(hf: dict, config: Qwen3Config) -> None:
    """Raise ValueError listing every field where a Hugging Face config.json disagrees with ours."""
    if "rope_theta" not in hf and isinstance(hf.get("rope_parameters"), dict):
        hf = {**hf, "rope_theta": hf["rope_parameters"].get("rope_theta")}
    wrong = []
    for ours, theirs in _HF_FIELDS.items():
        # A truncated config (--layers N) may load the first N layers of a deeper checkpoint.
        if ours == "num_layers" and hf.get(theirs, 0) >= config.num_layers:
            continue
        if hf.get(theirs) != getattr(config, ours):
            wrong.append(f"{theirs}={hf.get(theirs)!r} (expected {getattr(config, ours)!r})")
    if hf.get("tie_word_embeddings", False):
        wrong.append("tie_word_embeddings=True (expected an untied lm_head)")
    if wrong:
        raise ValueError(f"config.json does not match model {config.name}: " + ", ".join(wrong))


def load_hf_checkpoint(path, config: Qwen3Config, *, device="cpu", dtype=None) -> dict:
    """Load a Qwen3 checkpoint directory (config.json + *.safetensors), after checking its config."""
    from safetensors import safe_open

    path = Path(path)
    config_file = path / "config.json"
    if not config_file.is_file():
        raise ValueError(f"weights_path: {path} has no config.json")
    check_hf_config(json.loads(config_file.read_text()), config)
    wanted = weight_shapes(config)
    weights = {}
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise ValueError(f"weights_path: {path} has no *.safetensors files")
    for file in files:
        with safe_open(str(file), framework="pt", device=str(device)) as f:
            for name in f.keys():
                if name in wanted:
                    t = f.get_tensor(name)
                    weights[name] = t if dtype is None else t.to(dtype)
    missing = [n for n in wanted if n not in weights]
    if missing:
        raise ValueError(f"weights_path: {path} lacks {len(missing)} tensors, e.g. {missing[:3]}")
    for name, shape in wanted.items():
        if tuple(weights[name].shape) != shape:
            raise ValueError(f"weights_path: {name} has shape {tuple(weights[name].shape)}, expected {shape}")
    return weights
