"""Rollout engine: continuous batching with chunked prefill over a paged KV cache, on the model's profile.

A sequence's known tokens are its prompt, then its sampled tokens; `cached` of them have keys and values
in the cache. Each engine step:
  1. pages: every running sequence gets pages for the positions it writes this step (new pages, and a
     copy of any page it would write that another sequence shares). When the pool is short, the newest
     running sequence is evicted (preempted): its pages go back and it returns to the front of the
     queue with its sampled tokens, to be recomputed later by prefilling prompt + tokens (prefill and
     decode give the same bits, so eviction changes no bit);
  2. admission: waiting requests whose `arrival` step has come join, in arrival order (then request id),
     while there are fewer than `max_batch_size` running and the pool has the pages of their first work
     (with `preemption=False`: the pages of prompt + max_new_tokens, counted against every running
     sequence's remaining worst case, so nothing is ever evicted);
  3. work: every running sequence feeds its next `chunk_size` known tokens not yet cached (a prompt chunk,
     a recompute chunk, or in decode its newest token). One `forward_cached` call per distinct query
     length (all decodes together; prefill chunks grouped by length), each over the paged cache;
  4. sampling: for every sequence whose forward reached its newest known token, the last hidden row
     gives logits -> a token (rl_engine.rollout.sampling), and the token's logprobs, raw and at the
     sampling temperature (rl_engine.rollout.logprobs), from that same hidden row (under a Triton profile
     one kernel reads the lm_head for the logits and the raw logprobs: `logits_and_raw`);
  5. a sequence stops at a stop token (kept in its output) or at max_new_tokens; its pages go back.
With `prefix_sharing`, requests with the same prompt_ids (a GRPO group) prefill it once: a later member
waits for one member to cache the prompt, then takes that member's pages for the prompt's first
len - 1 positions (page refcounts in the cache) and feeds only the last prompt token itself, writing
it, and everything after, into pages of its own (the shared partial page is copied on write).
With `cuda_graphs`, a step in which every running sequence decodes is one CUDA graph replay (forward,
lm_head, sampler, both logprobs: rl_engine.rollout.decode_graph); prefill chunks stay eager. Such a step is
then overlapped: when the next step would feed the same sequences again (no admission due, no sequence at
max_new_tokens, pages at hand without eviction), it is launched on the device's sampled tokens before the host
reads this step's, so the host's bookkeeping of step t runs while the GPU computes step t+1. A sequence that
samples a stop token at step t has then also run step t+1: that row is dropped (batch invariance: no other
row sees it), and its pages go back as it finishes.

Parity by construction (triton_bf16): every op a token meets is batch invariant (a row's bits depend on
its own inputs only), the chunk size, page size and tiles are constants, attention reduces keys in
fixed blocks from position 0 in prefill, chunked prefill and decode alike, and the sampler draws from
(seed, request id, position) alone. So a sequence's tokens and logprobs do not depend on the schedule
(arrival order, batch size, chunk size, page size, sharing, eviction) and equal the trainer's packed
recompute.
"""

from __future__ import annotations

import operator
import time
from dataclasses import dataclass, field

import torch

from rl_engine.rollout.decode_graph import DecodeGraphs
from rl_engine.rollout.logprobs import logits_and_raw, tempered_logprobs
from rl_engine.rollout.paged_cache import PagedKvCache
from rl_engine.rollout.sampling import SamplingParams, check_tokens, sample

_ID_LIMIT = 2**63  # ids are keyed into the sampler's hash as 64-bit words


def _index(name: str, value, limit: int = _ID_LIMIT) -> int:
    """value as an int in [0, limit): TypeError for a non-integer (bool, float, str, tensor), else ValueError."""
    if isinstance(value, (bool, float, str, torch.Tensor)) or not hasattr(value, "__index__"):
        raise TypeError(f"{name}: expected an integer, got {type(value).__name__} {value!r}")
    value = operator.index(value)
    if not 0 <= value < limit:
        raise ValueError(f"{name}: expected an integer in [0, {'2^63' if limit == _ID_LIMIT else limit}), got {value}")
    return value


