"""Bitwise parity under triton_bf16 (Triton interpreter on a CPU): every sequence's tokens and logprobs
are the same in any schedule as generated alone, and equal the trainer's packed teacher-forced recompute."""

import dataclasses

import pytest
import torch

import rl_engine.kernels.ops.triton.linear.matmul as matmul
import rl_engine.models.decoder as decoder
import rl_engine.rollout.decode_graph as decode_graph
import rl_engine.rollout.engine as engine_module
from rl_engine.checks.forward_invariance.harness import build_model
from rl_engine.models.weights import pack_projections
from rl_engine.rollout import Request, RolloutEngine, SamplingParams, tempered_logprobs
from rl_engine.rollout.paged_cache import PagedKvCache
from rl_engine.rollout.sampling import sample
from rl_engine.workload.layouts import Sample, pack

PROFILE = "triton_bf16"
PROMPTS = [(5, 17, 33, 2, 9), (40, 41), (7, 7, 60, 1)]
PARAMS = [SamplingParams(temperature=0.8, top_k=20, top_p=0.9, max_new_tokens=3, seed=1),
          SamplingParams(temperature=1.0, min_p=0.05, max_new_tokens=2, seed=1),
          SamplingParams(temperature=1.3, max_new_tokens=3, seed=2)]


def requests(arrivals):
    return [Request(i, p, params, arrival=a) for i, (p, params, a) in enumerate(zip(PROMPTS, PARAMS, arrivals))]


def mismatches(got: dict, want: dict) -> list[str]:
    """Which sequences differ from `want` in tokens or in any logprob bit."""
    bad = []
    for rid, w in want.items():
        g = got[rid]
        same = g.token_ids == w.token_ids and all(
            x.shape == y.shape and torch.equal(x.view(torch.int32), y.view(torch.int32))
            for x, y in ((g.logprobs, w.logprobs), (g.raw_logprobs, w.raw_logprobs)))
        if not same:
            bad.append(f"request {rid}: {g.token_ids} {g.logprobs.tolist()} vs {w.token_ids} {w.logprobs.tolist()}")
    return bad


@pytest.fixture(scope="module")
def alone(micro_model):
    model = micro_model(PROFILE)
    return {r.request_id: RolloutEngine(model, max_batch_size=1, chunk_size=8, page_size=8).generate([r])[r.request_id]
            for r in requests([0, 0, 0])}


# (max batch, chunk, page, arrival steps): staggered joins with a batch cap of 2 (request 2 joins when
# one finishes), or everything at once in reverse arrival order with other chunk and page sizes.
SCHEDULES = {"staggered-b2-c2-p2": (2, 2, 2, [0, 1, 1]), "reversed-b3-c3-p4": (3, 3, 4, [2, 1, 0])}


@pytest.mark.parametrize("graphs", [False, True], ids=["eager", "decode-graphs"])
@pytest.mark.parametrize("name", SCHEDULES)
def test_every_schedule_gives_the_bits_of_generating_alone(micro_model, alone, name, graphs):
    # decode-graphs: the CUDA-graph path's padded static buffers (run without capture on a CPU)
    batch, chunk, page, arrivals = SCHEDULES[name]
    engine = RolloutEngine(micro_model(PROFILE), max_batch_size=batch, chunk_size=chunk, page_size=page,
                           cuda_graphs=graphs)
    got = engine.generate(requests(arrivals))
    assert engine.stats.max_running > 1  # sequences did share forwards
    if graphs:
        assert engine.graphs.steps  # decode steps went through the graphs' buckets
    assert not mismatches(got, alone)


def test_a_token_budget_splits_prefill_forwards_without_changing_a_bit(micro_model, alone):
    # max_num_batched_tokens 4 with chunks of 3: one sequence's prefill chunk per forward (3 prompts at once
    # would hold 9 tokens)
    engine = RolloutEngine(micro_model(PROFILE), max_batch_size=3, chunk_size=3, page_size=4,
                           max_num_batched_tokens=4)
    got = engine.generate(requests([0, 0, 0]))
    assert engine.stats.max_forward_tokens == 3 and engine.stats.max_running == 3
    assert not mismatches(got, alone)


QKV, GATE_UP = "model.layers.0.self_attn.q_proj+k_proj+v_proj", "model.layers.0.mlp.gate_proj+up_proj"
QK_NORM, QK_ROPE = "model.layers.0.self_attn.q_norm+k_norm", "model.layers.0.self_attn.q_rope+k_rope"


def _stacked_run(micro_config, micro_weights):
    """Generation on a model whose q/k/v and gate/up are row views of one buffer each, and the nodes it ran."""
    model = build_model(micro_config, pack_projections(micro_weights, micro_config), PROFILE)
    got = RolloutEngine(model, max_batch_size=3, chunk_size=3, page_size=4, cuda_graphs=True).generate(
        requests([0, 0, 0]))
    return got, {r.node for r in model.ops.recorder.records}


