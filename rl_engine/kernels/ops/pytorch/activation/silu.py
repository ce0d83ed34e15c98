"""SiLU: x * sigmoid(x)."""

from __future__ import annotations

import torch

from rl_engine.kernels.ops.pytorch.base import NativeOp, expect_float, expect_rank


class NativeSiluOp(NativeOp):
    input_names = ("x",)

    def validate(self, *, x):
        expect_rank("x", x, 3, "[B,S,I]")
        expect_float("x", x, "[B,S,I]")

    def forward(self, *, x):
        return x * torch.sigmoid(x)

    def baseline(self, *, x):
        self.validate(x=x)
        return torch.nn.functional.silu(x)