@dataclass(frozen=True)
class Request:
    request_id: int
    prompt_ids: tuple[int, ...]
    params: SamplingParams = SamplingParams()
    arrival: int = 0  # the engine step at which it may join

    def __post_init__(self):
        _index("request_id", self.request_id)
        ids = self.prompt_ids
        if not isinstance(ids, (tuple, list)):
            hint = " (pass tensor.tolist())" if isinstance(ids, torch.Tensor) else ""
            raise TypeError(f"prompt_ids: expected a tuple of token ids, got {type(ids).__name__}{hint}")
        if not ids:
            raise ValueError(f"request {self.request_id}: expected a non-empty prompt (prompt_ids is empty)")
        object.__setattr__(self, "prompt_ids", tuple(_index("prompt_ids", t) for t in ids))
        if not isinstance(self.params, SamplingParams):
            raise TypeError(f"params: expected SamplingParams, got {type(self.params).__name__}")
        _index("arrival", self.arrival)


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
    cached: int = 0  # known tokens (prompt, then sampled) whose keys and values are in the cache
    tokens: list = field(default_factory=list)
    logprobs: list = field(default_factory=list)
    raw: list = field(default_factory=list)
    waits: bool = False  # waits for another member of its prompt group to cache the shared prompt
    shared: int = 0  # prompt positions taken from a member, counted in the stats once it runs
    retired: bool = False  # finished; a row of it in an overlapped step in flight is dropped

    @property
    def id(self) -> int:
        return self.request.request_id

    @property
    def known(self) -> int:
        return len(self.request.prompt_ids) + len(self.tokens)

    def work(self, chunk_size: int) -> list[int]:
        """The known tokens this sequence feeds next: up to chunk_size from `cached` (in decode: its newest)."""
        prompt, n = self.request.prompt_ids, len(self.request.prompt_ids)
        start, end = self.cached, min(self.cached + chunk_size, self.known)
        if start >= n:
            return self.tokens[start - n : end - n]
        return list(prompt[start : min(end, n)]) + self.tokens[: max(end - n, 0)]


@dataclass
class EngineStats:
    steps: int = 0
    forwards: int = 0
    max_forward_tokens: int = 0  # the most tokens one eager forward held (at most max_num_batched_tokens)
    prefill_tokens: int = 0
    decode_tokens: int = 0
    max_running: int = 0
    preemptions: int = 0  # sequences evicted to free pages
    recomputed_tokens: int = 0  # cached tokens the evicted sequences had (fed again when they come back)
    shared_prompt_tokens: int = 0  # prompt positions read from a group member's pages instead of prefilled
    graph_steps: int = 0  # decode steps replayed as one CUDA graph (forward, sampling, logprobs)
    overlapped_steps: int = 0  # of those, launched before the host had read the previous step's tokens
    dropped_rows: int = 0  # rows of overlapped steps whose sequence had stopped at the step before
    _totals: dict = field(default_factory=lambda: {"forward": 0.0, "sample": 0.0, "logprobs": 0.0, "decode_graph": 0.0})
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


@dataclass
class _WholeHead:
    """What `tempered_logprobs` reads of a model: its lm_head matrix and its ops."""

    lm_head_weight: torch.Tensor
    ops: object