def test_stacked_projections_run_as_one_product_with_the_bits_of_each(micro_config, micro_weights, alone):
    got, nodes = _stacked_run(micro_config, micro_weights)
    assert {QKV, GATE_UP, QK_NORM, QK_ROPE} <= nodes and "model.layers.0.self_attn.k_proj" not in nodes
    assert "model.layers.0.self_attn.k_norm" not in nodes and "model.layers.0.self_attn.k_rope" not in nodes
    assert not mismatches(got, alone)


def test_q_and_k_heads_stacked_with_their_norms_swapped_are_caught(micro_config, micro_weights, alone, monkeypatch):
    # Planted: the one norm launch given [k_norm; q_norm] (q's heads normed by k's weight)
    stacked = decoder.DecoderModel._stacked_heads

    def swapped(self, q, k, layer):
        qk, norms = stacked(self, q, k, layer)
        return qk, None if norms is None else norms.flip(0)

    monkeypatch.setattr(decoder.DecoderModel, "_stacked_heads", swapped)
    got, nodes = _stacked_run(micro_config, micro_weights)
    assert QK_NORM in nodes and mismatches(got, alone)


def test_stacked_heads_write_the_paged_cache_from_the_rope_launch(micro_config, micro_weights, alone, monkeypatch):
    # The RoPE launch writes the rotated keys and the values (no separate write a layer): the bits of generating alone
    writes = []
    monkeypatch.setattr(PagedKvCache, "write", lambda self, *args: writes.append(args))
    got, nodes = _stacked_run(micro_config, micro_weights)
    assert QK_ROPE in nodes and not writes and not mismatches(got, alone)
    # Planted: the launch writes each token one pool row past its slot
    kv_pages = PagedKvCache.kv_pages

    def one_row_on(self, *args):
        pages = kv_pages(self, *args)
        return pages._replace(slots=pages.slots + 1)

    monkeypatch.setattr(PagedKvCache, "kv_pages", one_row_on)
    got, _ = _stacked_run(micro_config, micro_weights)
    assert mismatches(got, alone)


def test_a_stacked_product_that_would_walk_k_otherwise_is_refused(micro_config, micro_weights, alone, monkeypatch):
    # Planted: gate+up (N = 128) gets a config of BLOCK_K 8 where its parts walk K by 16: two products run.
    def other_k(rule):
        def config(dtype, n, k):
            found = rule(dtype, n, k)
            if n != 2 * micro_config.intermediate_size:
                return found
            if isinstance(found, tuple):
                return tuple(matmul.SmallMConfig(t.max_m, dataclasses.replace(t.config, block_k=8)) for t in found)
            return dataclasses.replace(found, block_k=8)
        return config

    monkeypatch.setattr(matmul, "matmul_config", other_k(matmul.matmul_config))
    monkeypatch.setattr(matmul, "small_m_tiers", other_k(matmul.small_m_tiers))
    monkeypatch.setattr(matmul, "_plans", {})
    got, nodes = _stacked_run(micro_config, micro_weights)
    assert QKV in nodes and GATE_UP not in nodes and "model.layers.0.mlp.up_proj" in nodes
    assert not mismatches(got, alone)


def test_views_out_of_order_run_apart_and_a_swapped_split_is_caught(micro_config, micro_weights, alone, monkeypatch):
    gate, up = (f"model.layers.0.mlp.{r}.weight" for r in ("gate_proj", "up_proj"))
    swapped = dict(micro_weights)
    swapped[up], swapped[gate] = torch.cat([micro_weights[up], micro_weights[gate]]).split(
        [micro_weights[up].shape[0], micro_weights[gate].shape[0]])  # [up; gate]: adjacent, in the other order

    def run():
        model = build_model(micro_config, swapped, PROFILE)
        got = RolloutEngine(model, max_batch_size=3, chunk_size=3, page_size=4).generate(requests([0, 0, 0]))
        return got, {r.node for r in model.ops.recorder.records}

    got, nodes = run()
    assert GATE_UP not in nodes and not mismatches(got, alone)
    # Planted: the stacked product taken from the buffer's start, split as if gate came first
    def stacked(self, roles, layer):
        if roles != ("gate_proj", "up_proj"):
            return None
        w = self._weight("up_proj", layer)
        return w.as_strided((2 * w.shape[0], w.shape[1]), (w.shape[1], 1)), [w.shape[0]] * 2

    monkeypatch.setattr(decoder.DecoderModel, "_stacked", stacked)
    got, nodes = run()
    assert GATE_UP in nodes and mismatches(got, alone)


def test_graph_padding_rows_that_write_into_a_sequences_pages_are_caught(micro_model, alone, monkeypatch):
    # Planted bug: padding rows take the first sequence's page table instead of null pages, so their
    # keys and values overwrite its cache.
    real = decode_graph.padded_block_table

    def leaky(tables, width, rows=None):
        table = real(tables, width, rows)
        table[len(tables):] = table[0].clone()
        return table

    monkeypatch.setattr(decode_graph, "padded_block_table", leaky)
    # Three sequences decode together in the bucket of 4 rows: one padding row.
    engine = RolloutEngine(micro_model(PROFILE), max_batch_size=4, chunk_size=8, page_size=4, cuda_graphs=True)
    assert mismatches(engine.generate(requests([0, 0, 0])), alone)
    assert (4, 2, 0.8) in engine.graphs.steps  # rows, width, the graph's temperature


