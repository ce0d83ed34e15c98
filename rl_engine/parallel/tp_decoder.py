"""The tensor-parallel decoder: the single-GPU `DecoderModel` with its projections, embedding and logprob
head split across the ranks of a process group, on the same Triton kernels (rl_engine.parallel.tp_kernels).

Split (Megatron's): q/k/v and gate/up are column-parallel (a rank holds num_heads/TP query heads,
num_kv_heads/TP key/value heads and intermediate/TP MLP rows); o_proj and down_proj are row-parallel
(the matching K slices); the embedding and the lm_head are vocab-parallel (runs of whole linear_logp
chunks, `tp_kernels.vocab_bounds`). Norms, RoPE, attention over a rank's heads and SwiGLU run the
`triton_bf16` profile's ops on local tensors; the residual stream is replicated. Split reductions are
continued rank to rank in the single GPU's order, so logprobs and input gradients have the
single-GPU model's bits at every TP size that divides the heads (tests/parallel/test_tp_decoder.py).
Dense families only (an MoE layer is refused); weights are frozen here (no weight gradients).
"""

from __future__ import annotations

import dataclasses

from rl_engine.models.decoder import DecoderModel
from rl_engine.models.profiles import ProfileOps, get_profile
from rl_engine.parallel.tp_kernels import (
    Ranks,
    column_parallel_matmul,
    row_parallel_matmul,
    vocab_align,
    vocab_bounds,
    vocab_parallel_embedding,
    vocab_parallel_linear_logp,
)

COLUMN_PARALLEL = ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj")
ROW_PARALLEL = ("o_proj", "down_proj")


class TensorParallelDecoder(DecoderModel):
    """`DecoderModel(config, weights, triton_bf16)` split over `group` (None: one process, TP = 1)."""

    def __init__(self, config, weights: dict, group=None, ops: ProfileOps | None = None):
        if config.moe is not None:
            raise ValueError(f"{config.name}: the tensor-parallel decoder runs dense families only")
        ranks = Ranks(group)
        tp = ranks.size
        for field in ("num_heads", "num_kv_heads", "intermediate_size"):
            ranks.even_split(field, getattr(config, field))  # ValueError unless TP divides it
        super().__init__(config, weights, ops or ProfileOps(get_profile("triton_bf16")))
        self.ranks, self.group = ranks, group
        dtype = self._weight("embed").dtype
        bounds = vocab_bounds(config.vocab_size, tp, vocab_align(dtype))
        self.vocab_rows = slice(bounds[ranks.rank], bounds[ranks.rank + 1])
        # The local config: a rank's heads (the views in _layer read num_heads and num_kv_heads).
        self.config = dataclasses.replace(config, num_heads=config.num_heads // tp,
                                          num_kv_heads=config.num_kv_heads // tp)
        self.full_config = config
        for name in list(self.w):
            self.w[name] = self._local(name, self.w[name])

    def _local(self, name, t):
        """This rank's slice of a full weight, as its own contiguous tensor."""
        if name in (self.name("embed"), self.family.hf_names.get("lm_head") and self.name("lm_head")):
            return t[self.vocab_rows].contiguous()
        for i in range(self.full_config.num_layers):
            for role in COLUMN_PARALLEL + ("q_bias", "k_bias", "v_bias"):
                if self.family.hf_names.get(role) and name == self.name(role, i):
                    return t[self.ranks.even_split(name, t.shape[0])].contiguous()
            for role in ROW_PARALLEL:
                if name == self.name(role, i):
                    return t[:, self.ranks.even_split(name, t.shape[1])].contiguous()
        return t

    def _linear(self, node, x, role, layer):
        w = self._weight(role, layer)
        if role in ROW_PARALLEL:
            return row_parallel_matmul(x, w, self.group)
        y = column_parallel_matmul(x, w, self.group)
        if self.family.qkv_bias and role in ("q_proj", "k_proj", "v_proj"):
            y = y + self._weight(role[0] + "_bias", layer)
        return y

    def embed(self, token_ids):
        return vocab_parallel_embedding(token_ids, self._weight("embed"), self.group, self.full_config.vocab_size)

    def logits(self, hidden):
        raise NotImplementedError("the tensor-parallel decoder gives selected logprobs, not full logits")

    def selected_logprobs(self, hidden, target_ids):
        return vocab_parallel_linear_logp(hidden, self.lm_head_weight, target_ids, self.group,
                                          self.full_config.vocab_size)
