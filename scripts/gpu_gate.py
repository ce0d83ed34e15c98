"""The GPU gate: the whole `gpu`-marked suite plus every Triton op checked at Qwen3-8B geometry, in one call.

    python scripts/gpu_gate.py --out DIR [--workers N]
    python scripts/gpu_gate.py --tree-hash     the digest the log's tree= gives this checkout's tested files

Runs on the H200 whenever kernel code changes (a subset is not a green run):
  1. `check-op --candidate triton --check-invariance` for every op in the harness's op list, bf16
     and fp32, Qwen3-8B geometry, seq 1024, with `--check-grad` where the op declares a Triton backward;
  2. then `pytest -m gpu tests` (pytest-xdist workers when installed: Triton compiles are CPU-bound).
Writes DIR/gpu_gate.log (everything, in order of completion), DIR/gpu_gate_summary.json,
DIR/pytest_gpu.log and DIR/check_op/check_op_<op>_<dtype>.json.
Exit 0 only when nothing failed, errored or was skipped; 1 otherwise; 2 without CUDA.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from rl_engine.cli import ArgumentParser, run_guarded  # noqa: E402
from rl_engine.outputs import check_writable, write_atomic  # noqa: E402


def log(fh, line: str) -> None:
    print(line, flush=True)
    fh.write(line + "\n")
    fh.flush()


# What the gate tests: the package, its tests, the scripts and benchmarks, the project file (results excluded).
TREE_PARTS = ("rl_engine", "tests", "scripts", "benchmarks", "pyproject.toml")
TREE_SUFFIXES = (".py", ".json", ".sh", ".toml")


def tree_hash(root: Path = ROOT) -> str:
    """sha256 (16 hex digits) of the tested files' paths and bytes. The device's copy of the tree may carry a
    stale .git (its `git rev-parse` named a commit two changes old twice), so the log names the code by its
    content: `python scripts/gpu_gate.py --tree-hash` on a checkout gives the same digest for the same code."""
    import hashlib

    digest = hashlib.sha256()
    files = []
    for part in TREE_PARTS:
        path = root / part
        files += [path] if path.is_file() else [f for f in path.rglob("*") if f.is_file()]
    for f in sorted(files):
        rel = f.relative_to(root).as_posix()
        if f.suffix not in TREE_SUFFIXES or rel.startswith("benchmarks/results/"):  # bytecode, results
            continue
        digest.update(rel.encode() + b"\0" + f.read_bytes() + b"\0")
    return digest.hexdigest()[:16]


def environment(commit: str | None, device: str = "cuda") -> dict:
    if commit is None:  # a copied tree may carry a stale .git: --commit names what was copied
        try:
            commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True,
                                    text=True, timeout=10).stdout.strip() or None
        except OSError:
            pass
    from rl_engine.environment import environment as record

    return {**record(device), "commit": commit, "tree": tree_hash()}


def start_pytest(out: Path, workers: int) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "pytest", "-o", "addopts=", "-m", "gpu", "-q", "-rfEs", "-p", "no:cacheprovider",
           "--durations=10", "tests"]
    try:
        import xdist  # noqa: F401

        if workers > 1:
            cmd[3:3] = ["-n", str(workers)]
    except ImportError:
        pass
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    env.pop("TRITON_INTERPRET", None)
    # A session of its own: on an interrupt the gate kills the suite and its xdist workers as one group.
    return subprocess.Popen(cmd, cwd=ROOT, stdout=open(out / "pytest_gpu.log", "w"), stderr=subprocess.STDOUT,
                            env=env, start_new_session=True)


def pytest_counts(text: str) -> dict:
    """Counts from pytest's closing line, e.g. '2 failed, 131 passed, 3 skipped in 40.1s'."""
    tail = text.strip().splitlines()[-1] if text.strip() else ""
    counts = {k: 0 for k in ("passed", "failed", "errors", "skipped", "xfailed", "xpassed")}
    for n, word in re.findall(r"(\d+) (passed|failed|errors?|skipped|xfailed|xpassed)", tail):
        counts["errors" if word.startswith("error") else word] = int(n)
    counts["closing_line"] = tail
    return counts


def gate_passed(suite: dict, ops: list[dict]) -> bool:
    """Green only if the suite ran, nothing failed, errored or skipped, and every op passed: a subset is not green."""
    return (suite["rc"] == 0 and suite["passed"] > 0 and suite["failed"] == suite["errors"] == suite["skipped"] == 0
            and bool(ops) and all(r["passed"] for r in ops))


