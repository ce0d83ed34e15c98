"""Selected-token log-probability: logp[b, s] = logits[b, s, t] - logsumexp(logits[b, s, :])."""

from __future__ import annotations

import torch

from rl_engine.kernels.ops.pytorch.base import NativeOp, expect_ids_in_range, expect_rank, expect_shape


def selected_logprobs(logits: torch.Tensor, target_ids: torch.Tensor) -> torch.Tensor:
    lse = torch.logsumexp(logits, dim=-1)
    picked = torch.gather(logits, -1, target_ids.long().unsqueeze(-1)).squeeze(-1)
    return picked - lse


class NativeLogpOp(NativeOp):
    input_names = ("logits", "target_ids")

    def validate(self, *, logits, target_ids):
        expect_rank("logits", logits, 3, "[B,S,V]")
        b, s, v = logits.shape
        expect_shape("target_ids", target_ids, (b, s), "[B,S]")
        expect_ids_in_range("target_ids", target_ids, v, f"vocabulary size V={v}")

    def forward(self, *, logits, target_ids):
        return selected_logprobs(logits, target_ids)

    def baseline(self, *, logits, target_ids):
        """What RL trainers do today: the log-softmax after an fp32 upcast of the logits."""
        self.validate(logits=logits, target_ids=target_ids)
        return selected_logprobs(logits.float(), target_ids)
