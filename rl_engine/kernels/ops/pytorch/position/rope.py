"""Rotary position embedding, Qwen3 / Hugging Face rotate-half convention.

inv_freq[j] = theta^(-2j/D) for j < D/2; angle = position * inv_freq, repeated twice along D;
out = x * cos + rotate_half(x) * sin, rotate_half(x) = cat(-x[D/2:], x[:D/2]).
The angles are computed in fp32 from integer positions, whatever the dtype of x (as HF does).
A scaled RoPE (Llama 3) passes its own fp32 table `inv_freq` [D/2], which replaces theta^(-2j/D).
"""

from __future__ import annotations

import torch

from rl_engine.kernels.ops.pytorch.base import NativeOp, expect_float, expect_rank, expect_shape


def rope_cos_sin(positions: torch.Tensor, head_dim: int, theta: float,
                 inv_freq: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin of shape [*positions.shape, head_dim], fp32."""
    if inv_freq is None:
        inv_freq = 1.0 / (
            theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64, device=positions.device).float() / head_dim)
        )
    angles = positions.float().unsqueeze(-1) * inv_freq
    emb = torch.cat((angles, angles), dim=-1)
    return emb.cos(), emb.sin()


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


class NativeRopeOp(NativeOp):
    input_names = ("x", "positions")

    def __init__(self, theta: float = 1e6, inv_freq: torch.Tensor | None = None):
        self.theta = theta
        self.inv_freq = inv_freq

    def validate(self, *, x, positions):
        expect_rank("x", x, 4, "[B,S,Hh,D]")
        expect_float("x", x, "[B,S,Hh,D]")
        b, s, _, d = x.shape
        if d % 2:
            raise ValueError(f"x: expected an even head dim D in [B,S,Hh,D], got D={d}")
        expect_shape("positions", positions, (b, s), "[B,S]")
        if positions.is_floating_point():
            raise ValueError(f"positions: expected integer positions [B,S], got dtype {positions.dtype}")
        if self.inv_freq is not None:
            expect_shape("inv_freq", self.inv_freq, (d // 2,), "[D/2]")
            if self.inv_freq.dtype != torch.float32 or self.inv_freq.device != x.device:
                raise ValueError(f"inv_freq: expected fp32 on {x.device}, got {self.inv_freq.dtype} on "
                                 f"{self.inv_freq.device}")

    def forward(self, *, x, positions):
        cos, sin = rope_cos_sin(positions, x.shape[-1], self.theta, self.inv_freq)
        cos, sin = cos.unsqueeze(2).to(x.dtype), sin.unsqueeze(2).to(x.dtype)
        return x * cos + rotate_half(x) * sin
