"""Layouts of a set of samples, and the exact way back to logical order.

A `Layout` is a [B,S] grid of token slots. Every slot carries its key (sample id, position) or
(-1, -1) for padding; `restore` gathers per-slot values from any number of layouts (batches,
chunks, B1 runs) back into one tensor per sample in position order, and fails closed: a missing,
duplicated or unknown (sample id, position) is an error naming it, never a silent gap.

Transforms: `pad` (right or left), `pack` (one row, `cu_seqlens`), `chunk` (column ranges of a
padded layout), `permute` (sample order). Positions restart at 0 in every sequence; padding slots
get token `pad_id`. Right padding keeps counting positions (slot column = position, so a KV cache
row written by position never lets a padding slot overwrite a real token); left padding slots get
position 0.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


class LayoutError(ValueError):
    """A layout or a restore that does not cover every (sample id, position) exactly once."""


@dataclass(frozen=True)
class Sample:
    sample_id: int
    token_ids: tuple[int, ...]
    prompt_len: int

    @property
    def length(self) -> int:
        return len(self.token_ids)


@dataclass
class Layout:
    token_ids: torch.Tensor  # [B,S] int64
    positions: torch.Tensor  # [B,S] int64
    keys: torch.Tensor  # [B,S,2] int64: (sample id, position), (-1, -1) for padding
    target_ids: torch.Tensor  # [B,S] the next token of the same sample, pad_id where there is none
    seq_starts: torch.Tensor | None = None  # [B] left padding: first valid slot of each row
    cu_seqlens: torch.Tensor | None = None  # [N+1] int32 packed: sequence boundaries in the row

    def to(self, device) -> Layout:
        move = lambda t: None if t is None else t.to(device)
        return Layout(*(move(getattr(self, f)) for f in self.__dataclass_fields__))


def _slot_values(sample: Sample, pad_id: int):
    n = sample.length
    tokens = torch.tensor(sample.token_ids, dtype=torch.int64)
    targets = torch.cat([tokens[1:], torch.tensor([pad_id], dtype=torch.int64)])
    positions = torch.arange(n, dtype=torch.int64)
    keys = torch.stack([torch.full((n,), sample.sample_id, dtype=torch.int64), positions], dim=-1)
    return tokens, positions, keys, targets


def pad(samples: list[Sample], side: str = "right", pad_id: int = 0) -> Layout:
    if side not in ("right", "left"):
        raise ValueError(f"side: expected 'right' or 'left', got {side!r}")
    if not samples:
        raise LayoutError("pad: no samples")
    width = max(s.length for s in samples)
    b = len(samples)
    tokens = torch.full((b, width), pad_id, dtype=torch.int64)
    positions = torch.zeros((b, width), dtype=torch.int64)
    if side == "right":
        positions[:] = torch.arange(width)
    keys = torch.full((b, width, 2), -1, dtype=torch.int64)
    targets = torch.full((b, width), pad_id, dtype=torch.int64)
    starts = []
    for row, sample in enumerate(samples):
        start = width - sample.length if side == "left" else 0
        starts.append(start)
        cols = slice(start, start + sample.length)
        tokens[row, cols], positions[row, cols], keys[row, cols], targets[row, cols] = _slot_values(sample, pad_id)
    seq_starts = torch.tensor(starts, dtype=torch.int64) if side == "left" else None
    return Layout(tokens, positions, keys, targets, seq_starts=seq_starts)


def pack(samples: list[Sample], pad_id: int = 0) -> Layout:
    if not samples:
        raise LayoutError("pack: no samples")
    parts = [_slot_values(s, pad_id) for s in samples]
    tokens, positions, keys, targets = (torch.cat([p[i] for p in parts]).unsqueeze(0) for i in range(4))
    lengths = torch.tensor([0] + [s.length for s in samples])
    cu_seqlens = torch.cumsum(lengths, 0).to(torch.int32)
    return Layout(tokens, positions, keys, targets, cu_seqlens=cu_seqlens)


def chunk(layout: Layout, size: int) -> list[Layout]:
    """Column ranges [0,size), [size,2 size), ... of a right-padded layout, for chunked prefill."""
    if size < 1:
        raise ValueError(f"size: expected a positive chunk size, got {size}")
    if layout.seq_starts is not None or layout.cu_seqlens is not None:
        raise LayoutError("chunk: only right-padded layouts are chunked (cache row = position)")
    width = layout.token_ids.shape[1]
    return [
        Layout(*(getattr(layout, f)[:, s : s + size] for f in ("token_ids", "positions", "keys", "target_ids")))
        for s in range(0, width, size)
    ]


def permute(samples: list[Sample], order: list[int]) -> list[Sample]:
    if sorted(order) != list(range(len(samples))):
        raise ValueError(f"order: expected a permutation of 0..{len(samples) - 1}, got {order}")
    return [samples[i] for i in order]


def restore(pieces: list[tuple[torch.Tensor, torch.Tensor]], lengths: dict[int, int]) -> dict[int, torch.Tensor]:
    """pieces: (keys [B,S,2], values [B,S,...]) pairs; lengths: sample id -> length.

    Returns sample id -> values [length, ...] in position order. Every (sample id, position) with
    position < length must appear exactly once across the pieces; padding slots are dropped.
    """
    flat_keys, flat_values = [], []
    for keys, values in pieces:
        if tuple(keys.shape[:2]) != tuple(values.shape[:2]):
            raise LayoutError(f"restore: keys {tuple(keys.shape)} do not cover values {tuple(values.shape)}")
        flat_keys.append(keys.reshape(-1, 2).cpu())
        flat_values.append(values.reshape(-1, *values.shape[2:]))
    keys = torch.cat(flat_keys)
    values = torch.cat(flat_values)
    real = keys[:, 0] >= 0
    keys, values = keys[real], values[real.to(values.device)]
    out = {}
    for sid, length in lengths.items():
        rows = (keys[:, 0] == sid).nonzero().flatten()
        pos = keys[rows, 1]
        seen = torch.zeros(length, dtype=torch.int64)
        inside = (pos >= 0) & (pos < length)
        if not bool(inside.all()):
            raise LayoutError(f"restore: sample {sid} has position {int(pos[~inside][0])} outside 0..{length - 1}")
        seen.index_add_(0, pos, torch.ones_like(pos))
        if bool((seen != 1).any()):
            p = int((seen != 1).nonzero()[0])
            what = "missing" if seen[p] == 0 else f"present {int(seen[p])} times"
            raise LayoutError(f"restore: (sample {sid}, position {p}) is {what}")
        order = torch.empty(length, dtype=torch.int64)
        order[pos] = rows
        out[sid] = values[order.to(values.device)]
    unknown = set(keys[:, 0].unique().tolist()) - set(lengths)
    if unknown:
        raise LayoutError(f"restore: slots of unknown samples {sorted(unknown)}")
    return out
