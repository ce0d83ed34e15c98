"""Per-row expert product (a Mixture-of-Experts layer's GEMMs): out[b, s, :] = x[b, s, :] @ weight[e]^T
with e = expert_ids[b, s] and weight [E,N,K] stored as Hugging Face stores expert projections.

Instead of expert_ids, a caller whose rows are already grouped by expert (experts in index order) may
give counts [E], an integer tensor: the flattened rows are counts[0] rows of expert 0, then counts[1]
of expert 1, ... (expert_ids = repeat_interleave(arange(E), counts)). The MoE layer does: its kernel then
needs neither a sort nor the ids on the host.
"""

from __future__ import annotations

import torch

from rl_engine.kernels.ops.pytorch.base import NativeOp, expect_ids_in_range, expect_rank


class NativeGroupedMatmulOp(NativeOp):
    input_names = ("x", "weight", "expert_ids", "counts")

    @staticmethod
    def validate_shapes(x, weight, expert_ids, counts) -> None:
        """The checks that need no value from the device."""
        expect_rank("x", x, 3, "[B,S,K]")
        expect_rank("weight", weight, 3, "[E,N,K]")
        if weight.shape[2] != x.shape[-1]:
            raise ValueError(f"weight: expected shape [E,N,K] with K={x.shape[-1]} (from x), got {tuple(weight.shape)}")
        if (expert_ids is None) == (counts is None):
            raise ValueError("expert_ids, counts: expected exactly one of them")
        if expert_ids is not None and tuple(expert_ids.shape) != tuple(x.shape[:2]):
            raise ValueError(f"expert_ids: expected shape [B,S] = {tuple(x.shape[:2])}, got {tuple(expert_ids.shape)}")
        if counts is not None and (not isinstance(counts, torch.Tensor) or counts.is_floating_point()
                                   or tuple(counts.shape) != (weight.shape[0],)):
            raise ValueError(f"counts: expected an integer tensor [E] = [{weight.shape[0]}], got {counts!r:.80}")

    def validate(self, *, x, weight, expert_ids=None, counts=None):
        self.validate_shapes(x, weight, expert_ids, counts)
        if expert_ids is not None:
            expect_ids_in_range("expert_ids", expert_ids, weight.shape[0], "[B,S] of experts")
        elif int(counts.min()) < 0 or int(counts.sum()) != x.shape[0] * x.shape[1]:
            raise ValueError(f"counts: expected non-negative counts summing to B*S = {x.shape[0] * x.shape[1]}, "
                             f"got {counts.tolist()}")

    def forward(self, *, x, weight, expert_ids=None, counts=None):
        if expert_ids is None:
            experts = torch.arange(weight.shape[0], device=x.device)
            expert_ids = torch.repeat_interleave(experts, counts.to(x.device)).view(x.shape[:2])
        # What a MoE layer written in plain PyTorch does: each expert's rows through its own weight.
        out = x.new_zeros(*x.shape[:2], weight.shape[1])
        for e in torch.unique(expert_ids).tolist():
            rows = expert_ids == e
            out[rows] = x[rows] @ weight[e].t()
        return out
