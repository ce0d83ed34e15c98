"""The sampler: each filter against a plain fp64 reference, the filter order, the draw's distribution,
and independence of a row's draw from its batch."""

import math

import pytest
import torch

from rl_engine.rollout.sampling import SamplingParams, keep_mask, sample, sample_row, uniforms


def reference_keep(z: torch.Tensor, min_p=0.0, top_k=0, top_p=1.0) -> torch.Tensor:
    """vLLM v1's order, written plainly in fp64: min-p, then top-k, then top-p over the survivors."""
    z = z.double().tolist()
    keep = [True] * len(z)
    if min_p > 0:
        m = max(z)
        keep = [k and math.exp(v - m) >= min_p for k, v in zip(keep, z)]
    if 0 < top_k < len(z):
        kth = sorted((v for k, v in zip(keep, z) if k), reverse=True)[min(top_k, sum(keep)) - 1]
        keep = [k and v >= kth for k, v in zip(keep, z)]
    if top_p < 1:
        alive = sorted((i for i in range(len(z)) if keep[i]), key=lambda i: (-z[i], i))
        total = sum(math.exp(z[i]) for i in alive)
        before, kept = 0.0, set()
        for i in alive:
            if not kept or before < top_p:
                kept.add(i)
            before += math.exp(z[i]) / total
        keep = [i in kept for i in range(len(z))]
    return torch.tensor(keep)


CASES = [dict(min_p=0.1), dict(top_k=3), dict(top_p=0.6), dict(top_p=0.95), dict(min_p=0.05, top_k=5, top_p=0.8),
         dict(top_k=1), dict(top_k=4, top_p=0.5)]


@pytest.mark.parametrize("case", CASES, ids=[str(c) for c in CASES])
def test_each_filter_matches_the_fp64_reference(case):
    g = torch.Generator().manual_seed(7)
    for _ in range(20):
        z = torch.randn(12, generator=g) * 2
        params = SamplingParams(**case)
        assert torch.equal(keep_mask(z, params), reference_keep(z, **case)), (z, case)


def test_filters_actually_filter():
    # A reference-agreement test passes vacuously if nothing is ever removed: check each filter bites.
    z = torch.tensor([3.0, 2.0, 1.0, 0.0, -1.0, -5.0])
    assert keep_mask(z, SamplingParams(top_k=2)).tolist() == [True, True, False, False, False, False]
    assert keep_mask(z, SamplingParams(min_p=0.1)).tolist() == [True, True, True, False, False, False]
    # softmax: 0.6652, 0.2447, 0.0900, ...: mass before the 2nd is 0.665 < 0.7, before the 3rd 0.91
    assert keep_mask(z, SamplingParams(top_p=0.7)).tolist() == [True, True, False, False, False, False]
    assert keep_mask(z, SamplingParams(top_p=0.6)).tolist() == [True, False, False, False, False, False]


def test_filter_order_is_min_p_before_top_p():
    # Two tokens at 0 and ten at -3. vLLM's order: min-p=0.1 drops the ten (e^-3 < 0.1); renormalised, the
    # first token holds 0.5 >= top_p, so top-p keeps it alone. HF's order (top-p on the full
    # distribution: the first holds 0.40 < 0.45, so both stay; then min-p) would keep two.
    z = torch.tensor([0.0, 0.0] + [-3.0] * 10)
    keep = keep_mask(z, SamplingParams(min_p=0.1, top_p=0.45))
    assert keep.tolist() == [True] + [False] * 11
    assert torch.equal(keep, reference_keep(z, min_p=0.1, top_p=0.45))
    assert keep_mask(z, SamplingParams(top_p=0.45)).tolist() == [True, True] + [False] * 10


def test_ties_at_the_kth_value_are_kept():
    z = torch.tensor([1.0, 2.0, 2.0, 0.0])
    assert keep_mask(z, SamplingParams(top_k=1)).tolist() == [False, True, True, False]


def test_greedy_is_argmax_of_raw_logits():
    logits = torch.tensor([0.5, 3.0, 3.0, -1.0])
    assert int(sample_row(logits, SamplingParams(temperature=0.0), 1, 0)) == 1  # first index on ties


def test_draws_follow_softmax_over_the_survivors():
    # Positions are the counter: 3000 draws of one sequence. top_k=3 removes token 3 (never drawn).
    logits = torch.tensor([1.0, 0.5, 0.0, -3.0])
    params = SamplingParams(temperature=0.7, top_k=3, seed=11)
    draws = torch.stack([sample_row(logits, params, 5, pos) for pos in range(3000)])
    counts = torch.bincount(draws, minlength=4).double()
    p = torch.softmax(logits[:3].double() / 0.7, 0)
    n = counts.sum()
    assert counts[3] == 0
    sigma = (n * p * (1 - p)).sqrt()
    assert ((counts[:3] - n * p).abs() < 4 * sigma).all(), (counts, n * p)


def test_uniforms_are_a_pure_function_of_the_key():
    a = uniforms(3, 9, 17, 64)
    assert torch.equal(a, uniforms(3, 9, 17, 64))
    assert ((a > 0) & (a < 1)).all() and a.dtype == torch.float64
    others = (uniforms(4, 9, 17, 64), uniforms(3, 10, 17, 64), uniforms(3, 9, 18, 64), uniforms(3 + 2**32, 9, 17, 64))
    for other in others:
        assert (a != other).float().mean() > 0.9  # each key word changes (nearly) every draw
    assert abs(float(uniforms(1, 2, 3, 20000).mean()) - 0.5) < 0.01


def test_a_row_draws_the_same_in_any_batch():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(5, 40, generator=g)
    params = [SamplingParams(temperature=0.9, top_p=0.9, seed=2)] * 5
    ids, pos = [10, 11, 12, 13, 14], [3, 7, 7, 1, 9]
    batch = sample(logits, params, ids, pos)
    order = [3, 0, 4, 2, 1]
    permuted = sample(logits[order], [params[i] for i in order], [ids[i] for i in order], [pos[i] for i in order])
    assert torch.equal(permuted, batch[order])
    for b in range(5):
        assert int(sample(logits[b : b + 1], params[b : b + 1], ids[b : b + 1], pos[b : b + 1])[0]) == int(batch[b])


def test_bad_params_are_one_line_errors():
    for bad in (dict(temperature=-1.0), dict(top_k=-2), dict(top_p=0.0), dict(min_p=1.5), dict(max_new_tokens=0),
                dict(seed=-1)):
        with pytest.raises(ValueError, match=next(iter(bad))):
            SamplingParams(**bad)
