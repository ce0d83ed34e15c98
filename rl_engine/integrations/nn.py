"""nn.Module layers over the registry ops, named and shaped like transformers' modules (public as `rl_engine.nn`).

Each layer calls its op through a `ProfileOps` (rl_engine.models.profiles), as `DecoderModel` does,
with the same node names when built by `rl_engine.integrations.transformers.patch`; so a model made of
these layers computes what `DecoderModel` computes under the same profile, bit for bit. Parameter names
and shapes are transformers' (`weight`, `bias`, `q_proj.weight`, ...), so their state_dicts load as is.

Weights are cast to the profile's dtype per call exactly as `DecoderModel` casts them once (torch and
triton profiles compute in their dtype; the reference profile upcasts inside the gold ops).
"""

from __future__ import annotations

import torch
from torch import nn

from rl_engine.models.profiles import ProfileOps, get_profile

__all__ = ["Attention", "FusedLinearPolicyLoss", "GatedMLP", "Linear", "LmHead", "RMSNorm", "RotaryEmbedding",
           "SelectedLogprobHead", "profile_ops"]


def profile_ops(profile: str | ProfileOps) -> ProfileOps:
    """A profile name or a ProfileOps. A name gets one that records nothing: a training loop dispatches
    millions of times, and an unbounded record list would grow without end (pass a ProfileOps to record)."""
    if isinstance(profile, ProfileOps):
        return profile
    ops = ProfileOps(get_profile(profile))
    ops.recorder = None  # Registry.dispatch takes None as "record nothing"
    return ops


class _OpModule(nn.Module):
    def __init__(self, profile: str | ProfileOps, node: str):
        super().__init__()
        self.ops = profile_ops(profile)
        self.node = node  # the name its dispatches are recorded under

    def _cast(self, t: torch.Tensor) -> torch.Tensor:
        dtype = self.ops.profile.dtype
        return t if dtype == torch.float32 or not t.is_floating_point() else t.to(dtype)


class RMSNorm(_OpModule):
    """y = x / sqrt(mean(x^2) + eps) * weight over the last dim (transformers' *RMSNorm)."""

    def __init__(self, hidden_size: int, eps: float = 1e-6, *,
                 profile: str | ProfileOps = "triton_bf16", node: str = "norm"):
        super().__init__(profile, node)
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.variance_epsilon = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Rows are independent: [B,S,H,D] goes as [B,S*H,D], the shape DecoderModel hands the op.
        shape = x.shape
        x3 = x.reshape(shape[0], -1, shape[-1]) if x.dim() >= 3 else x.reshape(1, -1, shape[-1])
        y = self.ops("rms_norm", self.node, {"eps": self.variance_epsilon}, x=x3, weight=self._cast(self.weight))
        return y.view(shape)


class Linear(_OpModule):
    """y = x @ weight.T (+ bias), the matmul op (batch invariant under the triton profile)."""

    def __init__(self, in_features: int, out_features: int, bias: bool = False, *,
                 profile: str | ProfileOps = "triton_bf16", node: str = "linear"):
        super().__init__(profile, node)
        self.in_features, self.out_features = in_features, out_features
        self.weight = nn.Parameter(torch.empty(out_features, in_features))
        self.bias = nn.Parameter(torch.zeros(out_features)) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.ops("matmul", self.node, a=x, b=self._cast(self.weight).t())
        # The bias goes on the rounded matmul output, as DecoderModel adds it (see its docstring).
        return y if self.bias is None else y + self._cast(self.bias)


class GatedMLP(_OpModule):
    """down_proj(silu(gate_proj(x)) * up_proj(x)) with the swiglu op (transformers' *MLP)."""

    def __init__(self, hidden_size: int, intermediate_size: int, *,
                 profile: str | ProfileOps = "triton_bf16", node: str = "mlp"):
        super().__init__(profile, node)
        ops = self.ops
        self.gate_proj = Linear(hidden_size, intermediate_size, profile=ops, node=f"{node}.gate_proj")
        self.up_proj = Linear(hidden_size, intermediate_size, profile=ops, node=f"{node}.up_proj")
        self.down_proj = Linear(intermediate_size, hidden_size, profile=ops, node=f"{node}.down_proj")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        m = self.ops("swiglu", f"{self.node}.swiglu", gate=self.gate_proj(x), up=self.up_proj(x))
        return self.down_proj(m)