class RolloutEngine:
    def __init__(self, model: torch.nn.Module, *, max_batch_size: int = 8, chunk_size: int = 16, page_size: int = 16,
                 num_pages: int = 256, cuda_graphs: bool | None = None, prefix_sharing: bool = True,
                 preemption: bool = True, max_num_batched_tokens: int = 8192):
        """cuda_graphs: replay decode steps from CUDA graphs. None: on for a dense model on a GPU. True on a
        CPU runs the graphs' padded static path without capture (what the CPU tests check).
        prefix_sharing: requests with the same prompt_ids prefill it once and share its pages.
        preemption: admit on the pages of a request's first step and evict the newest sequence when the pool
        runs short (False: admit only when prompt + max_new_tokens of every running sequence fit).
        max_num_batched_tokens: the most tokens one eager forward holds (vLLM's name); prefill chunks beyond it
        run in further forwards, which bounds the activations' memory and changes no bit (batch invariance)."""
        for name, value in (("max_batch_size", max_batch_size), ("chunk_size", chunk_size),
                            ("page_size", page_size), ("max_num_batched_tokens", max_num_batched_tokens)):
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name}: expected a positive integer, got {value!r}")
        self.model = model
        self.max_batch_size = max_batch_size
        self.chunk_size = chunk_size
        self.max_num_batched_tokens = max_num_batched_tokens
        self.prefix_sharing = bool(prefix_sharing)
        self.preemption = bool(preemption)
        self.device = model.lm_head_weight.device
        # A TensorParallelDecoder (rl_engine.parallel): its cache holds this rank's heads; sampling and the
        # tempered logprobs read the whole lm_head, gathered from the ranks' vocabulary slices.
        self.tensor_parallel = hasattr(model, "full_config")
        self.cache = PagedKvCache(model.config, num_pages, page_size, model.ops.profile.dtype, self.device)
        self.stats = EngineStats()
        on_gpu = self.device.type == "cuda"
        if cuda_graphs is None:
            cuda_graphs = on_gpu and not self.tensor_parallel and not any(
                model.config.sparse_layer(i) for i in range(model.config.num_layers))
        if cuda_graphs and self.tensor_parallel:
            raise ValueError("cuda_graphs: not with a tensor-parallel model (its collectives are not captured); "
                             "pass cuda_graphs=False")
        self.graphs = DecodeGraphs(model, self.cache, max_batch_size, capture=on_gpu) if cuda_graphs else None
        self._head = None
        self._refresh_head()

    # -- weights ----------------------------------------------------------------------------------
    def update_weights(self, named_tensors) -> list[str]:
        """Copy new weights into the model's own tensors, in place, between RL steps; returns the names.

        named_tensors: (name, tensor) pairs under the model's weight names (its Hugging Face names, as vLLM's
        `load_weights` takes them); any subset of the weights. Every pair is checked before anything is
        copied: an unknown or repeated name, another shape, a non-float tensor for a float weight (or another
        dtype for an integer one), or a value that is not finite in the model's dtype is one error and
        changes nothing. A float tensor of another dtype is cast as the model's constructor casts it (round to
        nearest even), so the engine holds what a fresh engine built on these tensors would. `copy_` keeps
        every tensor where it was, so captured CUDA graphs read the new values; a model that keeps tensors
        derived from its weights (fused or transposed copies) refreshes them in `refresh_derived(names)`,
        called here after the copy. The cache holds nothing across `generate` calls, so no key or value of
        the old weights is ever read.
        """
        weights = self.model.w
        pairs, seen = [], set()
        for item in named_tensors:
            if not (isinstance(item, tuple) and len(item) == 2):
                raise TypeError(f"update_weights: expected (name, tensor) pairs, got {type(item).__name__}")
            name, tensor = item
            if not isinstance(name, str) or name not in weights:
                raise ValueError(f"update_weights: unknown weight name {name!r} (the model's names are its "
                                 f"Hugging Face names, e.g. {next(iter(weights))!r})")
            if name in seen:
                raise ValueError(f"update_weights: {name!r} given twice")
            seen.add(name)
            if not isinstance(tensor, torch.Tensor):
                raise TypeError(f"update_weights: {name}: expected a tensor, got {type(tensor).__name__}")
            target = weights[name]
            tensor = self._local_part(name, tensor)
            if tuple(tensor.shape) != tuple(target.shape):
                raise ValueError(f"update_weights: {name}: expected shape {tuple(target.shape)}, got "
                                 f"{tuple(tensor.shape)}")
            floating = target.is_floating_point()
            if tensor.is_complex() or tensor.is_floating_point() != floating or (
                    not floating and tensor.dtype != target.dtype):
                kind = "a floating-point dtype" if floating else str(target.dtype)
                raise TypeError(f"update_weights: {name}: expected {kind}, got {tensor.dtype}")
            if floating and not bool(torch.isfinite(tensor.to(device=target.device, dtype=target.dtype)).all()):
                raise ValueError(f"update_weights: {name}: holds NaN or inf (in {target.dtype})")
            pairs.append((name, tensor))
        for name, tensor in pairs:
            weights[name].copy_(tensor)
        names = [name for name, _ in pairs]
        refresh = getattr(self.model, "refresh_derived", None)
        if refresh is not None and names:
            refresh(names)
        if self.tensor_parallel and self._head_name() in names:
            self._refresh_head()
        return names

    def _local_part(self, name: str, tensor: torch.Tensor) -> torch.Tensor:
        """A whole checkpoint tensor cut to this rank's slice under tensor parallelism (else as given)."""
        if not self.tensor_parallel:
            return tensor
        from rl_engine.models.weights import checkpoint_shapes
        from rl_engine.parallel.tp_decoder import weight_part

        model = self.model
        whole = checkpoint_shapes(model.full_config).get(name)
        if tuple(tensor.shape) != whole:
            return tensor
        index = weight_part(model.full_config, model.group, model.ops.profile.name)(name, whole)
        return tensor if index is None else tensor[index]

    # -- the head: logits for sampling, tempered logprobs -----------------------------------------
    def _head_name(self) -> str:
        return self.model.name("embed" if self.model.config.tie_word_embeddings else "lm_head")

    def _refresh_head(self) -> None:
        """Under tensor parallelism, the whole lm_head gathered from the ranks (a derived copy: refreshed by
        `update_weights`). The ranks' slices are runs of whole rows, so the gather is exact."""
        if not self.tensor_parallel:
            return
        import torch.distributed as dist

        from rl_engine.parallel.tp_kernels import vocab_align, vocab_bounds

        model, local = self.model, self.model.lm_head_weight
        if model.group is None or model.ranks.size == 1:
            self._head = local
            return
        bounds = vocab_bounds(model.full_config.vocab_size, model.ranks.size, vocab_align(local.dtype))
        width = max(b - a for a, b in zip(bounds, bounds[1:]))
        padded = torch.zeros((width, local.shape[1]), dtype=local.dtype, device=local.device)
        padded[: local.shape[0]] = local
        parts = [torch.empty_like(padded) for _ in range(model.ranks.size)]
        dist.all_gather(parts, padded, group=model.group)
        head = torch.cat([p[: b - a] for p, a, b in zip(parts, bounds, bounds[1:])])
        if self._head is None:
            self._head = head
        else:
            self._head.copy_(head)

    def _logits(self, hidden: torch.Tensor) -> torch.Tensor:
        if not self.tensor_parallel:
            return self.model.logits(hidden)
        return self.model.ops("lm_head", "lm_head", hidden=hidden, weight=self._head)

    def _tempered(self, hidden, targets, temperature) -> torch.Tensor:
        model = self.model
        if self.tensor_parallel:  # the single-GPU computation on the whole head (hidden rows are replicated)
            model = _WholeHead(self._head, model.ops)
        return tempered_logprobs(model, hidden, targets, temperature)

    # -- requests ---------------------------------------------------------------------------------
    def _check(self, requests: list[Request]) -> None:
        if not isinstance(requests, (list, tuple)):
            raise TypeError(f"requests: expected a list of Request, got {type(requests).__name__}")
        for r in requests:
            if not isinstance(r, Request):
                raise TypeError(f"requests: expected Request objects, got {type(r).__name__}")
        ids = [r.request_id for r in requests]
        if len(set(ids)) != len(ids):
            repeated = sorted({i for i in ids if ids.count(i) > 1})
            raise ValueError(f"requests: request ids must be unique; repeated: {repeated[:5]}")
        vocab = self.model.config.vocab_size
        for r in requests:
            if not all(t < vocab for t in r.prompt_ids):
                raise ValueError(f"request {r.request_id}: expected a non-empty prompt of ids in [0, {vocab})")
            # Alone in the pool, a sequence must fit whole: eviction frees everything but the oldest.
            need = self.cache.pages_for(len(r.prompt_ids) + r.params.max_new_tokens)
            if need > self.cache.num_pages - 1:
                raise ValueError(f"request {r.request_id}: needs {need} pages, the pool has {self.cache.num_pages - 1}")

    def generate(self, requests: list[Request]) -> dict[int, Completion]:
        """request id -> Completion, whatever the order in which sequences ran and finished."""
        self._check(requests)
        waiting = [_Running(r) for r in sorted(requests, key=lambda r: (r.arrival, r.request_id))]
        running: list[_Running] = []
        done: dict[int, Completion] = {}
        step = 0
        pending = None  # a launched decode graph step whose tokens the host has not read yet
        try:
            with torch.no_grad():
                while waiting or running:
                    if pending is not None:  # step t's results; step t+1 launched first when it may be
                        launched = self._overlap(pending, running, waiting, step)
                        self._settle(pending)
                        self._retire(running, done)
                        pending = launched
                        if launched is not None:
                            step += 1
                            self.stats.steps += 1
                            continue
                        if not (waiting or running):
                            break
                    step = self._next_step(step, running, waiting)
                    self._allocate(running, waiting)
                    self._admit(running, waiting, step)
                    self.stats.max_running = max(self.stats.max_running, len(running))
                    pending = self._step(running)
                    if pending is None:
                        self._retire(running, done)
                    step += 1
                    self.stats.steps += 1
                if pending is not None:
                    self._settle(pending)
                    self._retire(running, done)
        finally:  # an error mid-way leaves no page taken
            for seq_id in list(self.cache.tables):
                self.cache.release(seq_id)
        return done

    def _retire(self, running: list[_Running], done: dict[int, Completion]) -> None:
        """Finished sequences leave the batch and give their pages back."""
        for seq in [s for s in running if self._finished(s)]:
            running.remove(seq)
            seq.retired = True
            self.cache.release(seq.id)
            done[seq.id] = self._completion(seq)

    @staticmethod
    def _next_step(step: int, running: list[_Running], waiting: list[_Running]) -> int:
        """With nothing running, the step of the next arrival: no idle steps (arrival=10**9 does not spin)."""
        return max(step, waiting[0].request.arrival) if not running else step

    # -- pages and admission ----------------------------------------------------------------------
    def _span(self, seq: _Running) -> tuple[int, int]:
        """The cache positions [start, end) the sequence writes this step."""
        return seq.cached, min(seq.cached + self.chunk_size, seq.known)

    def _attach(self, seq: _Running, running: list[_Running]) -> None:
        """A waiting group member takes the shared prompt's pages once a member has cached them; if no member
        is caching them any more (evicted, finished), it prefills the prompt itself."""
        prompt = seq.request.prompt_ids
        shared = len(prompt) - 1  # the last prompt token is fed again: its hidden row gives the first token
        members = [s for s in running if s is not seq and not s.waits and s.request.prompt_ids == prompt]
        source = next((s for s in members if s.cached >= shared), None)
        if source is not None:
            self.cache.share(source.id, seq.id, shared)
            seq.cached = seq.shared = shared
            seq.waits = False
        elif not members:
            seq.waits = False

    def _place(self, seq: _Running, running: list[_Running]) -> bool:
        """Pages for the sequence's work this step (after attaching it to its group); False: the pool is short."""
        if seq.waits:
            self._attach(seq, running)
            if seq.waits:
                return True
        start, end = self._span(seq)
        if self.cache.write_cost(seq.id, start, end) > self.cache.free_pages:
            return False
        self.cache.prepare_write(seq.id, start, end)
        return True

    def _allocate(self, running: list[_Running], waiting: list[_Running]) -> None:
        """Pages for every running sequence, oldest first; when short, evict the newest that holds pages (the
        short one itself, if it is the newest): the oldest always progresses, and fits alone (`_check`)."""
        for seq in list(running):
            while seq in running and not self._place(seq, running):
                if not self.preemption:
                    raise RuntimeError("rollout engine: the page budget of preemption=False was exceeded")
                victim = next(s for s in reversed(running) if s is seq or s.id in self.cache.tables)
                self._evict(victim, running, waiting)

    def _evict(self, seq: _Running, running: list[_Running], waiting: list[_Running]) -> None:
        running.remove(seq)
        if seq.id in self.cache.tables:
            self.cache.release(seq.id)
        self.stats.preemptions += 1
        self.stats.recomputed_tokens += seq.cached
        seq.cached, seq.waits, seq.shared = 0, False, 0
        waiting.insert(0, seq)  # first in line again; evicted newest first, so the older ends up in front

    def _worst_pages(self, seq: _Running, group: bool) -> int:
        """Pages the sequence may still take: up to prompt + max_new_tokens, and one copy-on-write page."""
        total = self.cache.pages_for(len(seq.request.prompt_ids) + seq.request.params.max_new_tokens)
        return max(total + int(group) - len(self.cache.tables.get(seq.id, ())), 0)

    def _admit(self, running: list[_Running], waiting: list[_Running], step: int) -> None:
        while waiting and len(running) < self.max_batch_size and waiting[0].request.arrival <= step:
            seq = waiting[0]
            prompt = seq.request.prompt_ids
            seq.waits = self.prefix_sharing and len(prompt) > 1 and any(
                s.request.prompt_ids == prompt for s in running)
            if not self.preemption and running:
                budget = self.cache.free_pages - sum(
                    self._worst_pages(s, self._grouped(s, running, waiting)) for s in running)
                if budget < self._worst_pages(seq, self._grouped(seq, running, waiting)):
                    break
            running.append(seq)
            if not self._place(seq, running):  # admission evicts nobody: it waits for pages
                running.pop()
                if seq.id in self.cache.tables:
                    self.cache.release(seq.id)
                seq.cached, seq.waits, seq.shared = 0, False, 0
                break
            waiting.pop(0)

    def _grouped(self, seq: _Running, running: list[_Running], waiting: list[_Running]) -> bool:
        """Whether the sequence may share pages (and so copy one on write): another with its prompt exists."""
        prompt = seq.request.prompt_ids
        return self.prefix_sharing and any(s is not seq and s.request.prompt_ids == prompt for s in running + waiting)

    # -- one step -------------------------------------------------------------------------------
    def _step(self, running: list[_Running]):
        """Feeds every running sequence its work. Returns the step's decode graph launch, whose results the
        caller reads (`_settle`), or None when everything ran eagerly and its tokens are recorded."""
        groups: dict[int, list[tuple[_Running, list[int]]]] = {}
        for seq in running:
            if not seq.waits:
                self.stats.shared_prompt_tokens += seq.shared
                seq.shared = 0
                work = seq.work(self.chunk_size)
                groups.setdefault(len(work), []).append((seq, work))
        launch = None
        for length in sorted(groups):  # sampling is per row: sampling group by group changes no bit
            group = groups[length]
            if length == 1 and self.graphs is not None and all(s.cached + 1 == s.known for s, _ in group):
                launch = self._launch([s for s, _ in group], [w[0] for _, w in group])
                continue
            per_forward = max(1, self.max_num_batched_tokens // length)
            for first in range(0, len(group), per_forward):
                self._eager(group[first:first + per_forward])
        return launch

    def _eager(self, group: list[tuple[_Running, list[int]]]) -> None:
        """One eager forward of the group's work (equal lengths), then sampling for the rows that reached their
        newest token."""
        hidden = self._forward(group)
        rows, owners = [], []
        for b, (seq, work) in enumerate(group):
            prompt_part = max(min(len(seq.request.prompt_ids) - seq.cached, len(work)), 0)
            self.stats.prefill_tokens += prompt_part
            self.stats.decode_tokens += len(work) - prompt_part
            seq.cached += len(work)
            if seq.cached == seq.known:  # this forward reached its newest token
                rows.append(b)
                owners.append(seq)
        if owners:
            self._sample(hidden[rows, -1:], owners)

    def _launch(self, owners: list[_Running], tokens: list[int] | None):
        """One decode graph step of `owners`, each feeding one token (None: the last launch's sampled tokens,
        on the device) at its position `cached`; launched, not read."""
        t0 = self._mark()
        launch = self.graphs.launch([s.id for s in owners], tokens, [s.cached for s in owners],
                                    [s.request.params for s in owners],
                                    [s.known + (tokens is None) for s in owners])
        launch.owners = owners
        for seq in owners:
            prompt = seq.cached < len(seq.request.prompt_ids)  # a group member's feed of its last prompt token
            self.stats.prefill_tokens += prompt
            self.stats.decode_tokens += not prompt
            seq.cached += 1
        self.stats.forwards += 1
        self.stats.graph_steps += 1
        self.stats.add("decode_graph", t0, self._mark())
        return launch

    def _overlap(self, pending, running: list[_Running], waiting: list[_Running], step: int):
        """Launch the next step on `pending`'s sampled tokens before reading them, when that step would feed the
        same sequences (unless a stop token ends one: its row is then dropped): no sequence reaches its
        max_new_tokens, no admission is due, and the pages of the next position come without eviction."""
        owners = pending.owners
        if len(owners) != len(running) or any(a is not b for a, b in zip(owners, running)):
            return None
        if any(len(s.tokens) + 1 >= s.request.params.max_new_tokens for s in owners):
            return None
        if waiting and len(running) < self.max_batch_size and waiting[0].request.arrival <= step:
            return None
        if sum(self.cache.write_cost(s.id, s.cached, s.cached + 1) for s in owners) > self.cache.free_pages:
            return None
        for seq in owners:
            self.cache.prepare_write(seq.id, seq.cached, seq.cached + 1)
        self.stats.overlapped_steps += 1
        return self._launch(owners, None)

    def _settle(self, launch) -> None:
        """Reads a decode graph step's tokens and logprobs (the step's one wait) and records them."""
        tokens, raw, tempered = launch.results()
        live = [(b, s) for b, s in enumerate(launch.owners) if not s.retired]
        self.stats.dropped_rows += len(launch.owners) - len(live)
        check_tokens([tokens[b] for b, _ in live], [s.id for _, s in live])
        for b, seq in live:
            seq.tokens.append(tokens[b])
            seq.logprobs.append(tempered[b])
            seq.raw.append(raw[b])

    def _forward(self, group) -> torch.Tensor:
        """hidden [n,Sq,H] of the group, eagerly."""
        t0 = self._mark()
        starts = [s.cached for s, _ in group]
        tokens = torch.tensor([w for _, w in group], dtype=torch.int64, device=self.device)
        sq = tokens.shape[1]
        positions = torch.tensor(starts, dtype=torch.int64, device=self.device)[:, None] + torch.arange(
            sq, device=self.device)
        seqlens = torch.tensor([p + sq for p in starts], dtype=torch.int32, device=self.device)
        self.cache.bind([s.id for s, _ in group])
        hidden = self.model.forward_cached(tokens, positions, self.cache, seqlens)
        self.stats.forwards += 1
        self.stats.max_forward_tokens = max(self.stats.max_forward_tokens, tokens.numel())
        self.stats.add("forward", t0, self._mark())
        return hidden

    def _sample(self, hidden: torch.Tensor, owners: list[_Running]) -> None:
        """hidden [n,1,H]: the last row of each owner; draws its next token and records its logprobs."""
        t0 = self._mark()
        if self.tensor_parallel:
            logits = self._logits(hidden)[:, 0]
            raw_of = lambda targets: self.model.selected_logprobs(hidden, targets)[:, 0]  # noqa: E731
        else:
            logits, raw_of = logits_and_raw(self.model, hidden)
        params = [s.request.params for s in owners]
        positions = [len(s.request.prompt_ids) + len(s.tokens) for s in owners]
        ids = [s.id for s in owners]
        tokens = sample(logits, params, ids, positions)
        t1 = self._mark()
        # -1 (no token: NaN/+inf logits) is refused below, once the host reads the tokens; the logprob ops
        # must not index with it before that.
        targets = tokens.clamp_min(0)[:, None]
        raw = raw_of(targets)
        tempered = raw.clone()
        for temperature in sorted({p.temperature for p in params if not p.greedy}):
            rows = torch.tensor([i for i, p in enumerate(params) if p.temperature == temperature], device=self.device)
            tempered[rows] = self._tempered(hidden[rows], targets[rows], temperature)[:, 0]
        t2 = self._mark()
        # The step's one wait for the GPU: the host needs the tokens (the next step's inputs, stop checks).
        token_list = tokens.tolist()
        check_tokens(token_list, ids)
        for seq, token, lp, rp in zip(owners, token_list, tempered.cpu(), raw.cpu()):
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
