"""Paged KV cache: per-layer page pools, per-sequence page tables, pages taken and given back as
sequences join and finish.

Pool per layer: k, v [num_pages, page_size, Hkv, D] in the activation dtype. Page 0 is the null page:
never handed out; table slots past a sequence's pages point at it. It holds zeros, or the keys and
values of a CUDA graph's padding rows (rl_engine.rollout.decode_graph): finite either way, so every value
that `kv_cache_attention` may touch is finite (the gold reads masked positions: 0 · NaN would poison a row).

Attention reads the pages in place: `layer_kv` hands the pools and `block_table` the bound batch's page
tables (int32 [B, width], null pages past a sequence's), flash_attn_with_kvcache's paged convention; the
Triton kernel loads each key through the table (no gather), the gold op gathers (`paged_cache_view`, the
meaning). The Triton kernel reads cached positions only below cache_seqlens with key blocks aligned to
position 0, so the width (which depends on the batch) and where the pages lie change no bit; the parity
tests check it.
"""

from __future__ import annotations

import torch

from rl_engine.kernels.ops.triton.attention.paged_write import KvPages, write_kv_pages
from rl_engine.models.config import ModelConfig

NULL_PAGE = 0


def padded_block_table(tables: list[list[int]], width: int, rows: int | None = None) -> torch.Tensor:
    """int32 [rows, width] (on the CPU): row r holds tables[r], then null pages (so do rows past len(tables))."""
    table = torch.full((len(tables) if rows is None else rows, width), NULL_PAGE, dtype=torch.int32)
    for r, t in enumerate(tables):
        table[r, : len(t)] = torch.tensor(t, dtype=torch.int32)
    return table


