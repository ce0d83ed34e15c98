"""Causal grouped-query attention over [B,S,H,D] tensors, written out (no fused SDPA) as the gold.

Query head h reads key/value head h // (Hq // Hkv). Scores are q·k * scale, masked above the
diagonal when causal, softmax over keys, then weighted sum of values.
"""

from __future__ import annotations

import math

import torch

from rl_engine.kernels.ops.pytorch.base import NativeOp, expect_rank, expect_shape


def grouped_attention(q, k, v, mask, scale):
    """q [B,Sq,Hq,D], k/v [B,Sk,Hkv,D], mask [B or 1, Sq, Sk] bool (True = attend) -> [B,Sq,Hq,D].

    IEEE over the visible (query, key) pairs only: a NaN/inf in q row i reaches row i (and the
    gradients its pairs touch), one in k/v at key j reaches the rows that see j, nothing else. A row
    with no visible key outputs 0, decided from the mask.
    """
    group = q.shape[2] // k.shape[2]
    k = k.repeat_interleave(group, dim=2)
    v = v.repeat_interleave(group, dim=2)
    mask4 = mask.unsqueeze(1)  # [B or 1, 1, Sq, Sk]
    # Keys no query sees (a KV cache beyond its length may hold anything) are dropped before any product.
    seen = mask.any(dim=1)[:, :, None, None]
    k, v = torch.where(seen, k, 0.0), torch.where(seen, v, 0.0)
    finite = all(bool(torch.isfinite(t).all()) for t in (q, k, v))
    if finite:
        # Finite inputs: an invisible pair's weight is an exact 0 and 0·x = 0, so plain matmuls compute
        # the visible sums (and their autograd the visible gradients).
        scores = torch.einsum("bqhd,bkhd->bhqk", q, k) * scale
    else:
        # A non-finite value times the 0 of an invisible pair would be NaN: build every pair's terms
        # with both factors masked (masked in both, so autograd never multiplies 0 by NaN either).
        # Memory B·H·Sq·Sk·D: meant for the small shapes where non-finite inputs are tested.
        pair = mask4[..., None]  # [B or 1, 1, Sq, Sk, 1]
        qp = torch.where(pair, q.permute(0, 2, 1, 3)[:, :, :, None, :], 0.0)
        kp = torch.where(pair, k.permute(0, 2, 1, 3)[:, :, None, :, :], 0.0)
        scores = (qp * kp).sum(-1) * scale
    scores = scores.masked_fill(~mask4, float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    # Invisible pairs weigh exactly 0; a row with no visible key (softmax of all -inf = NaN) outputs 0.
    probs = torch.where(mask4, probs, 0.0)
    if finite:
        return torch.einsum("bhqk,bkhd->bqhd", probs, v)
    vp = torch.where(mask4[..., None], v.permute(0, 2, 1, 3)[:, :, None, :, :], 0.0)
    return (probs[..., None] * vp).sum(-2).permute(0, 2, 1, 3)


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
