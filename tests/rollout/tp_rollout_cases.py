"""What the ranks run for tests/rollout/test_tp_rollout.py (spawned ranks import this module by name)."""

from __future__ import annotations

import interpreter_memos
import torch.distributed as dist

from rl_engine.models.config import ModelConfig
from rl_engine.models.weights import synthetic_weights
from rl_engine.parallel.tp_decoder import TensorParallelDecoder
from rl_engine.rollout import Request, RolloutEngine, SamplingParams

interpreter_memos.install()  # spawned ranks import this module, not conftest (tests/interpreter_memos.py)

# The rollout tests' micro Qwen3 with 2 KV heads (one head of each kind per rank at TP = 2; o_proj's K of 16
# per rank is one K step, and V = 64 two linear_logp chunks of 32). Prompts of one length: a prefill forward
# and a decode forward per generate.
CONFIG = ModelConfig("tp-rollout-micro", "qwen3", 64, 32, 64, 1, 2, 2, 16)
REQUESTS = [Request(0, (5, 17, 33, 2), SamplingParams(temperature=0.8, top_p=0.9, max_new_tokens=2, seed=1)),
            Request(1, (40, 41, 7, 60), SamplingParams(temperature=0.0, max_new_tokens=2))]
ENGINE = {"chunk_size": 4, "page_size": 4, "cuda_graphs": False}


def weights(seed: int) -> dict:
    return synthetic_weights(CONFIG, seed)


def plain(out: dict) -> dict:
    """request id -> (tokens, logprobs, raw logprobs): what comes back from a rank."""
    return {i: (c.token_ids, c.logprobs, c.raw_logprobs) for i, c in out.items()}


def engine_run(engine) -> dict:
    return plain(engine.generate(REQUESTS))


def rollout_ranks(rank: int, world_size: int, device: str) -> dict:
    """spawn_group entry: the engine on the TP decoder, before and after an update to other weights (whole
    tensors: each rank takes its slices, the gathered lm_head is refreshed), then with a planted stale
    gathered head (updated back to the first weights, head not refreshed)."""
    group = dist.new_group(list(range(world_size)))
    engine = RolloutEngine(TensorParallelDecoder(CONFIG, weights(3), group), **ENGINE)
    out = {"old": engine_run(engine)}
    engine.update_weights(weights(4).items())
    out["new"] = engine_run(engine)
    engine._refresh_head = lambda: None  # the planted bug
    engine.update_weights(weights(3).items())
    out["planted_stale_head"] = engine_run(engine)
    return out
