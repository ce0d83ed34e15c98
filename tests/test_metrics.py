import math
import time

import numpy as np
import pytest
import torch

from rl_engine import metrics
from rl_engine.metrics import rollout_corr_metrics, truncated_is_weights

B, T = 6, 9


def _inputs(seed=0, scale=0.3):
    g = torch.Generator().manual_seed(seed)
    train = -torch.rand(B, T, generator=g) * 4
    rollout = train + torch.randn(B, T, generator=g) * scale
    mask = torch.rand(B, T, generator=g) < 0.6
    mask[0] = False  # a sequence with no active token: left out of the sequence averages
    mask[1] = False
    mask[1, 3] = True  # a one-token sequence
    return train, rollout, mask


def _reference(train, rollout, mask, clip=(0.8, 1.2), level="token", tau=2.0):
    """verl's formulas (rollout_corr_helper.py) written again in float64 numpy, sequence by sequence."""
    t = train.numpy().astype(np.float64)
    r = rollout.numpy().astype(np.float64)
    d = (train.numpy() - rollout.numpy()).astype(np.float64)  # Δ rounded in fp32, as documented
    m = mask.numpy()
    seqs = [i for i in range(t.shape[0]) if m[i].any()]
    tok_d = d[m]
    mt = np.array([t[i][m[i]].mean() for i in seqs])
    mr = np.array([r[i][m[i]].mean() for i in seqs])
    sd = mr - mt
    ssum = np.array([d[i][m[i]].sum() for i in seqs])
    ratio = np.exp(tok_d)
    out = {
        "training_ppl": np.exp(-mt).mean(), "training_log_ppl": (-mt).mean(),
        "rollout_ppl": np.exp(-mr).mean(), "rollout_log_ppl": (-mr).mean(),
        "kl": (r[m] - t[m]).mean(), "k3_kl": (np.expm1(tok_d) - tok_d).mean(),
        "log_ppl_diff": sd.mean(), "log_ppl_abs_diff": np.abs(sd).mean(),
        "log_ppl_diff_max": sd.max(), "log_ppl_diff_min": sd.min(), "ppl_ratio": np.exp(sd).mean(),
        "chi2_token": np.mean(np.exp(np.clip(tok_d, -20, 20)) ** 2) - 1,
        "chi2_seq": np.mean(np.exp(np.clip(ssum, -20, 20)) ** 2) - 1,
        "max_abs_dlogp": np.abs(tok_d).max(), "mean_abs_dlogp": np.abs(tok_d).mean(),
        "clipfrac": np.mean((ratio < clip[0]) | (ratio > clip[1])),
    }
    if level == "token":
        w_tok = [np.exp(np.clip(d[i][m[i]], -20, 20)) for i in seqs]
        w = np.concatenate(w_tok)
        out.update(rollout_is_max=w.max(), rollout_is_min=w.min(),
                   rollout_is_ratio_fraction_high=np.mean(w > tau), rollout_is_ratio_fraction_low=np.mean(w < 1 / tau))
    else:
        w_tok = [np.full(m[i].sum(), np.exp(np.clip(s, -20, 20))) for i, s in zip(seqs, ssum)]
        w = np.concatenate(w_tok)
        out.update(rollout_is_max=np.exp(min(ssum.max(), 20)), rollout_is_min=np.exp(ssum.min()),
                   rollout_is_ratio_fraction_high=np.mean(ssum > np.log(tau)),
                   rollout_is_ratio_fraction_low=np.mean(ssum < np.log(1 / tau)))
    wc = np.clip(w, 1 / tau, tau)
    u = np.array([x.mean() for x in w_tok])
    out.update(
        rollout_is_mean=w.mean(), rollout_is_std=np.sqrt(max(np.mean(wc**2) - wc.mean() ** 2, 0)),
        rollout_is_eff_sample_size=1 / np.mean((wc / (wc.mean() + 1e-8)) ** 2),
        rollout_is_seq_mean=u.mean(), rollout_is_seq_std=u.std(ddof=1), rollout_is_seq_max=u.max(),
        rollout_is_seq_min=u.min(), rollout_is_seq_max_deviation=np.abs(u - 1).max(),
        rollout_is_seq_fraction_high=np.mean(u > tau), rollout_is_seq_fraction_low=np.mean(u < 1 / tau),
    )
    return {metrics.PREFIX + k: float(v) for k, v in out.items()}


@pytest.mark.parametrize("level", ["token", "sequence"])
@pytest.mark.parametrize("seed", [0, 1])
def test_every_metric_matches_float64_numpy(seed, level):
    train, rollout, mask = _inputs(seed)
    got = rollout_corr_metrics(train, rollout, mask, clip_low=0.85, clip_high=1.1, is_level=level, is_threshold=1.5)
    want = _reference(train, rollout, mask, clip=(0.85, 1.1), level=level, tau=1.5)
    assert set(got) == set(want)
    for k, v in got.items():
        assert v.dim() == 0 and v.dtype == torch.float64, k
        assert float(v) == pytest.approx(want[k], rel=1e-12, abs=1e-14), k
    # The data exercise the bounds: otherwise a fraction of 0 would test nothing.
    assert 0 < float(got["rollout_corr/clipfrac"]) < 1
    fractions = got["rollout_corr/rollout_is_ratio_fraction_high"] + got["rollout_corr/rollout_is_ratio_fraction_low"]
    assert float(fractions) > 0


