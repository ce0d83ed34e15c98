"""Paged KV cache: per-layer page pools, per-sequence page tables, pages taken and given back as
sequences join and finish.

Pool per layer: k, v [num_pages, page_size, Hkv, D] in the activation dtype. Page 0 is the null page:
never handed out; table slots past a sequence's pages point at it. It holds zeros, or the keys and
values of a CUDA graph's padding rows (rl_engine.rollout.decode_graph): finite either way, so every value
that `kv_cache_attention` may touch is finite (the gold reads masked positions: 0 · NaN would poison a row).

The attention op takes a contiguous cache [B,Smax,Hkv,D] + cache_seqlens, so `layer_kv` gathers the
batch's pages into that layout (no kernel change). Cost: one copy of the batch's cache per layer per
forward, 2 · B · Smax · Hkv · D elements, where Smax = the batch's longest page table × page_size
(the Triton kernel already copies its cache rows to a contiguous buffer). A paged attention kernel
that reads through the page table would remove it. The Triton kernel reads cached positions only
below cache_seqlens with key blocks aligned to position 0, so Smax (which depends on the batch) and
where the pages lie change no bit; the parity tests check it.
"""

from __future__ import annotations

import torch

from rl_engine.models.config import ModelConfig

NULL_PAGE = 0


def page_slots(block_table: torch.Tensor, page_size: int) -> torch.Tensor:
    """[B, max_pages * page_size]: the flat pool slot of every cache index of each row."""
    offsets = torch.arange(page_size, dtype=torch.int64, device=block_table.device)
    return (block_table.long()[:, :, None] * page_size + offsets).flatten(1)


def gather_pages(pool: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """The contiguous cache [B,S,Hkv,D] the attention op reads, from a pool [num_pages,page,Hkv,D]."""
    return pool.view(-1, *pool.shape[2:])[slots]


def write_pages(pool: torch.Tensor, slots: torch.Tensor, positions: torch.Tensor, x: torch.Tensor) -> None:
    """Write x [B,S,Hkv,D] into the pool at cache positions [B,S], in place."""
    pool.view(-1, *pool.shape[2:])[torch.gather(slots, 1, positions.long())] = x


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
        self._slots = None  # [B, Smax] flat slot of each cache index of the bound batch

    # -- allocation -----------------------------------------------------------------------------
    def pages_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.page_size)

    @property
    def free_pages(self) -> int:
        return len(self._free)

    def reserve(self, seq_id: int, num_tokens: int) -> None:
        """Give `seq_id` pages for `num_tokens` cache positions in all (it keeps the ones it has)."""
        table = self.tables.setdefault(seq_id, [])
        need = self.pages_for(num_tokens) - len(table)
        if need > len(self._free):
            raise RuntimeError(f"paged cache: sequence {seq_id} needs {need} more pages, {len(self._free)} free")
        table.extend(self._free.pop() for _ in range(max(need, 0)))

    def release(self, seq_id: int) -> None:
        self._free.extend(reversed(self.tables.pop(seq_id)))

    # -- the cache protocol of DecoderModel.forward_cached ----------------------------------------
    def bind(self, seq_ids: list[int]) -> None:
        """Set the batch (row b = seq_ids[b]) of the next forward."""
        width = max(len(self.tables[s]) for s in seq_ids)
        table = torch.full((len(seq_ids), width), NULL_PAGE, dtype=torch.int64)
        for row, s in enumerate(seq_ids):
            table[row, : len(self.tables[s])] = torch.tensor(self.tables[s], dtype=torch.int64)
        self._slots = page_slots(table, self.page_size).to(self.device)

    def use_slots(self, slots: torch.Tensor) -> None:
        """Bind a batch by its slot matrix [B, width * page_size] (a CUDA graph's static buffer)."""
        self._slots = slots

    def write(self, layer: int, positions: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        write_pages(self.k[layer], self._slots, positions, k)
        write_pages(self.v[layer], self._slots, positions, v)

    def layer_kv(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        return gather_pages(self.k[layer], self._slots), gather_pages(self.v[layer], self._slots)
