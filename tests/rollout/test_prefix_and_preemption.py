"""Prefix sharing (a GRPO group prefills its prompt once) and preemption (evict, then recompute) under
triton_bf16 on the Triton interpreter: every sequence gets the bits it gets without them."""

import pytest
import torch

import rl_engine.rollout.engine as engine_module
from rl_engine.rollout import Request, RolloutEngine, SamplingParams
from rl_engine.rollout.paged_cache import PagedKvCache

PROFILE = "triton_bf16"
# A group of 3 on one prompt of 6 tokens (page 4: the shared positions 0-4 end inside page 1, which every
# member then writes: copy-on-write), and two requests on prompts of their own.
GROUP = (5, 17, 33, 2, 9, 40)
PARAMS = SamplingParams(temperature=1.0, max_new_tokens=3, seed=7)
REQUESTS = [Request(i, GROUP, PARAMS) for i in range(3)] + [Request(3, (7, 7, 60), PARAMS),
                                                           Request(4, (1, 8, 21), PARAMS)]


def mismatches(got: dict, want: dict) -> list[int]:
    return [i for i, w in want.items() if got[i].token_ids != w.token_ids or not all(
        torch.equal(x.view(torch.int32), y.view(torch.int32))
        for x, y in ((got[i].logprobs, w.logprobs), (got[i].raw_logprobs, w.raw_logprobs)))]


@pytest.fixture(scope="module")
def unshared(micro_model):
    engine = RolloutEngine(micro_model(PROFILE), chunk_size=8, page_size=4, prefix_sharing=False)
    out = engine.generate(REQUESTS)
    assert engine.stats.shared_prompt_tokens == 0 and engine.stats.preemptions == 0
    assert len({out[i].token_ids[0] for i in range(3)}) > 1  # the members write different keys after the prompt
    return out


def test_a_group_prefills_its_prompt_once_with_the_same_bits(micro_model, unshared):
    # decode graphs on: a member's one-token feed of the last prompt token goes through their static path
    engine = RolloutEngine(micro_model(PROFILE), chunk_size=8, page_size=4, cuda_graphs=True)
    assert mismatches(engine.generate(REQUESTS), unshared) == []
    assert engine.stats.shared_prompt_tokens == 2 * 5  # two members read positions 0-4 from the first's pages
    assert engine.stats.prefill_tokens == 6 + 2 * 1 + 3 + 3
    assert engine.cache.free_pages == engine.cache.num_pages - 1 and not engine.cache.tables
    assert sum(engine.cache._refs) == 0


def test_sharing_without_copy_on_write_is_caught(micro_model, unshared, monkeypatch):
    # Planted bug: members write into the shared partial page itself, over each other's keys and values.
    monkeypatch.setattr(PagedKvCache, "_copy_on_write", lambda self, table, index: None)
    engine = RolloutEngine(micro_model(PROFILE), chunk_size=8, page_size=4)
    assert mismatches(engine.generate(REQUESTS[:3]), {i: unshared[i] for i in range(3)})


def _small_pool(micro_model):
    # 4 usable pages of 2 for requests 3 and 4 (prompts of 3, 3 new tokens): both are admitted on their
    # prompts; at the second decode the first needs a third page and evicts the second, which comes back
    # when the first finishes and prefills its prompt + 2 tokens again.
    return RolloutEngine(micro_model(PROFILE), chunk_size=4, page_size=2, num_pages=5, prefix_sharing=False)


def test_eviction_and_recompute_give_the_bits_of_a_large_pool(micro_model, unshared):
    engine = _small_pool(micro_model)
    out = engine.generate(REQUESTS[3:])
    assert mismatches(out, {i: unshared[i] for i in (3, 4)}) == []
    assert engine.stats.preemptions == 1 and engine.stats.recomputed_tokens == 4
    assert engine.cache.free_pages == 4 and not engine.cache.tables


def test_resuming_without_recompute_is_caught(micro_model, unshared, monkeypatch):
    # Planted bug: an evicted sequence comes back without recompute, decoding on as if its fresh pages
    # still held its keys and values (they hold what the other sequence wrote there).
    real = engine_module.RolloutEngine._place

    def no_recompute(self, seq, running):
        if seq.tokens and seq.cached == 0:
            seq.cached = seq.known - 1
        return real(self, seq, running)

    monkeypatch.setattr(engine_module.RolloutEngine, "_place", no_recompute)
    engine = _small_pool(micro_model)
    out = engine.generate(REQUESTS[3:])
    assert engine.stats.preemptions == 1 and mismatches(out, {i: unshared[i] for i in (3, 4)})


def test_sharing_and_eviction_together(micro_model, unshared):
    # 3 usable pages: the first member's prompt takes 2, the second member's copy of the shared page the
    # third; the third member shares, finds no page for its copy and is evicted (it is the newest), and
    # shares again once the first member finishes.
    engine = RolloutEngine(micro_model(PROFILE), chunk_size=8, page_size=4, num_pages=4)
    assert mismatches(engine.generate(REQUESTS[:3]), {i: unshared[i] for i in range(3)}) == []
    assert engine.stats.preemptions == 1 and engine.stats.shared_prompt_tokens == 2 * 5  # counted when run
    assert engine.cache.free_pages == 3 and sum(engine.cache._refs) == 0
