"""TP invariance on NCCL: as many ranks as the GPUs allow (1, 2 or 4), small sizes. Needs CUDA."""

from __future__ import annotations

import pytest
import torch

from rl_engine.checks.tp_invariance.check import PRESETS
from rl_engine.checks.tp_invariance.harness import compare_runs, oracle_comparison, run_world_sizes, runs_by_tp
from rl_engine.parallel.launch import spawn_group


@pytest.mark.gpu
def test_nccl_ranks_give_the_same_bits_for_every_tp_size():
    gpus = torch.cuda.device_count()
    launch = 4 if gpus >= 4 else 2 if gpus >= 2 else 1
    tp_sizes = tuple(s for s in (1, 2, 4) if s <= launch)
    sizes = PRESETS["gpu"]  # the GPU's tiles: every split whole steps at TP = 4
    runs = runs_by_tp(spawn_group(run_world_sizes, launch, backend="nccl", device="cuda", args=(sizes, tp_sizes)))
    report = compare_runs(runs)
    assert report["passed"], [n for n, v in report["results"].items() if not all(
        x["bitwise_equal_to_tp1"] and x["ranks_agree"] for x in v.values())]
    # strict-fp32 mHC on CUDA: the CPU oracle's bytes
    assert all(v["bitwise_equal_to_oracle"] for v in oracle_comparison(sizes, runs["1"][0]).values())
