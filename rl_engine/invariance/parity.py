"""Train/infer parity aggregates over active tokens (DESIGN.md, "Parity aggregates").

delta = logp_train - logp_infer (fp32), r = exp(delta) the importance ratio:
max_abs_dlogp = max|delta|, mean_abs_dlogp = mean|delta|, k3_kl = mean(r - 1 - delta),
clipfrac = mean(r outside [0.8, 1.2]). An empty active set or a non-finite value fails.
"""

from __future__ import annotations

import torch

AGGREGATES = ("max_abs_dlogp", "mean_abs_dlogp", "k3_kl", "clipfrac")
CLIP_LOW, CLIP_HIGH = 0.8, 1.2


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
    return train.float() - infer.float()


def parity_aggregates(train: torch.Tensor, infer: torch.Tensor) -> dict:
    delta = dlogp(train, infer).double()
    ratio = torch.exp(delta)
    return {
        "max_abs_dlogp": float(delta.abs().max()),
        "mean_abs_dlogp": float(delta.abs().mean()),
        "k3_kl": float((ratio - 1 - delta).mean()),
        "clipfrac": float(((ratio < CLIP_LOW) | (ratio > CLIP_HIGH)).double().mean()),
        "tokens": int(delta.numel()),
    }


def bitwise_parity(aggregates: dict) -> bool:
    """The goal for the Triton profile: all four aggregates exactly 0."""
    return all(aggregates[k] == 0.0 for k in AGGREGATES)
