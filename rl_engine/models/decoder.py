"""The decoder every family runs, assembled from registry ops and read from its `Family` recipe.

embedding -> L x [RMSNorm -> q/k/v proj (+ bias) -> (per-head q/k RMSNorm) -> RoPE -> grouped-query
attention -> o proj -> residual -> RMSNorm -> gate/up proj -> SwiGLU -> down proj -> residual]
-> final RMSNorm -> lm_head, or the embedding matrix itself when tied. A sparse layer of an MoE
family runs rl_engine.models.moe.moe_block in place of the dense MLP (router + top-k experts).
Weights are keyed by their Hugging Face names (the family's `hf_names`), except a sparse layer's
experts: one [E, ...] stack per projection (`Family.weight_name`); node names are rl_engine's and the
same for every family.

Every node calls its op through a `ProfileOps` (rl_engine.models.profiles), which picks the backend
and records what ran. Residual adds, q/k/v bias adds and reshapes are elementwise in the activation dtype, hence
batch invariant and deterministic under every profile; the o/down projections take the residual stream as the
matmul op's `residual` (the Triton kernel adds it in its epilogue, with the bits of the separate add).
A bias is added to the rounded matmul output (two roundings in bf16, where transformers' fused
`F.linear` on a GPU rounds once): at most one bf16 ulp of q/k/v, inside bf16 error; in fp32 the
reference adds it exactly as transformers does, up to the order of one addition.

RoPE: plain RoPE hands the rope op theta; Llama 3 scaling computes the inverse-frequency table on the
host exactly as transformers' `_compute_llama3_parameters` and hands it to the rope op as `inv_freq`.

Attention layouts:
- padded [B,S]: right padding needs no mask; left padding passes `seq_starts` [B];
- packed [1,T] with `cu_seqlens` [N+1];
- cached: new tokens are written into a cache at their positions, then attend through
  `kv_cache_attention` (chunked prefill and decode). Cached layouts hold each sequence from
  position 0 of its cache row (no left padding), so cache index = position. A cache is anything
  with `write(layer, positions, k, v)`, `layer_kv(layer) -> (k, v)` and `block_table`: the
  contiguous `KvCache` below (k [B,Smax,Hkv,D], block_table None), or the paged cache of
  rl_engine.rollout (page pools [num_pages,page,Hkv,D] + int32 block_table [B,width], read in place).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from rl_engine.kernels.ops.triton.linear.matmul import fused_keeps_bits
from rl_engine.models.config import EXPERT_ROLES, ModelConfig
from rl_engine.models.families import get_family
from rl_engine.models.moe import local_experts, moe_block
from rl_engine.models.profiles import ProfileOps


def rope_inv_freq(config: ModelConfig) -> torch.Tensor | None:
    """The fp32 inverse-frequency table [D/2] of a scaled RoPE (None: plain RoPE from theta).

    Llama 3: transformers' `_compute_llama3_parameters`, operation for operation, on the CPU.
    """
    s = config.rope_scaling
    if s is None:
        return None
    d = config.head_dim
    inv_freq = 1.0 / (config.rope_theta ** (torch.arange(0, d, 2, dtype=torch.int64).float() / d))
    old_context_len = s.original_max_position_embeddings
    low_freq_wavelen = old_context_len / s.low_freq_factor
    high_freq_wavelen = old_context_len / s.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    inv_freq_llama = torch.where(wavelen > low_freq_wavelen, inv_freq / s.factor, inv_freq)
    smooth_factor = (old_context_len / wavelen - s.low_freq_factor) / (s.high_freq_factor - s.low_freq_factor)
    smoothed_inv_freq = (1 - smooth_factor) * inv_freq_llama / s.factor + smooth_factor * inv_freq_llama
    is_medium_freq = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
    return torch.where(is_medium_freq, smoothed_inv_freq, inv_freq_llama)


@dataclass
class KvCache:
    k: list  # per layer [B,Smax,Hkv,D]
    v: list

    @classmethod
    def empty(cls, config: ModelConfig, batch: int, max_len: int, dtype, device) -> KvCache:
        shape = (batch, max_len, config.num_kv_heads, config.head_dim)
        k = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(config.num_layers)]
        v = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(config.num_layers)]
        return cls(k, v)

    def write(self, layer: int, positions: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        rows = torch.arange(k.shape[0], device=k.device)[:, None].expand_as(positions)
        self.k[layer][rows, positions.long()] = k
        self.v[layer][rows, positions.long()] = v

    def layer_kv(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.k[layer], self.v[layer]

    block_table = None  # contiguous: no page table (the cache protocol's, module docstring)


def _consecutive(ws: list[torch.Tensor]) -> bool:
    """Whether the tensors are contiguous, of one dtype, and lie one after another in one buffer (the views
    `pack_projections` makes)."""
    first, offset = ws[0], ws[0].storage_offset()
    for w in ws:
        if (not w.is_contiguous() or w.dtype != first.dtype or w.storage_offset() != offset
                or w.untyped_storage().data_ptr() != first.untyped_storage().data_ptr()):
            return False
        offset += w.numel()
    return True


class DecoderModel:
    def __init__(self, config: ModelConfig, weights: dict, ops: ProfileOps):
        self.config = config
        self.family = get_family(config.family)
        self.family.check(config)
        self.ops = ops
        # torch/triton profiles compute in their dtype; the reference upcasts inside the gold ops.
        dtype = ops.profile.dtype
        self.w = {
            n: (t if dtype == torch.float32 or not t.is_floating_point() else t.to(dtype)) for n, t in weights.items()
        }
        inv_freq = rope_inv_freq(config)
        device = self.w[self.name("embed")].device
        self.rope_params = {"theta": config.rope_theta}
        if inv_freq is not None:
            self.rope_params["inv_freq"] = inv_freq.to(device)

    def name(self, role: str, layer: int | None = None) -> str:
        """The name of a role's tensor (of layer `layer`) in the weights."""
        return self.family.weight_name(role, layer)

    def _weight(self, role, layer=None):
        return self.w[self.name(role, layer)]

    # -- node names -----------------------------------------------------------------------------
    def required_nodes(self) -> list[str]:
        """Nodes every selected-logprob forward must dispatch (the `lm_head` node is optional)."""
        attn = ("q_proj", "k_proj", "v_proj") + (("q_norm", "k_norm") if self.family.qk_norm else ())
        nodes = ["model.embed_tokens"]
        for i in range(self.config.num_layers):
            p = f"model.layers.{i}"
            nodes += [f"{p}.input_layernorm", f"{p}.post_attention_layernorm"]
            nodes += [f"{p}.self_attn.{n}" for n in attn + ("q_rope", "k_rope", "attention", "o_proj")]
            # A sparse layer runs its router, then all its experts as one grouped dispatch per projection.
            mlp = ("gate_proj", "up_proj", "swiglu", "down_proj")
            if self.config.sparse_layer(i):
                mlp = ("gate",) + tuple(f"experts.{n}" for n in mlp)
            nodes += [f"{p}.mlp.{n}" for n in mlp]
        return nodes + ["model.norm", "logp"]

    def known_nodes(self) -> list[str]:
        return self.required_nodes() + ["lm_head"]

    # -- pieces ---------------------------------------------------------------------------------
    def embed(self, token_ids: torch.Tensor) -> torch.Tensor:
        return self.ops("embedding", "model.embed_tokens", token_ids=token_ids, weight=self._weight("embed"))

    def _norm(self, node, x, role, layer=None):
        return self.ops("rms_norm", node, {"eps": self.config.rms_norm_eps}, x=x, weight=self._weight(role, layer))

    def _linear(self, node, x, role, layer):
        return self._bias(self.ops("matmul", node, a=x, b=self._weight(role, layer).t()), role, layer)

    def _residual_linear(self, node, h, x, role, layer):
        """h + x's projection by `role` (no bias), the add in the matmul op."""
        return self.ops("matmul", node, a=x, b=self._weight(role, layer).t(), residual=h)

    def _bias(self, y, role, layer):
        if self.family.qkv_bias and role in ("q_proj", "k_proj", "v_proj"):
            y = y + self._weight(role[0] + "_bias", layer)
        return y

    def _projections(self, prefix, x, roles, layer) -> list:
        """x's projections by `roles` (nodes `prefix`.role): ONE matmul, node `prefix`.<roles joined by +>, when
        their weights are consecutive rows of one buffer (`pack_projections`) and the Triton matmul gives each
        part's columns their own product's bits (`fused_keeps_bits`); else one matmul each. The parts are views."""
        fused = self._stacked(roles, layer)
        if fused is None:
            return [self._linear(f"{prefix}.{r}", x, r, layer) for r in roles]
        weight, rows = fused
        y = self.ops("matmul", f"{prefix}.{'+'.join(roles)}", a=x, b=weight.t())
        return [self._bias(part, r, layer) for part, r in zip(y.split(rows, dim=-1), roles)]

    # The tensor-parallel decoder splits each projection over its ranks (its own `_linear`): never stacked there.
    stack_projections = True

    def _stacked(self, roles, layer):
        """(one [sum N, K] view over the roles' weights, their row counts), or None where one product would not
        be each part's product (see `_projections`)."""
        ws = [self._weight(r, layer) for r in roles]
        first, k = ws[0], ws[0].shape[-1]
        if not self.stack_projections or self.ops.profile.backend("matmul") != "triton":
            return None  # cuBLAS picks its kernel by N: a stacked product's bits are not the parts'
        if torch.is_grad_enabled() and any(w.requires_grad for w in ws):
            return None  # each parameter gets its own gradient
        if any(w.dim() != 2 or w.stride() != (k, 1) for w in ws) or not _consecutive(ws):
            return None
        rows = [w.shape[0] for w in ws]
        if not fused_keeps_bits(first.dtype, rows, k):
            return None
        return first.as_strided((sum(rows), k), (k, 1)), rows

    def _stacked_heads(self, q, k, layer):
        """(q and k as one [B,S,Hq+Hkv,D] view, their norm weights as one [2,D] view) where q's and k's heads lie
        side by side in one product (a stacked q/k/v) and the norm weights are consecutive (`pack_projections`) and
        both ops run Triton (one launch each, each head's bits as in its own launch); else (None, None)."""
        if not (self.family.qk_norm and self.ops.profile.backend("rms_norm") == "triton"
                and self.ops.profile.backend("rope") == "triton"):
            return None, None
        d = q.shape[-1]
        # strides compared where a dimension has more than one index (a size-1 dimension's stride is arbitrary)
        if (q.untyped_storage().data_ptr() != k.untyped_storage().data_ptr()
                or any(n > 1 and a != b for n, a, b in zip(q.shape[:2], q.stride()[:2], k.stride()[:2]))
                or any(t.stride(3) != 1 or (t.shape[2] > 1 and t.stride(2) != d) for t in (q, k))
                or k.storage_offset() != q.storage_offset() + q.shape[2] * d):
            return None, None
        wq, wk = self._weight("q_norm", layer), self._weight("k_norm", layer)
        if wq.shape != (d,) or wk.shape != (d,) or not _consecutive([wq, wk]):
            return None, None
        b, s, hq, _ = q.shape
        qk = q.as_strided((b, s, hq + k.shape[2], d), (*q.stride()[:2], d, 1))
        return qk, wq.as_strided((2, d), (d, 1))

    def _head_norm(self, node, x, role, layer):
        b, s, h, d = x.shape
        return self._norm(node, x.reshape(b, s * h, d), role, layer).view(b, s, h, d)

    def _rope(self, node, x, positions, kv_pages=None):
        params = self.rope_params if kv_pages is None else {**self.rope_params, "kv_pages": kv_pages}
        return self.ops("rope", node, params, x=x, positions=positions)

    def _layer(self, i, h, positions, attend, cache=None):
        c, p = self.config, f"model.layers.{i}"
        b, s = h.shape[0], h.shape[1]
        x = self._norm(f"{p}.input_layernorm", h, "input_norm", i)
        q, k, v = self._projections(f"{p}.self_attn", x, ("q_proj", "k_proj", "v_proj"), i)
        q = q.reshape(b, s, c.num_heads, c.head_dim)
        k = k.reshape(b, s, c.num_kv_heads, c.head_dim)
        v = v.reshape(b, s, c.num_kv_heads, c.head_dim)
        qk, norms = self._stacked_heads(q, k, i)
        pages = None
        if qk is not None:  # q's and k's heads adjacent in one product: one norm launch and one RoPE launch
            qk = self.ops("rms_norm", f"{p}.self_attn.q_norm+k_norm", {"eps": c.rms_norm_eps, "split": c.num_heads},
                          x=qk, weight=norms)
            # a paged cache is written by the RoPE launch itself: the rotated keys and the values, a launch fewer
            pages = cache.kv_pages(i, positions, v) if hasattr(cache, "kv_pages") else None
            q, k = self._rope(f"{p}.self_attn.q_rope+k_rope", qk, positions, pages).split(
                [c.num_heads, c.num_kv_heads], dim=2)
        else:
            if self.family.qk_norm:
                q = self._head_norm(f"{p}.self_attn.q_norm", q, "q_norm", i)
                k = self._head_norm(f"{p}.self_attn.k_norm", k, "k_norm", i)
            q = self._rope(f"{p}.self_attn.q_rope", q, positions)
            k = self._rope(f"{p}.self_attn.k_rope", k, positions)
        a = attend(i, f"{p}.self_attn.attention", q, k, v, pages is not None).reshape(b, s, c.num_heads * c.head_dim)
        h = self._residual_linear(f"{p}.self_attn.o_proj", h, a, "o_proj", i)
        x = self._norm(f"{p}.post_attention_layernorm", h, "post_norm", i)
        if c.sparse_layer(i):
            experts = local_experts(self.ops, f"{p}.mlp", *(self._weight(role, i) for role in EXPERT_ROLES))
            return h + moe_block(self.ops, f"{p}.mlp", x, self._weight("router", i), c.moe, experts)
        gate, up = self._projections(f"{p}.mlp", x, ("gate_proj", "up_proj"), i)
        m = self.ops("swiglu", f"{p}.mlp.swiglu", gate=gate, up=up)
        return self._residual_linear(f"{p}.mlp.down_proj", h, m, "down_proj", i)

    def _decoder(self, h, positions, attend, cache=None):
        for i in range(self.config.num_layers):
            h = self._layer(i, h, positions, attend, cache)
        return self._norm("model.norm", h, "final_norm")

    # -- forwards (each returns the final-normed hidden states) ---------------------------------
    def forward(self, token_ids=None, positions=None, *, seq_starts=None, cu_seqlens=None, embeds=None, cache=None):
        """Padded [B,S] (optional left-padding `seq_starts`) or packed [1,T] (`cu_seqlens`) forward.

        With `cache`, the new keys/values are also written into it (prompt prefill before decode).
        """
        h = self.embed(token_ids) if embeds is None else embeds
        extra = {}
        if seq_starts is not None:
            extra["seq_starts"] = seq_starts
        if cu_seqlens is not None:
            extra["cu_seqlens"] = cu_seqlens

        def attend(i, node, q, k, v, written):
            if cache is not None and not written:
                cache.write(i, positions, k, v)
            return self.ops("attention", node, q=q, k=k, v=v, **extra)

        return self._decoder(h, positions, attend, cache)

    def forward_cached(self, token_ids, positions, cache, cache_seqlens, *, embeds=None):
        """New tokens [B,Sq] at `positions` against the cache (chunked prefill, decode).

        cache_seqlens[b] counts the valid cached tokens of row b after this step, the new ones included.
        `cache`: a `KvCache` or any object with its `write`, `layer_kv` and `block_table` (module docstring).
        """
        h = self.embed(token_ids) if embeds is None else embeds

        def attend(i, node, q, k, v, written):
            if not written:
                cache.write(i, positions, k, v)
            k_cache, v_cache = cache.layer_kv(i)
            table = getattr(cache, "block_table", None)
            paged = {} if table is None else {"block_table": table}
            return self.ops("kv_cache_attention", node, q=q, k_cache=k_cache, v_cache=v_cache,
                            cache_seqlens=cache_seqlens, **paged)

        return self._decoder(h, positions, attend, cache)

    # -- heads ----------------------------------------------------------------------------------
    @property
    def lm_head_weight(self) -> torch.Tensor:
        """lm_head's matrix: the embedding matrix itself (the same tensor) when tied."""
        return self._weight("embed" if self.config.tie_word_embeddings else "lm_head")

    def logits(self, hidden):
        return self.ops("lm_head", "lm_head", hidden=hidden, weight=self.lm_head_weight)

    def selected_logprobs(self, hidden, target_ids):
        """fp32 log-probability of target_ids[b, s] given the prefix up to slot s."""
        return self.ops(
            "linear_logp", "logp", hidden=hidden, lm_head_weight=self.lm_head_weight, target_ids=target_ids
        )
