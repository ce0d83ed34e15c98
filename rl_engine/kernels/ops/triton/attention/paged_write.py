"""The new keys and values of a forward written into the paged KV pools: one launch for both, one program per
token. A copy (no arithmetic), so the pools hold the bits that `torch` index assignment would put there; it
replaces two index_put launches a layer (and the copy of the strided value view from the stacked q/k/v product).
Where RoPE rotates q's and k's heads in one launch, that launch writes the pools instead (`KvPages`, rope.py)."""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from rl_engine.kernels.ops.triton.runtime import pdl_launch, unit_column_rows


@triton.jit
def _write_kv_kernel(k_ptr, v_ptr, k_pool_ptr, v_pool_ptr, slots_ptr, k_stride, v_stride,
                     ROW: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr):
    if PDL:  # launched as a programmatic dependent (runtime.pdl_launch)
        gdc_launch_dependents()
        gdc_wait()
    token = tl.program_id(0).to(tl.int64)
    slot = tl.load(slots_ptr + token).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < ROW
    tl.store(k_pool_ptr + slot * ROW + cols, tl.load(k_ptr + token * k_stride + cols, mask=mask), mask=mask)
    tl.store(v_pool_ptr + slot * ROW + cols, tl.load(v_ptr + token * v_stride + cols, mask=mask), mask=mask)


class KvPages(NamedTuple):
    """Where a forward's new keys and values go: pool rows `slots` (int64, one per token) of k_pool/v_pool
    [num_pages, page, Hkv, D]; `v` [..., Hkv, D] holds the values (the keys come from the launch that takes this)."""

    k_pool: torch.Tensor
    v_pool: torch.Tensor
    slots: torch.Tensor
    v: torch.Tensor

    @property
    def row(self) -> int:
        return self.k_pool.shape[-2] * self.k_pool.shape[-1]


def write_kv_pages(k_pool: torch.Tensor, v_pool: torch.Tensor, slots: torch.Tensor, k: torch.Tensor,
                   v: torch.Tensor) -> None:
    """k_pool/v_pool [num_pages, page, Hkv, D] (contiguous) at pool rows `slots` [...] (int64) ← k/v [..., Hkv, D],
    in place. Same dtype throughout (the caller falls back to index assignment otherwise)."""
    row = k_pool.shape[-2] * k_pool.shape[-1]
    k2, v2 = unit_column_rows(k, row), unit_column_rows(v, row)
    flat = slots.reshape(-1)
    if flat.numel():
        _write_kv_kernel[(flat.numel(),)](k2, v2, k_pool, v_pool, flat, k2.stride(0), v2.stride(0),
                                          ROW=row, BLOCK=triton.next_power_of_2(row), num_warps=4, **pdl_launch())
