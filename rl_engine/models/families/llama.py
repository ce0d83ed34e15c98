"""Llama 3.x: no biases, no q/k norm, RoPE (theta 500000) with Llama 3 scaling of the frequencies.

Sizes from the published meta-llama/Llama-3.1-8B and Llama-3.2-1B config.json files (the 3.2 sizes
tie lm_head to the embedding).
"""

from rl_engine.models.config import LLAMA_LAYOUT_NAMES, Family, ModelConfig, RopeScaling
from rl_engine.models.hf_fields import DECODER_INERT_FIELDS, decoder_math_fields, one_of


def _llama(name, hidden, intermediate, layers, heads, head_dim, factor, tied, vocab=128256):
    return ModelConfig(name, "llama", vocab, hidden, intermediate, layers, heads, 8, head_dim, rms_norm_eps=1e-5,
                       rope_theta=500000.0, tie_word_embeddings=tied, rope_scaling=RopeScaling(factor, 1.0, 4.0, 8192))


FAMILY = Family(
    name="llama",
    model_types=("llama",),
    qk_norm=False,
    qkv_bias=False,
    rope_scaling="llama3",
    tied_embeddings=True,
    hf_names=LLAMA_LAYOUT_NAMES,
    hf_math_fields={
        **decoder_math_fields(("llama",), tied_embeddings=True),
        "attention_bias": (False, one_of(False), "q/k/v/o biases are not part of the Llama 3 recipe here"),
        "mlp_bias": (False, one_of(False), "MLP biases are not implemented"),
        "pretraining_tp": (1, one_of(1), "transformers 4.x sliced the projections when > 1 (another summation order)"),
    },
    hf_inert_fields=DECODER_INERT_FIELDS,
    configs=(
        ModelConfig("tiny-llama", "llama", 257, 64, 128, 2, 4, 2, 16, rms_norm_eps=1e-5, rope_theta=500000.0,
                    tie_word_embeddings=True, rope_scaling=RopeScaling(32.0, 1.0, 4.0, 8192)),
        _llama("llama-3.2-1b", 2048, 8192, 16, 32, 64, 32.0, tied=True),
        _llama("llama-3.1-8b", 4096, 14336, 32, 32, 128, 8.0, tied=False),
    ),
)