def check_ops(out: Path, fh) -> list[dict]:
    from rl_engine.checks.operators import check_op
    from rl_engine.kernels.records import OPS

    results = []
    for op, spec in OPS.items():
        for layout in spec.layouts:
            for dtype in ("bf16", "fp32"):
                name = op if layout == spec.layouts[0] else f"{op}_{layout}"
                parser = argparse.ArgumentParser()
                check_op.add_arguments(parser)
                report = out / "check_op" / f"check_op_{name}_{dtype}.json"
                argv = ["--op", op, "--layout", layout, "--candidate", "triton", "--device", "cuda", "--dtype", dtype,
                        "--arch-key", "sm90", "--qwen3-8b", "--seq", "1024", "--check-invariance",
                        "--json-out", str(report)]
                if spec.grad_input_names:  # forward-only ops declare none
                    argv.append("--check-grad")
                t0 = time.perf_counter()
                try:
                    rc = check_op.run(parser.parse_args(argv))
                    error = None
                except Exception as exc:  # a UsageError too: one op's error must not hide the others
                    rc, error = None, f"{type(exc).__name__}: {exc}"
                seconds = time.perf_counter() - t0
                row = {"op": op, "layout": layout, "dtype": dtype, "check_grad": "--check-grad" in argv, "rc": rc,
                       "error": error, "passed": rc == 0, "seconds": round(seconds, 1)}
                results.append(row)
                log(fh, f"check-op {name:<24} {dtype:<5} grad={row['check_grad']!s:<5} "
                        f"{'PASSED' if row['passed'] else 'FAILED'} ({seconds:.1f} s){' ' + error if error else ''}")
    return results


def main() -> int:
    parser = ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", help="folder for the log, the summary and the check-op reports")
    parser.add_argument("--tree-hash", action="store_true",
                        help="print the tested files' digest (the log's tree=) for this checkout and exit")
    parser.add_argument("--workers", type=int, default=4, help="pytest-xdist workers for the suite (default 4)")
    parser.add_argument("--commit", default=None, help="the commit under test (default: git rev-parse HEAD)")
    args = parser.parse_args()
    if args.tree_hash:
        print(tree_hash())
        return 0
    if args.out is None:
        parser.error("the following arguments are required: --out")
    out = check_writable(args.out, "--out", directory=True)
    import torch

    if not torch.cuda.is_available():
        print("gpu_gate: error: needs CUDA; run it on the GPU machine", file=sys.stderr)
        return 2
    out.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    with open(out / "gpu_gate.log", "w") as fh:
        env = environment(args.commit)
        log(fh, "GPU gate " + " ".join(f"{k}={v}" for k, v in env.items()))
        # One after the other: the suite's workers and the 8B-geometry checks together overrun 141 GB.
        ops = check_ops(out, fh)
        gc.collect()
        torch.cuda.empty_cache()
        pytest_proc = start_pytest(out, args.workers)
        try:
            pytest_rc = pytest_proc.wait()
        except BaseException:  # an interrupt: the suite must not run on alone
            os.killpg(pytest_proc.pid, signal.SIGKILL)
            pytest_proc.wait()
            raise
        pytest_text = (out / "pytest_gpu.log").read_text()
        log(fh, "--- pytest -m gpu ---")
        fh.write(pytest_text)
        print(pytest_text[-6000:])
        suite = pytest_counts(pytest_text)
        suite["rc"] = pytest_rc
        ops_failed = [f"{r['op']} {r['dtype']}" for r in ops if not r["passed"]]
        ok = gate_passed(suite, ops)
        summary = {"environment": env, "passed": ok, "wall_s": round(time.perf_counter() - t0, 1),
                   "pytest_gpu": suite, "check_op": ops, "check_op_failed": ops_failed}
        write_atomic(out / "gpu_gate_summary.json", json.dumps(summary, indent=2) + "\n", "--out")
        verdict = (f"GPU gate {'PASSED' if ok else 'FAILED'}: pytest -m gpu {suite['passed']} passed, "
                   f"{suite['failed']} failed, {suite['errors']} errors, {suite['skipped']} skipped; check-op "
                   f"{len(ops) - len(ops_failed)}/{len(ops)} passed; {summary['wall_s']} s on {env['device_name']} "
                   f"(torch {env['torch']}, Triton {env['triton']}, commit {env['commit']}, tree {env['tree']})")
        log(fh, verdict)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(run_guarded("gpu_gate", main))
