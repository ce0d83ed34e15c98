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


def test_a_small_pool_without_preemption_runs_sequences_one_after_another(micro_model):
    model = micro_model("reference_fp32")
    # 4 pages: prompt + max_new_tokens of one sequence at a time
    engine = RolloutEngine(model, max_batch_size=4, page_size=2, num_pages=5, preemption=False)
    reqs = [Request(i, (1, 2, 3), SamplingParams(max_new_tokens=4, seed=i)) for i in range(3)]
    out = engine.generate(reqs)
    assert engine.stats.max_running == 1 and all(len(out[i].token_ids) == 4 for i in range(3))


@pytest.mark.parametrize("reqs, match", [
    (lambda: [Request(0, (1,)), Request(0, (2,))], r"unique; repeated: \[0\]"),
    (lambda: [Request(0, (1, 64))], r"ids in \[0, 64\)"),
    (lambda: [Request(0, (1,) * 40, SamplingParams(max_new_tokens=30))], "needs 18 pages, the pool has 15"),
])
def test_bad_requests_are_one_line_errors(micro_model, reqs, match):
    engine = RolloutEngine(micro_model("reference_fp32"), page_size=4, num_pages=16)
    with pytest.raises(ValueError, match=match):
        engine.generate(reqs())


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
    assert stats.seconds == {"forward": 0.0025, "sample": 0.5, "logprobs": 0.0, "decode_graph": 0.0} and end.waited
    assert stats.seconds["forward"] == 0.0025  # read once, not added twice
    stats.add("logprobs", _FakeEvent(0.0), _FakeEvent(2.0, done=True))  # finished: folded at once
    assert stats._pending == [] and stats.seconds["logprobs"] == 0.002


@pytest.mark.parametrize("make, error, match", [
    (lambda: Request(0, torch.tensor([1, 2])), TypeError, r"prompt_ids: .*Tensor \(pass tensor.tolist\(\)\)"),
    (lambda: Request(0, "12"), TypeError, "prompt_ids: expected a tuple"),
    (lambda: Request(0, ()), ValueError, "non-empty prompt"),
    (lambda: Request(0, (1, -2)), ValueError, r"prompt_ids: expected an integer in \[0, 2\^63\), got -2"),
    (lambda: Request(0, (1, 2.0)), TypeError, "prompt_ids: expected an integer, got float"),
    (lambda: Request("7", (1,)), TypeError, "request_id: expected an integer, got str"),
    (lambda: Request(7.0, (1,)), TypeError, "request_id: expected an integer, got float"),
    (lambda: Request(True, (1,)), TypeError, "request_id: expected an integer, got bool"),
    (lambda: Request(-1, (1,)), ValueError, "request_id: expected an integer in"),
    (lambda: Request(2**63, (1,)), ValueError, r"request_id: expected an integer in \[0, 2\^63\), got 92"),
    (lambda: Request(0, (1,), arrival=-1), ValueError, "arrival"),
    (lambda: Request(0, (1,), arrival=0.5), TypeError, "arrival"),
    (lambda: Request(0, (1,), params={"temperature": 1.0}), TypeError, "params: expected SamplingParams"),
    (lambda: SamplingParams(temperature=float("nan")), ValueError, "temperature"),
    (lambda: SamplingParams(top_p=float("nan")), ValueError, "top_p"),
    (lambda: SamplingParams(min_p=float("nan")), ValueError, "min_p"),
    (lambda: SamplingParams(min_p=-0.1), ValueError, "min_p"),
    (lambda: SamplingParams(top_k=-1), ValueError, "top_k"),
    (lambda: SamplingParams(top_k=True), ValueError, "top_k"),
    (lambda: SamplingParams(max_new_tokens=0), ValueError, "max_new_tokens"),
    (lambda: SamplingParams(seed=-1), ValueError, "seed"),
    (lambda: SamplingParams(stop_token_ids=(3, -1)), TypeError, "stop_token_ids"),
    (lambda: SamplingParams(stop_token_ids=7), TypeError, "stop_token_ids"),
])
def test_bad_request_fields_are_refused_at_construction(make, error, match):
    with pytest.raises(error, match=match):
        make()


def test_requests_take_lists_and_integer_like_ids():
    r = Request(torch.tensor(3).item(), [1, 2], SamplingParams(stop_token_ids=[5]))
    assert r.prompt_ids == (1, 2) and r.params.stop_token_ids == (5,)


@pytest.mark.parametrize("planted", [False, True], ids=["jumps", "planted-idle-steps"])
def test_a_late_arrival_does_not_spin(micro_model, monkeypatch, planted):
    # arrival 10**9 must not run 10**9 idle steps; the planted engine steps one by one (caught at arrival 50).
    engine = RolloutEngine(micro_model("reference_fp32"))
    if planted:
        monkeypatch.setattr(RolloutEngine, "_next_step", staticmethod(lambda step, running, waiting: step))
    arrival = 50 if planted else 10**9
    out = engine.generate([Request(0, (1, 2), SamplingParams(max_new_tokens=2), arrival=arrival),
                           Request(1, (3,), SamplingParams(max_new_tokens=2))])
    assert len(out[0].token_ids) == 2
    assert (engine.stats.steps <= 4) != planted  # request 1's two steps, then request 0's two


@pytest.mark.parametrize("planted", [False, True], ids=["refused", "planted-unchecked"])
def test_nan_logits_are_one_error_naming_the_request(micro_config, micro_weights, monkeypatch, planted):
    import rl_engine.rollout.engine as engine_module
    from rl_engine.checks.forward_invariance.harness import build_model

    weights = {n: t.clone() for n, t in micro_weights.items()}
    weights["lm_head.weight"][5] = float("nan")  # every logit row holds a NaN
    engine = RolloutEngine(build_model(micro_config, weights, "reference_fp32"))
    if planted:  # the bug: the engine records the sampler's -1 as a token
        monkeypatch.setattr(engine_module, "check_tokens", lambda tokens, ids: None)
        assert -1 in engine.generate([Request(3, (1, 2), SamplingParams(max_new_tokens=1))])[3].token_ids
        return
    with pytest.raises(ValueError, match="request 3: its logits hold NaN"):
        engine.generate([Request(3, (1, 2), SamplingParams(max_new_tokens=1))])
    assert not engine.cache.tables and engine.cache.free_pages == engine.cache.num_pages - 1  # pages came back
