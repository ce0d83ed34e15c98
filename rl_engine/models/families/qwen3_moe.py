"""Qwen3-MoE: the Qwen3 attention (per-head q/k RMSNorm, no biases, plain RoPE) with a sparse MLP:
a router over `num_experts` SwiGLU experts, top `num_experts_per_tok` per token, no shared expert
(rl_engine/models/moe.py says how it stays batch invariant).

Sizes of qwen3-30b-a3b from the published Qwen/Qwen3-30B-A3B config.json: hidden 2048, 48 layers,
32/4 heads of 128, 128 experts, 8 active, moe_intermediate_size 768, norm_topk_prob true, every layer
sparse (decoder_sparse_step 1, mlp_only_layers []), intermediate_size 6144 (read by dense layers only).
"""

from rl_engine.models.config import LLAMA_LAYOUT_NAMES, Family, ModelConfig, MoeConfig
from rl_engine.models.hf_fields import DECODER_INERT_FIELDS, decoder_math_fields, one_of, same


def _moe(attr):
    def check(value, config):
        expected = getattr(config.moe, attr)
        return None if same(value, expected) else f"{expected!r} for {config.name}"

    return check


def _dense_layers(value, config):
    """transformers only asks `i in mlp_only_layers` (null reads as []): compared as a set."""
    expected = list(config.moe.dense_layers)
    ok = (value is None and not expected) or (
        isinstance(value, list) and all(isinstance(i, int) and not isinstance(i, bool) for i in value)
        and sorted(set(value)) == expected)
    return None if ok else f"{expected} for {config.name}"


FAMILY = Family(
    name="qwen3_moe",
    model_types=("qwen3_moe",),
    qk_norm=True,
    qkv_bias=False,
    rope_scaling="none",
    tied_embeddings=True,
    mlp="moe",
    hf_names={
        **LLAMA_LAYOUT_NAMES,
        "router": "model.layers.{i}.mlp.gate.weight",
        "expert_gate_proj": "model.layers.{i}.mlp.experts.{j}.gate_proj.weight",
        "expert_up_proj": "model.layers.{i}.mlp.experts.{j}.up_proj.weight",
        "expert_down_proj": "model.layers.{i}.mlp.experts.{j}.down_proj.weight",
    },
    hf_math_fields={
        **decoder_math_fields(("qwen3_moe",), tied_embeddings=True),
        "attention_bias": (False, one_of(False), "q/k/v/o biases are not part of the Qwen3 recipe here"),
        "use_sliding_window": (False, one_of(False), "sliding-window attention is not implemented"),
        # transformers' defaults when absent (Qwen3MoeConfig).
        # num_experts = 0 (every layer dense in transformers) is refused by MoeConfig.
        "num_experts": (128, _moe("num_experts"), "experts per sparse layer"),
        "num_local_experts": (128, _moe("num_experts"), "experts per sparse layer (the transformers >= 5 name)"),
        "num_experts_per_tok": (8, _moe("top_k"), "experts per token"),
        "moe_intermediate_size": (768, _moe("expert_intermediate_size"), "expert MLP width"),
        "norm_topk_prob": (False, _moe("norm_topk_prob"), "whether the k routing weights are renormalised"),
        "decoder_sparse_step": (1, _moe("sparse_step"), "which layers are sparse"),
        "mlp_only_layers": (None, _dense_layers, "layers with the dense MLP"),
    },
    hf_inert_fields={
        **DECODER_INERT_FIELDS,
        "sliding_window": "read only when use_sliding_window is true, which is refused",
        "max_window_layers": "read only when use_sliding_window is true, which is refused",
        "output_router_logits": "adds the router's load-balancing loss to the training loss; the logits do not change",
        "router_aux_loss_coef": "the weight of that load-balancing loss",
    },
    configs=(
        ModelConfig("tiny-moe", "qwen3_moe", 257, 64, 128, 2, 4, 2, 16, moe=MoeConfig(8, 2, 32, True)),
        ModelConfig("qwen3-30b-a3b", "qwen3_moe", 151936, 2048, 6144, 48, 32, 4, 128,
                    moe=MoeConfig(128, 8, 768, True)),
    ),
)
