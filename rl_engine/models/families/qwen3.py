"""Qwen3 dense: per-head q/k RMSNorm, no biases, plain RoPE (theta 1e6); the small sizes tie lm_head.

Sizes from the published config.json of each Qwen/Qwen3-* checkpoint (vocab 151936, head_dim 128,
rms_norm_eps 1e-6, rope_theta 1e6 throughout).
"""

from rl_engine.models.config import LLAMA_LAYOUT_NAMES, Family, ModelConfig
from rl_engine.models.hf_fields import DECODER_INERT_FIELDS, decoder_math_fields, full_attention_layers, one_of


def _qwen3(name, hidden, intermediate, layers, heads, tied):
    return ModelConfig(name, "qwen3", 151936, hidden, intermediate, layers, heads, 8, 128, tie_word_embeddings=tied)


FAMILY = Family(
    name="qwen3",
    model_types=("qwen3",),
    qk_norm=True,
    qkv_bias=False,
    rope_scaling="none",
    tied_embeddings=True,
    hf_names=LLAMA_LAYOUT_NAMES,
    hf_math_fields={
        **decoder_math_fields(("qwen3",), tied_embeddings=True),
        "attention_bias": (False, one_of(False), "q/k/v/o biases are not part of the Qwen3 recipe here"),
        "mlp_bias": (False, one_of(False), "MLP biases are not implemented"),
        "use_sliding_window": (False, one_of(False), "sliding-window attention is not implemented"),
        "layer_types": (None, full_attention_layers, "sliding-attention layers are not implemented"),
    },
    hf_inert_fields={
        **DECODER_INERT_FIELDS,
        "sliding_window": "read only when use_sliding_window is true, which is refused",
        "max_window_layers": "read only when use_sliding_window is true, which is refused",
    },
    configs=(
        ModelConfig("tiny", "qwen3", 257, 64, 128, 2, 4, 2, 16),
        _qwen3("qwen3-0.6b", 1024, 3072, 28, 16, tied=True),
        _qwen3("qwen3-1.7b", 2048, 6144, 28, 16, tied=True),
        _qwen3("qwen3-4b", 2560, 9728, 36, 32, tied=True),
        _qwen3("qwen3-8b", 4096, 12288, 36, 32, tied=False),
        _qwen3("qwen3-14b", 5120, 17408, 40, 40, tied=False),
        _qwen3("qwen3-32b", 5120, 25600, 64, 64, tied=False),
    ),
)
