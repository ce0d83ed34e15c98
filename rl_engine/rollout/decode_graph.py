"""Decode steps replayed from CUDA graphs: one graph launch per step instead of hundreds of kernel launches.

A decode step (every running sequence feeds its newest token) is the same work each time up to the batch
size and the page-table width, so it is captured once per (rows, width) and replayed:
  rows   the decode batch padded up to a bucket (1, 2, 4, … , max_batch_size);
  width  the page-table width padded up to a power of two (the static block table is rows × width).
Two graphs per bucket, sharing one memory pool: (1) forward_cached + lm_head -> hidden and logits of every
row, (2) selected_logprobs of the sampled tokens (the raw, T = 1 logprobs). The sampler and the tempered
logprobs stay eager (they take per-sequence parameters).

Padding rows feed token 0 at position 0 with a page table of null pages: they write their key and value
into the null page (which stays finite; no sequence reads it below its length) and their outputs are
dropped. Bits: the graph runs the eager kernels at the padded shapes; under triton_bf16 every op is batch
invariant and attention does not depend on the cache width (key blocks aligned to position 0, lengths
from cache_seqlens), so a sequence gets the bits of the eager step; the GPU parity tests check it.

On a CPU nothing is captured: the same padded, static-buffer path runs eagerly, which is what the CPU
tests exercise. MoE layers read expert counts back to the host and cannot be captured.
"""

from __future__ import annotations

import torch

from rl_engine.rollout.paged_cache import padded_block_table


def _pow2_at_least(n: int) -> int:
    return 1 << max(n - 1, 0).bit_length()


def batch_buckets(max_batch_size: int) -> list[int]:
    """1, 2, 4, … below max_batch_size, then max_batch_size itself."""
    return sorted({min(1 << i, max_batch_size) for i in range(max_batch_size.bit_length() + 1)})


class _Step:
    """Static inputs and outputs of one (rows, width) bucket, and its graphs."""

    def __init__(self, model, cache, rows: int, width: int, device):
        self.model, self.cache = model, cache
        self.tokens = torch.zeros((rows, 1), dtype=torch.int64, device=device)
        self.positions = torch.zeros((rows, 1), dtype=torch.int64, device=device)
        self.seqlens = torch.ones((rows,), dtype=torch.int32, device=device)
        self.block_table = torch.zeros((rows, width), dtype=torch.int32, device=device)
        self.targets = torch.zeros((rows, 1), dtype=torch.int64, device=device)
        self.forward_graph = self.logprob_graph = None
        self.hidden = self.logits = self.raw = None

    def run_forward(self):
        self.cache.use_block_table(self.block_table)
        self.hidden = self.model.forward_cached(self.tokens, self.positions, self.cache, self.seqlens)
        self.logits = self.model.logits(self.hidden)[:, 0]

    def run_logprobs(self):
        self.raw = self.model.selected_logprobs(self.hidden, self.targets)[:, 0]


def capture_graph(fn, pool=None) -> torch.cuda.CUDAGraph:
    """Warm up on a side stream (compiles kernels, fills the caches, computes this step), then capture."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, pool=pool):
        fn()
    return graph


class DecodeGraphs:
    def __init__(self, model, cache, max_batch_size: int, *, capture: bool):
        if any(model.config.sparse_layer(i) for i in range(model.config.num_layers)):
            raise ValueError("cuda_graphs: MoE layers read expert counts back to the host and cannot be captured; "
                             "pass cuda_graphs=False")
        self.model, self.cache = model, cache
        self.buckets = batch_buckets(max_batch_size)
        self.capture = capture
        self.pool = torch.cuda.graph_pool_handle() if capture else None
        self.steps: dict[tuple[int, int], _Step] = {}
        self._step: _Step | None = None

    def forward(self, seq_ids: list[int], tokens: list[int], starts: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """hidden [n,1,H] and logits [n,V] of n sequences decoding `tokens` at positions `starts`."""
        n = len(seq_ids)
        rows = next(b for b in self.buckets if b >= n)
        tables = [self.cache.tables[s] for s in seq_ids]
        width = _pow2_at_least(max(len(t) for t in tables))
        key = (rows, width)
        step = self.steps.get(key)
        new = step is None
        if new:
            step = self.steps[key] = _Step(self.model, self.cache, rows, width, self.cache.device)
        pad = rows - n
        step.tokens.copy_(torch.tensor(tokens + [0] * pad, dtype=torch.int64)[:, None])
        step.positions.copy_(torch.tensor(starts + [0] * pad, dtype=torch.int64)[:, None])
        step.seqlens.copy_(torch.tensor([p + 1 for p in starts] + [1] * pad, dtype=torch.int32))
        step.block_table.copy_(padded_block_table(tables, width, rows))
        if not self.capture:
            step.run_forward()
        else:  # capture swaps in the graph's own output tensors: replay fills them
            if new:
                step.forward_graph = capture_graph(step.run_forward, self.pool)
            step.forward_graph.replay()
        self._step = step
        return step.hidden[:n], step.logits[:n]

    def raw_logprobs(self, targets: torch.Tensor) -> torch.Tensor:
        """fp32 [n]: selected_logprobs of targets [n] on the rows of the last `forward`."""
        step, n = self._step, targets.shape[0]
        step.targets[:n, 0].copy_(targets)
        if not self.capture:
            step.run_logprobs()
        else:
            if step.logprob_graph is None:
                step.logprob_graph = capture_graph(step.run_logprobs, self.pool)
            step.logprob_graph.replay()
        return step.raw[:n]
