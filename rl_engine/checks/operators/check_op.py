"""`rl-engine check-op`: one candidate of one op against the gold.

Exit codes: 0 passed, 1 failed, 2 usage or configuration error (one line on stderr).
"""

from __future__ import annotations

import argparse
import dataclasses
import math

import torch

from rl_engine.checks.operators.op_checks import GRAD_MODES, run_operator_suite
from rl_engine.checks.operators.operator_inputs import INPUT_MODES, QWEN3_8B, OperatorDims
from rl_engine.checks.operators.operator_specs import get_spec, make_candidate, make_operator_case
from rl_engine.checks.operators.tolerance import DTYPES, ContractError, load_contract
from rl_engine.errors import UsageError
from rl_engine.kernels.records import OPS
from rl_engine.loading import module_file
from rl_engine.outputs import check_run_paths, check_writable, write_atomic

DEFAULT_CASE_TIMEOUT_S = 600.0
# flag -> OperatorDims field; the defaults live in OperatorDims, so the flags default to None.
DIM_FLAGS = {
    "batch": int, "seq": int, "vocab": int, "normalized_dim": int, "intermediate": int, "n_heads": int,
    "n_kv_heads": int, "head_dim": int, "k_dim": int, "n_dim": int, "experts": int, "theta": float, "eps": float,
}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--op", help=f"operator: {', '.join(OPS)}")
    parser.add_argument("--candidate", default="pytorch",
                        help="pytorch (default: the smoke test), triton, or module:attr: your own function or class "
                             "(constructed like the gold op), called with the op's inputs as keywords")
    parser.add_argument("--dtype", default="fp32", help=f"case dtype: {', '.join(DTYPES)} (default fp32)")
    parser.add_argument("--device", default="auto", help="auto (cuda if available, else cpu), cpu, cuda, cuda:N")
    parser.add_argument("--arch-key", default=None,
                        help="tolerance override key the contract knows, e.g. sm90 (default: none: the default rows)")
    defaults = OperatorDims()
    for name, kind in DIM_FLAGS.items():
        parser.add_argument(f"--{name.replace('_', '-')}", type=kind, default=None,
                            help=f"default {getattr(defaults, name)}")
    parser.add_argument("--qwen3-8b", action="store_true",
                        help="Qwen3-8B geometry (hidden 4096, 32/8 heads of 128, intermediate 12288, vocab 151936); "
                             "explicit dim flags still win")
    parser.add_argument("--layout", default=None,
                        help="input layout where the op has several (attention: padded, left_padded, packed); "
                             "default: the op's first")
    parser.add_argument("--input-mode", default="random", help=f"{' or '.join(INPUT_MODES)} (default random)")
    parser.add_argument("--constant-value", type=float, default=1.0, help="floating inputs in constant mode")
    parser.add_argument("--token-value", type=int, default=0, help="ids in constant mode, reduced modulo the range")
    parser.add_argument("--seed", type=int, default=0, help="seed of the random inputs")
    parser.add_argument("--check-grad", action="store_true", help="also compare the declared input gradients")
    parser.add_argument("--grad-mode", default="random", help="upstream gradient: random (default) or ones")
    parser.add_argument("--grad-seed", type=int, default=123, help="seed of the random upstream gradient")
    parser.add_argument("--check-invariance", action="store_true",
                        help="each batch row alone must match the full batch bit for bit")
    parser.add_argument("--case-timeout", type=float, default=DEFAULT_CASE_TIMEOUT_S, metavar="SECONDS",
                        help=f"stop a candidate still running a case after this long; it fails "
                             f"(default {DEFAULT_CASE_TIMEOUT_S:g})")
    parser.add_argument("--contract", default=None, help="tolerance contract JSON (default: the packaged one)")
    parser.add_argument("--json", action="store_true", help="print the report as JSON")
    parser.add_argument("--json-out", default=None, metavar="PATH", help="also write the JSON report to PATH")
    parser.add_argument("--list", action="store_true", help="list the operators and their candidates")


SEED_RANGE = (0, 2**64)  # torch.Generator.manual_seed takes a 64-bit unsigned seed


def resolve_device(name: str) -> str:
    if name == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    try:
        device = torch.device(name)
    except (RuntimeError, ValueError):
        raise UsageError(f"--device: unknown device {name!r}; use auto, cpu, cuda or cuda:N") from None
    if device.type not in ("cpu", "cuda") or (device.type == "cpu" and device.index not in (None, 0)):
        raise UsageError(f"--device {name}: the checks run on cpu or cuda[:N] only")
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise UsageError(f"--device {name}: CUDA was asked for but is not available on this machine")
        if device.index is not None and device.index >= torch.cuda.device_count():
            raise UsageError(f"--device {name}: only {torch.cuda.device_count()} CUDA devices present")
    return str(device)


