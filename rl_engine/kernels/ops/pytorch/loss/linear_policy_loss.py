"""Fused lm_head + RL policy loss, the gold: logits materialised, autograd, verl's formulas.

Per token t of sequence i (all formulas as verl's `verl/trainer/ppo/core_algos.py`:
compute_policy_loss_vanilla, compute_policy_loss_gspo, agg_loss, kl_penalty("low_var_kl"), and
`verl/workers/actor/dp_actor.py` for how the terms are combined):

  z      = (hidden @ W^T) / temperature                 logits at the sampling temperature
  logp_t = z[target] - logsumexp(z)                      H_t = logsumexp(z) - sum_v softmax(z)_v z_v
  delta  = clamp(logp_t - old_t, -20, 20),  r = exp(delta)

  ppo (GRPO/PPO/DAPO clip, dual-clip for negative advantages):
    L1 = -A r,  L2 = -A clip(r, 1 - eps_low, 1 + eps_high),  C = max(L1, L2),  L3 = -A clip_ratio_c
    pg_t = min(L3, C) if A < 0 else C
  gspo (sequence-level ratio, the geometric mean of token ratios, detached but for the token's own logp):
    s_i  = sum_t m_t (logp_t - old_t) / max(sum_t m_t, 1)
    r_t  = exp(min(logp_t - sg(logp_t) + sg(s_i), 10))
    pg_t = max(-A r_t, -A clip(r_t, 1 - eps_low, 1 + eps_high))
  k3 KL to the reference ("low_var_kl"): k = clamp(ref_t - logp_t, -20, 20), kl_t = clamp(e^k - k - 1, -10, 10)
  token loss: l_t = pg_t + kl_coef kl_t - entropy_coef H_t

  aggregation (m = token mask, n = normalizer):
    token-mean            loss = sum_t m_t l_t / n,          n default: sum_t m_t (active tokens)
    seq-mean-token-mean   loss = sum_i [sum_t m_t l_t / max(sum_t m_t, 1)] / n,  n default: B sequences
    seq-mean-token-sum    loss = sum_i sum_t m_t l_t / n,    n default: B sequences
  (verl aggregates pg, kl and entropy separately with the same mode; the sum is the same.)

Metrics, means over active tokens: pg_clipfrac = mean[L2 > L1], pg_clipfrac_lower = mean[C > L3 and
A < 0] (ppo), ppo_kl = mean(-delta) (verl's k1), k3_kl = mean(r - 1 - delta) (DESIGN.md's k3 vs the
old policy), kl_loss = mean(kl_t) (with a reference), entropy = mean(H_t) (when asked).

Where verl differs: verl's masked mean divides by count + 1e-8 (the same fp32 number for any count
>= 1) and gives NaN for an all-masked sequence in seq-mean-token-mean; here the count is clamped to 1.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from rl_engine.kernels.ops.pytorch.base import NativeOp, expect_ids_in_range, expect_rank, expect_shape

POLICY_LOSSES = ("ppo", "gspo")
LOSS_AGG_MODES = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum")
RATIO_LOG_CLAMP = 20.0  # |logp - old| and |ref - logp| clamp (verl)
GSPO_LOG_RATIO_MAX = 10.0  # the sequence log-ratio clamp (verl)
KL_CLAMP = 10.0  # the k3 value clamp (verl)


@dataclass(frozen=True)
class PolicyLossConfig:
    """One policy-loss variant. `loss_agg_mode` None: token-mean for ppo, seq-mean-token-mean for gspo."""

    policy_loss: str = "ppo"
    clip_ratio_low: float = 0.2
    clip_ratio_high: float = 0.2  # DAPO's clip-higher: e.g. 0.28
    clip_ratio_c: float = 3.0  # dual-clip bound for A < 0 (ppo only)
    loss_agg_mode: str | None = None
    kl_coef: float = 0.0  # > 0 needs ref_logprobs
    entropy_coef: float = 0.0
    temperature: float = 1.0
    compute_entropy: bool = False  # the entropy metric without a bonus

    def __post_init__(self):
        if self.policy_loss not in POLICY_LOSSES:
            raise ValueError(f"policy_loss: expected one of {POLICY_LOSSES}, got {self.policy_loss!r}")
        if self.loss_agg_mode is not None and self.loss_agg_mode not in LOSS_AGG_MODES:
            raise ValueError(f"loss_agg_mode: expected one of {LOSS_AGG_MODES}, got {self.loss_agg_mode!r}")
        if not (0 <= self.clip_ratio_low < 1 and self.clip_ratio_high >= 0):
            raise ValueError(f"clip ratios: need 0 <= clip_ratio_low < 1 and clip_ratio_high >= 0, "
                             f"got {self.clip_ratio_low}, {self.clip_ratio_high}")
        if not self.clip_ratio_c > 1:
            raise ValueError(f"clip_ratio_c: the dual-clip bound must exceed 1, got {self.clip_ratio_c}")
        if not 0 < self.temperature < math.inf:
            raise ValueError(f"temperature: expected a positive finite number, got {self.temperature}")
        for name in ("kl_coef", "entropy_coef"):
            if not 0 <= getattr(self, name) < math.inf:
                raise ValueError(f"{name}: expected a finite number >= 0, got {getattr(self, name)}")

    @property
    def agg_mode(self) -> str:
        if self.loss_agg_mode is not None:
            return self.loss_agg_mode
        return "seq-mean-token-mean" if self.policy_loss == "gspo" else "token-mean"

    @property
    def needs_entropy(self) -> bool:
        return self.compute_entropy or self.entropy_coef > 0

    @property
    def needs_sequences(self) -> bool:
        return self.policy_loss == "gspo" or self.agg_mode != "token-mean"


def token_stats(logits: torch.Tensor, target_ids: torch.Tensor, temperature: float):
    """(logp, entropy) per token from raw logits [..., V]."""
    z = logits / temperature
    logz = torch.log_softmax(z, dim=-1)
    logp = torch.gather(logz, -1, target_ids.long().unsqueeze(-1)).squeeze(-1)
    entropy = -(logz.exp() * logz).sum(-1)
    return logp, entropy


def token_terms(logp, entropy, old, ref, adv, mask, cfg: PolicyLossConfig) -> dict:
    """verl's per-token terms on [B,T] (or [N] for ppo): pg, kl, clip indicators, the ratios' log."""
    mask = mask.to(logp.dtype)
    lo, hi = 1 - cfg.clip_ratio_low, 1 + cfg.clip_ratio_high
    # a NaN or ±inf old (or reference) logprob makes the token's terms NaN: the clamps would hide it
    finite = torch.isfinite(old) & torch.isfinite(logp) & (True if ref is None else torch.isfinite(ref))
    delta = torch.where(torch.isfinite(old), torch.clamp(logp - old, -RATIO_LOG_CLAMP, RATIO_LOG_CLAMP), torch.nan)
    if cfg.policy_loss == "ppo":
        ratio = torch.exp(delta)
        l1, l2 = -adv * ratio, -adv * torch.clamp(ratio, lo, hi)
        c = torch.maximum(l1, l2)
        l3 = -adv * cfg.clip_ratio_c
        pg = torch.where(adv < 0, torch.minimum(l3, c), c)
        lower = torch.gt(c, l3) & (adv < 0)
    else:
        raw = logp - old  # GSPO's sequence mean is unclamped (verl)
        seq = (raw * mask).sum(-1) / mask.sum(-1).clamp(min=1)
        log_ratio = torch.clamp(logp - logp.detach() + seq.detach().unsqueeze(-1), max=GSPO_LOG_RATIO_MAX)
        ratio = torch.exp(log_ratio)
        l1, l2 = -adv * ratio, -adv * torch.clamp(ratio, lo, hi)
        pg = torch.maximum(l1, l2)
        lower = torch.zeros_like(mask, dtype=torch.bool)
    terms = {"pg": pg, "clipped": torch.gt(l2, l1), "clipped_lower": lower, "delta": delta, "loss": pg}
    if ref is not None:
        k = torch.clamp(ref - logp, -RATIO_LOG_CLAMP, RATIO_LOG_CLAMP)
        terms["kl"] = torch.clamp(torch.exp(k) - k - 1, -KL_CLAMP, KL_CLAMP)
        terms["loss"] = terms["loss"] + cfg.kl_coef * terms["kl"]
    if cfg.entropy_coef:
        terms["loss"] = terms["loss"] - cfg.entropy_coef * entropy
    # + logp · (0 or NaN): the loss unchanged where finite (logp · 0 is -0), NaN with NaN gradients where not
    terms["loss"] = terms["loss"] + logp * torch.where(finite, 0.0, torch.nan).to(logp.dtype)
    return terms


def aggregation_weights(mask: torch.Tensor, cfg: PolicyLossConfig, normalizer=None) -> torch.Tensor:
    """w_t with loss = sum_t w_t l_t: the aggregation mode as one weight per token (mask included)."""
    mask = mask.to(torch.float64 if mask.dtype == torch.float64 else torch.float32)
    if isinstance(normalizer, (int, float)) and not 0 < normalizer < math.inf:
        raise ValueError(f"normalizer: expected a positive finite number, got {normalizer}")
    mode = cfg.agg_mode
    if mode == "token-mean":
        n = mask.sum().clamp(min=1) if normalizer is None else normalizer
        return mask / n
    n = mask.shape[0] if normalizer is None else normalizer
    if mode == "seq-mean-token-mean":
        return mask / mask.sum(-1, keepdim=True).clamp(min=1) / n
    return mask / n


def policy_loss_from_logits(logits, target_ids, advantages, old_logprobs, mask, ref_logprobs, cfg, normalizer=None):
    """(loss, metrics) from materialised logits: the meaning of the fused op."""
    logp, entropy = token_stats(logits, target_ids, cfg.temperature)
    terms = token_terms(logp, entropy, old_logprobs, ref_logprobs, advantages, mask, cfg)
    weights = aggregation_weights(mask, cfg, normalizer).to(logp.dtype)
    loss = (weights * terms["loss"]).sum()
    m = mask.to(logp.dtype)
    active = m.sum().clamp(min=1)

    def mean(x):
        return ((x.detach().to(logp.dtype) * m).sum() / active).detach()

    delta = terms["delta"].detach()
    metrics = {"pg_clipfrac": mean(terms["clipped"]), "ppo_kl": mean(-delta), "k3_kl": mean(delta.exp() - 1 - delta)}
    if cfg.policy_loss == "ppo":
        metrics["pg_clipfrac_lower"] = mean(terms["clipped_lower"])
    if "kl" in terms:
        metrics["kl_loss"] = mean(terms["kl"])
    if cfg.needs_entropy:
        metrics["entropy"] = mean(entropy)
    return loss, metrics


def validate_policy_inputs(hidden, lm_head_weight, target_ids, advantages, old_logprobs, mask, ref_logprobs, cfg):
    """One-line ValueErrors for the fused loss's inputs (hidden [N,H] or [B,T,H])."""
    if not isinstance(hidden, torch.Tensor) or hidden.dim() not in (2, 3):
        raise ValueError(f"hidden: expected [N,H] or [B,T,H], got {getattr(hidden, 'shape', type(hidden).__name__)}")
    lead, h = tuple(hidden.shape[:-1]), hidden.shape[-1]
    meaning = "[B,T]" if len(lead) == 2 else "[N]"
    expect_rank("lm_head_weight", lm_head_weight, 2, "[V,H]")
    expect_shape("lm_head_weight", lm_head_weight, (lm_head_weight.shape[0], h), "[V,H]")
    expect_shape("target_ids", target_ids, lead, meaning)
    if target_ids.dtype.is_floating_point or target_ids.dtype == torch.bool:
        raise ValueError(f"target_ids: expected integer ids {meaning}, got dtype {target_ids.dtype}")
    expect_shape("advantages", advantages, lead, meaning)
    expect_shape("old_logprobs", old_logprobs, lead, meaning)
    expect_shape("mask", mask, lead, meaning)
    if ref_logprobs is not None:
        expect_shape("ref_logprobs", ref_logprobs, lead, meaning)
    if cfg.kl_coef > 0 and ref_logprobs is None:
        raise ValueError("ref_logprobs: kl_coef > 0 needs the reference policy's logprobs")
    if cfg.needs_sequences and len(lead) != 2:
        raise ValueError(f"hidden: policy_loss={cfg.policy_loss} with loss_agg_mode={cfg.agg_mode} needs "
                         f"sequences: pass hidden as [B,T,H], got {tuple(hidden.shape)}")


