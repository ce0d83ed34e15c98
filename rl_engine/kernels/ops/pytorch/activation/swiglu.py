"""SwiGLU: silu(gate) * up."""

from __future__ import annotations

import torch

from rl_engine.kernels.ops.pytorch.base import NativeOp, expect_float, expect_rank, expect_shape


class NativeSwigluOp(NativeOp):
    input_names = ("gate", "up")

    def validate(self, *, gate, up):
        expect_rank("gate", gate, 3, "[B,S,I]")
        expect_shape("up", up, tuple(gate.shape), "[B,S,I] (the shape of gate)")
        expect_float("gate", gate, "[B,S,I]")
        expect_float("up", up, "[B,S,I]")

    def forward(self, *, gate, up):
        return gate * torch.sigmoid(gate) * up

    def baseline(self, *, gate, up):
        """F.silu(gate) * up in the inputs' dtype, as transformers' gated MLP computes it."""
        self.validate(gate=gate, up=up)
        return torch.nn.functional.silu(gate) * up
