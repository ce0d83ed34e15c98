"""Provider acceptance against the strict-fp32 oracle: `rl-engine check-p1` / `scripts/check_p1.py`.

For every selected case, on one device and the same seeded inputs:
1. `check_capability`: the provider must declare the case's fusion mode, trainability and placement
   (checked before any operator runs);
2. the oracle's trace must reproduce the golden hashes on this device;
3. every boundary of the provider's trace is compared with the oracle's:
   - a provider declaring `strict-fp32-v1` must be byte-identical to the oracle and to the golden
     hashes;
   - any other profile is judged by `TOLERANCE` (allclose, see below) and the report says so;
   the first diverging boundary is reported with its max abs error and ulp distance;
4. batch invariance, forward and backward: each token run alone through the provider must give
   the same bytes as its row in the batch, for every per-token boundary (always bitwise).
Exit codes: 0 passed, 1 failed, 2 usage error.
"""

from __future__ import annotations

import argparse
import datetime
import hashlib
import json
import platform
import time
from pathlib import Path

import torch

from rl_engine.errors import UsageError
from rl_engine.mhc import oracle
from rl_engine.mhc.fixtures import GOLDEN_PATH, Case, build_inputs, load_golden, select_cases
from rl_engine.mhc.numerics import PROFILE
from rl_engine.mhc.provider import check_capability, resolve_provider
from rl_engine.mhc.trace import boundaries_for, compare, tensor_sha256

# Judgment for a provider with a non-strict numeric profile: elementwise
#   |cand − ref| ≤ atol_rel · max|ref| + rtol · |ref|
# rtol = 1.6e-2 is four bf16 ulps (a non-strict provider may flip the bf16 rounding of an activation,
# which then feeds every later boundary); the absolute term is relative to the boundary's own scale
# because gradients are sums with cancellation. NaN/Inf where the oracle is finite always fails.
TOLERANCE = {"mode": "allclose", "rtol": 1.6e-2, "atol_rel": 1e-3}


def _within_tolerance(ref: torch.Tensor, cand: torch.Tensor) -> dict:
    ref64, cand64 = ref.detach().cpu().double(), cand.detach().cpu().double()
    bad_nan = bool((torch.isfinite(ref64) & ~torch.isfinite(cand64)).any())
    scale = float(ref64.abs().max()) if ref64.numel() else 0.0
    excess = (cand64 - ref64).abs() - (TOLERANCE["atol_rel"] * scale + TOLERANCE["rtol"] * ref64.abs())
    return {"within_tolerance": not bad_nan and bool((excess <= 0).all()),
            "max_excess": float(torch.nan_to_num(excess, nan=float("inf")).max()) if excess.numel() else 0.0}


def check_case(provider, case: Case, device, golden: dict | None, batch_invariance: bool = True) -> dict:
    """One case: capability, oracle vs golden, provider vs oracle (and golden), batch invariance."""
    strict = provider.numeric_profile == PROFILE
    contract, batch, controller, norm = build_inputs(case, device)
    result = {"case": case.name, "tokens": case.tokens, "hidden": case.hidden,
              "contract_fingerprint": contract.fingerprint(), "passed": False, "failures": []}
    failures = result["failures"]
    if golden is None:
        failures.append("case missing from the golden manifest")
    elif golden["contract_fingerprint"] != contract.fingerprint():
        failures.append("golden manifest was made under another contract (fingerprint differs)")
    try:
        check_capability(provider, contract)
    except UsageError as exc:
        failures.append(f"capability: {exc}")
        return result

    names = [b.name for b in boundaries_for(contract)]
    reference = oracle.mhc_site(batch, controller, norm, contract)
    golden_hashes = {n: g["sha256"] for n, g in (golden or {}).get("boundaries", {}).items()}
    oracle_off_golden = [n for n in names if tensor_sha256(reference[n]) != golden_hashes.get(n)]
    result["oracle_matches_golden"] = not oracle_off_golden
    if oracle_off_golden:
        failures.append(f"the oracle on {device} does not reproduce the golden hashes of "
                        f"{len(oracle_off_golden)} boundaries, first {oracle_off_golden[0]}")

    try:
        traced = oracle.mhc_site(batch, controller, norm, contract, ops=provider)
    except oracle.OperatorError as exc:
        result["operator_error"] = {"operator": exc.operator, "error": str(exc)}
        failures.append(f"operator {exc}")
        return result

    rows = []
    for name in names:
        cand = traced.get(name)
        if cand is None:
            rows.append({"boundary": name, "equal": False, "reason": "missing from the provider's trace"})
            continue
        row = {"boundary": name, **compare(reference[name], cand)}
        if strict:
            row["golden_equal"] = tensor_sha256(cand) == golden_hashes.get(name)
            row["passed"] = row["equal"] and row["golden_equal"]
        elif "reason" in row:
            row["passed"] = False
        else:
            row.update(_within_tolerance(reference[name], cand))
            row["passed"] = row["within_tolerance"]
        rows.append(row)
    result["boundaries"] = rows
    first = next((r for r in rows if not r.get("passed")), None)
    if first is not None:
        result["first_divergence"] = first
        failures.append(_describe_divergence(first))

    if batch_invariance and case.tokens > 1:
        result["batch_invariance"] = _batch_invariance(provider, batch, controller, norm, contract, traced)
        if not result["batch_invariance"]["passed"]:
            failures.append("batch invariance: " + result["batch_invariance"]["first_divergence"]["what"])
    result["passed"] = not failures
    return result


