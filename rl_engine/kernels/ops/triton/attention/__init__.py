"""Triton attention: prefill/packed (forward + backward) and KV-cache attention, sharing one kernel."""

from rl_engine.kernels.ops.triton.attention.attention import TritonAttentionOp, triton_attention
from rl_engine.kernels.ops.triton.attention.kv_cache_attention import (
    TritonKvCacheAttentionOp,
    triton_kv_cache_attention,
)

__all__ = ["TritonAttentionOp", "TritonKvCacheAttentionOp", "triton_attention", "triton_kv_cache_attention"]
