"""Planted bugs for the TP-invariance checker: each is a case (layout, inputs) -> results, run on the ranks.

Kept beside the tests (spawned ranks import this module by name: spawn passes sys.path on). On fp32 data:
a bf16 rounding can hide a changed order of fp32 adds.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from rl_engine.kernels.ops.triton.linear.matmul import batch_invariant_mm
from rl_engine.parallel import tp_kernels


def _data(seed: int, *shape, scale=1.0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)) * scale


def _k_slice(t: torch.Tensor, layout, index: int) -> torch.Tensor:
    part = t.shape[1] // layout.world_size
    return t[:, index * part:(index + 1) * part].contiguous()


def planted_allreduce_row_parallel(layout, inputs) -> dict:
    """Row-parallel product: each rank's K slice from zero, summed by all_reduce (the backend's order)."""
    x, w = _data(1, 64, 256), _data(2, 32, 256, scale=1 / 16)
    y = batch_invariant_mm(_k_slice(x, layout, layout.rank), _k_slice(w, layout, layout.rank).t(), out_fp32=True)
    if layout.distributed:
        dist.all_reduce(y, group=layout.group)
    return {"planted_allreduce_row_parallel.forward": y}


def planted_rotated_row_parallel(layout, inputs) -> dict:
    """The continued product, but rank r holds K slice r + 1 (mod TP): the order depends on the TP size."""
    x, w = _data(3, 64, 256), _data(4, 32, 256, scale=1 / 16)
    held = (layout.rank + 1) % layout.world_size
    y = tp_kernels.row_parallel_matmul(_k_slice(x, layout, held), _k_slice(w, layout, held), layout.group)
    return {"planted_rotated_row_parallel.forward": y}


def planted_one_ulp_on_rank1(layout, inputs) -> dict:
    """The correct row-parallel product, then rank 1 of each group moves one element by one ulp."""
    x, w = _data(5, 64, 256), _data(6, 32, 256, scale=1 / 16)
    y = tp_kernels.row_parallel_matmul(_k_slice(x, layout, layout.rank), _k_slice(w, layout, layout.rank),
                                       layout.group)
    if layout.rank == 1:
        y = y.clone()
        y.view(-1)[0] = torch.nextafter(y.view(-1)[0], torch.tensor(float("inf")))
    return {"planted_one_ulp_on_rank1.forward": y}


PLANTED = (planted_allreduce_row_parallel, planted_rotated_row_parallel, planted_one_ulp_on_rank1)
