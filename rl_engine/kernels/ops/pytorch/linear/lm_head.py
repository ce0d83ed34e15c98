"""Language-model head: logits = hidden @ weight^T."""

from __future__ import annotations

from rl_engine.kernels.ops.pytorch.base import NativeOp, expect_rank


class NativeLmHeadOp(NativeOp):
    input_names = ("hidden", "weight")

    def validate(self, *, hidden, weight):
        expect_rank("hidden", hidden, 3, "[B,S,H]")
        expect_rank("weight", weight, 2, "[V,H]")
        if weight.shape[1] != hidden.shape[-1]:
            raise ValueError(f"weight: expected shape [V,H] with H={hidden.shape[-1]}, got {tuple(weight.shape)}")

    def forward(self, *, hidden, weight):
        return hidden @ weight.t()
