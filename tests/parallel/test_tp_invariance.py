"""TP = 1, 2, 4 on gloo, one launch of 4 CPU processes: every parallel op and mHC placement, bit for bit.

The ranks are cut into groups of each TP size (launch.spawn_group + invariance.run_world_sizes); the
planted bugs run in the same launch so the spawn cost (seconds per process) is paid once.
"""

from __future__ import annotations

import pytest
import torch
from tp_planted_bugs import PLANTED

from rl_engine.checks.tp_invariance.harness import (
    CASES,
    ProblemSizes,
    case_decoder,
    compare_runs,
    oracle_comparison,
    run_cases,
    run_world_sizes,
    runs_by_tp,
)
from rl_engine.parallel.canonical import ShardLayout
from rl_engine.parallel.launch import spawn_group

SIZES = ProblemSizes()


# The decoder case runs here at TP = 1 only (in process, below): its bits at TP = 2 and 4, on every rank,
# are tests/parallel/test_tp_decoder.py's, and under the interpreter it is most of this launch's time.
SPAWNED = tuple(c for c in CASES if c is not case_decoder)


@pytest.fixture(scope="module")
def runs():
    ranks = spawn_group(run_world_sizes, 4, backend="gloo", device="cpu", args=(SIZES, (1, 2, 4), SPAWNED + PLANTED))
    return runs_by_tp(ranks)


def _only(runs: dict, prefix: str | None) -> dict:
    """The results whose name starts with `prefix` (None: every result that is not a planted bug)."""
    keep = (lambda n: n.startswith(prefix)) if prefix else (lambda n: not n.startswith("planted_"))
    return {tp: [{k: v for k, v in r.items() if keep(k)} for r in ranks] for tp, ranks in runs.items()}


def test_every_op_and_placement_is_bitwise_equal_for_tp_1_2_4(runs):
    report = compare_runs(_only(runs, None))
    failing = [(name, tp) for name, per_tp in report["results"].items() for tp, v in per_tp.items()
               if not (v["bitwise_equal_to_tp1"] and v["ranks_agree"])]
    assert report["passed"] and not failing, failing
    names = set(report["results"])
    for expected in ("linear_logp.forward", "linear_logp.grad_hidden", "linear_logp.grad_weight",
                     "column_parallel.grad_x", "column_parallel_fp32.grad_weight", "row_parallel.forward",
                     "row_parallel_fp32.grad_x", "parallel_mlp.grad_w_down",
                     "mhc_tp_sharded.inside_unfused.bwd.gemm_rms.d_phi",
                     "mhc_cp_token_sharded.inside_unfused.bwd.norm.d_gamma",
                     "mhc_cp_token_sharded.outside_fused.fwd.post.out"):
        assert expected in names
    assert all(len(ranks) == 4 for ranks in runs.values())  # every rank of every group compared


def test_single_process_without_process_group_gives_the_same_bits(runs):
    local = run_cases(ShardLayout.from_group(), SIZES, "cpu")
    assert {"decoder.logp", "decoder.grad_embeds"} <= set(local)  # check-tp's decoder case runs
    local = {k: v for k, v in local.items() if not k.startswith("decoder.")}
    report = compare_runs({"1": _only(runs, None)["1"][:1], "no_process_group": [local]})
    failing = [n for n, v in report["results"].items() if not v["no_process_group"]["bitwise_equal_to_tp1"]]
    assert report["passed"], failing


def test_mhc_placements_are_the_replicated_oracles_bits(runs):
    verdicts = oracle_comparison(SIZES, runs["1"][0])
    assert len(verdicts) == 6
    assert all(v["bitwise_equal_to_oracle"] for v in verdicts.values()), verdicts


def _verdicts(runs, prefix):
    return compare_runs(_only(runs, prefix))


def test_planted_all_reduce_sum_is_flagged(runs):
    report = _verdicts(runs, "planted_allreduce_row_parallel")
    assert not report["passed"]
    v = report["results"]["planted_allreduce_row_parallel.forward"]
    assert not v["4"]["bitwise_equal_to_tp1"], v
    assert 0 < v["4"]["max_abs_diff_to_tp1"] < 1e-4  # a rounding difference, not a wrong result


def test_planted_tp_dependent_reduction_order_is_flagged(runs):
    report = _verdicts(runs, "planted_rotated_row_parallel")
    v = report["results"]["planted_rotated_row_parallel.forward"]
    assert not report["passed"]
    assert v["4"]["ranks_agree"]  # every rank has the last rank's result: only TP = 1 can show it
    assert not v["4"]["bitwise_equal_to_tp1"]


def test_planted_one_ulp_on_one_rank_is_flagged(runs):
    report = _verdicts(runs, "planted_one_ulp_on_rank1")
    v = report["results"]["planted_one_ulp_on_rank1.forward"]
    assert not report["passed"]
    for tp in ("2", "4"):
        assert not v[tp]["ranks_agree"] and not v[tp]["bitwise_equal_to_tp1"]
        ulp = float(torch.finfo(torch.float32).eps) * 64  # |y| < 64: one ulp is below this
        assert 0 < v[tp]["max_abs_diff_to_tp1"] < ulp


def test_sizes_that_split_into_partial_kernel_steps_are_a_usage_error():
    from rl_engine.checks.tp_invariance.check import _check_sizes
    from rl_engine.errors import UsageError

    _check_sizes(SIZES, "small")  # the interpreter's tiles
    with pytest.raises(UsageError, match="hidden a multiple of 64"):
        _check_sizes(ProblemSizes(hidden=48), "odd")


def test_the_cpu_check_without_the_interpreter_is_one_usage_line():
    import os
    import subprocess
    import sys

    env = dict(os.environ, TRITON_INTERPRET="0")
    proc = subprocess.run([sys.executable, "-m", "rl_engine.cli", "check-tp"], capture_output=True, text=True,
                          env=env, timeout=300)
    assert proc.returncode == 2 and "set TRITON_INTERPRET=1" in proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1, proc.stderr
