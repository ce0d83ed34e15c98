"""Fused lm_head + RL policy losses: the user-facing entry points over the loss ops.

`linear_policy_loss` takes the last hidden states and the lm_head weight instead of logits, so the
[tokens, V] logits are never materialised (Triton), or computes the gold with materialised logits
(`backend="pytorch"`). Formulas: rl_engine/kernels/ops/pytorch/loss/linear_policy_loss.py.
"""

from __future__ import annotations

import torch

from rl_engine.kernels.ops.pytorch.loss.linear_policy_loss import (
    LOSS_AGG_MODES,
    POLICY_LOSSES,
    PolicyLossConfig,
    reference_linear_policy_loss,
)

BACKENDS = ("triton", "pytorch")


def linear_policy_loss(hidden: torch.Tensor, lm_head_weight: torch.Tensor, target_ids: torch.Tensor,
                       advantages: torch.Tensor, old_logprobs: torch.Tensor, mask: torch.Tensor | None = None,
                       ref_logprobs: torch.Tensor | None = None, *, policy_loss: str = "ppo",
                       clip_ratio_low: float = 0.2, clip_ratio_high: float | None = None, clip_ratio_c: float = 3.0,
                       loss_agg_mode: str | None = None, kl_coef: float = 0.0, entropy_coef: float = 0.0,
                       temperature: float = 1.0, compute_entropy: bool = False,
                       normalizer: float | torch.Tensor | None = None, backend: str = "triton",
                       main_grad: torch.Tensor | None = None) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """(loss, metrics) of a GRPO/PPO/DAPO/GSPO policy loss on hidden [N,H] or [B,T,H] @ lm_head_weight [V,H]^T.

    policy_loss: "ppo" (token ratio, clip [1 - clip_ratio_low, 1 + clip_ratio_high], dual clip
    clip_ratio_c for negative advantages) or "gspo" (sequence ratio). loss_agg_mode: "token-mean",
    "seq-mean-token-mean" or "seq-mean-token-sum" (default: token-mean for ppo, seq-mean-token-mean
    for gspo); sequence variants need [B,T,H]. kl_coef: k3 KL to `ref_logprobs`. entropy_coef: the
    entropy bonus (compute_entropy: the metric alone). temperature: logits / temperature, as sampled.
    normalizer: the aggregation's divisor (default: this batch's active tokens, or sequences); fix it
    across micro-batches to make per-token gradients independent of the split.
    metrics: pg_clipfrac, pg_clipfrac_lower (ppo), ppo_kl, k3_kl, kl_loss (with a reference),
    entropy (when computed): means over active tokens.

    Bad values, both backends, any token (masked or not): a target id outside [0, V) is an error (on a
    CPU a ValueError naming target_ids; on a GPU the PyTorch backend's gather asserts on the device, and
    the Triton backend, which reads nothing back to the host, makes that token's logp NaN, so the loss,
    its gradients and the metrics are NaN). A NaN or ±inf old or reference logprob (or logp) makes the
    loss and its gradients NaN, never a clamped finite number. kl_coef, entropy_coef and temperature
    must be finite (ValueError), a number `normalizer` finite and > 0.

    Weight-gradient modes, with the same loss, logp and metric bits: lean (the default, 4 GEMMs of work),
    the gradient in lm_head_weight's dtype; fp32 main-grad (3 GEMMs), when `main_grad` (a contiguous fp32
    [V,H] tensor on the weight's device) is given or the weight carries `.main_grad` (Megatron), and the
    weight needs a gradient: dL/dW is added into it (main_grad += dW, fp32, token chunks in a fixed order)
    and lm_head_weight gets no .grad. The Triton backend adds it during the forward, for an upstream of 1
    (`loss.backward()`, or the loss entering a sum with coefficient 1); backward adds (g - 1) dW for
    another upstream g, with a second pass. So one backward per forward: a loss that is never
    backpropagated, or recomputed by activation checkpointing, has still added its dW. GSPO runs 4 GEMMs
    in this mode too (its sequence ratio needs every logp first). The "pytorch" backend adds the gold's
    gradient in backward. docs/kernels.md compares the modes (work, memory).
    """
    cfg = PolicyLossConfig(policy_loss=policy_loss, clip_ratio_low=clip_ratio_low,
                           clip_ratio_high=clip_ratio_low if clip_ratio_high is None else clip_ratio_high,
                           clip_ratio_c=clip_ratio_c, loss_agg_mode=loss_agg_mode, kl_coef=kl_coef,
                           entropy_coef=entropy_coef, temperature=temperature, compute_entropy=compute_entropy)
    if backend not in BACKENDS:
        raise ValueError(f"backend: expected one of {BACKENDS}, got {backend!r}")
    main_grad = _main_grad(lm_head_weight, main_grad)
    if backend == "pytorch":
        if main_grad is not None and torch.is_grad_enabled() and lm_head_weight.requires_grad:
            lm_head_weight = _into_main_grad(lm_head_weight, main_grad)
        args = (hidden, lm_head_weight, target_ids, advantages, old_logprobs, mask, ref_logprobs)
        return reference_linear_policy_loss(*args, cfg=cfg, normalizer=normalizer)
    from rl_engine.kernels.ops.triton.loss.linear_policy_loss import linear_policy_loss as fused

    args = (hidden, lm_head_weight, target_ids, advantages, old_logprobs, mask, ref_logprobs)
    return fused(*args, cfg=cfg, normalizer=normalizer, main_grad=main_grad)


def _main_grad(weight: torch.Tensor, main_grad: torch.Tensor | None) -> torch.Tensor | None:
    """The fp32 buffer of the main-grad mode: `main_grad`, else the weight's `.main_grad`, else None."""
    if main_grad is None:
        main_grad = getattr(weight, "main_grad", None)
    if main_grad is None:
        return None
    want = tuple(weight.shape)
    if not (isinstance(main_grad, torch.Tensor) and main_grad.dtype == torch.float32
            and tuple(main_grad.shape) == want and main_grad.device == weight.device and main_grad.is_contiguous()):
        got = (f"{main_grad.dtype} {tuple(main_grad.shape)} on {main_grad.device}"
               f"{'' if main_grad.is_contiguous() else ', not contiguous'}"
               if isinstance(main_grad, torch.Tensor) else type(main_grad).__name__)
        raise ValueError(f"main_grad: expected a contiguous torch.float32 {want} on {weight.device}, got {got}")
    return main_grad


def _into_main_grad(weight: torch.Tensor, main_grad: torch.Tensor) -> torch.Tensor:
    """The gold's main-grad mode: an fp32 copy of the weight whose gradient is added into main_grad."""
    w32 = weight.detach().float().requires_grad_(True)

    def add(grad):
        main_grad.add_(grad)

    w32.register_hook(add)
    return w32


__all__ = ["BACKENDS", "LOSS_AGG_MODES", "POLICY_LOSSES", "PolicyLossConfig", "linear_policy_loss"]
