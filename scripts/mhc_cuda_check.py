"""H200 evidence for the strict-fp32 mHC oracle (issue #7); run by the lead on the GPU machine.

    python scripts/mhc_cuda_check.py --out docs/evidence [--quick]

1. the numerics (pinned exp/log/sigmoid, sqrt_rn, lane_sum) on CUDA vs CPU: mismatch counts;
2. the reference provider's acceptance on CUDA and on the host CPU, against the committed golden
   hashes: mhc_check_p1_reference_{cuda,cpu}.json (the same reports as `rl-engine check-p1 --json`);
3. forward+backward time of one site at DeepSeek-V4-Flash geometry (T = 64, hidden 4096), CPU and CUDA.
A summary goes to mhc_cuda_check.json. Each step is guarded, so one failure doesn't lose the others.
"""

import json
import sys
import time
import traceback
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from rl_engine.checks.mhc_acceptance import check_provider  # noqa: E402
from rl_engine.cli import ArgumentParser, run_guarded  # noqa: E402
from rl_engine.environment import environment  # noqa: E402
from rl_engine.mhc import numerics as nm  # noqa: E402
from rl_engine.mhc.fixtures import CASES, CASES_BY_NAME, build_inputs  # noqa: E402
from rl_engine.mhc.oracle import mhc_site  # noqa: E402
from rl_engine.mhc.provider import ReferenceProvider  # noqa: E402
from rl_engine.outputs import check_writable, write_atomic  # noqa: E402


def numerics_parity(n: int) -> dict:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(n, generator=g) * 30
    pos = x.abs() * torch.exp(torch.randn(n, generator=g) * 10)
    out = {}
    for name, arg in [("exp", x), ("sigmoid", x), ("log", pos), ("sqrt_rn", pos), ("rsqrt", pos)]:
        fn = getattr(nm, name)
        out[name] = int((fn(arg).view(torch.int32) != fn(arg.cuda()).cpu().view(torch.int32)).sum())
    rows = torch.randn(64, 24, 16384, generator=g)
    out["lane_sum_64x24x16384"] = int((nm.lane_sum(rows, 64) != nm.lane_sum(rows.cuda(), 64).cpu()).sum())
    return out


def site_seconds(device: str, repeats: int) -> float:
    contract, batch, controller, norm = build_inputs(CASES_BY_NAME["production"], device)
    mhc_site(batch, controller, norm, contract)  # warm-up
    best = float("inf")
    for _ in range(repeats):
        if device == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        mhc_site(batch, controller, norm, contract)
        if device == "cuda":
            torch.cuda.synchronize()
        best = min(best, time.perf_counter() - start)
    return best


def step(summary: dict, name: str, fn):
    print(f"== {name}", flush=True)
    try:
        summary[name] = fn()
        print(f"   {json.dumps(summary[name])}", flush=True)
    except Exception as exc:  # noqa: BLE001 - keep the other measurements
        traceback.print_exc()
        summary[name] = {"error": f"{type(exc).__name__}: {exc}"}


def acceptance(device: str, out: Path, cases) -> dict:
    report = check_provider(ReferenceProvider(), cases, device,
                            provider_name="rl_engine.mhc.provider:ReferenceProvider")
    path = out / f"mhc_check_p1_reference_{device}.json"
    write_atomic(path, json.dumps(report, indent=1) + "\n", "--out")
    return {"passed": report["passed"], "cases": {c["case"]: c["passed"] for c in report["cases"]}, "report": str(path)}


def main() -> int:
    parser = ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("docs/evidence"))
    parser.add_argument("--quick", action="store_true", help="skip the production case and use fewer inputs")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("mhc_cuda_check: error: CUDA is not available", file=sys.stderr)
        return 2
    check_writable(args.out, "--out", directory=True)
    torch.set_num_threads(1)  # the CPU oracle is many small elementwise ops
    cases = [c for c in CASES if not (args.quick and c.production)]
    summary = {"environment": environment("cuda")}
    step(summary, "numerics_mismatches_cuda_vs_cpu", lambda: numerics_parity(1 << (20 if args.quick else 22)))
    step(summary, "acceptance_cuda", lambda: acceptance("cuda", args.out, cases))
    step(summary, "acceptance_cpu", lambda: acceptance("cpu", args.out, cases))
    step(summary, "site_fwd_bwd_seconds_production", lambda: {
        "cuda": site_seconds("cuda", 3), "cpu_1_thread": site_seconds("cpu", 1)})
    write_atomic(args.out / "mhc_cuda_check.json", json.dumps(summary, indent=1) + "\n", "--out")
    print(f"wrote {args.out / 'mhc_cuda_check.json'}")
    ok = all(summary[k].get("passed") for k in ("acceptance_cuda", "acceptance_cpu"))
    ok = ok and not any(summary["numerics_mismatches_cuda_vs_cpu"].values())  # an "error" entry counts
    print("mhc_cuda_check", "PASSED" if ok else "FAILED")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(run_guarded("mhc_cuda_check", main))
