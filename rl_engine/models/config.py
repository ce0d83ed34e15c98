"""What a decoder computes, as data: a `ModelConfig` (the sizes) and a `Family` (the block recipe).

One decoder (rl_engine/models/decoder.py) reads both; a family is one file under
rl_engine/models/families/ that declares a `FAMILY`.
"""

from __future__ import annotations

import hashlib
import json
import math
from dataclasses import asdict, dataclass, replace

ROPE_SCALING_KINDS = ("none", "llama3")


@dataclass(frozen=True)
class RopeScaling:
    """Llama 3 RoPE scaling (HF rope_type "llama3"): it changes the inverse frequencies only."""

    factor: float
    low_freq_factor: float
    high_freq_factor: float
    original_max_position_embeddings: int
    rope_type: str = "llama3"

    def __post_init__(self):
        for field in ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"):
            _positive_number(f"rope_scaling.{field}", getattr(self, field))
        if self.rope_type != "llama3":
            raise ValueError(f"rope_scaling.rope_type: expected 'llama3', got {self.rope_type!r}")
        if self.high_freq_factor <= self.low_freq_factor:
            raise ValueError("rope_scaling: expected high_freq_factor > low_freq_factor")


def _positive_int(name, value):
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ValueError(f"{name}: expected a positive integer, got {value!r}")


def _positive_number(name, value):
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value) and value > 0
    if not ok:
        raise ValueError(f"{name}: expected a positive number, got {value!r}")


@dataclass(frozen=True)
class ModelConfig:
    name: str
    family: str  # a Family name (rl_engine/models/families/<family>.py)
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 1e6
    tie_word_embeddings: bool = False  # lm_head is the embedding matrix (the same tensor)
    rope_scaling: RopeScaling | None = None

    def __post_init__(self):
        for field in ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads", "num_kv_heads",
                      "head_dim"):
            _positive_int(field, getattr(self, field))
        if self.head_dim % 2:
            raise ValueError(f"head_dim: RoPE needs an even head dim, got {self.head_dim}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_heads: expected a multiple of num_kv_heads ({self.num_kv_heads}), got "
                             f"{self.num_heads}")
        _positive_number("rms_norm_eps", self.rms_norm_eps)
        _positive_number("rope_theta", self.rope_theta)
        if not isinstance(self.tie_word_embeddings, bool):
            raise ValueError(f"tie_word_embeddings: expected true or false, got {self.tie_word_embeddings!r}")

    def fingerprint(self) -> str:
        """sha256 of the architecture (every field but the name), canonical JSON."""
        fields = {k: v for k, v in asdict(self).items() if k != "name"}
        return hashlib.sha256(json.dumps(fields, sort_keys=True).encode()).hexdigest()

    def with_layers(self, num_layers: int) -> ModelConfig:
        if num_layers < 1 or num_layers > self.num_layers:
            raise ValueError(f"num_layers: expected 1..{self.num_layers} for {self.name}, got {num_layers}")
        if num_layers == self.num_layers:
            return self
        return replace(self, name=f"{self.name}[:{num_layers}]", num_layers=num_layers)


# Tensor names of the Llama layout, which Qwen2, Qwen3 and Llama checkpoints share. A role the
# family's recipe does not use (q_norm without qk_norm, q_bias without qkv_bias, lm_head when tied)
# is not part of the model. "{i}" is the layer index.
LLAMA_LAYOUT_NAMES = {
    "embed": "model.embed_tokens.weight",
    "input_norm": "model.layers.{i}.input_layernorm.weight",
    "q_proj": "model.layers.{i}.self_attn.q_proj.weight",
    "k_proj": "model.layers.{i}.self_attn.k_proj.weight",
    "v_proj": "model.layers.{i}.self_attn.v_proj.weight",
    "q_bias": "model.layers.{i}.self_attn.q_proj.bias",
    "k_bias": "model.layers.{i}.self_attn.k_proj.bias",
    "v_bias": "model.layers.{i}.self_attn.v_proj.bias",
    "q_norm": "model.layers.{i}.self_attn.q_norm.weight",
    "k_norm": "model.layers.{i}.self_attn.k_norm.weight",
    "o_proj": "model.layers.{i}.self_attn.o_proj.weight",
    "post_norm": "model.layers.{i}.post_attention_layernorm.weight",
    "gate_proj": "model.layers.{i}.mlp.gate_proj.weight",
    "up_proj": "model.layers.{i}.mlp.up_proj.weight",
    "down_proj": "model.layers.{i}.mlp.down_proj.weight",
    "final_norm": "model.norm.weight",
    "lm_head": "lm_head.weight",
}
LAYER_ROLES = ("input_norm", "q_proj", "k_proj", "v_proj", "q_bias", "k_bias", "v_bias", "q_norm", "k_norm",
               "o_proj", "post_norm", "gate_proj", "up_proj", "down_proj")


@dataclass(frozen=True)
class Family:
    """A decoder family: its Hugging Face names and fields, and the recipe of its block.

    Every family computes embedding -> L x [RMSNorm -> q/k/v proj (+ bias) -> (per-head q/k RMSNorm)
    -> RoPE -> grouped-query attention -> o proj -> residual -> RMSNorm -> SwiGLU MLP -> residual]
    -> final RMSNorm -> lm_head (or the embedding matrix, tied).
    """

    name: str
    model_types: tuple[str, ...]  # HF config.json model_type values
    qk_norm: bool  # per-head RMSNorm of q and k before RoPE (Qwen3)
    qkv_bias: bool  # q/k/v projections carry a bias (Qwen2)
    rope_scaling: str  # one of ROPE_SCALING_KINDS
    tied_embeddings: bool  # whether tie_word_embeddings=true is allowed
    hf_names: dict  # role -> HF tensor name
    hf_math_fields: dict  # config.json field -> (default, check(value, config), why): see hf_fields.py
    hf_inert_fields: dict  # config.json field -> why it cannot change the logprobs
    configs: tuple  # the named ModelConfigs of this family

    def __post_init__(self):
        if self.rope_scaling not in ROPE_SCALING_KINDS:
            raise ValueError(f"{self.name}: rope_scaling must be one of {ROPE_SCALING_KINDS}")
        if set(self.hf_math_fields) & set(self.hf_inert_fields):
            raise ValueError(f"{self.name}: a field is both math and inert")
        for config in self.configs:
            self.check(config)

    def roles(self, config: ModelConfig) -> tuple[str, ...]:
        """The layer roles this recipe uses."""
        skip = set()
        if not self.qk_norm:
            skip |= {"q_norm", "k_norm"}
        if not self.qkv_bias:
            skip |= {"q_bias", "k_bias", "v_bias"}
        return tuple(r for r in LAYER_ROLES if r not in skip)

    def check(self, config: ModelConfig) -> None:
        """Raise ValueError when `config` asks for something this family does not compute."""
        if config.family != self.name:
            raise ValueError(f"{config.name}: family {config.family!r} is not {self.name!r}")
        if config.tie_word_embeddings and not self.tied_embeddings:
            raise ValueError(f"{config.name}: the {self.name} family has no tied embeddings")
        scaled = "none" if config.rope_scaling is None else config.rope_scaling.rope_type
        if scaled not in ("none", self.rope_scaling):
            raise ValueError(f"{config.name}: the {self.name} family has no {scaled} RoPE scaling")