def _describe_divergence(row: dict) -> str:
    if "reason" in row:
        return f"{row['boundary']}: {row['reason']}"
    if row.get("equal"):
        return f"{row['boundary']}: equal to the oracle but not to the golden hash"
    return (f"first diverging boundary {row['boundary']}: {row['mismatched']} elements differ, "
            f"max abs error {row['max_abs_error']:.3g}, max {row['max_ulp']} ulp at {row['worst_index']}")


def _batch_invariance(provider, batch, controller, norm, contract, traced) -> dict:
    per_token = [b.name for b in boundaries_for(contract) if b.per_token]
    for t in range(batch.tokens):
        try:
            alone = oracle.mhc_site(batch.row(t), controller, norm, contract, ops=provider)
        except oracle.OperatorError as exc:
            return {"passed": False, "first_divergence": {"row": t, "what": f"row {t} alone: operator {exc}"}}
        for name in per_token:
            diff = compare(traced[name][t : t + 1], alone[name])
            if not diff["equal"]:
                what = (f"row {t} alone differs from row {t} of the batch at {name}"
                        + (f" (max abs error {diff['max_abs_error']:.3g}, {diff['max_ulp']} ulp)"
                           if "max_ulp" in diff else ""))
                return {"passed": False, "first_divergence": {"row": t, "boundary": name, "what": what, **diff}}
    return {"passed": True, "rows": batch.tokens, "boundaries": len(per_token)}


def environment(device) -> dict:
    try:
        import triton

        triton_version = triton.__version__
    except Exception:  # noqa: BLE001 - optional
        triton_version = "unavailable"
    dev = torch.device(device)
    name = torch.cuda.get_device_name(dev) if dev.type == "cuda" else platform.processor() or platform.machine()
    return {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "device": str(dev), "device_name": name, "torch": torch.__version__, "triton": triton_version,
            "python": platform.python_version()}


def check_provider(provider, cases: list[Case], device="cpu", manifest: dict | None = None,
                   batch_invariance: bool = True, progress=print, provider_name: str | None = None) -> dict:
    """Run every case; returns the report (report["passed"] is the verdict)."""
    manifest = load_golden() if manifest is None else manifest
    strict = provider.numeric_profile == PROFILE
    report = {
        "command": "check-p1",
        "provider": provider_name or f"{type(provider).__module__}:{type(provider).__name__}",
        "numeric_profile": provider.numeric_profile,
        "judgment": "bitwise (oracle and golden hashes)" if strict else
                    "tolerance (non-strict profile: allclose vs the oracle; golden hashes not applicable)",
        "tolerance": None if strict else TOLERANCE,
        "golden_manifest_sha256": hashlib.sha256(json.dumps(manifest, sort_keys=True).encode()).hexdigest(),
        **environment(device),
        "cases": [],
    }
    if progress and not strict:
        progress(f"provider profile {provider.numeric_profile!r} is not {PROFILE}: judged by tolerance {TOLERANCE}")
    for case in cases:
        start = time.perf_counter()
        result = check_case(provider, case, device, manifest["cases"].get(case.name), batch_invariance)
        result["seconds"] = round(time.perf_counter() - start, 3)
        report["cases"].append(result)
        if progress:
            verdict = "PASS" if result["passed"] else "FAIL"
            detail = "" if result["passed"] else "  " + result["failures"][0]
            progress(f"{case.name:16s} T={case.tokens:<3d} C={case.hidden:<5d} {verdict}  "
                     f"{result['seconds']:6.2f}s{detail}")
    report["passed"] = all(c["passed"] for c in report["cases"])
    return report


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--provider", required=True, metavar="MODULE:CLASS",
                        help="provider to check, e.g. rl_engine.mhc.provider:ReferenceProvider")
    parser.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    parser.add_argument("--cases", nargs="+", metavar="CASE", help="subset of the fixture cases (default: all)")
    parser.add_argument("--json", type=Path, metavar="PATH", help="write the full report here")
    parser.add_argument("--skip-batch-invariance", action="store_true", help="skip the row-alone runs")
    parser.add_argument("--golden", type=Path, default=GOLDEN_PATH, help=argparse.SUPPRESS)


def run(args: argparse.Namespace) -> int:
    if args.device == "cpu":
        # The oracle is many small elementwise ops: on a shared CPU, OpenMP threads only add contention
        # (measured 4 s vs 40 s at production geometry on a loaded 2-core machine). Bytes don't change.
        torch.set_num_threads(1)
    if args.device == "cuda" and not torch.cuda.is_available():
        raise UsageError("--device cuda requested but CUDA is not available")
    provider = resolve_provider(args.provider)
    cases = select_cases(args.cases)
    manifest = load_golden(args.golden)
    report = check_provider(provider, cases, args.device, manifest, not args.skip_batch_invariance,
                            provider_name=args.provider)
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(report, indent=1) + "\n")
        print(f"report written to {args.json}")
    passed = sum(c["passed"] for c in report["cases"])
    print(f"check-p1 {'PASSED' if report['passed'] else 'FAILED'}: {passed}/{len(report['cases'])} cases, "
          f"{report['judgment']}, device {report['device']} ({report['device_name']})")
    return 0 if report["passed"] else 1
