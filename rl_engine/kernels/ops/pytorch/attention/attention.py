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


def attention_mask(q, seq_starts=None, cu_seqlens=None, causal: bool = True) -> torch.Tensor:
    """[B,S,S] bool (True = attend) of a layout: padded q [B,S,H,D] (right padding needs no mask:
    causality hides it behind each valid token), left-padded (`seq_starts` [B], each row's first valid
    index), or packed q [1,T,H,D] with `cu_seqlens` [N+1] (block-diagonal). Padding queries see only
    themselves, so no row is empty (an empty row would be NaN in plain SDPA, and its NaN values would
    reach valid rows through 0 * NaN)."""
    b, s = q.shape[0], q.shape[1]
    idx = torch.arange(s, device=q.device)
    mask = (idx[None, :] <= idx[:, None]) if causal else torch.ones(s, s, dtype=torch.bool, device=q.device)
    mask = mask.unsqueeze(0).expand(b, s, s)
    if seq_starts is not None:
        mask = mask & (idx[None, None, :] >= seq_starts.long().to(q.device)[:, None, None])
    if cu_seqlens is not None:
        # Each position's sequence index + 1 (all of cu searched: only equality of ids is used below).
        seq_id = torch.searchsorted(cu_seqlens.long().to(q.device), idx, right=True)
        mask = mask & (seq_id[:, None] == seq_id[None, :]).unsqueeze(0)
    return mask | torch.eye(s, dtype=torch.bool, device=q.device).unsqueeze(0)


def sdpa(q, k, v, mask, scale):
    """PyTorch's fused attention as users call it, on [B,S,H,D] tensors with a [B,Sq,Sk] bool mask."""
    group = q.shape[2] // k.shape[2]
    k, v = k.repeat_interleave(group, dim=2), v.repeat_interleave(group, dim=2)
    out = torch.nn.functional.scaled_dot_product_attention(
        q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), attn_mask=mask.unsqueeze(1), scale=scale
    )
    return out.transpose(1, 2)


class NativeAttentionOp(NativeOp):
    """Causal (or full) grouped-query attention over a padded, left-padded or packed batch."""

    input_names = ("q", "k", "v", "seq_starts", "cu_seqlens")

    def __init__(self, causal: bool = True, scale: float | None = None):
        self.causal = causal
        self.scale = scale

    def validate(self, *, q, k, v, seq_starts=None, cu_seqlens=None):
        expect_rank("q", q, 4, "[B,S,Hq,D]")
        b, s, _, d = q.shape
        expect_rank("k", k, 4, "[B,S,Hkv,D]")
        expect_shape("k", k, (b, s, k.shape[2], d), "[B,S,Hkv,D]")
        expect_shape("v", v, tuple(k.shape), "[B,S,Hkv,D]")
        check_heads("q", q, "k", k)
        if seq_starts is not None and cu_seqlens is not None:
            raise ValueError("seq_starts: not used with cu_seqlens (packed sequences have no padding)")
        if seq_starts is not None:
            expect_shape("seq_starts", seq_starts, (b,), "[B]")
            if seq_starts.is_floating_point() or b and (int(seq_starts.min()) < 0 or int(seq_starts.max()) > s):
                raise ValueError(f"seq_starts: expected integer starts in [0, S={s}], got {seq_starts.tolist()}")
        if cu_seqlens is not None:
            if b != 1:
                raise ValueError(f"q: the packed form is [1,T,Hq,D] with cu_seqlens, got {tuple(q.shape)}")
            if cu_seqlens.dim() != 1 or cu_seqlens.is_floating_point() or int(cu_seqlens[0]) != 0 or (
                    int(cu_seqlens[-1]) != s or bool((cu_seqlens.diff() < 0).any())):
                raise ValueError(f"cu_seqlens: expected non-decreasing integer offsets from 0 to T={s}, "
                                 f"got {cu_seqlens.tolist()}")

    def _scale(self, q):
        return self.scale if self.scale is not None else 1.0 / math.sqrt(q.shape[3])

    def forward(self, *, q, k, v, seq_starts=None, cu_seqlens=None):
        return grouped_attention(q, k, v, attention_mask(q, seq_starts, cu_seqlens, self.causal), self._scale(q))

    def baseline(self, *, q, k, v, seq_starts=None, cu_seqlens=None):
        """SDPA in the inputs' dtype, default backend, as users call it with a mask."""
        self.validate(q=q, k=k, v=v, seq_starts=seq_starts, cu_seqlens=cu_seqlens)
        return sdpa(q, k, v, attention_mask(q, seq_starts, cu_seqlens, self.causal), self._scale(q))
