"""`rl-engine check-invariance`: config invariance, accuracy, gradients and train/infer parity of a
decoder (any supported family) under one backend profile. Exit 0 passed, 1 failed, 2 usage or
configuration error."""

from __future__ import annotations

import json
import re
import sys
import time
from pathlib import Path

import torch

from rl_engine.errors import UsageError
from rl_engine.models.families import CONFIGS, get_config
from rl_engine.models.profiles import PROFILES
from rl_engine.outputs import atomic_path, check_run_paths, check_writable, write_atomic

# Models whose manifest entry pins a synthetic weight hash (the tiny ones) are drawn on the CPU
# generator; the others are drawn directly on the target device (16 GB of bf16 for an 8B), so their
# hash is reported only.


def add_arguments(parser) -> None:
    parser.add_argument("--profile", required=True, choices=sorted(PROFILES), help="backend profile to check")
    model = parser.add_mutually_exclusive_group()
    model.add_argument("--model", choices=sorted(CONFIGS),
                       help="named model config (default: the one of --weights-path's config.json, else tiny)")
    model.add_argument("--config", type=Path, help="a Hugging Face config.json (or its dir) to build the model from")
    parser.add_argument("--device", default="cpu", help="cpu or cuda[:N]")
    parser.add_argument("--weights-path", type=Path, help="Hugging Face checkpoint dir (default: synthetic weights)")
    parser.add_argument("--layers", type=int, help="run only the first N decoder layers (for time)")
    parser.add_argument("--manifest", type=Path, help="workload manifest (default: the packaged one)")
    parser.add_argument("--no-gradients", action="store_true", help="skip the gradient invariance checks")
    parser.add_argument("--out", type=Path, help="write report.json here, and a |Δ| plot when failing")
    parser.add_argument(
        "--json",
        nargs="?",
        const="-",
        metavar="PATH",
        help="print the report as JSON (or write it to PATH and print the summary; a failing plot goes beside it)",
    )


def _device(name: str) -> torch.device:
    try:
        device = torch.device(name)
    except RuntimeError as exc:
        raise UsageError(f"--device: {exc}") from None
    if device.type == "cuda" and not torch.cuda.is_available():
        raise UsageError("--device: CUDA asked for but not available")
    if device.type not in ("cpu", "cuda") or (device.type == "cpu" and device.index not in (None, 0)):
        raise UsageError(f"--device: expected cpu or cuda[:N], got {name!r}")
    return device


def _progress(enabled: bool):
    if not enabled:
        return None
    from tqdm import tqdm

    def bar(steps):
        with tqdm(steps, desc="check-invariance", file=sys.stderr, unit="step") as it:
            for step in it:
                it.set_postfix_str(step.name)
                yield step

    return bar


def _config(args):
    """(config, pinned): a named config is pinned in the manifest; one read from a config.json is not."""
    from rl_engine.models.weights import load_hf_config

    path = args.config if args.config is not None else (args.weights_path if args.model is None else None)
    if path is None:
        return get_config(args.model or "tiny"), True
    try:
        return load_hf_config(path), False
    except ValueError as exc:
        raise UsageError(str(exc)) from None


def _load_weights(args, config, workload, device) -> tuple[dict, dict]:
    from rl_engine.models.weights import HASH_ALGORITHM, content_hash, load_hf_checkpoint, synthetic_weights

    start = time.perf_counter()
    if args.weights_path is not None:
        try:
            weights = load_hf_checkpoint(args.weights_path, config, device=device, dtype=torch.bfloat16)
        except ValueError as exc:
            raise UsageError(str(exc)) from None
        info = {"source": str(args.weights_path)}
    elif workload.weight_hash is not None:
        weights = {n: t.to(device) for n, t in synthetic_weights(config, workload.weight_seed).items()}
        info = {"source": "synthetic (cpu generator)", "seed": workload.weight_seed}
    else:
        weights = synthetic_weights(config, workload.weight_seed, device=device)
        info = {"source": f"synthetic ({device.type} generator)", "seed": workload.weight_seed}
    info["content_hash"] = content_hash(weights)
    info["hash_algorithm"] = HASH_ALGORITHM
    if args.weights_path is None and workload.weight_hash is not None and args.layers is None:
        info["pinned_hash_matches"] = info["content_hash"] == workload.weight_hash
        if not info["pinned_hash_matches"]:
            raise UsageError(f"synthetic weights hash {info['content_hash']} != pinned {workload.weight_hash}")
    info["load_s"] = round(time.perf_counter() - start, 3)
    return weights, info