def dims_from_args(args) -> OperatorDims:
    values = dict(QWEN3_8B) if args.qwen3_8b else {}
    values.update({k: getattr(args, k) for k in DIM_FLAGS if getattr(args, k) is not None})
    dims = dataclasses.replace(OperatorDims(), **values)
    try:
        dims.validate()
    except ValueError as exc:
        raise UsageError(f"--{str(exc).replace('_', '-')}") from None
    return dims


def list_operators() -> str:
    lines = []
    for spec in OPS.values():
        grads = ",".join(spec.grad_input_names) or "none (forward only)"
        lines.append(
            f"{spec.name} class={spec.op_class} gold={spec.gold_path} candidates={','.join(spec.candidate_paths)} "
            f"grad_inputs={grads} per_row_inputs={','.join(spec.batch_input_names)} layouts={','.join(spec.layouts)}"
        )
    return "\n".join(lines)


def run(args) -> int:
    if args.list:
        print(list_operators())
        return 0
    if args.json_out:
        check_writable(args.json_out, "--json-out")
        check_run_paths([("--json-out", args.json_out)], [("--contract", args.contract),
                                                          ("--candidate's source", module_file(args.candidate))])
    if not args.op:
        raise UsageError(f"--op is required; valid ops: {', '.join(OPS)}")
    spec = get_spec(args.op)
    if args.layout is not None and args.layout not in spec.layouts:
        raise UsageError(f"--layout {args.layout}: op {args.op} takes {', '.join(spec.layouts)}")
    if args.check_grad and not spec.grad_input_names:
        raise UsageError(f"{args.op} has no backward (an inference op); drop --check-grad")
    if args.dtype not in DTYPES:
        raise UsageError(f"--dtype: unsupported dtype {args.dtype!r}; valid: {', '.join(DTYPES)}")
    if args.input_mode not in INPUT_MODES:
        raise UsageError(f"--input-mode: expected {' or '.join(INPUT_MODES)}, got {args.input_mode!r}")
    if args.grad_mode not in GRAD_MODES:
        raise UsageError(f"--grad-mode: expected {' or '.join(GRAD_MODES)}, got {args.grad_mode!r}")
    for flag, seed in (("--seed", args.seed), ("--grad-seed", args.grad_seed)):
        if not SEED_RANGE[0] <= seed < SEED_RANGE[1]:
            raise UsageError(f"{flag}: expected an integer in [0, 2**64), got {seed}")
    if not (math.isfinite(args.case_timeout) and args.case_timeout > 0):
        raise UsageError(f"--case-timeout must be a positive number of seconds, got {args.case_timeout:g}")
    if not math.isfinite(args.constant_value):
        raise UsageError(f"--constant-value: expected a finite number, got {args.constant_value}")
    if args.token_value < 0:
        raise UsageError(f"--token-value: expected a non-negative id, got {args.token_value}")
    dims = dims_from_args(args)
    try:
        contract = load_contract(args.contract)
    except ContractError as exc:
        raise UsageError(str(exc)) from None
    arch_keys = sorted({row["arch_key"] for row in contract["rows"] if "arch_key" in row})
    if args.arch_key is not None and args.arch_key not in arch_keys:
        raise UsageError(f"--arch-key: the contract has no rows for {args.arch_key!r}; known keys: "
                         f"{', '.join(arch_keys) or 'none'} (leave the flag out for the default rows)")
    device = resolve_device(args.device)
    candidate = make_candidate(args.op, args.candidate, dims=dims, arch_key=args.arch_key)
    case = make_operator_case(args.op, dtype=args.dtype, device=device, dims=dims, input_mode=args.input_mode,
                              constant_value=args.constant_value, token_value=args.token_value, seed=args.seed,
                              layout=args.layout)
    try:
        report = run_operator_suite(args.op, candidates=[candidate], cases=[case], contract=contract,
                                    check_grad=args.check_grad, grad_mode=args.grad_mode, grad_seed=args.grad_seed,
                                    check_invariance=args.check_invariance, seed=args.seed,
                                    case_timeout_s=args.case_timeout)
    except ContractError as exc:  # e.g. a custom contract that lacks this op's class
        raise UsageError(str(exc)) from None
    print(report.to_json() if args.json else report.to_text())
    if args.json_out:
        write_atomic(args.json_out, report.to_json() + "\n", "--json-out")
    return 0 if report.passed else 1
