"""The canonical shards: one reduction tree shared by every tensor-parallel size.

A dimension that tensor parallelism splits (vocabulary, K of a row-parallel GEMM, output columns of
a column-parallel GEMM) is cut into CANONICAL_SHARDS = 4 equal shards, 4 being the largest TP size
supported. With TP = 1, 2 or 4, rank r holds the consecutive shards r*S .. r*S + S - 1
(S = 4 / TP). Every rank computes the same per-shard partials that a single rank would, with the
same shapes, memory layout and code; `all_gather` (a copy, no arithmetic) puts the 4 partials on
every rank in shard order; every rank combines them in the same fixed tree ((c0 + c1) + (c2 + c3)).
So the bits cannot depend on TP, nor on which rank does the combining. `all_reduce` is never used
for a sum: its order is the backend's choice (NCCL ring/tree, gloo ring) and changes with TP.

Why shapes and layout must be equal too: torch's CPU elementwise kernels run a vector body and a
scalar tail that may round `exp` differently, so an element's bits can depend on its position in a
tensor; and BLAS/cuBLAS pick code paths by shape and pointer alignment. Each shard is therefore
computed as its own contiguous, freshly aligned block of the same shape on every TP.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist

CANONICAL_SHARDS = 4
SUPPORTED_WORLD_SIZES = (1, 2, 4)
# Blocks whose storage starts at this alignment are used in place; others are copied to a fresh one.
_ALIGNMENT_BYTES = 256


@dataclass(frozen=True)
class ShardLayout:
    """Which canonical shards this rank holds."""

    world_size: int
    rank: int
    group: object = None  # the process group; None with world_size 1 and no process group

    @classmethod
    def from_group(cls, group=None) -> ShardLayout:
        if not (dist.is_available() and dist.is_initialized()):
            if group is not None:
                raise ValueError("group: a process group was given but torch.distributed is not initialized")
            return cls(world_size=1, rank=0, group=None)
        world_size, rank = dist.get_world_size(group), dist.get_rank(group)
        if world_size not in SUPPORTED_WORLD_SIZES:
            raise ValueError(
                f"group: tensor-parallel size must be one of {SUPPORTED_WORLD_SIZES} (it must divide the "
                f"{CANONICAL_SHARDS} canonical shards), got {world_size}"
            )
        return cls(world_size=world_size, rank=rank, group=group if group is not None else dist.group.WORLD)

    @property
    def distributed(self) -> bool:
        return self.group is not None

    @property
    def shards_per_rank(self) -> int:
        return CANONICAL_SHARDS // self.world_size

    @property
    def local_shards(self) -> range:
        """Canonical indices of the shards this rank holds."""
        return range(self.rank * self.shards_per_rank, (self.rank + 1) * self.shards_per_rank)

    def shard_size(self, name: str, full_size: int, meaning: str) -> int:
        """Size of one canonical shard of a dimension of `full_size`; ValueError if 4 does not divide it."""
        if full_size % CANONICAL_SHARDS:
            raise ValueError(
                f"{name}: {meaning} = {full_size} must be divisible by the {CANONICAL_SHARDS} canonical "
                f"tensor-parallel shards"
            )
        return full_size // CANONICAL_SHARDS

    def local_size(self, name: str, local: int, meaning: str) -> int:
        """Shard size from a rank's local size; ValueError unless the local size holds whole shards."""
        if local % self.shards_per_rank:  # the same as: the global size is not divisible by 4
            raise ValueError(
                f"{name}: {meaning} = {local} per rank x {self.world_size} ranks = {local * self.world_size} "
                f"must be divisible by the {CANONICAL_SHARDS} canonical tensor-parallel shards"
            )
        return local // self.shards_per_rank

    def split(self, full: torch.Tensor, dim: int) -> torch.Tensor:
        """This rank's slice of a full tensor along `dim` (test and launch helper; no copy)."""
        self.shard_size("tensor", full.shape[dim], f"dimension {dim}")
        width = full.shape[dim] // self.world_size
        return full.narrow(dim, self.rank * width, width)


def canonical_block(t: torch.Tensor) -> torch.Tensor:
    """`t` as a contiguous block whose storage is aligned like a fresh allocation (copied if needed)."""
    if t.is_contiguous() and t.data_ptr() % _ALIGNMENT_BYTES == 0:
        return t
    return t.clone(memory_format=torch.contiguous_format)


def local_shard(t: torch.Tensor, dim: int, index: int, size: int) -> torch.Tensor:
    """The `index`-th local canonical shard of `t` along `dim`, as a canonical block."""
    return canonical_block(t.narrow(dim, index * size, size))


def gather_shards(local: torch.Tensor, layout: ShardLayout) -> torch.Tensor:
    """[shards_per_rank, ...] partials on each rank -> [4, ...] on every rank, in canonical order.

    all_gather only copies: the result is the same bits for every TP. With a process group it is
    called even at world size 1, so a one-rank NCCL/gloo run goes through the backend.
    """
    if local.shape[0] != layout.shards_per_rank:
        raise ValueError(f"partials: expected {layout.shards_per_rank} local shards first, got {tuple(local.shape)}")
    if not layout.distributed:
        return local
    local = local.contiguous()
    parts = [torch.empty_like(local) for _ in range(layout.world_size)]
    dist.all_gather(parts, local, group=layout.group)
    return torch.cat(parts, dim=0)


def tree_reduce(items: list, combine: Callable):
    """Pairwise tree over a power-of-two list: 4 items give combine(combine(a0, a1), combine(a2, a3))."""
    if not items or len(items) & (len(items) - 1):
        raise ValueError(f"tree_reduce: needs a power-of-two number of items, got {len(items)}")
    while len(items) > 1:
        items = [combine(items[i], items[i + 1]) for i in range(0, len(items), 2)]
    return items[0]


def tree_sum(stacked: torch.Tensor) -> torch.Tensor:
    """Sum over dim 0 of [4, ...] in the canonical tree ((p0 + p1) + (p2 + p3))."""
    return tree_reduce(list(stacked.unbind(0)), torch.add)


def sum_shards(local: torch.Tensor, layout: ShardLayout) -> torch.Tensor:
    """The canonical tree sum of the 4 shard partials, from this rank's [shards_per_rank, ...] partials.

    A rank's shards are a whole subtree of the canonical tree (consecutive, aligned), so each rank sums
    its own first and only that one partial per rank travels: at TP = 2 rank 0 sends (p0 + p1). The
    same tree, the same bits; the bytes on the wire are one partial per rank.
    """
    if local.shape[0] != layout.shards_per_rank:
        raise ValueError(f"partials: expected {layout.shards_per_rank} local shards first, got {tuple(local.shape)}")
    own = tree_sum(local)
    if not layout.distributed:
        return own
    own = own.contiguous()
    parts = [torch.empty_like(own) for _ in range(layout.world_size)]
    dist.all_gather(parts, own, group=layout.group)
    return tree_reduce(parts, torch.add)
