"""The tensor-parallel decoder: the single-GPU `DecoderModel` with its projections, embedding and logprob
head split across the ranks of a process group, on the same Triton kernels (rl_engine.parallel.tp_kernels).

Split (Megatron's): q/k/v and gate/up are column-parallel (a rank holds num_heads/TP query heads,
num_kv_heads/TP key/value heads and intermediate/TP MLP rows); o_proj and down_proj are row-parallel
(the matching K slices); the embedding and the lm_head are vocab-parallel (runs of whole linear_logp
chunks, `tp_kernels.vocab_bounds`). Norms, RoPE, attention over a rank's heads and SwiGLU run the
`triton_bf16` profile's ops on local tensors; the residual stream is replicated. Split reductions are
continued rank to rank in the single GPU's order, so logprobs and input gradients have the
single-GPU model's bits at every TP size that divides the heads (tests/parallel/test_tp_decoder.py).
Weight gradients are the single GPU's too, each rank holding its slices'. Dense families only (an MoE
layer is refused).
"""

from __future__ import annotations

import dataclasses

from rl_engine.models.config import ModelConfig
from rl_engine.models.decoder import DecoderModel
from rl_engine.models.families import get_family
from rl_engine.models.profiles import ProfileOps, get_profile
from rl_engine.models.weights import checkpoint_shapes, load_hf_checkpoint
from rl_engine.parallel.tp_kernels import (
    Ranks,
    column_parallel_matmul,
    heads_gathered,
    row_parallel_matmul,
    vocab_align,
    vocab_bounds,
    vocab_parallel_embedding,
    vocab_parallel_linear_logp,
)

COLUMN_PARALLEL = ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj")
ROW_PARALLEL = ("o_proj", "down_proj")


def weight_part(config: ModelConfig, group=None, profile: str = "triton_bf16"):
    """part(name, shape) -> this rank's index into a whole weight (None: replicated), for `config` split
    over `group`; what `load_hf_checkpoint(part=)` reads and `TensorParallelDecoder` slices."""
    if config.moe is not None:
        raise ValueError(f"{config.name}: the tensor-parallel decoder runs dense families only")
    ranks = Ranks(group)
    for field in ("num_heads", "num_kv_heads", "intermediate_size"):
        ranks.even_split(field, getattr(config, field))  # ValueError unless TP divides it
    bounds = vocab_bounds(config.vocab_size, ranks.size, vocab_align(get_profile(profile).dtype))
    family = get_family(config.family)
    vocab = {family.weight_name("embed")} | ({family.weight_name("lm_head")} if "lm_head" in family.hf_names else set())
    column, row = set(), set()
    for i in range(config.num_layers):
        column |= {family.weight_name(r, i) for r in COLUMN_PARALLEL + ("q_bias", "k_bias", "v_bias")
                   if family.hf_names.get(r)}
        row |= {family.weight_name(r, i) for r in ROW_PARALLEL}

    def part(name: str, shape: tuple) -> tuple | None:
        if ranks.size == 1:
            return None
        if name in vocab:
            return (slice(bounds[ranks.rank], bounds[ranks.rank + 1]),)
        if name in column:
            return (ranks.even_split(name, shape[0]),)
        if name in row:
            return (slice(None), ranks.even_split(name, shape[1]))
        return None

    return part


def _take(t, index):
    return t if index is None else t[index].contiguous()


class TensorParallelDecoder(DecoderModel):
    """`DecoderModel(config, weights, triton_bf16)` split over `group` (None: one process, TP = 1).

    weights: whole tensors (each rank keeps its slice) or this rank's slices, as `from_checkpoint` reads them.
    """

    def __init__(self, config, weights: dict, group=None, ops: ProfileOps | None = None):
        ops = ops or ProfileOps(get_profile("triton_bf16"))
        part = weight_part(config, group, ops.profile.name)
        whole = checkpoint_shapes(config)
        local = {n: _take(t, part(n, whole[n]) if tuple(t.shape) == whole.get(n) else None) for n, t in weights.items()}
        super().__init__(config, local, ops)
        self.ranks, self.group = Ranks(group), group
        tp = self.ranks.size
        # The local config: a rank's heads (the views in _layer read num_heads and num_kv_heads).
        self.config = dataclasses.replace(config, num_heads=config.num_heads // tp,
                                          num_kv_heads=config.num_kv_heads // tp)
        self.full_config = config

    @classmethod
    def from_checkpoint(cls, path, config, group=None, *, device="cpu", ops: ProfileOps | None = None):
        """Each rank reads only its slices of an HF checkpoint directory (config.json + *.safetensors)."""
        ops = ops or ProfileOps(get_profile("triton_bf16"))
        weights = load_hf_checkpoint(path, config, device=device, part=weight_part(config, group, ops.profile.name))
        return cls(config, weights, group, ops)

    stack_projections = False  # each projection is split over the ranks by its own rule (_linear)

    def _linear(self, node, x, role, layer):
        w = self._weight(role, layer)
        if role in ROW_PARALLEL:
            return row_parallel_matmul(x, w, self.group)
        y = column_parallel_matmul(x, w, self.group)
        if self.family.qkv_bias and role in ("q_proj", "k_proj", "v_proj"):
            y = y + self._weight(role[0] + "_bias", layer)
        return y

    def _residual_linear(self, node, h, x, role, layer):
        return h + self._linear(node, x, role, layer)  # the add after the row-parallel reduction

    def _head_norm(self, node, x, role, layer):
        # q/k RMSNorm's weight is shared by all heads: its gradient is taken over all of them.
        def norm(full, weight):
            b, s, h, d = full.shape
            out = self.ops("rms_norm", node, {"eps": self.config.rms_norm_eps}, x=full.reshape(b, s * h, d),
                           weight=weight)
            return out.view(b, s, h, d)

        return heads_gathered(norm, x, self._weight(role, layer), self.group)

    def embed(self, token_ids):
        return vocab_parallel_embedding(token_ids, self._weight("embed"), self.group, self.full_config.vocab_size)

    def logits(self, hidden):
        raise NotImplementedError("the tensor-parallel decoder gives selected logprobs, not full logits")

    def selected_logprobs(self, hidden, target_ids):
        return vocab_parallel_linear_logp(hidden, self.lm_head_weight, target_ids, self.group,
                                          self.full_config.vocab_size)
