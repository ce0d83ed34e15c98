"""Check TP invariance: every parallel op and mHC placement on TP = 1, 2, 4, compared bit for bit.

One launch of max(world sizes) processes (gloo on CPUs, NCCL on GPUs) cut into groups of each TP
size; plus TP = 1 in this process without any process group. Every result of every rank must have
the TP = 1 bits, and TP = 1 without a process group is the single-GPU Triton ops themselves. The
report also says whether the mHC placements reproduce the replicated strict-fp32 oracle run on the
CPU (bitwise). Exit 0 passed, 1 failed, 2 usage error.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import platform
import time
from pathlib import Path

import torch

from rl_engine.checks.operators.tolerance import contract_fingerprint, load_contract
from rl_engine.checks.tp_invariance.harness import (
    ProblemSizes,
    compare_runs,
    oracle_comparison,
    run_cases,
    run_world_sizes,
    runs_by_tp,
)
from rl_engine.environment import environment
from rl_engine.errors import UsageError
from rl_engine.outputs import check_writable, write_atomic
from rl_engine.parallel.canonical import SUPPORTED_WORLD_SIZES, ShardLayout
from rl_engine.parallel.launch import BACKENDS, COMMUNICATION_ENV, spawn_group

SEED_LIMIT = 2**63  # the cases add small offsets to the seed; torch generators take 64 bits
PRESETS = {
    "small": ProblemSizes(),  # the interpreter's tiles (CPU)
    "gpu": ProblemSizes(hidden=256, vocab=16384, features_out=64),  # the GPU's tiles, small
    # Qwen-like vocabulary and DeepSeek-V4-Flash mHC geometry (K = 16384): for the GPUs.
    "large": ProblemSizes(batch=4, seq=128, hidden=1024, vocab=151936, features_out=1024, mhc_tokens=128,
                          mhc_hidden=4096),
}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--backend", choices=sorted(BACKENDS), default="gloo")
    parser.add_argument("--device", choices=sorted(set(BACKENDS.values())), default="cpu")
    parser.add_argument("--world-sizes", default="1,2,4", help="TP sizes to compare, comma separated; must include 1")
    parser.add_argument("--preset", choices=sorted(PRESETS), default="small", help="problem sizes")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", type=Path, default=None, help="write the report here")


def _world_sizes(text: str) -> tuple[int, ...]:
    try:
        sizes = tuple(sorted({int(s) for s in text.split(",") if s.strip()}))
    except ValueError:
        raise UsageError(f"--world-sizes: expected comma-separated integers, got {text!r}") from None
    if not sizes or 1 not in sizes or any(s not in SUPPORTED_WORLD_SIZES for s in sizes):
        raise UsageError(f"--world-sizes: expected a subset of {SUPPORTED_WORLD_SIZES} including 1, got {text!r}")
    return sizes


def _check_sizes(sizes: ProblemSizes, preset: str) -> None:
    """Every split must be whole steps of the kernels' tiles at TP = 4 (GPU tiles are larger)."""
    from rl_engine.kernels.ops.triton.linear.matmul import matmul_config
    from rl_engine.parallel.tp_kernels import vocab_align

    step = max(matmul_config(d, 1, 1).block_k for d in (torch.bfloat16, torch.float32))
    align = vocab_align(torch.bfloat16)
    if sizes.hidden % (4 * step) or sizes.features_out % step or sizes.vocab < 4 * align:
        raise UsageError(f"--preset {preset}: these kernels need hidden a multiple of {4 * step}, features_out "
                         f"of {step} and a vocabulary of at least {4 * align} (try --preset gpu on a GPU)")


def _summary(report: dict) -> dict:
    """Per case (the name before the first dot) and TP: 'ok' or the number of failing results."""
    table: dict = {}
    for name, per_tp in report["results"].items():
        case = name.split(".")[0]
        for tp, v in per_tp.items():
            bad = not (v["bitwise_equal_to_tp1"] and v["ranks_agree"])
            table.setdefault(case, {}).setdefault(tp, 0)
            table[case][tp] += int(bad)
    return table