def test_graph_padding_rows_change_no_bit(micro_model, alone):
    engine = RolloutEngine(micro_model(PROFILE), max_batch_size=4, chunk_size=8, page_size=4, cuda_graphs=True)
    assert not mismatches(engine.generate(requests([0, 0, 0])), alone)
    assert (4, 2, 0.8) in engine.graphs.steps  # 3 sequences padded to 4 rows, 2-page tables, T 0.8 in the graph


def test_rollout_logprobs_equal_the_trainer_recompute(micro_model, alone):
    # The trainer: one packed teacher-forced forward over prompt + completion of every sequence.
    model = micro_model(PROFILE)
    samples = [Sample(rid, c.prompt_ids + tuple(c.token_ids), len(c.prompt_ids)) for rid, c in sorted(alone.items())]
    layout = pack(samples)
    with torch.no_grad():
        hidden = model.forward(layout.token_ids, layout.positions, cu_seqlens=layout.cu_seqlens)
        raw = model.selected_logprobs(hidden, layout.target_ids)[0]
        starts = layout.cu_seqlens.tolist()
        for s, start in zip(samples, starts):
            c = alone[s.sample_id]
            rows = slice(start + s.prompt_len - 1, start + s.length - 1)  # the slots that predict the completion
            assert torch.equal(raw[rows].view(torch.int32), c.raw_logprobs.view(torch.int32)), s.sample_id
            t = PARAMS[s.sample_id].temperature
            tempered = tempered_logprobs(model, hidden[:, rows], layout.target_ids[:, rows], t)[0]
            assert torch.equal(tempered.view(torch.int32), c.logprobs.view(torch.int32)), s.sample_id
            assert not torch.equal(c.logprobs, c.raw_logprobs) or t == 1.0


def test_a_sampler_that_sees_the_batch_position_is_caught(micro_model, alone, monkeypatch):
    # Planted bug: the draw keyed by the row's place in the batch instead of the request id.
    monkeypatch.setattr(engine_module, "sample",
                        lambda logits, params, ids, positions: sample(logits, params, list(range(len(ids))), positions))
    batch, chunk, page, arrivals = SCHEDULES["reversed-b3-c3-p4"]
    engine = RolloutEngine(micro_model(PROFILE), max_batch_size=batch, chunk_size=chunk, page_size=page)
    assert mismatches(engine.generate(requests(arrivals)), alone)


# Overlap: one temperature (the graph computes every tempered logprob), five new tokens, request 0 stopped early by
# a stop token, so that an overlapped step runs a row of a sequence that had already stopped.
OVERLAP = SamplingParams(temperature=0.9, top_k=30, max_new_tokens=5, seed=3)


@pytest.fixture(scope="module")
def overlap_case(micro_model):
    model = micro_model(PROFILE)
    first = RolloutEngine(model, max_batch_size=1, chunk_size=8, page_size=4, cuda_graphs=False).generate(
        [Request(0, PROMPTS[0], OVERLAP)])[0]
    stop = first.token_ids[1]
    params = [SamplingParams(temperature=0.9, top_k=30, max_new_tokens=5, seed=3, stop_token_ids=(stop,)), OVERLAP,
              OVERLAP]
    reqs = [Request(i, p, params[i]) for i, p in enumerate(PROMPTS)]
    alone = {r.request_id: RolloutEngine(model, max_batch_size=1, chunk_size=8, page_size=4, cuda_graphs=False)
             .generate([r])[r.request_id] for r in reqs}
    assert alone[0].finish_reason == "stop" and len(alone[0].token_ids) <= 2
    return reqs, alone


def test_overlapped_decode_steps_keep_every_bit(micro_model, overlap_case):
    reqs, alone = overlap_case
    engine = RolloutEngine(micro_model(PROFILE), max_batch_size=4, chunk_size=8, page_size=4, cuda_graphs=True)
    assert not mismatches(engine.generate(reqs), alone)
    stats = engine.stats
    assert stats.overlapped_steps >= 2 and stats.dropped_rows >= 1, stats  # the stopped sequence's row was dropped
    assert (4, 2, 0.9) in engine.graphs.steps and not engine.cache.tables  # no page left taken


def test_an_overlapped_step_fed_its_inputs_again_is_caught(micro_model, overlap_case, monkeypatch):
    # Planted bug: a continued launch feeds the previous step's input tokens instead of its sampled tokens.
    reqs, alone = overlap_case
    monkeypatch.setattr(decode_graph, "feed_sampled",
                        lambda step, previous, n: step.tokens[:n, 0].copy_(previous.tokens[:n, 0]))
    engine = RolloutEngine(micro_model(PROFILE), max_batch_size=4, chunk_size=8, page_size=4, cuda_graphs=True)
    assert mismatches(engine.generate(reqs), alone)
    assert engine.stats.overlapped_steps >= 2
