"""write_kv_pages (one launch for a forward's keys and values into the paged pools) puts into the pools exactly
what index assignment (`write_pages`, the CPU path) puts there, for strided value views and scattered slots; a
planted off-by-one slot is caught."""

from __future__ import annotations

import pytest
import torch

from rl_engine.kernels.ops.triton.attention.paged_write import write_kv_pages
from rl_engine.rollout.paged_cache import padded_block_table, pool_slots, write_pages

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
PAGES, PAGE, HKV, D, HQ = 9, 4, 2, 8, 4


def _case(dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    b, s = 3, 2
    # The stacked q/k/v product's layout: k and v are strided column views of one [B, S, (Hq + 2 Hkv) D] buffer.
    qkv = torch.randn(b, s, (HQ + 2 * HKV) * D, generator=g).to(dtype).to(DEVICE)
    k = qkv[..., HQ * D:(HQ + HKV) * D].reshape(b, s, HKV, D)
    v = qkv[..., (HQ + HKV) * D:].reshape(b, s, HKV, D)
    table = padded_block_table([[3, 7], [1], [8, 2, 5]], 3).to(DEVICE)  # scattered pages, in no order
    positions = torch.tensor([[5, 6], [2, 3], [9, 10]], device=DEVICE)
    return k, v, table, positions


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_one_launch_writes_the_bits_of_index_assignment(dtype):
    k, v, table, positions = _case(dtype)
    assert not v.is_contiguous()
    want_k, want_v = (torch.full((PAGES, PAGE, HKV, D), -1.0, dtype=dtype, device=DEVICE) for _ in range(2))
    got_k, got_v = want_k.clone(), want_v.clone()
    write_pages(want_k, table, positions, k)
    write_pages(want_v, table, positions, v)
    write_kv_pages(got_k, got_v, pool_slots(table, positions, PAGE), k, v)
    assert torch.equal(got_k, want_k) and torch.equal(got_v, want_v)


def test_a_slot_off_by_one_is_caught():
    k, v, table, positions = _case(torch.float32, seed=1)
    want = torch.zeros(PAGES, PAGE, HKV, D, device=DEVICE)
    write_pages(want, table, positions, k)
    got_k, got_v = torch.zeros_like(want), torch.zeros_like(want)
    write_kv_pages(got_k, got_v, pool_slots(table, positions, PAGE) + 1, k, v)  # planted: the next row
    assert not torch.equal(got_k, want)


@pytest.mark.gpu
def test_gpu_one_launch_writes_the_bits_of_index_assignment():
    assert DEVICE == "cuda"
    test_one_launch_writes_the_bits_of_index_assignment(torch.bfloat16)
