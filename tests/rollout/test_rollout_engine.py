"""Engine behaviour on the fast reference profile: stop tokens, max tokens, continuous batching, pages,
bad requests. (Bitwise parity across schedules is tests/rollout/test_rollout_parity.py, under Triton.)"""

import pytest
import torch

from rl_engine.rollout import Request, RolloutEngine, SamplingParams


def test_max_new_tokens_and_stop_tokens(micro_model):
    model = micro_model("reference_fp32")
    greedy = SamplingParams(temperature=0.0, max_new_tokens=5)
    free = RolloutEngine(model).generate([Request(0, (1, 2, 3), greedy)])[0]
    assert len(free.token_ids) == 5 and free.finish_reason == "length"
    assert free.logprobs.dtype == free.raw_logprobs.dtype == torch.float32
    assert torch.equal(free.logprobs, free.raw_logprobs)  # greedy records the raw logprobs
    stop = free.token_ids[2]
    first = free.token_ids.index(stop)
    params = SamplingParams(temperature=0.0, max_new_tokens=5, stop_token_ids=(stop,))
    stopped = RolloutEngine(model).generate([Request(0, (1, 2, 3), params)])[0]
    assert stopped.token_ids == free.token_ids[: first + 1] and stopped.finish_reason == "stop"
    assert torch.equal(stopped.raw_logprobs, free.raw_logprobs[: first + 1])


def test_continuous_batching_admits_as_sequences_finish(micro_model):
    model = micro_model("reference_fp32")
    engine = RolloutEngine(model, max_batch_size=2, chunk_size=2, page_size=2, num_pages=16)
    reqs = [Request(i, (3 + i, 4, 5, 6 + i)[: 2 + i % 3], SamplingParams(max_new_tokens=1 + i, seed=1), arrival=i // 2)
            for i in range(5)]
    out = engine.generate(reqs)
    assert sorted(out) == list(range(5))
    assert [len(out[i].token_ids) for i in range(5)] == [1, 2, 3, 4, 5]
    assert engine.stats.max_running == 2
    assert engine.cache.free_pages == 15 and not engine.cache.tables  # every page came back
    assert engine.stats.prefill_tokens == sum(len(r.prompt_ids) for r in reqs)


def test_a_small_pool_runs_sequences_one_after_another(micro_model):
    model = micro_model("reference_fp32")
    engine = RolloutEngine(model, max_batch_size=4, page_size=2, num_pages=5)  # 4 pages: one sequence at a time
    reqs = [Request(i, (1, 2, 3), SamplingParams(max_new_tokens=4, seed=i)) for i in range(3)]
    out = engine.generate(reqs)
    assert engine.stats.max_running == 1 and all(len(out[i].token_ids) == 4 for i in range(3))


@pytest.mark.parametrize("reqs, match", [
    ([Request(0, (1,)), Request(0, (2,))], "unique"),
    ([Request(0, ())], "non-empty prompt"),
    ([Request(0, (1, 64))], r"ids in \[0, 64\)"),
    ([Request(0, (1,) * 40, SamplingParams(max_new_tokens=30))], "needs 18 pages, the pool has 15"),
])
def test_bad_requests_are_one_line_errors(micro_model, reqs, match):
    engine = RolloutEngine(micro_model("reference_fp32"), page_size=4, num_pages=16)
    with pytest.raises(ValueError, match=match):
        engine.generate(reqs)


class _FakeEvent:
    """Stands in for a CUDA event: a time in ms, and whether the host waited for it."""

    def __init__(self, ms, done=False):
        self.ms, self.waited, self.done = ms, False, done

    def synchronize(self):
        self.waited = True

    def query(self):
        return self.done

    def elapsed_time(self, end):
        return end.ms - self.ms


def test_phase_times_from_events_are_read_only_when_asked():
    from rl_engine.rollout.engine import EngineStats

    stats = EngineStats()
    start, end = _FakeEvent(1.0), _FakeEvent(3.5)
    stats.add("forward", start, end)
    stats.add("sample", 0.25, 0.75)  # the CPU's wall clock
    assert not end.waited  # adding never waits for the GPU
    assert stats.seconds == {"forward": 0.0025, "sample": 0.5, "logprobs": 0.0} and end.waited
    assert stats.seconds["forward"] == 0.0025  # read once, not added twice
    stats.add("logprobs", _FakeEvent(0.0), _FakeEvent(2.0, done=True))  # finished: folded at once
    assert stats._pending == [] and stats.seconds["logprobs"] == 0.002
