"""Per-step trainer metrics between trainer and rollout logprobs (verl's ``rollout_corr/*``).

Names and formulas follow verl ``verl/trainer/ppo/rollout_corr_helper.py`` (``compute_offpolicy_metrics``
and ``compute_is_metrics``, volcengine/verl b178a3c); ``max_abs_dlogp``, ``mean_abs_dlogp`` and
``clipfrac`` are rl_engine's parity aggregates (DESIGN.md), computed here by the same functions the
invariance harness calls.

Notation: inputs of any shape, the last dimension is the sequence (leading dimensions are sequences).
A token is active where ``mask != 0``. Δ = logp_train − logp_rollout, formed in fp32 as DESIGN.md
defines it (bit-equal logprobs give exactly 0); every later step is fp64 (k3 = r − 1 − Δ cancels
catastrophically in fp32 for |Δ| ≲ 1e-3). r = exp(Δ). E_tok = mean over active tokens; per sequence s,
m_s(x) = mean of x over its active tokens; E_seq = mean over sequences with at least one active token.
C(x) = clamp(x, −20, 20) (verl's SAFETY_BOUND); τ = ``is_threshold`` (verl default 2.0).

Off-policy diagnostics (verl ``compute_offpolicy_metrics``):
  training_ppl = E_seq[exp(−m_s(logp_train))]     training_log_ppl = E_seq[−m_s(logp_train)]
  rollout_ppl  = E_seq[exp(−m_s(logp_rollout))]   rollout_log_ppl  = E_seq[−m_s(logp_rollout)]
  kl = E_tok[logp_rollout − logp_train] = −E_tok[Δ]          k3_kl = E_tok[r − 1 − Δ]
  d_s = m_s(logp_rollout) − m_s(logp_train): log_ppl_diff = E_seq[d_s], log_ppl_abs_diff = E_seq[|d_s|],
  log_ppl_diff_max = max_s d_s, log_ppl_diff_min = min_s d_s, ppl_ratio = E_seq[exp(d_s)]
  chi2_token = E_tok[exp(2·C(Δ))] − 1             chi2_seq = E_seq[exp(2·C(Σ_s Δ))] − 1
Parity aggregates (DESIGN.md): max_abs_dlogp = max|Δ|, mean_abs_dlogp = E_tok|Δ|,
  clipfrac = E_tok[r ∉ [clip_low, clip_high]] (default [0.8, 1.2]).
Importance-sampling weights (verl ``compute_is_metrics``), level ``is_level``:
  "token":    w_t = exp(C(Δ_t));   "sequence": w_t = exp(C(Σ_s Δ)) for every token of sequence s.
  rollout_is_mean = E_tok[w]; rollout_is_max / _min = max / min over active tokens (sequence level:
  exp(min(max_s Σ_s Δ, 20)) and exp(min_s Σ_s Δ), unclamped below as in verl);
  rollout_is_ratio_fraction_high / _low = E_tok[w > τ] / E_tok[w < 1/τ] (sequence level:
  E_seq[Σ_s Δ > log τ] / E_seq[Σ_s Δ < log(1/τ)]);
  with w̃ = clamp(w, 1/τ, τ): rollout_is_std = sqrt(max(E_tok[w̃²] − E_tok[w̃]², 0)) (0 for one token),
  rollout_is_eff_sample_size = 1 / E_tok[(w̃ / (E_tok[w̃] + 1e-8))²];
  with u_s = m_s(w): rollout_is_seq_mean = E_seq[u], _seq_std = unbiased std of u (0 for one sequence),
  _seq_max / _seq_min = max / min u, _seq_max_deviation = max|u − 1|,
  _seq_fraction_high / _low = E_seq[u > τ] / E_seq[u < 1/τ].
Every key carries the ``rollout_corr/`` prefix.

Where this departs from verl, on purpose (verl's helpers are called once per batch, after host checks):
- No host sync: every value is a 0-dim fp64 tensor on the input's device; nothing branches on data.
- An empty mask makes every metric NaN (verl asserts, or divides by 1e-8 and reports 0).
- A NaN or ±inf logprob in an active token makes every metric NaN (verl's clamp would turn an infinite
  Δ into a finite chi2, and a comparison would count a NaN as inside the bounds). Masked tokens never
  matter, whatever they hold.
- Sequences with no active token are left out of E_seq and the sequence max/min (verl's masked mean of
  an empty row is 0, which counts a phantom perplexity of 1 and a chi2 of 0).
- The mask is a set: any non-zero entry is an active token, with weight 1 (verl multiplies by the
  mask; the two agree for 0/1 masks). A NaN entry is neither: it makes every metric NaN (and its
  token's truncated IS weight NaN), never a counted token.
"""

from __future__ import annotations

import math

import torch

PREFIX = "rollout_corr/"
SAFETY_BOUND = 20.0  # verl: exp(±20) keeps weights finite
CLIP_LOW, CLIP_HIGH = 0.8, 1.2  # the parity clip range (DESIGN.md)
IS_THRESHOLD = 2.0  # verl's rollout_is_threshold default
IS_LEVELS = ("token", "sequence")