def test_mask_accepts_float_and_any_leading_shape():
    train, rollout, mask = _inputs()
    base = rollout_corr_metrics(train, rollout, mask)
    as_float = rollout_corr_metrics(train, rollout, mask.float())
    reshaped = rollout_corr_metrics(train.reshape(2, 3, T), rollout.reshape(2, 3, T), mask.reshape(2, 3, T))
    for k in base:
        assert torch.equal(base[k], as_float[k]) and torch.equal(base[k], reshaped[k]), k


def test_empty_mask_gives_nan_everywhere():
    train, rollout, mask = _inputs()
    got = rollout_corr_metrics(train, rollout, torch.zeros_like(mask))
    assert all(torch.isnan(v) for v in got.values())


@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf])
@pytest.mark.parametrize("which", ["train", "rollout"])
def test_non_finite_active_token_poisons_and_masked_one_does_not(bad, which):
    train, rollout, mask = _inputs()
    base = rollout_corr_metrics(train, rollout, mask)
    active = tuple(mask.nonzero()[0].tolist())
    masked = tuple((~mask).nonzero()[-1].tolist())
    for pos, poisoned in ((active, True), (masked, False)):
        t, r = train.clone(), rollout.clone()
        (t if which == "train" else r)[pos] = bad
        got = rollout_corr_metrics(t, r, mask)
        for k, v in got.items():
            if poisoned:
                assert torch.isnan(v), k
            else:
                assert torch.equal(v, base[k]), k


@pytest.mark.parametrize("where", ["active", "masked"])
def test_a_nan_in_the_mask_is_never_counted_active(where):
    train, rollout, mask = _inputs()
    pos = tuple((mask if where == "active" else ~mask).nonzero()[0].tolist())
    nan_mask = mask.double()
    nan_mask[pos] = math.nan
    got = rollout_corr_metrics(train, rollout, nan_mask)
    assert all(torch.isnan(v) for v in got.values())
    w = truncated_is_weights(train, rollout, nan_mask)
    assert torch.isnan(w[pos]) and torch.isnan(w).sum() == 1


def test_bit_equal_logprobs_give_exact_zeros():
    train, _, mask = _inputs()
    got = rollout_corr_metrics(train, train.clone(), mask)
    for k in ("kl", "k3_kl", "log_ppl_diff", "chi2_token", "chi2_seq", "max_abs_dlogp", "clipfrac"):
        assert float(got[metrics.PREFIX + k]) == 0.0, k
    assert float(got["rollout_corr/ppl_ratio"]) == 1.0


def test_truncated_is_weights():
    train, rollout, mask = _inputs(scale=1.0)
    w = truncated_is_weights(train, rollout, mask, is_threshold=2.0)
    d = (train - rollout).double()
    want = torch.where(mask, torch.exp(d).clamp(max=2.0), 0)
    assert w.shape == train.shape and torch.allclose(w, want, rtol=1e-15, atol=0)
    assert (w == 2.0).any() and (w[mask] < 2.0).any()
    ws = truncated_is_weights(train, rollout, mask, is_level="sequence", is_threshold=2.0)
    seq = torch.exp(torch.where(mask, d, 0).sum(-1, keepdim=True)).clamp(max=2.0).expand_as(d)
    assert torch.allclose(ws, torch.where(mask, seq, 0), rtol=1e-15, atol=0)


def test_a_mask_that_is_ignored_is_caught(monkeypatch):
    # Planted bug: the mask read as all-active. The padding carries garbage logprobs, as in a real batch.
    train, rollout, mask = _inputs()
    garbage = torch.where(torch.arange(B)[:, None] < 3, 5.0, -5.0)  # Δ = ∓5: moves both tails
    rollout = torch.where(mask, rollout, rollout + garbage)
    want = _reference(train, rollout, mask)
    real = metrics._flatten
    monkeypatch.setattr(metrics, "_flatten", lambda t: torch.ones_like(real(t)) if t.dtype == torch.bool else real(t))
    got = rollout_corr_metrics(train, rollout, mask)
    wrong = [k for k in want if float(got[k]) != pytest.approx(want[k], rel=1e-12, abs=1e-14)]
    assert set(want) - set(wrong) == set()


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"is_level": "seq"}, "is_level"),
        ({"is_threshold": 1.0}, "is_threshold"),
        ({"clip_low": 1.2, "clip_high": 0.8}, "clip range"),
    ],
)
def test_bad_options_raise_one_line(kwargs, message):
    train, rollout, mask = _inputs()
    with pytest.raises(ValueError, match=message):
        rollout_corr_metrics(train, rollout, mask, **kwargs)
    with pytest.raises(ValueError, match="expected one shape"):
        rollout_corr_metrics(train, rollout[:, :-1], mask)


def test_compiles_without_graph_break():
    # fullgraph=True fails on any .item(), data-dependent branch or other host sync.
    train, rollout, mask = _inputs()
    start = time.monotonic()
    compiled = torch.compile(rollout_corr_metrics, fullgraph=True, dynamic=False, backend="eager")
    got = compiled(train, rollout, mask)
    elapsed = time.monotonic() - start
    want = rollout_corr_metrics(train, rollout, mask)
    for k in want:
        assert torch.allclose(got[k], want[k], rtol=1e-12, atol=1e-14), k
    assert elapsed < 120
