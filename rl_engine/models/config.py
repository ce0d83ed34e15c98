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
class MoeConfig:
    """A sparse MLP block: a router picks `top_k` of `num_experts` gated MLPs for each token.

    Layer i is sparse unless it is in `dense_layers` or (i + 1) is not a multiple of `sparse_step`
    (transformers' `mlp_only_layers` and `decoder_sparse_step`); a dense layer runs the dense MLP of
    width `intermediate_size`. `norm_topk_prob` renormalises the k chosen probabilities to sum to 1.
    """

    num_experts: int
    top_k: int
    expert_intermediate_size: int
    norm_topk_prob: bool
    sparse_step: int = 1
    dense_layers: tuple[int, ...] = ()

    def __post_init__(self):
        for field in ("num_experts", "top_k", "expert_intermediate_size", "sparse_step"):
            _positive_int(f"moe.{field}", getattr(self, field))
        if self.top_k > self.num_experts:
            raise ValueError(f"moe.top_k: expected at most num_experts ({self.num_experts}), got {self.top_k}")
        if not isinstance(self.norm_topk_prob, bool):
            raise ValueError(f"moe.norm_topk_prob: expected true or false, got {self.norm_topk_prob!r}")
        layers = self.dense_layers
        indices = isinstance(layers, tuple) and all(isinstance(i, int) and not isinstance(i, bool) for i in layers)
        ok = indices and all(i >= 0 for i in layers)
        if not ok or list(layers) != sorted(set(layers)):
            raise ValueError(f"moe.dense_layers: expected sorted distinct layer indices, got {layers!r}")


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
    moe: MoeConfig | None = None  # the sparse MLP block, for families whose recipe has one

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

    def sparse_layer(self, layer: int) -> bool:
        """Whether layer `layer` runs the sparse (MoE) MLP block."""
        m = self.moe
        return m is not None and layer not in m.dense_layers and (layer + 1) % m.sparse_step == 0

    def fingerprint(self) -> str:
        """sha256 of the architecture (every field but the name), canonical JSON.

        `moe` enters only when set, so the fingerprints pinned before it existed stay valid."""
        fields = {k: v for k, v in asdict(self).items() if k != "name" and not (k == "moe" and v is None)}
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
# The roles of a sparse layer's MLP, in place of gate/up/down_proj: the router and, per expert
# ("{j}" in the HF name), its gated MLP; a model holds each expert role as one [E, ...] stack.
DENSE_MLP_ROLES = ("gate_proj", "up_proj", "down_proj")
EXPERT_ROLES = ("expert_gate_proj", "expert_up_proj", "expert_down_proj")
MOE_ROLES = ("router",) + EXPERT_ROLES
MLP_KINDS = ("dense", "moe")


@dataclass(frozen=True)
class Family:
    """A decoder family: its Hugging Face names and fields, and the recipe of its block.

    Every family computes embedding -> L x [RMSNorm -> q/k/v proj (+ bias) -> (per-head q/k RMSNorm)
    -> RoPE -> grouped-query attention -> o proj -> residual -> RMSNorm -> SwiGLU MLP (or, in the
    sparse layers of an `mlp="moe"` family, a router and top-k SwiGLU experts) -> residual]
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
    mlp: str = "dense"  # one of MLP_KINDS: "moe" layers run a MoeConfig's sparse block (rl_engine/models/moe.py)

    def __post_init__(self):
        if self.rope_scaling not in ROPE_SCALING_KINDS:
            raise ValueError(f"{self.name}: rope_scaling must be one of {ROPE_SCALING_KINDS}")
        if self.mlp not in MLP_KINDS:
            raise ValueError(f"{self.name}: mlp must be one of {MLP_KINDS}")
        if set(self.hf_math_fields) & set(self.hf_inert_fields):
            raise ValueError(f"{self.name}: a field is both math and inert")
        for config in self.configs:
            self.check(config)

    def roles(self, config: ModelConfig, layer: int | None = None) -> tuple[str, ...]:
        """The roles this recipe uses in layer `layer` (None: a dense layer)."""
        skip = set()
        if layer is not None and config.sparse_layer(layer):
            skip |= set(DENSE_MLP_ROLES)
        else:
            skip |= set(MOE_ROLES)
        if not self.qk_norm:
            skip |= {"q_norm", "k_norm"}
        if not self.qkv_bias:
            skip |= {"q_bias", "k_bias", "v_bias"}
        return tuple(r for r in LAYER_ROLES + MOE_ROLES if r not in skip)

    def weight_name(self, role: str, layer: int | None = None) -> str:
        """The name of a role's tensor in a model's weights: its HF name, except that the per-expert HF
        tensors ("{j}" in the name) are held as one [E, ...] stack of all experts (stacked at load, so
        the expert GEMMs read them in place and their gradients land there), named without the expert
        index as transformers 5 names its stacks:
        "...mlp.experts.{j}.gate_proj.weight" -> "...mlp.experts.gate_proj"."""
        name = self.hf_names[role]
        if "{j}" in name:
            name = name.replace(".{j}.", ".").removesuffix(".weight")
        return name.format(i=layer)

    def check(self, config: ModelConfig) -> None:
        """Raise ValueError when `config` asks for something this family does not compute."""
        if config.family != self.name:
            raise ValueError(f"{config.name}: family {config.family!r} is not {self.name!r}")
        if (config.moe is not None) != (self.mlp == "moe"):
            raise ValueError(f"{config.name}: the {self.name} family's MLP is {self.mlp}: "
                             + ("it needs a moe config" if self.mlp == "moe" else "it has no moe config"))
        if config.tie_word_embeddings and not self.tied_embeddings:
            raise ValueError(f"{config.name}: the {self.name} family has no tied embeddings")
        scaled = "none" if config.rope_scaling is None else config.rope_scaling.rope_type
        if scaled not in ("none", self.rope_scaling):
            raise ValueError(f"{config.name}: the {self.name} family has no {scaled} RoPE scaling")
