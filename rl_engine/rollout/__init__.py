"""Generation on rl_engine's kernels, bitwise on-policy: paged KV cache, continuous batching with chunked
prefill, per-sequence counter-based sampling, logprobs from the trainer's own ops (docs/rollout.md)."""

from rl_engine.rollout.engine import Completion, EngineStats, Request, RolloutEngine
from rl_engine.rollout.logprobs import loss_backend, tempered_logprobs
from rl_engine.rollout.paged_cache import PagedKvCache
from rl_engine.rollout.sampling import SamplingParams, sample

__all__ = ["Completion", "EngineStats", "PagedKvCache", "Request", "RolloutEngine", "SamplingParams", "loss_backend",
           "sample", "tempered_logprobs"]
