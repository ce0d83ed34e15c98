"""Provider acceptance against the strict-fp32 oracle: `rl-engine check-p1`.

The provider runs in its own process (`isolation.IsolatedProvider`): the checker never shares an
interpreter with the code it judges, so a provider cannot patch the checker, and its
`numeric_profile` and `capabilities()` are read once, when it starts, and recorded in the report.
For every selected case, on one device and the same seeded inputs:
1. `check_capability`: the provider must declare the case's fusion mode, trainability and placement
   (checked before any operator runs);
2. the oracle's trace must reproduce the golden hashes on this device;
3. every boundary of the provider's trace is compared with the oracle's, under the judgment the
   contract names for the provider's declared `numeric_profile` (`contract.JUDGMENTS`), never one the
   provider picks:
   - `strict-fp32-v1`: byte-identical to the oracle and to the golden hashes;
   - another profile the contract names (e.g. `fp32-relaxed`): its tolerance, and the report and the
     summary line say so ("PASSED under tolerance ...");
   - a profile the contract does not name (None, "", a typo): the case fails, nothing runs;
   the first diverging boundary is reported with its max abs error and ulp distance;
   an operator that raises (anything, SystemExit and KeyboardInterrupt included), returns the wrong
   number, shape, dtype or device of outputs, kills its process or outlasts the per-case time limit
   fails the case, naming the operator (after a death or a time-out the remaining cases are not run);
4. batch invariance, forward and backward: each token run alone through the provider must give
   the same bytes as its row in the batch, for every per-token boundary (always bitwise).
Exit codes: 0 passed bitwise under the strict profile; 1 failed, or passed only under a tolerance
(unless --accept-tolerance: the report's `accepted_under` says which); 2 usage error.
`check_provider` also takes a provider object (run in the caller's process: the caller vouches for it).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import time
from pathlib import Path

import torch

from rl_engine.environment import environment
from rl_engine.errors import UsageError
from rl_engine.loading import module_file
from rl_engine.mhc import oracle
from rl_engine.mhc.contract import JUDGMENTS, judgment_for
from rl_engine.mhc.fixtures import GOLDEN_PATH, Case, build_inputs, load_golden, select_cases
from rl_engine.mhc.isolation import DEFAULT_CASE_TIMEOUT_S, IsolatedProvider
from rl_engine.mhc.provider import check_capability, check_spec
from rl_engine.mhc.trace import boundaries_for, compare, tensor_sha256
from rl_engine.outputs import check_run_paths, check_writable, write_atomic


def resolve_judgment(provider) -> tuple[dict | None, str]:
    """(the judgment the contract names for the provider's declared profile, "") or (None, why not).
    Called once per run: the profile is what the provider answered first."""
    if isinstance(provider, IsolatedProvider):
        if (exc := provider.profile_error) is not None:
            return None, f"reading numeric_profile raised {type(exc).__name__}: {exc}"
        if provider.numeric_profile is None and provider.profile_repr != "None":  # not a string
            return None, (f"provider declares numeric_profile {provider.profile_repr}, which the contract does "
                          f"not know (known: {sorted(JUDGMENTS)})")
    try:
        profile = getattr(provider, "numeric_profile", None)
    except KeyboardInterrupt:
        raise
    except BaseException as exc:  # noqa: BLE001 - a profile that cannot be read is not declared
        return None, f"reading numeric_profile raised {type(exc).__name__}: {exc}"
    try:
        return judgment_for(profile), ""
    except ValueError as exc:
        return None, str(exc)


def describe_judgment(judgment: dict | None, reason: str = "") -> str:
    if judgment is None:
        return f"none: {reason}"
    if judgment["mode"] == "bitwise":
        return f"bitwise ({judgment['profile']}: oracle and golden hashes)"
    return (f"tolerance {judgment['profile']} ({judgment['mode']} vs the oracle, rtol {judgment['rtol']:g}, "
            f"atol {judgment['atol_rel']:g}·max|ref|; golden hashes not applicable)")


def _within_tolerance(ref: torch.Tensor, cand: torch.Tensor, judgment: dict) -> dict:
    if judgment["mode"] != "allclose":
        raise ValueError(f"judgment mode {judgment['mode']!r} is not implemented")
    ref64, cand64 = ref.detach().cpu().double(), cand.detach().cpu().double()
    bad_nan = bool((torch.isfinite(ref64) & ~torch.isfinite(cand64)).any())
    scale = float(ref64.abs().max()) if ref64.numel() else 0.0
    excess = (cand64 - ref64).abs() - (judgment["atol_rel"] * scale + judgment["rtol"] * ref64.abs())
    return {"within_tolerance": not bad_nan and bool((excess <= 0).all()),
            "max_excess": float(torch.nan_to_num(excess, nan=float("inf")).max()) if excess.numel() else 0.0}


def check_case(provider, case: Case, device, golden: dict | None, batch_invariance: bool = True,
               judgment: tuple[dict | None, str] | None = None) -> dict:
    """One case: judgment, capability, oracle vs golden, provider vs oracle (and golden), batch invariance.
    `judgment` is `resolve_judgment(provider)` read once by the caller (read here when not given)."""
    judgment, why_not = resolve_judgment(provider) if judgment is None else judgment
    contract, batch, controller, norm = build_inputs(case, device)
    result = {"case": case.name, "tokens": case.tokens, "hidden": case.hidden,
              "layer_contract_fingerprint": contract.fingerprint(), "passed": False, "failures": []}
    failures = result["failures"]
    if golden is None:
        failures.append("case missing from the golden manifest")
    elif golden["layer_contract_fingerprint"] != contract.fingerprint():
        failures.append("golden manifest was made under another contract (fingerprint differs)")
    if judgment is None:
        failures.append(f"judgment: {why_not}")
        return result
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
        if judgment["mode"] == "bitwise":
            row["golden_equal"] = tensor_sha256(cand) == golden_hashes.get(name)
            row["passed"] = row["equal"] and row["golden_equal"]
        elif "reason" in row:
            row["passed"] = False
        else:
            row.update(_within_tolerance(reference[name], cand, judgment))
            row["passed"] = row["within_tolerance"]
        rows.append(row)
    result["boundaries"] = rows
    first = next((r for r in rows if not r.get("passed")), None)
    if first is not None:
        result["first_divergence"] = first
        failures.append(_describe_divergence(first, judgment))

    if batch_invariance and case.tokens > 1:
        result["batch_invariance"] = _batch_invariance(provider, batch, controller, norm, contract, traced)
        if not result["batch_invariance"]["passed"]:
            failures.append("batch invariance: " + result["batch_invariance"]["first_divergence"]["what"])
    result["passed"] = not failures
    return result


def _describe_divergence(row: dict, judgment: dict) -> str:
    if "reason" in row:
        return f"{row['boundary']}: {row['reason']}"
    if row.get("equal"):
        return f"{row['boundary']}: equal to the oracle but not to the golden hash"
    where = ("first diverging boundary" if judgment["mode"] == "bitwise"
             else f"first boundary outside tolerance {judgment['profile']}")
    n = row["mismatched"]
    count = f"{n} element differs" if n == 1 else f"{n} elements differ"
    nans = f" ({row['nan_mismatched']} NaN against a number)" if row["nan_mismatched"] else ""
    return (f"{where} {row['boundary']}: {count}{nans}, max abs error {row['max_abs_error']:.3g}, "
            f"max {row['max_ulp']} ulp, worst at {row['worst_index']}")


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



def check_provider(provider, cases: list[Case], device="cpu", manifest: dict | None = None,
                   batch_invariance: bool = True, progress=print, provider_name: str | None = None,
                   case_timeout_s: float = DEFAULT_CASE_TIMEOUT_S, accept_tolerance: bool = False) -> dict:
    """Run every case; returns the report. `provider` is a 'module:Class' spec, run in its own process
    (`IsolatedProvider`), or a provider object, run in this one. report["passed"]: every case passed under
    the judgment; report["accepted"]: passed bitwise, or under a tolerance with `accept_tolerance`."""
    manifest = load_golden() if manifest is None else manifest
    if isinstance(provider, str):
        with IsolatedProvider(provider, device, case_timeout_s) as isolated:
            return check_provider(isolated, cases, device, manifest, batch_invariance, progress,
                                  provider_name or provider, case_timeout_s, accept_tolerance)
    isolated = isinstance(provider, IsolatedProvider)
    judgment, why_not = resolve_judgment(provider)  # once: a profile that changes later changes nothing
    report = {
        "command": "check-p1",
        "provider": provider_name or f"{type(provider).__module__}:{type(provider).__name__}",
        "provider_process": (f"its own (pid {provider.pid}; profile and capabilities read once at start)"
                             if isolated else "the checker's (a provider object passed to check_provider)"),
        "numeric_profile": judgment["profile"] if judgment else None,
        "judgment": describe_judgment(judgment, why_not),
        "tolerance": judgment if judgment and judgment["mode"] != "bitwise" else None,
        "case_timeout_s": case_timeout_s if isolated else None,
        "golden_manifest_sha256": hashlib.sha256(json.dumps(manifest, sort_keys=True).encode()).hexdigest(),
        **environment(device),
        "cases": [],
    }
    if progress and (judgment is None or judgment["mode"] != "bitwise"):
        progress(f"judgment: {report['judgment']}")
    for case in cases:
        start = time.perf_counter()
        if isolated and provider.failed is not None:  # dead or ended after a time-out: nothing more runs
            result = {"case": case.name, "tokens": case.tokens, "hidden": case.hidden, "passed": False,
                      "failures": [f"not run: {provider.failed}"]}
        else:
            if isolated:
                provider.begin_case()
            result = check_case(provider, case, device, manifest["cases"].get(case.name), batch_invariance,
                                (judgment, why_not))
        result["seconds"] = round(time.perf_counter() - start, 3)
        report["cases"].append(result)
        if progress:
            verdict = ("FAIL" if not result["passed"] else "PASS" if judgment["mode"] == "bitwise"
                       else "PASS (tolerance)")
            detail = "" if result["passed"] else "  " + result["failures"][0]
            progress(f"{case.name:16s} T={case.tokens:<3d} C={case.hidden:<5d} {verdict}  "
                     f"{result['seconds']:6.2f}s{detail}")
    # no judgment or no case is never a pass
    report["passed"] = judgment is not None and bool(report["cases"]) and all(c["passed"] for c in report["cases"])
    bitwise = judgment is not None and judgment["mode"] == "bitwise"
    report["accepted_under"] = (None if not report["passed"] else "bitwise" if bitwise
                                else f"tolerance {judgment['profile']} (--accept-tolerance)" if accept_tolerance
                                else None)
    report["accepted"] = report["accepted_under"] is not None
    return report


def summary_line(report: dict) -> str:
    """The command's last line: the verdict and the judgment it was reached under (a pass under a tolerance
    never reads as a bitwise pass), and the first failure."""
    cases = report["cases"]
    counts = f"{sum(c['passed'] for c in cases)}/{len(cases)} cases"
    tol = report["tolerance"]
    if report["numeric_profile"] is None:
        under = ""  # no judgment: the first failure says why
    else:
        under = f" under tolerance {tol['profile']} (not bitwise)" if tol else " bitwise"
    if report["passed"] and not report.get("accepted", True):
        under += ", not accepted (exit 1; --accept-tolerance accepts it)"
    line = (f"check-p1 {'PASSED' if report['passed'] else 'FAILED'}{under}: {counts}, "
            f"device {report['device']} ({report['device_name']})")
    failed = next((c for c in cases if c["failures"]), None)
    return line + (f"; first failure: {failed['case']}: {failed['failures'][0]}" if failed else "")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--provider", required=True, metavar="MODULE:CLASS",
                        help="provider to check, e.g. rl_engine.mhc.provider:ReferenceProvider")
    parser.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    parser.add_argument("--cases", nargs="+", metavar="CASE", help="subset of the fixture cases (default: all)")
    parser.add_argument("--json", type=Path, metavar="PATH", help="write the full report here")
    parser.add_argument("--skip-batch-invariance", action="store_true", help="skip the row-alone runs")
    parser.add_argument("--accept-tolerance", action="store_true",
                        help="exit 0 for a pass under a relaxed profile's tolerance too (default: only a bitwise "
                             "pass under the strict profile exits 0)")
    parser.add_argument("--case-timeout", type=float, default=DEFAULT_CASE_TIMEOUT_S, metavar="SECONDS",
                        help=f"end the provider when one case takes longer (default {DEFAULT_CASE_TIMEOUT_S:g})")
    parser.add_argument("--golden", type=Path, default=GOLDEN_PATH, help=argparse.SUPPRESS)


def run(args: argparse.Namespace) -> int:
    if args.device == "cpu":
        # The oracle is many small elementwise ops: on a shared CPU, OpenMP threads only add contention
        # (measured 4 s vs 40 s at production geometry on a loaded 2-core machine). Bytes don't change.
        torch.set_num_threads(1)
    if args.device == "cuda" and not torch.cuda.is_available():
        raise UsageError("--device cuda requested but CUDA is not available")
    if not (math.isfinite(args.case_timeout) and args.case_timeout > 0):
        raise UsageError(f"--case-timeout must be a positive number of seconds, got {args.case_timeout:g}")
    check_spec(args.provider)  # the spec's form only: its module is imported in its own process
    if args.json:
        check_writable(args.json, "--json")
        check_run_paths([("--json", args.json)], [("--golden", args.golden),
                                                  ("--provider's source", module_file(args.provider))])
    cases = select_cases(args.cases)
    manifest = load_golden(args.golden)
    report = check_provider(args.provider, cases, args.device, manifest, not args.skip_batch_invariance,
                            case_timeout_s=args.case_timeout, accept_tolerance=args.accept_tolerance)
    if args.json:
        write_atomic(args.json, json.dumps(report, indent=1) + "\n", "--json")
        print(f"report written to {args.json}")
    print(summary_line(report))
    return 0 if report["accepted"] else 1