def _summary(report: dict) -> str:
    lines = [
        f"check-invariance {report['profile']} on {report['model']} ({report['device']}): "
        + ("PASSED" if report["passed"] else "FAILED")
    ]
    fi = report["forward_invariance"]
    for name, cell in fi["cells"].items():
        detail = (
            cell.get("error")
            or f"{cell['mismatched_tokens']}/{cell['tokens']} tokens differ, max|Δ| {cell['max_abs_diff']:.3g}"
        )
        lines.append(f"  forward {name:14s} {'bitwise' if cell['bitwise'] else 'DIFFERS'}  {detail}")
    acc = report["accuracy"]
    lines.append(
        f"  accuracy {'ok' if acc['passed'] else 'FAIL'}  "
        + (
            acc.get("error")
            or f"max|cand-ref| {acc['max_abs_vs_reference']:.3g}, "
            f"max|torch_bf16-ref| {acc['baseline_max_abs_vs_reference']:.3g}"
        )
    )
    if "gradient_invariance" in report:
        gi = report["gradient_invariance"]
        for name, cell in gi["input_gradients"].items():
            detail = cell.get("error") or f"{cell['mismatched_tokens']}/{cell['tokens']} tokens differ"
            lines.append(f"  grad    {name:14s} {'bitwise' if cell['bitwise'] else 'DIFFERS'}  {detail}")
        wd = gi["weight_gradient_determinism"]
        lines.append(
            f"  weight gradients run to run: {'deterministic' if wd['deterministic'] else 'DIFFER'}"
            + (f" ({wd['error']})" if "error" in wd else "")
        )
    for name, agg in report["parity"]["infer"].items():
        if "error" in agg:
            lines.append(f"  parity  infer {name}: error {agg['error']}")
        else:
            lines.append(
                f"  parity  infer {name}: max|Δ| {agg['max_abs_dlogp']:.3g} mean|Δ| {agg['mean_abs_dlogp']:.3g} "
                f"k3 {agg['k3_kl']:.3g} clipfrac {agg['clipfrac']:.3g} ({agg['tokens']} tokens)"
                + ("  bitwise" if agg["bitwise"] else "")
            )
    prov = report["provenance"]
    lines.append(
        f"  provenance {'ok' if prov['passed'] else 'FAIL'} ({prov['nodes']} nodes, {prov['dispatches']} dispatches)"
    )
    lines += [f"    {f}" for f in prov["failures"][:20]]
    lines += [f"  error in {k}: {v}" for k, v in report["errors"].items()]
    if "timing_s" in report:
        lines.append(
            "  canonical forward s: "
            + ", ".join(f"{k} {v:.3f}" for k, v in report["timing_s"]["canonical_forward"].items())
        )
    return "\n".join(lines)


def run(args) -> int:
    from rl_engine.checks.forward_invariance.harness import run_harness
    from rl_engine.checks.forward_invariance.plot import plot_abs_dlogp
    from rl_engine.workload.manifest import ManifestError, load_workload

    json_path = Path(args.json) if args.json not in (None, "-") else None
    if args.out is not None:
        check_writable(args.out, "--out", directory=True)
    if json_path is not None:
        check_writable(json_path, "--json")
    device = _device(args.device)
    config, pinned = _config(args)
    stem = f"invariance_{args.profile}_{re.sub(r'[^A-Za-z0-9._-]', '_', config.name.split('[')[0])}"
    plot_dir = args.out or (json_path.parent if json_path else None)
    plot_name = f"{json_path.stem}.png" if json_path and args.out is None else f"{stem}.png"
    outputs = [("--json", json_path), ("--out", args.out / f"{stem}.json" if args.out is not None else None),
               ("the failure plot", plot_dir / plot_name if plot_dir is not None else None)]
    for flag, path in outputs[1:]:
        if path is not None:
            check_writable(path, flag)
    check_run_paths(outputs, [("--config", args.config), ("--weights-path", args.weights_path),
                              ("--manifest", args.manifest)])
    try:
        workload = load_workload(config, args.manifest, pinned=pinned)
    except ManifestError as exc:
        raise UsageError(str(exc)) from None
    if args.layers is not None:
        try:
            config = config.with_layers(args.layers)
        except ValueError as exc:
            raise UsageError(f"--layers: {exc}") from None
    weights, weight_info = _load_weights(args, config, workload, device)
    report = run_harness(
        config,
        weights,
        workload,
        args.profile,
        device,
        gradients=not args.no_gradients,
        progress=_progress(sys.stderr.isatty() or args.json != "-"),
    )
    report["weights"] = weight_info
    report["layers"] = config.num_layers
    tokens = report.pop("_tokens", None)
    if plot_dir is not None and not report["passed"] and tokens:
        title = f"{args.profile} on {config.name}: |Δ| per token"
        with atomic_path(plot_dir / plot_name) as tmp:
            plot_abs_dlogp(tokens, tmp, title)
        report["plot"] = str(plot_dir / plot_name)
    text = json.dumps(report, indent=2)
    if args.out is not None:
        write_atomic(args.out / f"{stem}.json", text, "--out")
    if json_path is not None:
        write_atomic(json_path, text, "--json")
    print(text if args.json == "-" else _summary(report))
    return 0 if report["passed"] else 1
