"""The decode step as one CUDA graph: forward, lm_head, sampling and both logprobs in one launch.

A decode step (every running sequence feeds its newest token) is the same work each time up to the batch
size, the page-table width and the sampling temperature, so it is captured once per (rows, width, T) and
replayed:
  rows   the decode batch padded up to a bucket (1, 2, 4, … , max_batch_size);
  width  the page-table width padded up to a power of two (the static block table is rows × width);
  T      the temperature of the tempered logprobs the graph computes (the batch's most common sampling
         temperature; None when every row is greedy). Rows sampled at another temperature get theirs from
         the same hidden rows right after the replay (eager launches, still before anything is read back).
One replay: forward_cached -> lm_head logits -> the sampler kernel (per-row parameters in static device
buffers) -> raw logprobs (`selected_logprobs`) and tempered logprobs (the policy loss's, rollout/logprobs.py)
of the sampled tokens. Then the tokens and both logprobs are copied to pinned host memory and an event is
recorded: nothing waits for the GPU until the engine reads the results (`DecodeLaunch.results`).

Overlap: a launch may take its input tokens from the previous launch's sampled tokens on the device
(`tokens=None`), so the engine starts step t+1 before it reads step t's tokens and does step t's
bookkeeping while the GPU runs step t+1 (rollout/engine.py says when it does).

Padding rows feed token 0 at position 0 with a page table of null pages, greedy: they write their key and
value into the null page (which stays finite; no sequence reads it below its length) and their outputs are
dropped. Bits: the graph runs the eager kernels at the padded shapes; under triton_bf16 every op is batch
invariant and attention does not depend on the cache width (key blocks aligned to position 0, lengths from
cache_seqlens), so a sequence gets the bits of the eager step; the parity tests check it.

On a CPU nothing is captured: the same padded, static-buffer path runs eagerly (the sampler's torch path),
which is what the CPU tests exercise. MoE layers read expert counts back to the host and cannot be captured.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

import torch

from rl_engine.rollout.logprobs import logits_and_raw, tempered_logprobs
from rl_engine.rollout.paged_cache import padded_block_table
from rl_engine.rollout.sampling import SamplingParams, sample

_PAD = SamplingParams(temperature=0.0)


def _pow2_at_least(n: int) -> int:
    return 1 << max(n - 1, 0).bit_length()


def batch_buckets(max_batch_size: int) -> list[int]:
    """1, 2, 4, … below max_batch_size, then max_batch_size itself."""
    return sorted({min(1 << i, max_batch_size) for i in range(max_batch_size.bit_length() + 1)})


def graph_temperature(params: list[SamplingParams]) -> float | None:
    """The temperature a step's graph computes tempered logprobs at: the most common among sampled rows (the
    lowest on ties); None when every row is greedy."""
    counts = Counter(p.temperature for p in params if not p.greedy)
    return min(counts, key=lambda t: (-counts[t], t)) if counts else None


class _Step:
    """Static inputs and outputs of one (rows, width, T) bucket, and its graph.

    Inputs live in three packed buffers, each filled by one host-to-device copy per launch:
      ints   int64 [6, rows]: tokens, positions, top_k, seed, sequence ids, draw positions;
      small  int32 [rows · (1 + width)]: cache_seqlens, then the block table;
      floats fp32 [3, rows]: temperature, top_p, min_p.
    Outputs: tokens int64 [rows] and fp32 [2, rows] (raw, tempered at T)."""

    def __init__(self, model, cache, rows: int, width: int, temperature: float | None, device):
        self.model, self.cache, self.rows, self.width, self.temperature = model, cache, rows, width, temperature
        self.ints = torch.zeros((6, rows), dtype=torch.int64, device=device)
        self.small = torch.zeros((rows * (1 + width),), dtype=torch.int32, device=device)
        self.floats = torch.zeros((3, rows), dtype=torch.float32, device=device)
        self.tokens, self.positions = self.ints[0].view(rows, 1), self.ints[1].view(rows, 1)
        self.seqlens, self.block_table = self.small[:rows], self.small[rows:].view(rows, width)
        self.out_tokens = torch.zeros((rows,), dtype=torch.int64, device=device)
        self.out_logprobs = torch.zeros((2, rows), dtype=torch.float32, device=device)
        self.graph = None
        self.hidden = None
        self.params: list[SamplingParams] = []  # the host's copy (the CPU sampler reads these)

    def run(self) -> None:
        cache, model = self.cache, self.model
        cache.use_block_table(self.block_table)
        hidden = model.forward_cached(self.tokens, self.positions, cache, self.seqlens)
        logits, raw = logits_and_raw(model, hidden)
        if logits.is_cuda:
            from rl_engine.kernels.ops.triton.sampling.sampler import sample_tokens

            ints, floats = self.ints, self.floats
            tokens = sample_tokens(logits, floats[0], ints[2], floats[1], floats[2], ints[3], ints[4], ints[5])
        else:
            tokens = sample(logits, self.params, self.ints[4].tolist(), self.ints[5].tolist())
        # -1 (no token: NaN/+inf logits) is refused once the host reads the tokens; no logprob op indexes with it
        targets = tokens.clamp_min(0)[:, None]
        self.out_tokens.copy_(tokens)
        self.out_logprobs[0].copy_(raw(targets))
        if self.temperature is not None:
            self.out_logprobs[1].copy_(tempered_logprobs(model, hidden, targets, self.temperature)[:, 0])
        self.hidden = hidden


def feed_sampled(step: _Step, previous: _Step, n: int) -> None:
    """A continued launch's input tokens: the previous launch's sampled tokens, device to device (stream order puts
    the copy after the previous replay)."""
    step.tokens[:n, 0].copy_(previous.out_tokens[:n])


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


@dataclass
class DecodeLaunch:
    """A launched decode step: its rows' results land in host memory; `results` waits for them."""

    seq_ids: list[int]
    greedy: list[bool]
    step: _Step
    tokens: torch.Tensor  # int64 [rows] on the host (pinned on CUDA)
    logprobs: torch.Tensor  # fp32 [2, rows] on the host
    done: torch.cuda.Event | None
    owners: list | None = None  # the caller's records of the sequences, row by row

    def results(self) -> tuple[list[int], torch.Tensor, torch.Tensor]:
        """tokens, raw logprobs [n], tempered logprobs [n] (greedy rows: raw) of the launch's n sequences."""
        if self.done is not None:
            self.done.synchronize()
        n = len(self.seq_ids)
        raw = self.logprobs[0, :n].clone()
        tempered = torch.where(torch.tensor(self.greedy), raw, self.logprobs[1, :n])
        return self.tokens[:n].tolist(), raw, tempered