def run(args: argparse.Namespace) -> int:
    if BACKENDS.get(args.backend) != args.device:
        raise UsageError(f"--backend {args.backend} runs on --device {BACKENDS[args.backend]}, not {args.device}")
    world_sizes = _world_sizes(args.world_sizes)
    launch = max(world_sizes)
    if args.device == "cuda" and torch.cuda.device_count() < launch:
        raise UsageError(f"--world-sizes {args.world_sizes}: needs {launch} GPUs, found {torch.cuda.device_count()}")
    from rl_engine.kernels.ops.triton.runtime import interpreting

    if args.device == "cpu" and not interpreting():
        raise UsageError("--device cpu: the Triton kernels run under Triton's interpreter there; "
                         "set TRITON_INTERPRET=1")
    if args.device == "cpu" and args.preset != "small":
        raise UsageError(f"--preset {args.preset}: sizes for GPU tiles, minutes under the CPU interpreter; "
                         f"use --preset small on --device cpu")
    if not 0 <= args.seed < SEED_LIMIT:
        raise UsageError(f"--seed: expected an integer in [0, 2**63), got {args.seed}")
    sizes = dataclasses.replace(PRESETS[args.preset], seed=args.seed)
    _check_sizes(sizes, args.preset)
    if args.json:
        check_writable(args.json, "--json")

    started = time.perf_counter()
    print(f"launching {launch} {args.backend} rank(s) on {args.device} for TP {world_sizes} ...", flush=True)
    ranks = spawn_group(run_world_sizes, launch, backend=args.backend, device=args.device,
                        args=(sizes, world_sizes))
    runs = runs_by_tp(ranks)
    launched_s = time.perf_counter() - started
    print(f"  done in {launched_s:.1f} s; TP = 1 without a process group in this process ...", flush=True)
    runs["no_process_group"] = [run_cases(ShardLayout.from_group(), sizes, args.device)]
    report = compare_runs(runs)
    oracle = oracle_comparison(sizes, runs["1"][0])
    passed = report["passed"] and all(v["bitwise_equal_to_oracle"] for v in oracle.values())

    summary = _summary(report)
    tps = list(runs)
    print(f"{'case':28s} " + " ".join(f"{'TP=' + tp if tp.isdigit() else tp:>18s}" for tp in tps))
    for case, per_tp in summary.items():
        print(f"{case:28s} " + " ".join(f"{'ok' if per_tp[tp] == 0 else str(per_tp[tp]) + ' differ':>18s}"
                                        for tp in tps))
    for name, v in oracle.items():
        print(f"{name:44s} vs replicated oracle (CPU): {'bitwise' if v['bitwise_equal_to_oracle'] else v['differing']}")
    print("PASSED" if passed else "FAILED")

    if args.json:
        failing = [{"name": n, "tp": tp, **v} for n, per_tp in report["results"].items()
                   for tp, v in per_tp.items() if not (v["bitwise_equal_to_tp1"] and v["ranks_agree"])]
        doc = {
            "check": "tp_invariance",
            "passed": passed,
            "backend": args.backend,
            "device": args.device,
            "world_sizes": list(world_sizes),
            "launched_ranks": launch,
            "communication_env": COMMUNICATION_ENV,
            "preset": args.preset,
            "sizes": dataclasses.asdict(sizes),
            "environment": {**environment(args.device), "host": platform.node()},
            # Every verdict here is bitwise; the fingerprint names the contract that says so.
            "contract_fingerprint": contract_fingerprint(load_contract()),
            "results_compared": len(report["results"]),
            "summary": summary,
            "failing": failing,
            "mhc_vs_replicated_oracle": oracle,
            "launch_seconds": round(launched_s, 2),
            "results": report["results"],
        }
        write_atomic(args.json, json.dumps(doc, indent=1, default=float) + "\n", "--json")
        print(f"report: {args.json}")
    return 0 if passed else 1