class RotaryEmbedding(_OpModule):
    """RoPE of x [B,S,H,D] at positions [B,S]: from theta, or from a given fp32 `inv_freq` [D/2] (Llama 3)."""

    def __init__(self, theta: float, inv_freq: torch.Tensor | None = None, *,
                 profile: str | ProfileOps = "triton_bf16", node: str = "rope"):
        super().__init__(profile, node)
        self.theta = theta
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    def forward(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        params = {"theta": self.theta}
        if self.inv_freq is not None:
            params["inv_freq"] = self.inv_freq
        return self.ops("rope", self.node, params, x=x, positions=positions)


class Attention(_OpModule):
    """Grouped-query self-attention: q/k/v proj (+ bias) -> (per-head q/k RMSNorm) -> RoPE -> attention -> o proj.

    Layouts (as DecoderModel): padded [B,S] (left padding: `seq_starts` [B]); packed [1,T] with
    `cu_seqlens` [N+1]; cached: with `k_cache`/`v_cache` [B,Smax,Hkv,D] the new keys/values are written at
    `positions`; with `cache_seqlens` [B] (valid cached tokens after this step) the queries attend through
    the cache (chunked prefill, decode), without it through plain attention (prompt prefill).
    """

    def __init__(self, hidden_size: int, num_heads: int, num_kv_heads: int, head_dim: int, *,
                 qkv_bias: bool = False, qk_norm: bool = False, rms_norm_eps: float = 1e-6, rope_theta: float = 1e6,
                 inv_freq: torch.Tensor | None = None, profile: str | ProfileOps = "triton_bf16",
                 node: str = "self_attn"):
        super().__init__(profile, node)
        ops = self.ops
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.q_proj = Linear(hidden_size, num_heads * head_dim, qkv_bias, profile=ops, node=f"{node}.q_proj")
        self.k_proj = Linear(hidden_size, num_kv_heads * head_dim, qkv_bias, profile=ops, node=f"{node}.k_proj")
        self.v_proj = Linear(hidden_size, num_kv_heads * head_dim, qkv_bias, profile=ops, node=f"{node}.v_proj")
        self.o_proj = Linear(num_heads * head_dim, hidden_size, profile=ops, node=f"{node}.o_proj")
        if qk_norm:
            self.q_norm = RMSNorm(head_dim, rms_norm_eps, profile=ops, node=f"{node}.q_norm")
            self.k_norm = RMSNorm(head_dim, rms_norm_eps, profile=ops, node=f"{node}.k_norm")
        else:
            self.q_norm = self.k_norm = None
        self.q_rope = RotaryEmbedding(rope_theta, inv_freq, profile=ops, node=f"{node}.q_rope")
        self.k_rope = RotaryEmbedding(rope_theta, inv_freq, profile=ops, node=f"{node}.k_rope")

    def project(self, hidden_states, positions):
        """q [B,S,H,D], k and v [B,S,Hkv,D], after the q/k norms and RoPE."""
        b, s = hidden_states.shape[0], hidden_states.shape[1]
        q = self.q_proj(hidden_states).view(b, s, self.num_heads, self.head_dim)
        k = self.k_proj(hidden_states).view(b, s, self.num_kv_heads, self.head_dim)
        v = self.v_proj(hidden_states).view(b, s, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        return self.q_rope(q, positions), self.k_rope(k, positions), v

    def attend(self, q, k, v, **layout):
        """The attention op over keys k/v; `k_cache`, `v_cache`, `cache_seqlens` select kv_cache_attention."""
        node = f"{self.node}.attention"
        if "cache_seqlens" in layout:
            return self.ops("kv_cache_attention", node, q=q, **layout)
        return self.ops("attention", node, q=q, k=k, v=v, **{n: t for n, t in layout.items() if t is not None})

    def output(self, a):
        b, s = a.shape[0], a.shape[1]
        return self.o_proj(a.reshape(b, s, self.num_heads * self.head_dim))

    def forward(self, hidden_states: torch.Tensor, positions: torch.Tensor, *, seq_starts: torch.Tensor | None = None,
                cu_seqlens: torch.Tensor | None = None, k_cache: torch.Tensor | None = None,
                v_cache: torch.Tensor | None = None, cache_seqlens: torch.Tensor | None = None) -> torch.Tensor:
        q, k, v = self.project(hidden_states, positions)
        if k_cache is not None:
            rows = torch.arange(k.shape[0], device=k.device)[:, None].expand_as(positions)
            k_cache[rows, positions.long()] = k
            v_cache[rows, positions.long()] = v
        if cache_seqlens is not None:
            a = self.attend(q, k, v, k_cache=k_cache, v_cache=v_cache, cache_seqlens=cache_seqlens)
        else:
            a = self.attend(q, k, v, seq_starts=seq_starts, cu_seqlens=cu_seqlens)
        return self.output(a)


class LmHead(_OpModule):
    """logits [B,S,V] = hidden @ weight.T by the lm_head op (batch invariant under the triton profile): the
    logits transformers' `generate` picks tokens from, the same bits rl_engine's rollout engine samples from."""

    def __init__(self, hidden_size: int, vocab_size: int, *,
                 profile: str | ProfileOps = "triton_bf16", node: str = "lm_head"):
        super().__init__(profile, node)
        self.weight = nn.Parameter(torch.empty(vocab_size, hidden_size))

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.ops("lm_head", self.node, hidden=hidden, weight=self._cast(self.weight))


class SelectedLogprobHead(_OpModule):
    """fp32 log p(target_ids | hidden) through lm_head, by the linear_logp op: the [.., V] logits are never
    materialised under the triton profile (the torch profile materialises them: that is what it measures)."""

    def __init__(self, hidden_size: int, vocab_size: int, *,
                 profile: str | ProfileOps = "triton_bf16", node: str = "logp"):
        super().__init__(profile, node)
        self.weight = nn.Parameter(torch.empty(vocab_size, hidden_size))

    def forward(self, hidden: torch.Tensor, target_ids: torch.Tensor) -> torch.Tensor:
        return self.ops("linear_logp", self.node, hidden=hidden, lm_head_weight=self._cast(self.weight),
                        target_ids=target_ids)


class FusedLinearPolicyLoss(nn.Module):
    """The fused lm_head + RL policy loss as a module, shaped like Liger's `LigerFusedLinearGRPOLoss`:
    forward(hidden, lm_head weight, ids, advantages, old logprobs, mask, ref logprobs) -> (loss, metrics),
    the [tokens, V] logits never materialised (`backend="triton"`; "pytorch" is the gold, with logits).

    It holds no parameters: the lm_head weight is passed per call, as Liger's `lin_weight`, so one module
    serves a tied or an untied head. The options are `rl_engine.losses.linear_policy_loss`'s (verl's
    names; Liger's `epsilon_low`/`epsilon_high`/`beta` are `clip_ratio_low`/`clip_ratio_high`/`kl_coef`),
    checked here, at construction: an unknown `policy_loss` or `loss_agg_mode` is a ValueError naming it.
    """

    def __init__(self, policy_loss: str = "ppo", *, clip_ratio_low: float = 0.2, clip_ratio_high: float | None = None,
                 clip_ratio_c: float = 3.0, loss_agg_mode: str | None = None, kl_coef: float = 0.0,
                 entropy_coef: float = 0.0, temperature: float = 1.0, compute_entropy: bool = False,
                 backend: str = "triton"):
        """policy_loss: "ppo" (token ratio, clip, dual clip `clip_ratio_c` for negative advantages) or "gspo"
        (sequence ratio). loss_agg_mode: "token-mean", "seq-mean-token-mean" or "seq-mean-token-sum" (None:
        the policy loss's default). kl_coef: k3 KL to the reference logprobs. entropy_coef: entropy bonus
        (compute_entropy: the metric alone). temperature: the sampling temperature. backend: "triton" or
        "pytorch"."""
        super().__init__()
        from rl_engine.losses import BACKENDS, PolicyLossConfig

        if backend not in BACKENDS:
            raise ValueError(f"backend: expected one of {BACKENDS}, got {backend!r}")
        self.config = PolicyLossConfig(
            policy_loss=policy_loss, clip_ratio_low=clip_ratio_low,
            clip_ratio_high=clip_ratio_low if clip_ratio_high is None else clip_ratio_high, clip_ratio_c=clip_ratio_c,
            loss_agg_mode=loss_agg_mode, kl_coef=kl_coef, entropy_coef=entropy_coef, temperature=temperature,
            compute_entropy=compute_entropy)
        self.backend = backend

    def forward(self, hidden: torch.Tensor, lm_head_weight: torch.Tensor, target_ids: torch.Tensor,
                advantages: torch.Tensor, old_logprobs: torch.Tensor, mask: torch.Tensor | None = None,
                ref_logprobs: torch.Tensor | None = None, *, normalizer: float | torch.Tensor | None = None,
                main_grad: torch.Tensor | None = None) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """(loss, metrics) on hidden [N,H] or [B,T,H] @ lm_head_weight [V,H]^T.

        target_ids, old_logprobs, mask, ref_logprobs: [N] or [B,T]; advantages: the same, or [B] per
        sequence. normalizer: the aggregation's divisor (default: this batch's active tokens, or sequences).
        metrics: pg_clipfrac, pg_clipfrac_lower (ppo), ppo_kl, k3_kl, kl_loss (with ref_logprobs), entropy
        (when computed), each a mean over active tokens. main_grad: the fp32 main-grad mode (an fp32 [V,H]
        buffer dL/dW is added into, or the weight's `.main_grad`; see rl_engine.losses.linear_policy_loss).
        """
        from rl_engine.losses import linear_policy_loss

        c = self.config
        return linear_policy_loss(
            hidden, lm_head_weight, target_ids, advantages, old_logprobs, mask, ref_logprobs,
            policy_loss=c.policy_loss, clip_ratio_low=c.clip_ratio_low, clip_ratio_high=c.clip_ratio_high,
            clip_ratio_c=c.clip_ratio_c, loss_agg_mode=c.loss_agg_mode, kl_coef=c.kl_coef, entropy_coef=c.entropy_coef,
            temperature=c.temperature, compute_entropy=c.compute_entropy, normalizer=normalizer, backend=self.backend,
            main_grad=main_grad)

    def extra_repr(self) -> str:
        c = self.config
        return (f"policy_loss={c.policy_loss!r}, loss_agg_mode={c.agg_mode!r}, clip_ratio=({c.clip_ratio_low}, "
                f"{c.clip_ratio_high}), kl_coef={c.kl_coef}, entropy_coef={c.entropy_coef}, "
                f"temperature={c.temperature}, backend={self.backend!r}")
