"""Qwen3 dense decoder assembled from registry ops.

embedding -> L x [RMSNorm -> q/k/v proj -> per-head q/k RMSNorm -> RoPE (theta 1e6) -> grouped-query
attention -> o proj -> residual -> RMSNorm -> gate/up proj -> SwiGLU -> down proj -> residual]
-> final RMSNorm -> untied lm_head. Parameter names are the Hugging Face ones.

Every node calls its op through a `ProfileOps` (rl_engine.models.profiles), which picks the backend
and records what ran. Residual adds and reshapes are plain tensor ops in the activation dtype: they
are elementwise, hence batch invariant and deterministic under every profile.

Attention layouts:
- padded [B,S]: right padding needs no mask; left padding passes `seq_starts` [B];
- packed [1,T] with `cu_seqlens` [N+1];
- cached: new tokens are written into a `KvCache` at their positions, then attend through
  `kv_cache_attention` (chunked prefill and decode). Cached layouts hold each sequence from
  position 0 of its cache row (no left padding), so cache index = position.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass, replace

import torch

from rl_engine.models.profiles import ProfileOps


@dataclass(frozen=True)
class Qwen3Config:
    name: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 1e6

    def fingerprint(self) -> str:
        """sha256 of the architecture (every field but the name), canonical JSON."""
        fields = {k: v for k, v in asdict(self).items() if k != "name"}
        return hashlib.sha256(json.dumps(fields, sort_keys=True).encode()).hexdigest()

    def with_layers(self, num_layers: int) -> Qwen3Config:
        if num_layers < 1 or num_layers > self.num_layers:
            raise ValueError(f"num_layers: expected 1..{self.num_layers} for {self.name}, got {num_layers}")
        if num_layers == self.num_layers:
            return self
        return replace(self, name=f"{self.name}[:{num_layers}]", num_layers=num_layers)


CONFIGS = {
    "tiny": Qwen3Config("tiny", 257, 64, 128, 2, 4, 2, 16),
    "qwen3-8b": Qwen3Config("qwen3-8b", 151936, 4096, 12288, 36, 32, 8, 128),
}


def get_config(name: str) -> Qwen3Config:
    if name not in CONFIGS:
        raise ValueError(f"model: expected one of {sorted(CONFIGS)}, got {name!r}")
    return CONFIGS[name]


@dataclass
class KvCache:
    k: list  # per layer [B,Smax,Hkv,D]
    v: list

    @classmethod
    def empty(cls, config: Qwen3Config, batch: int, max_len: int, dtype, device) -> KvCache:
        shape = (batch, max_len, config.num_kv_heads, config.head_dim)
        k = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(config.num_layers)]
        v = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(config.num_layers)]
        return cls(k, v)

    def write(self, layer: int, positions: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        rows = torch.arange(k.shape[0], device=k.device)[:, None].expand_as(positions)
        self.k[layer][rows, positions.long()] = k
        self.v[layer][rows, positions.long()] = v


class Qwen3Model:
    def __init__(self, config: Qwen3Config, weights: dict, ops: ProfileOps):
        self.config = config
        self.ops = ops
        # torch/triton profiles compute in their dtype; the reference upcasts inside the gold ops.
        dtype = ops.profile.dtype
        self.w = {
            n: (t if dtype == torch.float32 or not t.is_floating_point() else t.to(dtype)) for n, t in weights.items()
        }

    # -- node names -----------------------------------------------------------------------------
    def required_nodes(self) -> list[str]:
        """Nodes every selected-logprob forward must dispatch (the `lm_head` node is optional)."""
        nodes = ["model.embed_tokens"]
        for i in range(self.config.num_layers):
            p = f"model.layers.{i}"
            nodes += [f"{p}.input_layernorm", f"{p}.post_attention_layernorm"]
            nodes += [f"{p}.self_attn.{n}" for n in ("q_proj", "k_proj", "v_proj", "q_norm", "k_norm")]
            nodes += [f"{p}.self_attn.{n}" for n in ("q_rope", "k_rope", "attention", "o_proj")]
            nodes += [f"{p}.mlp.{n}" for n in ("gate_proj", "up_proj", "swiglu", "down_proj")]
        return nodes + ["model.norm", "logp"]

    def known_nodes(self) -> list[str]:
        return self.required_nodes() + ["lm_head"]

    # -- pieces ---------------------------------------------------------------------------------
    def embed(self, token_ids: torch.Tensor) -> torch.Tensor:
        return self.ops(
            "embedding", "model.embed_tokens", token_ids=token_ids, weight=self.w["model.embed_tokens.weight"]
        )

    def _norm(self, node, x, weight_name):
        return self.ops("rms_norm", node, {"eps": self.config.rms_norm_eps}, x=x, weight=self.w[weight_name])

    def _linear(self, node, x, weight_name):
        return self.ops("matmul", node, a=x, b=self.w[weight_name].t())

    def _head_norm(self, node, x, weight_name):
        b, s, h, d = x.shape
        return self._norm(node, x.reshape(b, s * h, d), weight_name).view(b, s, h, d)

    def _rope(self, node, x, positions):
        return self.ops("rope", node, {"theta": self.config.rope_theta}, x=x, positions=positions)

    def _layer(self, i, h, positions, attend):
        c, p = self.config, f"model.layers.{i}"
        b, s = h.shape[0], h.shape[1]
        x = self._norm(f"{p}.input_layernorm", h, f"{p}.input_layernorm.weight")
        q = self._linear(f"{p}.self_attn.q_proj", x, f"{p}.self_attn.q_proj.weight").view(b, s, c.num_heads, c.head_dim)
        k = self._linear(f"{p}.self_attn.k_proj", x, f"{p}.self_attn.k_proj.weight")
        v = self._linear(f"{p}.self_attn.v_proj", x, f"{p}.self_attn.v_proj.weight")
        k = k.view(b, s, c.num_kv_heads, c.head_dim)
        v = v.view(b, s, c.num_kv_heads, c.head_dim)
        q = self._head_norm(f"{p}.self_attn.q_norm", q, f"{p}.self_attn.q_norm.weight")
        k = self._head_norm(f"{p}.self_attn.k_norm", k, f"{p}.self_attn.k_norm.weight")
        q = self._rope(f"{p}.self_attn.q_rope", q, positions)
        k = self._rope(f"{p}.self_attn.k_rope", k, positions)
        a = attend(i, f"{p}.self_attn.attention", q, k, v).reshape(b, s, c.num_heads * c.head_dim)
        h = h + self._linear(f"{p}.self_attn.o_proj", a, f"{p}.self_attn.o_proj.weight")
        x = self._norm(f"{p}.post_attention_layernorm", h, f"{p}.post_attention_layernorm.weight")
        gate = self._linear(f"{p}.mlp.gate_proj", x, f"{p}.mlp.gate_proj.weight")
        up = self._linear(f"{p}.mlp.up_proj", x, f"{p}.mlp.up_proj.weight")
        m = self.ops("swiglu", f"{p}.mlp.swiglu", gate=gate, up=up)
        return h + self._linear(f"{p}.mlp.down_proj", m, f"{p}.mlp.down_proj.weight")

    def _decoder(self, h, positions, attend):
        for i in range(self.config.num_layers):
            h = self._layer(i, h, positions, attend)
        return self._norm("model.norm", h, "model.norm.weight")

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

        def attend(i, node, q, k, v):
            if cache is not None:
                cache.write(i, positions, k, v)
            return self.ops("attention", node, q=q, k=k, v=v, **extra)

        return self._decoder(h, positions, attend)

    def forward_cached(self, token_ids, positions, cache: KvCache, cache_seqlens, *, embeds=None):
        """New tokens [B,Sq] at `positions` against the cache (chunked prefill, decode).

        cache_seqlens[b] counts the valid cached tokens of row b after this step, the new ones included.
        """
        h = self.embed(token_ids) if embeds is None else embeds

        def attend(i, node, q, k, v):
            cache.write(i, positions, k, v)
            return self.ops(
                "kv_cache_attention", node, q=q, k_cache=cache.k[i], v_cache=cache.v[i], cache_seqlens=cache_seqlens
            )

        return self._decoder(h, positions, attend)

    # -- heads ----------------------------------------------------------------------------------
    def logits(self, hidden):
        return self.ops("lm_head", "lm_head", hidden=hidden, weight=self.w["lm_head.weight"])

    def selected_logprobs(self, hidden, target_ids):
        """fp32 log-probability of target_ids[b, s] given the prefix up to slot s."""
        return self.ops(
            "linear_logp", "logp", hidden=hidden, lm_head_weight=self.w["lm_head.weight"], target_ids=target_ids
        )