def pool_slots(block_table: torch.Tensor, positions: torch.Tensor, page_size: int) -> torch.Tensor:
    """int64 [B,S]: the pool row (page · page_size + offset) of cache positions [B,S] of the rows' page tables."""
    pos = positions.long()
    return torch.gather(block_table.long(), 1, pos // page_size) * page_size + pos % page_size


def write_pages(pool: torch.Tensor, block_table: torch.Tensor, positions: torch.Tensor, x: torch.Tensor,
                slots: torch.Tensor | None = None) -> None:
    """Write x [B,S,Hkv,D] into the pool [num_pages,page,Hkv,D] at cache positions [B,S] of the rows' page
    tables [B, width], in place (`slots`: their pool_slots, if known)."""
    if slots is None:
        slots = pool_slots(block_table, positions, pool.shape[1])
    pool.view(-1, *pool.shape[2:])[slots] = x


class PagedKvCache:
    def __init__(self, config: ModelConfig, num_pages: int, page_size: int, dtype, device):
        if page_size < 1 or num_pages < 2:
            raise ValueError(f"paged cache: expected page_size >= 1 and num_pages >= 2 (page 0 is the null page), "
                             f"got {page_size}, {num_pages}")
        self.page_size = page_size
        self.num_pages = num_pages
        shape = (num_pages, page_size, config.num_kv_heads, config.head_dim)
        self.k = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(config.num_layers)]
        self.v = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(config.num_layers)]
        self.device = torch.device(device)
        self._free = list(range(num_pages - 1, NULL_PAGE, -1))  # pop() hands out the lowest page first
        self.tables: dict[int, list[int]] = {}
        self._refs = [0] * num_pages  # tables holding each page
        self.block_table = None  # int32 [B, width]: the bound batch's page tables
        self._written = None  # (positions, block_table, their pool slots): every layer writes the same positions

    # -- allocation -----------------------------------------------------------------------------
    # A page may sit in several tables (a prompt prefix shared by a group of samples): `_refs` counts its
    # tables, and it goes back to the free list when the last one lets go. A write into a page that other
    # tables hold copies it first (copy-on-write), so a sequence never changes what another one reads.
    def pages_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.page_size)

    @property
    def free_pages(self) -> int:
        return len(self._free)

    def _take(self) -> int:
        page = self._free.pop()
        self._refs[page] = 1
        return page

    def reserve(self, seq_id: int, num_tokens: int) -> None:
        """Give `seq_id` pages for `num_tokens` cache positions in all (it keeps the ones it has)."""
        table = self.tables.setdefault(seq_id, [])
        need = self.pages_for(num_tokens) - len(table)
        if need > len(self._free):
            raise RuntimeError(f"paged cache: sequence {seq_id} needs {need} more pages, {len(self._free)} free")
        table.extend(self._take() for _ in range(max(need, 0)))

    def share(self, src_id: int, dst_id: int, num_tokens: int) -> None:
        """Let `dst_id` (no pages yet) read `src_id`'s first `num_tokens` cache positions from the same pages."""
        if self.tables.get(dst_id):
            raise RuntimeError(f"paged cache: sequence {dst_id} already has pages; share into an empty table")
        pages = self.tables[src_id][: self.pages_for(num_tokens)]
        for page in pages:
            self._refs[page] += 1
        self.tables[dst_id] = list(pages)

    def write_cost(self, seq_id: int, start: int, end: int) -> int:
        """Free pages that `prepare_write(seq_id, start, end)` takes: new pages, and copies of shared ones."""
        table = self.tables.get(seq_id, [])
        shared = sum(self._refs[p] > 1 for p in table[start // self.page_size : self.pages_for(end)])
        return max(self.pages_for(end) - len(table), 0) + shared

    def prepare_write(self, seq_id: int, start: int, end: int) -> None:
        """Make cache positions [start, end) of `seq_id` writable: pages up to `end`, and a page of its own
        (copy-on-write) wherever another table holds the page it would write into."""
        if self.write_cost(seq_id, start, end) > len(self._free):
            raise RuntimeError(f"paged cache: sequence {seq_id} needs {self.write_cost(seq_id, start, end)} more "
                               f"pages, {len(self._free)} free")
        self.reserve(seq_id, end)
        table = self.tables[seq_id]
        for index in range(start // self.page_size, self.pages_for(end)):
            if self._refs[table[index]] > 1:
                self._copy_on_write(table, index)

    def _copy_on_write(self, table: list[int], index: int) -> None:
        """table[index] becomes a fresh page holding a copy of the shared one (every layer's keys and values)."""
        old, new = table[index], self._take()
        for pool in (*self.k, *self.v):
            pool[new].copy_(pool[old])
        self._refs[old] -= 1
        table[index] = new

    def release(self, seq_id: int) -> None:
        """Let go of `seq_id`'s pages; a page is free once no table holds it."""
        for page in reversed(self.tables.pop(seq_id)):
            self._refs[page] -= 1
            if self._refs[page] == 0:
                self._free.append(page)

    # -- the cache protocol of DecoderModel.forward_cached ----------------------------------------
    def bind(self, seq_ids: list[int]) -> None:
        """Set the batch (row b = seq_ids[b]) of the next forward."""
        tables = [self.tables[s] for s in seq_ids]
        self.block_table = padded_block_table(tables, max(len(t) for t in tables)).to(self.device)
        self._written = None

    def use_block_table(self, block_table: torch.Tensor) -> None:
        """Bind a batch by its page tables, int32 [B, width] on the device (a CUDA graph's static buffer; called
        before each forward: a capture must record the slots' computation, not reuse the warm-up's)."""
        self.block_table = block_table
        self._written = None

    def _slots(self, positions: torch.Tensor) -> torch.Tensor:
        """The pool slots of `positions`: computed at the forward's first write and reused by its other layers (the
        same tensor); binding resets them."""
        w = self._written
        if w is None or w[0] is not positions or w[1] is not self.block_table:  # the forward's first layer
            w = self._written = (positions, self.block_table, pool_slots(self.block_table, positions, self.page_size))
        return w[2]

    def write(self, layer: int, positions: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        slots = self._slots(positions)
        kp, vp = self.k[layer], self.v[layer]
        if kp.is_cuda and k.dtype == v.dtype == kp.dtype:  # one launch for both: a copy, the same bits
            write_kv_pages(kp, vp, slots, k, v)
        else:
            write_pages(kp, self.block_table, positions, k, slots)
            write_pages(vp, self.block_table, positions, v, slots)

    def kv_pages(self, layer: int, positions: torch.Tensor, v: torch.Tensor) -> KvPages | None:
        """The layer's write target for a launch that produces the keys (the Triton RoPE over q's and k's heads)
        and writes them with `v` in place of `write`: None where the dtypes differ (`write` casts)."""
        kp, vp = self.k[layer], self.v[layer]
        return KvPages(kp, vp, self._slots(positions), v) if v.dtype == kp.dtype else None

    def layer_kv(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The layer's page pools [num_pages, page_size, Hkv, D], read through `block_table` (no gather)."""
        return self.k[layer], self.v[layer]
