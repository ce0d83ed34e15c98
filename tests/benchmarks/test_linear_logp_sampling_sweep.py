"""benchmarks/linear_logp.py --sampling-sweep's bit check (Triton interpreter, tiny lm_head): other token tiles keep
the reference (trainer's) tiles' logits and partials, and a planted candidate that walks H in other steps is flagged."""

import torch

from rl_engine.kernels.ops.triton.loss import linear_logp as ours


def test_the_sampling_sweep_tells_tiles_that_keep_the_bits_from_tiles_that_do_not(load_benchmark):
    bench = load_benchmark("linear_logp")
    weight = (torch.randn(40, 32, generator=torch.Generator().manual_seed(0)) / 8).to(torch.bfloat16)
    trainer = ours.trainer_read_config(torch.bfloat16)
    candidates = [trainer, {**trainer, "BLOCK_T": 2 * trainer["BLOCK_T"]},
                  {**trainer, "BLOCK_H": trainer["BLOCK_H"] // 2}]  # planted: H in half-length steps
    calls = []
    rows = bench.sampling_sweep((1, 3), weight, candidates, copy_gb_per_s=1.0,
                                time_ms=lambda fn: calls.append(fn()) or 1.0)
    assert len(rows) == 6 and len(calls) == 6 and not any("error" in r for r in rows)
    assert [r["bitwise_vs_reference"] for r in rows] == [True, True, False] * 2
    assert [r["reference"] for r in rows] == [True, False, False] * 2
    assert [r["shipped"] for r in rows] == [True, False, False] * 2  # the interpreter samples with the trainer's tiles
    assert rows[0]["floor_ms"] == weight.numel() * 2 / bench.GB * 1e3 and rows[0]["pct_of_copy"] > 0
