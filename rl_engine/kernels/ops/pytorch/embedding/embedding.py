"""Token embedding lookup: out[b, s, :] = weight[token_ids[b, s], :]."""

from __future__ import annotations

import torch

from rl_engine.kernels.ops.pytorch.base import NativeOp, expect_ids_in_range, expect_rank


class NativeEmbeddingOp(NativeOp):
    input_names = ("token_ids", "weight")

    def validate(self, *, token_ids, weight):
        expect_rank("token_ids", token_ids, 2, "[B,S]")
        expect_rank("weight", weight, 2, "[V,H]")
        expect_ids_in_range("token_ids", token_ids, weight.shape[0], f"vocabulary size V={weight.shape[0]}")

    def forward(self, *, token_ids, weight):
        return torch.nn.functional.embedding(token_ids.long(), weight)
