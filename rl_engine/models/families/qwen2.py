"""Qwen2 / Qwen2.5 dense: biases on the q/k/v projections (not on o), no q/k norm, plain RoPE.

head_dim is absent from their config.json: hidden_size // num_attention_heads, as transformers.
Sizes from the published Qwen/Qwen2.5-* config.json files.
"""

from rl_engine.models.config import LLAMA_LAYOUT_NAMES, Family, ModelConfig
from rl_engine.models.hf_fields import DECODER_INERT_FIELDS, decoder_math_fields, full_attention_layers, one_of

FAMILY = Family(
    name="qwen2",
    model_types=("qwen2",),
    qk_norm=False,
    qkv_bias=True,
    rope_scaling="none",
    tied_embeddings=True,
    hf_names=LLAMA_LAYOUT_NAMES,
    hf_math_fields={
        **decoder_math_fields(("qwen2",), tied_embeddings=True),
        "use_sliding_window": (False, one_of(False), "sliding-window attention is not implemented"),
        "layer_types": (None, full_attention_layers, "sliding-attention layers are not implemented"),
        "use_mrope": (False, one_of(False), "multimodal RoPE (Qwen2-VL) is not implemented"),
    },
    hf_inert_fields={
        **DECODER_INERT_FIELDS,
        "sliding_window": "read only when use_sliding_window is true, which is refused",
        "max_window_layers": "read only when use_sliding_window is true, which is refused",
    },
    configs=(
        ModelConfig("tiny-qwen2", "qwen2", 257, 64, 128, 2, 4, 2, 16),
        ModelConfig("qwen2.5-1.5b", "qwen2", 151936, 1536, 8960, 28, 12, 2, 128, tie_word_embeddings=True),
        ModelConfig("qwen2.5-7b", "qwen2", 152064, 3584, 18944, 28, 28, 4, 128),
        ModelConfig("qwen2.5-14b", "qwen2", 152064, 5120, 13824, 48, 40, 8, 128, rms_norm_eps=1e-5),
    ),
)
