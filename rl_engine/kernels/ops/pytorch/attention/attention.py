"""Causal grouped-query attention over [B,S,H,D] tensors, written out (no fused SDPA) as the gold.

Query head h reads key/value head h // (Hq // Hkv). Scores are q·k * scale, masked above the
diagonal when causal, softmax over keys, then weighted sum of values.
"""

from __future__ import annotations

import math

import torch

from rl_engine.kernels.ops.pytorch.base import NativeOp, expect_rank, expect_shape


def grouped_attention(q, k, v, mask, scale):
    """q [B,Sq,Hq,D], k/v [B,Sk,Hkv,D], mask [B or 1, Sq, Sk] bool (True = attend) -> [B,Sq,Hq,D]."""
    group = q.shape[2] // k.shape[2]
    k = k.repeat_interleave(group, dim=2)
    v = v.repeat_interleave(group, dim=2)
    scores = torch.einsum("bqhd,bkhd->bhqk", q, k) * scale
    scores = scores.masked_fill(~mask.unsqueeze(1), float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    # A query with no visible key (possible only in padded layouts) outputs zeros, not NaN.
    probs = torch.nan_to_num(probs, nan=0.0)
    return torch.einsum("bhqk,bkhd->bqhd", probs, v)


def check_heads(q_name: str, q, k_name: str, k) -> None:
    hq, hkv = q.shape[2], k.shape[2]
    if hkv == 0 or hq % hkv:
        raise ValueError(
            f"{k_name}: its head count Hkv={hkv} must divide the query head count Hq={hq} of {q_name}"
        )


class NativeAttentionOp(NativeOp):
    input_names = ("q", "k", "v")

    def __init__(self, causal: bool = True, scale: float | None = None):
        self.causal = causal
        self.scale = scale

    def validate(self, *, q, k, v):
        expect_rank("q", q, 4, "[B,S,Hq,D]")
        b, s, _, d = q.shape
        expect_rank("k", k, 4, "[B,S,Hkv,D]")
        expect_shape("k", k, (b, s, k.shape[2], d), "[B,S,Hkv,D]")
        expect_shape("v", v, tuple(k.shape), "[B,S,Hkv,D]")
        check_heads("q", q, "k", k)

    def forward(self, *, q, k, v):
        s, d = q.shape[1], q.shape[3]
        scale = self.scale if self.scale is not None else 1.0 / math.sqrt(d)
        mask = torch.ones(s, s, dtype=torch.bool, device=q.device)
        if self.causal:
            mask = torch.tril(mask)
        return grouped_attention(q, k, v, mask.unsqueeze(0), scale)
