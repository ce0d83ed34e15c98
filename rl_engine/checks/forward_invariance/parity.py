"""Train/infer parity aggregates over active tokens (DESIGN.md, "Parity aggregates").

delta = logp_train - logp_infer (fp32), r = exp(delta) the importance ratio:
max_abs_dlogp = max|delta|, mean_abs_dlogp = mean|delta|, k3_kl = mean(r - 1 - delta),
clipfrac = mean(r outside [0.8, 1.2]). An empty active set or a non-finite value fails: that is the
harness's judgment; the formulas are rl_engine.metrics' (one definition, shared with the trainer metrics).
"""

from __future__ import annotations

import torch

from rl_engine import metrics

AGGREGATES = ("max_abs_dlogp", "mean_abs_dlogp", "k3_kl", "clipfrac")
CLIP_LOW, CLIP_HIGH = metrics.CLIP_LOW, metrics.CLIP_HIGH


class ParityError(ValueError):
    """Inputs the aggregates cannot judge: shape mismatch, no active token, NaN or Inf."""


def dlogp(train: torch.Tensor, infer: torch.Tensor) -> torch.Tensor:
    """Δ = train − infer, in fp32, on 1-D tensors of the same active tokens in the same order."""
    if train.shape != infer.shape or train.dim() != 1:
        raise ParityError(f"train {tuple(train.shape)} and infer {tuple(infer.shape)}: expected equal 1-D shapes")
    if train.numel() == 0:
        raise ParityError("no active tokens")
    if not (torch.isfinite(train).all() and torch.isfinite(infer).all()):
        raise ParityError("non-finite logprob among the active tokens")
    return metrics.log_ratio(train, infer).float()


def parity_aggregates(train: torch.Tensor, infer: torch.Tensor) -> dict:
    delta = dlogp(train, infer).double()
    active = torch.ones_like(delta, dtype=torch.bool)
    return {
        "max_abs_dlogp": float(metrics.max_abs_dlogp(delta, active)),
        "mean_abs_dlogp": float(metrics.mean_abs_dlogp(delta, active)),
        "k3_kl": float(metrics.k3_kl(delta, active)),
        "clipfrac": float(metrics.clipfrac(delta, active, CLIP_LOW, CLIP_HIGH)),
        "tokens": int(delta.numel()),
    }


def bitwise_parity(aggregates: dict) -> bool:
    """The goal for the Triton profile: all four aggregates exactly 0."""
    return all(aggregates[k] == 0.0 for k in AGGREGATES)