def expand_advantages(advantages: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
    """Per-sequence advantages [B] or [B,1] broadcast over T; per-token ones returned as they are."""
    if hidden.dim() == 3 and advantages.dim() in (1, 2) and tuple(advantages.shape) in (
        (hidden.shape[0],), (hidden.shape[0], 1)
    ) and hidden.shape[1] != 1:
        return advantages.reshape(-1, 1).expand(hidden.shape[0], hidden.shape[1])
    return advantages


def reference_linear_policy_loss(hidden, lm_head_weight, target_ids, advantages, old_logprobs, mask=None,
                                 ref_logprobs=None, cfg: PolicyLossConfig | None = None, normalizer=None):
    """The gold of the fused loss: (loss, metrics), fp32 (float64 stays float64), TF32 off, autograd."""
    from rl_engine.kernels.ops.pytorch.base import tf32_off

    cfg = cfg or PolicyLossConfig()
    advantages = expand_advantages(advantages, hidden)
    if mask is None:
        mask = torch.ones(hidden.shape[:-1], device=hidden.device)
    validate_policy_inputs(hidden, lm_head_weight, target_ids, advantages, old_logprobs, mask, ref_logprobs, cfg)
    dtype = torch.float64 if hidden.dtype == torch.float64 else torch.float32

    def up(t):
        return None if t is None else t.to(dtype)

    with tf32_off():
        logits = up(hidden) @ up(lm_head_weight).t()
        return policy_loss_from_logits(logits, target_ids, up(advantages), up(old_logprobs), up(mask),
                                       up(ref_logprobs), cfg, normalizer)


# The variant the operator harness judges: DAPO-style asymmetric clip, dual clip, k3 KL to a
# reference, an entropy bonus and a sampling temperature, all at once.
HARNESS_CONFIG = PolicyLossConfig(policy_loss="ppo", clip_ratio_low=0.2, clip_ratio_high=0.28, kl_coef=0.1,
                                  entropy_coef=0.01, temperature=0.9)


class NativeLinearPolicyLossOp(NativeOp):
    """The harness's view of the fused loss: the masked per-token loss m_t l_t [B,T] (before aggregation).

    The aggregation is linear in these terms, so judging them judges every aggregation mode; per-token
    outputs let the harness compare each sequence run alone with the same row of a batch.
    """

    input_names = ("hidden", "lm_head_weight", "target_ids", "advantages", "old_logprobs", "ref_logprobs", "mask")

    def __init__(self, cfg: PolicyLossConfig = HARNESS_CONFIG):
        self.cfg = cfg

    def validate(self, *, hidden, lm_head_weight, target_ids, advantages, old_logprobs, ref_logprobs, mask):
        expect_rank("hidden", hidden, 3, "[B,T,H]")
        validate_policy_inputs(hidden, lm_head_weight, target_ids, advantages, old_logprobs, mask, ref_logprobs,
                               self.cfg)
        expect_ids_in_range("target_ids", target_ids, lm_head_weight.shape[0], "vocabulary size V")

    def forward(self, *, hidden, lm_head_weight, target_ids, advantages, old_logprobs, ref_logprobs, mask):
        logp, entropy = token_stats(hidden @ lm_head_weight.t(), target_ids, self.cfg.temperature)
        terms = token_terms(logp, entropy, old_logprobs, ref_logprobs, advantages, mask, self.cfg)
        return terms["loss"] * mask.to(logp.dtype)
