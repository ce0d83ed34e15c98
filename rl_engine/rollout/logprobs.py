"""The logprobs a rollout records, computed by the very functions the trainer uses on the same hidden rows.

- raw (T = 1): `DecoderModel.selected_logprobs`, the `linear_logp` op of the model's profile; the
  trainer's teacher-forced recompute (packed forward + selected_logprobs) gives the same bits when the
  ops are batch invariant (triton_bf16).
- at the sampling temperature T: log_softmax(z / T)[target], z = hidden @ W^T, computed as the fused
  policy loss (rl_engine.losses) computes it, because that loss is where the trainer uses these
  numbers: the Triton loss forms z = acc · (1/T) on the fp32 GEMM accumulator inside its statistics
  pass; the PyTorch loss upcasts hidden and W to fp32 and divides the logits by T. `linear_logp` has
  no temperature and its kernels are not changed here. The alternatives change bits: scaling the hidden
  rows by 1/T rounds them to bf16 (a different GEMM input than the trainer's), and dividing bf16 logits
  by T rounds the logits the fused loss never materialises. So the rollout calls the loss's own
  per-token logprob: with old_logprobs = these values, the loss's ratio is exactly 1 on policy.
  (At T = 1 it is still the loss's value, which may differ from `linear_logp`'s by an ulp: the two
  kernels fold the log-sum-exp differently. Each is reproduced bit for bit by its trainer counterpart.)
The Triton path calls the loss's custom op directly (no ProfileOps record: the op is not a model node).
"""

from __future__ import annotations

import torch

from rl_engine.kernels.ops.pytorch.base import tf32_off
from rl_engine.kernels.ops.pytorch.loss.linear_policy_loss import token_stats


def loss_backend(model) -> str:
    """The rl_engine.losses backend that matches the model's profile: the Triton loss for Triton linear_logp."""
    return "triton" if model.ops.profile.backend("linear_logp") == "triton" else "pytorch"


def tempered_logprobs(model, hidden: torch.Tensor, target_ids: torch.Tensor, temperature: float) -> torch.Tensor:
    """fp32 log_softmax(hidden @ W^T / T)[target] [B,S], as rl_engine.losses.linear_policy_loss computes it."""
    weight = model.lm_head_weight
    if loss_backend(model) == "triton":
        from rl_engine.kernels.ops.triton.loss.linear_policy_loss import linear_policy_loss_op

        lead = hidden.shape[:-1]
        zeros = torch.zeros(lead, dtype=torch.float32, device=hidden.device)
        ones = torch.ones(lead, dtype=torch.float32, device=hidden.device)
        out = linear_policy_loss_op(hidden, weight, target_ids, zeros, zeros, None, ones, ones, "ppo", 0.2, 0.2, 3.0,
                                    0.0, 0.0, float(temperature), False, False, False)
        return out[1]
    dtype = torch.float64 if hidden.dtype == torch.float64 else torch.float32
    with tf32_off():
        logits = hidden.to(dtype) @ weight.to(dtype).t()
    return token_stats(logits, target_ids, temperature)[0].float()


def logits_and_raw(model, hidden: torch.Tensor):
    """(logits [n, V] for the sampler, raw(targets [n, 1]) -> fp32 [n]) for hidden [n, 1, H]. Where the profile's
    `linear_logp` is Triton one kernel reads the lm_head for both: fp32 logits, and the partials whose fold gives
    the drawn tokens `selected_logprobs`' bits (`sampling_logits`); else the lm_head op, then `selected_logprobs`."""
    if loss_backend(model) == "triton":
        from rl_engine.kernels.ops.triton.loss.linear_logp import logp_of_drawn, sampling_logits

        logits, parts = sampling_logits(hidden[:, 0], model.lm_head_weight)
        return logits, lambda targets: logp_of_drawn(logits, parts, targets[:, 0])
    return model.logits(hidden)[:, 0], lambda targets: model.selected_logprobs(hidden, targets)[:, 0]