# One definition per formula: the invariance harness (checks/forward_invariance/parity.py) calls these too.
def masked_mean(x: torch.Tensor, active: torch.Tensor, dim=None) -> torch.Tensor:
    """Mean of x over active entries; NaN where none is active (0/0). Inactive NaNs never leak."""
    total = torch.where(active, x, 0).sum(dim=dim)
    return total / active.sum(dim=dim)


def masked_max(x: torch.Tensor, active: torch.Tensor, dim=None) -> torch.Tensor:
    """Max of x over active entries (-inf where none is active; callers guard emptiness)."""
    filled = torch.where(active, x, -math.inf)
    return filled.amax() if dim is None else filled.amax(dim=dim)


def masked_min(x: torch.Tensor, active: torch.Tensor, dim=None) -> torch.Tensor:
    return -masked_max(-x, active, dim)


def log_ratio(train: torch.Tensor, rollout: torch.Tensor) -> torch.Tensor:
    """Δ = train − rollout in fp32 (exactly 0 where the logprobs are bit-equal), returned as fp64."""
    return (train.float() - rollout.float()).double()


def max_abs_dlogp(delta: torch.Tensor, active: torch.Tensor) -> torch.Tensor:
    return masked_max(delta.abs(), active)


def mean_abs_dlogp(delta: torch.Tensor, active: torch.Tensor) -> torch.Tensor:
    return masked_mean(delta.abs(), active)


def k3_kl(delta: torch.Tensor, active: torch.Tensor) -> torch.Tensor:
    """E[r − 1 − Δ]; (r − 1) first, which is exact for r in [0.5, 2] (Sterbenz)."""
    return masked_mean(torch.exp(delta) - 1 - delta, active)


def clipfrac(delta: torch.Tensor, active: torch.Tensor, low: float = CLIP_LOW, high: float = CLIP_HIGH) -> torch.Tensor:
    ratio = torch.exp(delta)
    return masked_mean(((ratio < low) | (ratio > high)).double(), active)


def _nan_unless(active: torch.Tensor, *values: torch.Tensor) -> torch.Tensor:
    """0 when some token is active and every active value is finite, NaN otherwise (0·inf = NaN)."""
    poison = sum(torch.where(active, v * 0, 0).sum() for v in values)
    return torch.where(active.any(), poison, math.nan)


def _isnan(mask: torch.Tensor) -> torch.Tensor:
    return torch.isnan(mask) if mask.is_floating_point() else torch.zeros_like(mask, dtype=torch.bool)


def _flatten(t: torch.Tensor) -> torch.Tensor:
    return t.reshape(-1, t.shape[-1]) if t.dim() else t.reshape(1, 1)


def truncated_is_weights(
    train_logprobs: torch.Tensor,
    rollout_logprobs: torch.Tensor,
    mask: torch.Tensor,
    *,
    is_level: str = "token",
    is_threshold: float = IS_THRESHOLD,
) -> torch.Tensor:
    """Truncated importance weights min(w, τ) · [active], w as in the module docstring; fp64, detached.

    verl ``compute_rollout_correction_weights`` without batch normalisation. Shape of the inputs.
    """
    _check(train_logprobs, rollout_logprobs, mask, is_level, is_threshold)
    flat_mask = _flatten(mask)
    active = (flat_mask != 0) & ~_isnan(flat_mask)
    w = _is_weights(log_ratio(_flatten(train_logprobs.detach()), _flatten(rollout_logprobs.detach())), active, is_level)
    w = torch.where(active, w.clamp(max=is_threshold), 0)
    return torch.where(_isnan(flat_mask), math.nan, w).reshape(train_logprobs.shape)


def _is_weights(delta: torch.Tensor, active: torch.Tensor, is_level: str) -> torch.Tensor:
    if is_level == "token":
        return torch.exp(delta.clamp(-SAFETY_BOUND, SAFETY_BOUND))
    seq_sum = torch.where(active, delta, 0).sum(dim=-1, keepdim=True)
    return torch.exp(seq_sum.clamp(-SAFETY_BOUND, SAFETY_BOUND)).expand_as(delta)


def _check(train, rollout, mask, is_level, is_threshold):
    # Shapes and options are static: checking them costs no sync.
    if train.shape != rollout.shape or train.shape != mask.shape:
        raise ValueError(
            f"train {tuple(train.shape)}, rollout {tuple(rollout.shape)} and mask {tuple(mask.shape)}: "
            "expected one shape"
        )
    if is_level not in IS_LEVELS:
        raise ValueError(f"is_level {is_level!r}: expected one of {', '.join(IS_LEVELS)}")
    if not is_threshold > 1:
        raise ValueError(f"is_threshold {is_threshold}: expected > 1 (the lower bound is 1/is_threshold)")


