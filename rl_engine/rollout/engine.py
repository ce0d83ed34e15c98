"""Rollout engine: continuous batching with chunked prefill over a paged KV cache, on the model's profile.

Each engine step:
  1. admission: waiting requests whose `arrival` step has come join the running batch, in arrival order
     (then request id), while there are fewer than `max_batch_size` running and the pool has pages for
     prompt + max_new_tokens (reserved whole at admission: no preemption);
  2. work: every running sequence either prefills its next prompt chunk (`chunk_size` tokens, the last
     chunk shorter) or decodes one token (its last sampled one). One `forward_cached` call per distinct
     query length (all decodes together; prefill chunks grouped by length), each over the paged cache;
  3. sampling: for every sequence whose forward reached the end of its known tokens, the last hidden row
     gives logits (`lm_head`) -> a token (rl_engine.rollout.sampling), and the token's logprobs, raw and
     at the sampling temperature (rl_engine.rollout.logprobs), from that same hidden row;
  4. a sequence stops at a stop token (kept in its output) or at max_new_tokens; its pages go back.
With `cuda_graphs`, the decode forward (+ lm_head) and the raw logprobs replay CUDA graphs captured per
batch bucket (rl_engine.rollout.decode_graph); prefill chunks stay eager.

Parity by construction (triton_bf16): every op a token meets is batch invariant (a row's bits depend on
its own inputs only), the chunk size, page size and tiles are constants, attention reduces keys in
fixed blocks from position 0 in prefill, chunked prefill and decode alike, and the sampler draws from
(seed, request id, position) alone. So a sequence's tokens and logprobs do not depend on the schedule
(arrival order, batch size, chunk size, page size) and equal the trainer's packed recompute.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from rl_engine.rollout.decode_graph import DecodeGraphs
from rl_engine.rollout.logprobs import tempered_logprobs
from rl_engine.rollout.paged_cache import PagedKvCache
from rl_engine.rollout.sampling import SamplingParams, sample


@dataclass(frozen=True)
class Request:
    request_id: int
    prompt_ids: tuple[int, ...]
    params: SamplingParams = SamplingParams()
    arrival: int = 0  # the engine step at which it may join


@dataclass
class Completion:
    request_id: int
    prompt_ids: tuple[int, ...]
    token_ids: list[int]
    logprobs: torch.Tensor  # fp32 [n]: at the sampling temperature (raw for greedy)
    raw_logprobs: torch.Tensor  # fp32 [n]: T = 1, linear_logp
    finish_reason: str  # "stop" or "length"


@dataclass
class _Running:
    request: Request
    prefilled: int = 0  # prompt tokens in the cache
    tokens: list = field(default_factory=list)
    logprobs: list = field(default_factory=list)
    raw: list = field(default_factory=list)

    @property
    def cached(self) -> int:
        """Cache positions filled: the prompt so far, then every sampled token but the newest."""
        return self.prefilled + max(len(self.tokens) - 1, 0)


@dataclass
class EngineStats:
    steps: int = 0
    forwards: int = 0
    prefill_tokens: int = 0
    decode_tokens: int = 0
    max_running: int = 0
    _totals: dict = field(default_factory=lambda: {"forward": 0.0, "sample": 0.0, "logprobs": 0.0})
    _pending: list = field(default_factory=list)  # (phase, start, end) CUDA events not yet read

    def add(self, phase: str, start, end) -> None:
        if isinstance(start, float):
            self._totals[phase] += end - start
            return
        self._pending.append((phase, start, end))
        # Events complete in stream order: fold the finished ones (query() never waits), so the list
        # stays a few steps long even when nobody reads the stats.
        while self._pending and self._pending[0][2].query():
            self._fold(*self._pending.pop(0))

    def _fold(self, phase: str, start, end) -> None:
        self._totals[phase] += start.elapsed_time(end) / 1e3

    @property
    def seconds(self) -> dict:
        """Time per phase: on a GPU the GPU time between CUDA events, read here (which waits for them;
        the generation loop itself never waits to time a phase); on the CPU, wall time."""
        for phase, start, end in self._pending:
            end.synchronize()
            self._fold(phase, start, end)
        self._pending.clear()
        return dict(self._totals)


class RolloutEngine:
    def __init__(self, model: torch.nn.Module, *, max_batch_size: int = 8, chunk_size: int = 16, page_size: int = 16,
                 num_pages: int = 256, cuda_graphs: bool | None = None):
        """cuda_graphs: replay decode steps from CUDA graphs. None: on for a dense model on a GPU. True on a
        CPU runs the graphs' padded static path without capture (what the CPU tests check)."""
        for name, value in (("max_batch_size", max_batch_size), ("chunk_size", chunk_size),
                            ("page_size", page_size)):
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name}: expected a positive integer, got {value!r}")
        self.model = model
        self.max_batch_size = max_batch_size
        self.chunk_size = chunk_size
        self.device = model.lm_head_weight.device
        self.cache = PagedKvCache(model.config, num_pages, page_size, model.ops.profile.dtype, self.device)
        self.stats = EngineStats()
        on_gpu = self.device.type == "cuda"
        if cuda_graphs is None:
            cuda_graphs = on_gpu and not any(model.config.sparse_layer(i) for i in range(model.config.num_layers))
        self.graphs = DecodeGraphs(model, self.cache, max_batch_size, capture=on_gpu) if cuda_graphs else None

    def _check(self, requests: list[Request]) -> None:
        ids = [r.request_id for r in requests]
        if len(set(ids)) != len(ids):
            raise ValueError("requests: request ids must be unique")
        vocab = self.model.config.vocab_size
        for r in requests:
            if not r.prompt_ids or not all(isinstance(t, int) and 0 <= t < vocab for t in r.prompt_ids):
                raise ValueError(f"request {r.request_id}: expected a non-empty prompt of ids in [0, {vocab})")
            need = self.cache.pages_for(len(r.prompt_ids) + r.params.max_new_tokens)
            if need > self.cache.num_pages - 1:
                raise ValueError(f"request {r.request_id}: needs {need} pages, the pool has {self.cache.num_pages - 1}")

    def generate(self, requests: list[Request]) -> dict[int, Completion]:
        """request id -> Completion, whatever the order in which sequences ran and finished."""
        self._check(requests)
        waiting = sorted(requests, key=lambda r: (r.arrival, r.request_id))
        running: list[_Running] = []
        done: dict[int, Completion] = {}
        step = 0
        with torch.no_grad():
            while waiting or running:
                while (waiting and waiting[0].arrival <= step and len(running) < self.max_batch_size
                       and self.cache.free_pages >= self.cache.pages_for(
                           len(waiting[0].prompt_ids) + waiting[0].params.max_new_tokens)):
                    r = waiting.pop(0)
                    self.cache.reserve(r.request_id, len(r.prompt_ids) + r.params.max_new_tokens)
                    running.append(_Running(r))
                self.stats.max_running = max(self.stats.max_running, len(running))
                if running:
                    self._step(running)
                for seq in [s for s in running if self._finished(s)]:
                    running.remove(seq)
                    self.cache.release(seq.request.request_id)
                    done[seq.request.request_id] = self._completion(seq)
                step += 1
                self.stats.steps += 1
        return done

    # -- one step -------------------------------------------------------------------------------
    def _work(self, seq: _Running) -> list[int]:
        """The token ids this sequence feeds this step."""
        prompt = seq.request.prompt_ids
        if seq.prefilled < len(prompt):
            return list(prompt[seq.prefilled : seq.prefilled + self.chunk_size])
        return [seq.tokens[-1]]

    def _step(self, running: list[_Running]) -> None:
        groups: dict[int, list[tuple[_Running, list[int]]]] = {}
        for seq in running:
            work = self._work(seq)
            groups.setdefault(len(work), []).append((seq, work))
        for length in sorted(groups):  # sampling is per row: sampling group by group changes no bit
            group = groups[length]
            graph = length == 1 and self.graphs is not None and all(
                s.prefilled == len(s.request.prompt_ids) for s, _ in group)
            hidden, logits = self._forward(group, graph)
            rows, owners = [], []
            for b, (seq, work) in enumerate(group):
                in_prompt = seq.prefilled < len(seq.request.prompt_ids)
                if in_prompt:
                    seq.prefilled += len(work)
                    self.stats.prefill_tokens += len(work)
                else:
                    self.stats.decode_tokens += 1
                if seq.prefilled == len(seq.request.prompt_ids):  # this forward reached its newest token
                    rows.append(b)
                    owners.append(seq)
            if owners:
                if logits is None:  # (graph steps sample every row, in order)
                    self._sample(hidden[rows, -1:], owners)
                else:
                    self._sample(hidden, owners, logits)

    def _forward(self, group, graph: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
        """hidden [n,Sq,H] of the group, and its logits [n,V] when a decode graph computed them."""
        t0 = self._mark()
        starts = [s.cached for s, _ in group]
        if graph:
            hidden, logits = self.graphs.forward([s.request.request_id for s, _ in group], [w[0] for _, w in group],
                                                 starts)
            self.stats.forwards += 1
            self.stats.add("forward", t0, self._mark())
            return hidden, logits
        tokens = torch.tensor([w for _, w in group], dtype=torch.int64, device=self.device)
        sq = tokens.shape[1]
        positions = torch.tensor(starts, dtype=torch.int64, device=self.device)[:, None] + torch.arange(
            sq, device=self.device)
        seqlens = torch.tensor([p + sq for p in starts], dtype=torch.int32, device=self.device)
        self.cache.bind([s.request.request_id for s, _ in group])
        hidden = self.model.forward_cached(tokens, positions, self.cache, seqlens)
        self.stats.forwards += 1
        self.stats.add("forward", t0, self._mark())
        return hidden, None

    def _sample(self, hidden: torch.Tensor, owners: list[_Running], logits: torch.Tensor | None = None) -> None:
        """hidden [n,1,H]: the last row of each owner; draws its next token and records its logprobs."""
        t0 = self._mark()
        from_graph = logits is not None
        if not from_graph:
            logits = self.model.logits(hidden)[:, 0]
        params = [s.request.params for s in owners]
        positions = [len(s.request.prompt_ids) + len(s.tokens) for s in owners]
        tokens = sample(logits, params, [s.request.request_id for s in owners], positions)
        t1 = self._mark()
        targets = tokens[:, None]
        if from_graph:
            raw = self.graphs.raw_logprobs(tokens)
        else:
            raw = self.model.selected_logprobs(hidden, targets)[:, 0]
        tempered = raw.clone()
        for temperature in sorted({p.temperature for p in params if not p.greedy}):
            rows = torch.tensor([i for i, p in enumerate(params) if p.temperature == temperature], device=self.device)
            tempered[rows] = tempered_logprobs(self.model, hidden[rows], targets[rows], temperature)[:, 0]
        t2 = self._mark()
        # The step's one wait for the GPU: the host needs the tokens (the next step's inputs, stop checks).
        for seq, token, lp, rp in zip(owners, tokens.tolist(), tempered.cpu(), raw.cpu()):
            seq.tokens.append(token)
            seq.logprobs.append(lp)
            seq.raw.append(rp)
        self.stats.add("sample", t0, t1)
        self.stats.add("logprobs", t1, t2)

    def _mark(self):
        """A point to time from: a CUDA event recorded on the stream (no wait), or the wall clock on the CPU."""
        if self.device.type != "cuda":
            return time.perf_counter()
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    @staticmethod
    def _finished(seq: _Running) -> bool:
        p = seq.request.params
        return bool(seq.tokens) and (seq.tokens[-1] in p.stop_token_ids or len(seq.tokens) >= p.max_new_tokens)

    @staticmethod
    def _completion(seq: _Running) -> Completion:
        p = seq.request.params
        reason = "stop" if seq.tokens[-1] in p.stop_token_ids else "length"
        return Completion(seq.request.request_id, seq.request.prompt_ids, list(seq.tokens),
                          torch.stack(seq.logprobs), torch.stack(seq.raw), reason)
