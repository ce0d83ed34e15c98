"""RMSNorm: y = x / sqrt(mean(x^2) + eps) * weight (eps inside the root, as Qwen3 and Llama)."""

from __future__ import annotations

import torch

from rl_engine.kernels.ops.pytorch.base import NativeOp, expect_float, expect_rank, expect_shape


class NativeRmsNormOp(NativeOp):
    input_names = ("x", "weight")

    def __init__(self, eps: float = 1e-6):
        self.eps = eps

    def validate(self, *, x, weight):
        expect_rank("x", x, 3, "[B,S,H]")
        expect_shape("weight", weight, (x.shape[-1],), "[H]")
        expect_float("x", x, "[B,S,H]")
        expect_float("weight", weight, "[H]")

    def forward(self, *, x, weight):
        return x * torch.rsqrt(x.pow(2).mean(dim=-1, keepdim=True) + self.eps) * weight

    def baseline(self, *, x, weight):
        """torch's fused RMSNorm in the inputs' dtype, as transformers and users call it."""
        self.validate(x=x, weight=weight)
        return torch.nn.functional.rms_norm(x, (x.shape[-1],), weight, self.eps)