def rollout_corr_metrics(
    train_logprobs: torch.Tensor,
    rollout_logprobs: torch.Tensor,
    mask: torch.Tensor,
    *,
    clip_low: float = CLIP_LOW,
    clip_high: float = CLIP_HIGH,
    is_level: str = "token",
    is_threshold: float = IS_THRESHOLD,
) -> dict[str, torch.Tensor]:
    """Trainer-vs-rollout metrics of one step: ``{"rollout_corr/<name>": 0-dim fp64 tensor}``.

    Formulas, and where they depart from verl, in the module docstring. No host sync, no raise on data:
    an empty mask or a non-finite active logprob gives NaN metrics. Bad shapes or options raise ValueError.
    """
    _check(train_logprobs, rollout_logprobs, mask, is_level, is_threshold)
    if not clip_low < clip_high:
        raise ValueError(f"clip range [{clip_low}, {clip_high}]: expected clip_low < clip_high")
    train = _flatten(train_logprobs.detach()).float().double()
    rollout = _flatten(rollout_logprobs.detach()).float().double()
    flat_mask = _flatten(mask)
    active = (flat_mask != 0) & ~_isnan(flat_mask)
    delta = log_ratio(train, rollout)
    # a NaN mask entry is no token, active or not: every metric NaN
    guard = _nan_unless(active, train, rollout) + torch.where(_isnan(flat_mask).any(), math.nan, 0.0)

    seq_active = active.any(dim=-1)
    seq_mean_train = masked_mean(train, active, dim=-1)
    seq_mean_rollout = masked_mean(rollout, active, dim=-1)
    seq_diff = seq_mean_rollout - seq_mean_train
    seq_sum = torch.where(active, delta, 0).sum(dim=-1)

    def e_seq(x):
        return masked_mean(x, seq_active)

    m = {
        "training_ppl": e_seq(torch.exp(-seq_mean_train)),
        "training_log_ppl": e_seq(-seq_mean_train),
        "kl": masked_mean(rollout - train, active),
        "k3_kl": k3_kl(delta, active),
        "rollout_ppl": e_seq(torch.exp(-seq_mean_rollout)),
        "rollout_log_ppl": e_seq(-seq_mean_rollout),
        "log_ppl_diff": e_seq(seq_diff),
        "log_ppl_abs_diff": e_seq(seq_diff.abs()),
        "log_ppl_diff_max": masked_max(seq_diff, seq_active),
        "log_ppl_diff_min": masked_min(seq_diff, seq_active),
        "ppl_ratio": e_seq(torch.exp(seq_diff)),
        "chi2_token": masked_mean(torch.exp(2 * delta.clamp(-SAFETY_BOUND, SAFETY_BOUND)), active) - 1,
        "chi2_seq": e_seq(torch.exp(2 * seq_sum.clamp(-SAFETY_BOUND, SAFETY_BOUND))) - 1,
        "max_abs_dlogp": max_abs_dlogp(delta, active),
        "mean_abs_dlogp": mean_abs_dlogp(delta, active),
        "clipfrac": clipfrac(delta, active, clip_low, clip_high),
    }

    high, low = is_threshold, 1.0 / is_threshold
    w = _is_weights(delta, active, is_level)
    m["rollout_is_mean"] = masked_mean(w, active)
    if is_level == "token":
        m["rollout_is_max"] = masked_max(w, active)
        m["rollout_is_min"] = masked_min(w, active)
        m["rollout_is_ratio_fraction_high"] = masked_mean((w > high).double(), active)
        m["rollout_is_ratio_fraction_low"] = masked_mean((w < low).double(), active)
    else:
        m["rollout_is_max"] = torch.exp(masked_max(seq_sum, seq_active).clamp(max=SAFETY_BOUND))
        m["rollout_is_min"] = torch.exp(masked_min(seq_sum, seq_active))
        m["rollout_is_ratio_fraction_high"] = e_seq((seq_sum > math.log(high)).double())
        m["rollout_is_ratio_fraction_low"] = e_seq((seq_sum < math.log(low)).double())
    w_clamped = w.clamp(low, high)
    mean_clamped = masked_mean(w_clamped, active)
    var = masked_mean(w_clamped.square(), active) - mean_clamped.square()
    m["rollout_is_std"] = torch.where(active.sum() > 1, var.clamp(min=0).sqrt(), 0)
    m["rollout_is_eff_sample_size"] = 1 / masked_mean((w_clamped / (mean_clamped + 1e-8)).square(), active)

    u = masked_mean(w, active, dim=-1)
    n_seq = seq_active.sum()
    u_mean = e_seq(u)
    u_var = torch.where(seq_active, (u - u_mean).square(), 0).sum() / (n_seq - 1)
    m["rollout_is_seq_mean"] = u_mean
    m["rollout_is_seq_std"] = torch.where(n_seq > 1, u_var.sqrt(), 0)
    m["rollout_is_seq_max"] = masked_max(u, seq_active)
    m["rollout_is_seq_min"] = masked_min(u, seq_active)
    m["rollout_is_seq_max_deviation"] = masked_max((u - 1).abs(), seq_active)
    m["rollout_is_seq_fraction_high"] = e_seq((u > high).double())
    m["rollout_is_seq_fraction_low"] = e_seq((u < low).double())
    return {PREFIX + k: v + guard for k, v in m.items()}
