"""Per-row expert product (a Mixture-of-Experts layer's GEMMs): out[b, s, :] = x[b, s, :] @ weight[e]^T
with e = expert_ids[b, s] and weight [E,N,K] stored as Hugging Face stores expert projections."""

from __future__ import annotations

import torch

from rl_engine.kernels.ops.pytorch.base import NativeOp, expect_ids_in_range, expect_rank


class NativeGroupedMatmulOp(NativeOp):
    input_names = ("x", "weight", "expert_ids")

    def validate(self, *, x, weight, expert_ids):
        expect_rank("x", x, 3, "[B,S,K]")
        expect_rank("weight", weight, 3, "[E,N,K]")
        if weight.shape[2] != x.shape[-1]:
            raise ValueError(f"weight: expected shape [E,N,K] with K={x.shape[-1]} (from x), got {tuple(weight.shape)}")
        if tuple(expert_ids.shape) != tuple(x.shape[:2]):
            raise ValueError(f"expert_ids: expected shape [B,S] = {tuple(x.shape[:2])}, got {tuple(expert_ids.shape)}")
        expect_ids_in_range("expert_ids", expert_ids, weight.shape[0], "[B,S] of experts")

    def forward(self, *, x, weight, expert_ids):
        # What a MoE layer written in plain PyTorch does: each expert's rows through its own weight.
        out = x.new_zeros(*x.shape[:2], weight.shape[1])
        for e in torch.unique(expert_ids).tolist():
            rows = expert_ids == e
            out[rows] = x[rows] @ weight[e].t()
        return out
