"""On the GPU at Qwen3-8B width: every schedule gives the bits of generating alone, and the rollout's
logprobs equal the trainer's packed recompute (triton_bf16, synthetic weights, 2 layers). Decode steps
replay CUDA graphs (the engine's default on a GPU), and give the bits of the eager engine."""

from types import SimpleNamespace

import pytest
import torch

from rl_engine.checks.forward_invariance.harness import build_model
from rl_engine.models.families import get_config
from rl_engine.models.weights import synthetic_weights
from rl_engine.rollout import Request, RolloutEngine, SamplingParams, tempered_logprobs
from rl_engine.workload.layouts import Sample, pack

pytestmark = pytest.mark.gpu

PROMPT_LENGTHS = [5, 37, 300, 1, 129, 64]
# (max batch, chunk, page, arrival steps)
SCHEDULES = {"staggered-b4-c64-p16": (4, 64, 16, [0, 0, 1, 3, 3, 9]), "reversed-b6-c256-p64": (6, 256, 64,
                                                                                               [5, 4, 3, 2, 1, 0])}


@pytest.fixture(scope="module")
def model():
    config = get_config("qwen3-8b").with_layers(2)
    return build_model(config, synthetic_weights(config, 0, device="cuda"), "triton_bf16")


def _requests(model, arrivals):
    gen = torch.Generator().manual_seed(0)
    out = []
    for i, (n, arrival) in enumerate(zip(PROMPT_LENGTHS, arrivals)):
        prompt = tuple(torch.randint(1, model.config.vocab_size, (n,), generator=gen).tolist())
        params = SamplingParams(temperature=0.8, top_p=0.95, top_k=50 if i % 2 else 0, max_new_tokens=24, seed=i)
        out.append(Request(i, prompt, params, arrival=arrival))
    return out


def _same(a, b) -> bool:
    return a.token_ids == b.token_ids and all(
        x.shape == y.shape and torch.equal(x.view(torch.int32), y.view(torch.int32))
        for x, y in ((a.logprobs, b.logprobs), (a.raw_logprobs, b.raw_logprobs)))


@pytest.fixture(scope="module")
def alone(model):
    engine = RolloutEngine(model, max_batch_size=1, chunk_size=64, page_size=16)
    return {r.request_id: engine.generate([r])[r.request_id] for r in _requests(model, [0] * len(PROMPT_LENGTHS))}


@pytest.mark.parametrize("name", SCHEDULES)
def test_every_schedule_gives_the_bits_of_generating_alone(model, alone, name):
    batch, chunk, page, arrivals = SCHEDULES[name]
    engine = RolloutEngine(model, max_batch_size=batch, chunk_size=chunk, page_size=page)
    got = engine.generate(_requests(model, arrivals))
    assert engine.stats.max_running > 1
    assert engine.graphs is not None and engine.graphs.capture and engine.graphs.steps  # graphs replayed
    differing = [rid for rid in alone if not _same(got[rid], alone[rid])]
    assert not differing, differing


def test_cuda_graph_steps_give_the_bits_of_eager_steps(model, alone):
    engine = RolloutEngine(model, max_batch_size=5, chunk_size=64, page_size=16, cuda_graphs=False)
    got = engine.generate(_requests(model, [0, 0, 0, 1, 1, 2]))
    differing = [rid for rid in alone if not _same(got[rid], alone[rid])]
    assert not differing, differing


def test_rollout_logprobs_equal_the_trainer_recompute(model, alone):
    samples = [Sample(rid, c.prompt_ids + tuple(c.token_ids), len(c.prompt_ids)) for rid, c in sorted(alone.items())]
    layout = pack(samples)
    device = model.lm_head_weight.device
    with torch.no_grad():
        hidden = model.forward(layout.token_ids.to(device), layout.positions.to(device),
                               cu_seqlens=layout.cu_seqlens.to(device))
        raw = model.selected_logprobs(hidden, layout.target_ids.to(device))[0]
        for s, start in zip(samples, layout.cu_seqlens.tolist()):
            c = alone[s.sample_id]
            rows = slice(start + s.prompt_len - 1, start + s.length - 1)
            assert torch.equal(raw[rows].cpu().view(torch.int32), c.raw_logprobs.cpu().view(torch.int32)), s.sample_id
            tempered = tempered_logprobs(model, hidden[:, rows], layout.target_ids[:, rows].to(device), 0.8)[0]
            assert torch.equal(tempered.cpu().view(torch.int32), c.logprobs.cpu().view(torch.int32)), s.sample_id


def test_a_group_with_sharing_and_eviction_under_cuda_graphs_keeps_the_bits(model):
    # 4 samples of one 37-token prompt (the shared positions end inside page 2 of 16: copy-on-write) and 2
    # other prompts in a pool of 12 pages: sequences are evicted and recomputed while graphs replay.
    gen = torch.Generator().manual_seed(1)
    prompts = [tuple(torch.randint(1, model.config.vocab_size, (n,), generator=gen).tolist()) for n in (37, 20, 50)]
    reqs = [Request(i, prompts[0 if i < 4 else i - 3], SamplingParams(temperature=1.0, max_new_tokens=40, seed=5))
            for i in range(6)]
    want = RolloutEngine(model, max_batch_size=6, chunk_size=64, page_size=16, prefix_sharing=False,
                         cuda_graphs=False).generate(reqs)
    engine = RolloutEngine(model, max_batch_size=6, chunk_size=64, page_size=16, num_pages=13)
    got = engine.generate(reqs)
    assert engine.stats.shared_prompt_tokens > 0 and engine.stats.preemptions > 0 and engine.graphs.capture
    differing = [rid for rid in want if not _same(got[rid], want[rid])]
    assert not differing, differing


def test_a_weight_update_reaches_the_captured_graphs():
    config = get_config("qwen3-8b").with_layers(2)
    old, new = (synthetic_weights(config, seed, device="cuda") for seed in (0, 1))
    reqs = _requests(SimpleNamespace(config=config), [0] * len(PROMPT_LENGTHS))  # (reads the vocabulary size)
    engine = RolloutEngine(build_model(config, {n: t.clone() for n, t in old.items()}, "triton_bf16"),
                           max_batch_size=6, chunk_size=64, page_size=16)
    before = engine.generate(reqs)  # captures the decode graphs on the old weights
    engine.update_weights(new.items())
    after = engine.generate(reqs)  # replays them on the new ones
    want = RolloutEngine(build_model(config, new, "triton_bf16"), max_batch_size=6, chunk_size=64,
                         page_size=16).generate(reqs)
    assert engine.graphs.capture and engine.graphs.steps
    assert all(_same(after[i], want[i]) for i in want) and not all(_same(before[i], want[i]) for i in want)