class DecodeGraphs:
    def __init__(self, model, cache, max_batch_size: int, *, capture: bool):
        if any(model.config.sparse_layer(i) for i in range(model.config.num_layers)):
            raise ValueError("cuda_graphs: MoE layers read expert counts back to the host and cannot be captured; "
                             "pass cuda_graphs=False")
        self.model, self.cache = model, cache
        self.buckets = batch_buckets(max_batch_size)
        self.capture = capture
        self.pool = torch.cuda.graph_pool_handle() if capture else None
        self.steps: dict[tuple[int, int, float | None], _Step] = {}
        self.last: DecodeLaunch | None = None

    def launch(self, seq_ids: list[int], tokens: list[int] | None, starts: list[int], params: list[SamplingParams],
               draw_positions: list[int]) -> DecodeLaunch:
        """One decode step of n sequences feeding `tokens` at cache positions `starts`, sampling the token at
        `draw_positions` with `params`. tokens None: the previous launch's sampled tokens, on the device (the
        same sequences in the same order)."""
        n = len(seq_ids)
        rows = next(b for b in self.buckets if b >= n)
        tables = [self.cache.tables[s] for s in seq_ids]
        width = _pow2_at_least(max(len(t) for t in tables))
        temperature = graph_temperature(params)
        key = (rows, width, temperature)
        step = self.steps.get(key)
        new = step is None
        if new:
            step = self.steps[key] = _Step(self.model, self.cache, rows, width, temperature, self.cache.device)
        pad = rows - n
        step.params = list(params) + [_PAD] * pad
        ps = step.params
        ints = torch.tensor([(tokens or [0] * n) + [0] * pad, starts + [0] * pad, [p.top_k for p in ps],
                             [p.seed for p in ps], seq_ids + [0] * pad, draw_positions + [0] * pad], dtype=torch.int64)
        seqlens = torch.tensor([p + 1 for p in starts] + [1] * pad, dtype=torch.int32)
        small = torch.cat([seqlens, padded_block_table(tables, width, rows).view(-1)])
        floats = torch.tensor([[p.temperature for p in ps], [p.top_p for p in ps], [p.min_p for p in ps]],
                              dtype=torch.float32)
        for static, host in ((step.ints, ints), (step.small, small), (step.floats, floats)):
            static.copy_(host.pin_memory() if self.capture else host, non_blocking=self.capture)
        if tokens is None:
            if self.last is None or self.last.seq_ids != seq_ids:
                raise ValueError("decode launch: tokens=None continues the previous launch's sequences only")
            feed_sampled(step, self.last.step, n)
        if not self.capture:
            step.run()
        else:
            if new:  # capture's warm-up computes this step; the graph's first replay computes it again (same bits)
                step.graph = capture_graph(step.run, self.pool)
            step.graph.replay()
        self._other_temperatures(step, n)
        if self.capture:
            host_tokens = torch.empty((rows,), dtype=torch.int64, pin_memory=True)
            host_logprobs = torch.empty((2, rows), dtype=torch.float32, pin_memory=True)
            host_tokens.copy_(step.out_tokens, non_blocking=True)
            host_logprobs.copy_(step.out_logprobs, non_blocking=True)
            done = torch.cuda.Event()
            done.record()
        else:
            host_tokens, host_logprobs, done = step.out_tokens.clone(), step.out_logprobs.clone(), None
        self.last = DecodeLaunch(list(seq_ids), [p.greedy for p in params], step, host_tokens, host_logprobs, done)
        return self.last

    def _other_temperatures(self, step: _Step, n: int) -> None:
        """Tempered logprobs of rows sampled at a temperature other than the graph's, from the replay's hidden rows."""
        params = step.params[:n]
        for t in sorted({p.temperature for p in params if not p.greedy and p.temperature != step.temperature}):
            rows = torch.tensor([i for i, p in enumerate(params) if p.temperature == t], device=step.hidden.device)
            targets = step.out_tokens[rows].clamp_min(0)[:, None]
            step.out_logprobs[1, rows] = tempered_logprobs(self.model, step.hidden[rows], targets, t)[:, 0]
