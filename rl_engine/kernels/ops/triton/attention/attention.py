"""Causal grouped-query flash attention in Triton, forward and backward, padded or packed.

Padded form: q [B,S,Hq,D], k/v [B,S,Hkv,D]. `seq_starts` [B] (optional) is the index of each row's
first valid token (left padding): keys before it are invisible and its key blocks start at it. A
padding query before it sees only its own key (output = its v, as the gold reference in
rl_engine.kernels.registry defines it, so no row is empty and nothing is NaN). Right padding needs
nothing: pad keys come after the real queries, so causality hides them; pad outputs are finite and
meant to be ignored.
Packed form: q [T,Hq,D] or [1,T,Hq,D], k/v alike, `cu_seqlens` int [N+1]: each sequence attends
within itself.

Every form runs the same kernels of `flash.py`, so a token's output bits do not depend on the form.
"""

from __future__ import annotations

import torch

from rl_engine.kernels.ops.pytorch.attention.attention import NativeAttentionOp, check_heads
from rl_engine.kernels.ops.triton.attention.contract import NO_WINDOW, SequenceTable, default_scale, sequence_table
from rl_engine.kernels.ops.triton.attention.dispatch import flash_attention
from rl_engine.kernels.ops.triton.runtime import check_devices


def _integer_vector(name: str, t, length: int, meaning: str) -> torch.Tensor:
    if not isinstance(t, torch.Tensor) or t.dim() != 1 or t.shape[0] != length:
        got = tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__
        raise ValueError(f"{name}: expected shape {meaning} = ({length},), got {got}")
    if t.is_floating_point() or t.dtype == torch.bool:
        raise ValueError(f"{name}: expected integers {meaning}, got dtype {t.dtype}")
    return t


def _check_same_dtype(q, k, v) -> None:
    if not (q.dtype == k.dtype == v.dtype):
        raise ValueError(f"k, v: expected q's dtype {q.dtype}, got {k.dtype} and {v.dtype}")


def _padded_table(q, seq_starts) -> SequenceTable:
    """One sequence per row from its start; with seq_starts, one more per row for its padding queries,
    each seeing only itself (window 1; an empty entry where the row has no padding)."""
    b, s = q.shape[:2]
    device = q.device
    if seq_starts is None:
        starts = torch.zeros(b, dtype=torch.int32, device=device)
    else:
        starts = _integer_vector("seq_starts", seq_starts, b, "[B]").to(device=device, dtype=torch.int32)
        if b and (int(starts.min()) < 0 or int(starts.max()) > s):
            raise ValueError(f"seq_starts: each start must lie in [0, S={s}], got {starts.tolist()}")
    first = torch.arange(b, dtype=torch.int32, device=device) * s
    row0, length, zero = first + starts, s - starts, torch.zeros_like(starts)
    if seq_starts is None:
        return sequence_table(row0, length, zero, row0, length, max_q_count=s, max_kv_len=s)
    window = torch.cat([torch.full_like(starts, NO_WINDOW), torch.ones_like(starts)])
    row0, length = torch.cat([row0, first]), torch.cat([length, starts])
    return sequence_table(row0, length, torch.cat([zero, zero]), row0, length, window, max_q_count=s, max_kv_len=s)


def _packed_table(total: int, cu_seqlens, device) -> SequenceTable:
    if not isinstance(cu_seqlens, torch.Tensor) or cu_seqlens.dim() != 1 or cu_seqlens.shape[0] < 1:
        raise ValueError("cu_seqlens: expected cumulative sequence lengths [N+1] starting at 0")
    if cu_seqlens.is_floating_point() or cu_seqlens.dtype == torch.bool:
        raise ValueError(f"cu_seqlens: expected integers [N+1], got dtype {cu_seqlens.dtype}")
    cu = cu_seqlens.to(device=device, dtype=torch.int32)
    lengths = cu[1:] - cu[:-1]
    if torch.compiler.is_compiling():
        # Traced: no value can be read back. The grid is bounded by T instead of the longest sequence;
        # programs past a sequence's queries exit at once, and no tile's work depends on the grid, so the
        # bits are eager's. The offsets are not checked here (eager calls check them).
        return sequence_table(cu[:-1], lengths, torch.zeros_like(lengths), cu[:-1], lengths,
                              max_q_count=total, max_kv_len=total)
    # One read-back for every check (each int() of a CUDA value is a device sync of its own).
    ends = [cu[0], cu[-1]] + ([lengths.min(), lengths.max()] if lengths.numel() else [])
    first, last, *extremes = torch.stack(ends).tolist()
    shortest, longest = extremes or (0, 0)
    if first != 0 or last != total or shortest < 0:
        raise ValueError(
            f"cu_seqlens: expected non-decreasing offsets from 0 to T={total}, got {cu_seqlens.tolist()}"
        )
    return sequence_table(cu[:-1], lengths, torch.zeros_like(lengths), cu[:-1], lengths,
                          max_q_count=longest, max_kv_len=longest)


def triton_attention(q, k, v, *, causal: bool = True, scale: float | None = None, seq_starts=None,
                     cu_seqlens=None):
    """Attention over a padded batch [B,S,H,D] or a packed one ([T,H,D] or [1,T,H,D] + cu_seqlens).

    Returns q's shape and dtype. Differentiable in q, k and v.
    """
    if cu_seqlens is not None:
        if seq_starts is not None:
            raise ValueError("seq_starts: not used with cu_seqlens (packed sequences have no padding)")
        if q.dim() == 4 and q.shape[0] != 1:
            raise ValueError(f"q: packed form expects [T,Hq,D] or [1,T,Hq,D], got {tuple(q.shape)}")
        if q.dim() not in (3, 4):
            raise ValueError(f"q: packed form expects [T,Hq,D] or [1,T,Hq,D], got {tuple(q.shape)}")
        q4, k4, v4 = (t if t.dim() == 4 else t.unsqueeze(0) for t in (q, k, v))
        NativeAttentionOp(causal, scale).validate(q=q4, k=k4, v=v4)
        table = _packed_table(q4.shape[1], cu_seqlens, q.device)
    else:
        NativeAttentionOp(causal, scale).validate(q=q, k=k, v=v)
        q4, k4, v4 = q, k, v
        table = _padded_table(q, seq_starts)
    check_heads("q", q4, "k", k4)
    _check_same_dtype(q, k, v)
    head_dim = q4.shape[3]
    rows = [t.reshape(-1, t.shape[2], t.shape[3]).contiguous() for t in (q4, k4, v4)]
    out, _ = flash_attention(*rows, table.info, table.max_q_count, table.max_kv_len, causal,
                             default_scale(head_dim, scale), 1)
    return out.reshape(q.shape)


class TritonAttentionOp:
    """Candidate for NativeAttentionOp: op(q=, k=, v=, [seq_starts= or cu_seqlens=]) -> q's shape and dtype."""

    input_names = ("q", "k", "v", "seq_starts", "cu_seqlens")

    def __init__(self, causal: bool = True, scale: float | None = None):
        self.causal = causal
        self.scale = scale

    def __call__(self, q, k, v, seq_starts=None, cu_seqlens=None):
        check_devices("TritonAttentionOp", q=q, k=k, v=v, seq_starts=seq_starts, cu_seqlens=cu_seqlens)
        return triton_attention(q, k, v, causal=self.causal, scale=self.scale, seq_starts=seq_starts,
                                cu_seqlens=cu_seqlens)
