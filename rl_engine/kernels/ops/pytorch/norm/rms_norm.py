"""RMSNorm: y = x / sqrt(mean(x^2) + eps) * weight (eps inside the root, as Qwen3 and Llama)."""

from __future__ import annotations

import torch

from rl_engine.kernels.ops.pytorch.base import NativeOp, expect_float, expect_rank, expect_shape


class NativeRmsNormOp(NativeOp):
    """x [B,S,H], weight [H]; or, with `split`, two projections' heads stacked: x [B,S,Hh,D], weight [2,D], heads
    [0, split) normed by weight[0] and the rest by weight[1] (q's and k's norms in one call)."""

    input_names = ("x", "weight")

    def __init__(self, eps: float = 1e-6, split: int | None = None):
        self.eps = eps
        self.split = split

    def validate(self, *, x, weight):
        if self.split is None:
            expect_rank("x", x, 3, "[B,S,H]")
            expect_shape("weight", weight, (x.shape[-1],), "[H]")
        else:
            expect_rank("x", x, 4, "[B,S,Hh,D]")
            expect_shape("weight", weight, (2, x.shape[-1]), "[2,D]")
            if not 0 < self.split < x.shape[2]:
                raise ValueError(f"split: expected 0 < split < Hh = {x.shape[2]}, got {self.split}")
        expect_float("x", x, "[B,S,H]")
        expect_float("weight", weight, "[H]")

    def forward(self, *, x, weight):
        if self.split is not None:
            heads = torch.arange(x.shape[2], device=x.device) >= self.split
            weight = weight[heads.long()]  # [Hh, D]: each head's row
        return x * torch.rsqrt(x.pow(2).mean(dim=-1, keepdim=True) + self.eps) * weight

    def baseline(self, *, x, weight):
        """torch's fused RMSNorm in the inputs' dtype, as transformers and users call it."""
        self.validate(x=x, weight=weight)
        if self.split is not None:
            return torch.cat([torch.nn.functional.rms_norm(part, (x.shape[-1],), w, self.eps)
                              for part, w in zip(x.split([self.split, x.shape[2] - self.split], dim=2), weight)], 2)
        return torch.nn.functional.rms_norm(x, (x.shape[-1],), weight, self.eps)
