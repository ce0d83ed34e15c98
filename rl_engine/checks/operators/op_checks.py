"""Run candidates against the gold reference on the same inputs; forward, backward, batch invariance.

Each call gets its own clone of the inputs, as `fn(**inputs)`. The gold (the reference, fp32) gets
fp32 leaves for the inputs it differentiates, so its gradients are not rounded to the case dtype;
the candidate gets the case dtype. Both get the same upstream gradient: seeded random values (or
ones) rounded to the case dtype, so that every party can hold them exactly. Comparisons run in fp64.

Invariance: the candidate on the whole batch vs on each batch row alone (every per-row input sliced
to that row, weights whole) must agree bit for bit. With gradients, the per-row input gradients are
compared too; weight gradients sum over the batch and are not row-invariant, so they are not.

Failures of the candidate (raises anything but KeyboardInterrupt, SystemExit included; wrong shape or
count, NaN/Inf, no autograd connection) become failed output reports; the suite goes on. With
`case_timeout_s`, a candidate still running a case after that long is stopped (SIGALRM, main thread
only) and fails that case; one that cannot be interrupted (stuck in native code) ends the process
`TIMEOUT_GRACE_S` later with one line on stderr and exit code 1.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch

from rl_engine.bits import bit_mismatch, dtype_key
from rl_engine.checks.operators.report import CandidateReport, OutputReport, SuiteReport
from rl_engine.checks.operators.tolerance import (
    Tolerance,
    contract_fingerprint,
    load_contract,
    resolve_tolerance,
    validate_contract,
)
from rl_engine.environment import environment

GRAD_MODES = ("random", "ones")
TIMEOUT_GRACE_S = 10.0


class CandidateTimeout(BaseException):
    """A candidate outlasted the per-case time limit. A BaseException, so no `except Exception` in the
    candidate's own code swallows it."""


def _passes_through(exc: BaseException) -> bool:
    """Exceptions that are not the candidate's failure: the person at the terminal, and the time limit."""
    return isinstance(exc, (KeyboardInterrupt, CandidateTimeout))


def _hard_stop(what: str, seconds: float) -> None:
    print(f"check-op: {what} did not return within the per-case time limit of {seconds:g} s and could not be "
          f"interrupted; process ended", file=sys.stderr, flush=True)
    os._exit(1)


@contextmanager
def time_limit(seconds: float | None, what: str) -> Iterator[None]:
    """Raise CandidateTimeout in the main thread after `seconds` (None, or another thread: no limit)."""
    if seconds is None or threading.current_thread() is not threading.main_thread():
        yield
        return
    from rl_engine.errors import safe_to_raise  # where raising would abort the process (Triton's native frames)

    def alarm(signum, frame):
        if not safe_to_raise(frame):
            signal.setitimer(signal.ITIMER_REAL, 0.01)  # again in 10 ms, when the main thread is elsewhere
            return
        raise CandidateTimeout(f"{what} exceeded the per-case time limit of {seconds:g} s")

    previous = signal.signal(signal.SIGALRM, alarm)
    watchdog = threading.Timer(seconds + TIMEOUT_GRACE_S, _hard_stop, (what, seconds))
    watchdog.daemon = True
    watchdog.start()
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
        watchdog.cancel()


@dataclass
class OperatorCase:
    name: str
    op_class: str
    dtype: torch.dtype
    inputs: dict
    gold_fn: Callable
    grad_input_names: tuple = ()
    baseline_fn: Callable | None = None  # plain PyTorch in the case dtype, for baseline_relative rows
    batch_input_names: tuple | None = None  # inputs sliced per row; None: those whose leading dim is B

    def batched_names(self) -> tuple:
        if self.batch_input_names is not None:
            return tuple(n for n in self.batch_input_names if n in self.inputs)
        tensors = [v for v in self.inputs.values() if isinstance(v, torch.Tensor) and v.dim() >= 1]
        if not tensors:
            return ()
        batch = tensors[0].shape[0]
        return tuple(
            k for k, v in self.inputs.items() if isinstance(v, torch.Tensor) and v.dim() and v.shape[0] == batch
        )


    def rows(self) -> list[tuple[dict, tuple]]:
        """Each row as (its inputs alone, the index of its part in the per-row outputs and gradients): a
        padded batch's rows are its entries; a packed batch's ([1,T,...] + cu_seqlens) are its sequences."""
        batched = self.batched_names()
        if "cu_seqlens" in self.inputs:
            cu = self.inputs["cu_seqlens"]
            bounds = cu.tolist()
            rows = []
            for start, end in zip(bounds[:-1], bounds[1:]):
                index = (slice(None), slice(start, end))
                inputs = {k: (v[index] if k in batched else v) for k, v in self.inputs.items()}
                inputs["cu_seqlens"] = torch.tensor([0, end - start], dtype=cu.dtype, device=cu.device)
                rows.append((inputs, index))
            return rows
        batch = self.inputs[batched[0]].shape[0]
        return [({k: (v[b:b + 1] if k in batched else v) for k, v in self.inputs.items()}, (slice(b, b + 1),))
                for b in range(batch)]


@dataclass
class CandidateSpec:
    name: str
    fn: Callable
    backend: str
    arch_key: str | None = None


@dataclass
class _Run:
    """One call: outputs (with their graph), the leaves it was called on, or why it failed."""

    outputs: list | None = None
    leaves: dict | None = None
    error: str | None = None


def _one_line(text: str) -> str:
    return " ".join(str(text).split())


def _clone_inputs(inputs: dict, grad_names, leaf_dtype=None) -> dict:
    leaves = {}
    for name, value in inputs.items():
        if isinstance(value, torch.Tensor):
            value = value.detach().clone()
            if name in grad_names and value.is_floating_point():
                value = value.to(leaf_dtype or value.dtype).requires_grad_(True)
        leaves[name] = value
    return leaves


def _forward(fn, inputs: dict, grad_names=(), leaf_dtype=None) -> _Run:
    leaves = _clone_inputs(inputs, grad_names, leaf_dtype)
    try:
        with torch.enable_grad():
            result = fn(**leaves)
    except BaseException as exc:  # noqa: BLE001 - a failing candidate is a finding (SystemExit too), not a crash
        if _passes_through(exc):
            raise
        return _Run(error=_one_line(f"candidate raised {type(exc).__name__}: {exc}"))
    outputs = list(result) if isinstance(result, (tuple, list)) else [result]
    for i, out in enumerate(outputs):
        if not isinstance(out, torch.Tensor):
            return _Run(error=f"output {i} is a {type(out).__name__}, not a tensor")
    return _Run(outputs=outputs, leaves=leaves)


def _backward(run: _Run, upstream: list, grad_names) -> tuple[dict, str | None]:
    """({name: gradient, or why it is missing}, None), or ({}, why not) when the call is not differentiable."""
    pairs = [(out, g) for out, g in zip(run.outputs, upstream) if g is not None]
    detached = [i for i, (out, _) in enumerate(pairs) if out.grad_fn is None]
    if detached:
        return {}, f"output {detached[0]} is not connected to autograd (no grad_fn)"
    try:
        with torch.enable_grad():
            torch.autograd.backward([o for o, _ in pairs], [g.to(o.dtype) for o, g in pairs])
    except BaseException as exc:  # noqa: BLE001 - as in _forward
        if _passes_through(exc):
            raise
        return {}, _one_line(f"backward raised {type(exc).__name__}: {exc}")
    grads = {}
    for name in grad_names:
        leaf = run.leaves.get(name)
        if leaf is None or leaf.grad is None:  # reported per input by the caller
            grads[name] = f"gradient:{name} is None: the outputs are not connected to autograd through {name}"
        else:
            grads[name] = leaf.grad.detach()
    return grads, None


def _upstream_grads(outputs: list, mode: str, seed: int, dtype: torch.dtype) -> list:
    """One upstream gradient per floating output, held exactly in the case dtype (fp32 tensors)."""
    grads = []
    for i, out in enumerate(outputs):
        if not out.is_floating_point():
            grads.append(None)
            continue
        if mode == "ones":
            g = torch.ones(out.shape)
        else:
            g = torch.randn(out.shape, generator=torch.Generator().manual_seed(seed + i))
        grads.append(g.to(dtype).float().to(out.device))
    return grads


def _finite_error(cand64: torch.Tensor, ref64: torch.Tensor) -> torch.Tensor:
    both = torch.isfinite(cand64) & torch.isfinite(ref64)
    return (cand64 - ref64).abs()[both], ref64.abs()[both]


def compare_tensor(
    cand: torch.Tensor, ref: torch.Tensor, tol: Tolerance, baseline: torch.Tensor | None = None, **where
) -> OutputReport:
    """Judge one candidate tensor against the reference under `tol`; `where` names it in the report."""
    report = OutputReport(
        **where, judgment=tol.judgment, passed=False, tolerance=tol, shape=tuple(cand.shape),
        dtype=dtype_key(cand.dtype), reference_dtype=dtype_key(ref.dtype),
    )
    if tuple(cand.shape) != tuple(ref.shape):
        report.message = f"wrong shape: got {tuple(cand.shape)}, expected {tuple(ref.shape)}"
        return report
    if cand.device != ref.device:
        report.message = f"wrong device: got {cand.device}, expected {ref.device}"
        return report
    c64, r64 = cand.detach().double(), ref.detach().double()
    problems = []
    r_finite, c_finite = torch.isfinite(r64), torch.isfinite(c64)
    if int((r_finite & ~c_finite).sum()):
        problems.append(f"NaN/Inf in {int((r_finite & ~c_finite).sum())} elements where the reference is finite")
    if int((~r_finite & (torch.isnan(r64) != torch.isnan(c64))).sum()):
        problems.append("NaN positions differ from the reference's")
    inf_ref = torch.isinf(r64)
    if int((inf_ref & (c64 != r64)).sum()):
        problems.append("Inf positions or signs differ from the reference's")

    diff, ref_abs = _finite_error(c64, r64)
    if diff.numel():
        report.max_abs, report.mean_abs = float(diff.max()), float(diff.mean())
        nonzero = ref_abs > 0
        report.max_rel = float((diff[nonzero] / ref_abs[nonzero]).max()) if nonzero.any() else 0.0
    else:
        report.max_abs = report.mean_abs = report.max_rel = 0.0

    if tol.mode == "bitwise":
        report.mismatches, report.max_ulp = bit_mismatch(cand.detach(), ref.detach())
        if report.mismatches:
            problems.append(f"{report.mismatches} elements differ in their bits (max {report.max_ulp} ulp)")
    elif tol.mode == "allclose":
        outside = int((diff > tol.atol + tol.rtol * ref_abs).sum())
        if outside:
            problems.append(f"{outside} of {diff.numel()} elements exceed atol + rtol*|ref|")
    elif baseline is None:
        problems.append("mode baseline_relative needs a baseline and the case has none")
    else:
        base_diff, _ = _finite_error(baseline.detach().double(), r64)
        report.baseline_max_abs = float(base_diff.max()) if base_diff.numel() else 0.0
        bound = tol.k * report.baseline_max_abs + tol.atol
        if report.max_abs > bound:
            problems.append(f"max_abs {report.max_abs:.3e} > k*baseline_max_abs + atol = {bound:.3e}")
    report.passed = not problems
    report.message = "; ".join(problems)
    return report


def _failed(case: str, index: int, role: str, tol: Tolerance, message: str) -> OutputReport:
    return OutputReport(case=case, output_index=index, role=role, judgment=tol.judgment, passed=False,
                        message=message, tolerance=tol)


class _Gold:
    """The reference run of one case (forward, backward), the upstream gradients and, on demand, the baseline."""

    def __init__(self, case: OperatorCase, check_grad: bool, grad_mode: str, grad_seed: int):
        self.case, self.check_grad = case, check_grad
        grad_names = case.grad_input_names if check_grad else ()
        run = _forward(case.gold_fn, case.inputs, grad_names, leaf_dtype=torch.float32)
        if run.error:
            raise RuntimeError(f"{case.name}: the gold op failed: {run.error}")
        self.upstream = _upstream_grads(run.outputs, grad_mode, grad_seed, case.dtype) if check_grad else []
        self.grads = {}
        if check_grad:
            self.grads, why = _backward(run, self.upstream, case.grad_input_names)
            why = why or next((g for g in self.grads.values() if isinstance(g, str)), None)
            if why:
                raise RuntimeError(f"{case.name}: the gold op's backward failed: {why}")
        self.outputs = [o.detach() for o in run.outputs]
        self._baseline = None

    def baseline(self) -> tuple[list, dict]:
        """Outputs and input gradients of plain PyTorch in the case dtype (computed once)."""
        if self._baseline is None:
            case = self.case
            if case.baseline_fn is None:
                self._baseline = ([None] * len(self.outputs), {})
            else:
                run = _forward(case.baseline_fn, case.inputs, case.grad_input_names if self.check_grad else ())
                if run.error:
                    raise RuntimeError(f"{case.name}: the baseline failed: {run.error}")
                grads = _backward(run, self.upstream, case.grad_input_names)[0] if self.check_grad else {}
                grads = {k: v for k, v in grads.items() if isinstance(v, torch.Tensor)}
                self._baseline = ([o.detach() for o in run.outputs], grads)
        return self._baseline


def _check_accuracy(case, cand, gold: _Gold, contract, check_grad) -> tuple[list, _Run, dict]:
    """Forward (and backward) accuracy reports, plus the candidate's run and gradients for invariance."""
    def tol(judgment):
        return resolve_tolerance(contract, judgment=judgment, op_class=case.op_class, dtype=case.dtype,
                                 arch_key=cand.arch_key)

    fwd_tol, grad_tol = tol("forward_accuracy"), tol("gradient_accuracy")
    n_out = len(gold.outputs)
    grad_roles = [(n_out + j, f"gradient:{name}") for j, name in enumerate(case.grad_input_names)] if check_grad else []
    run = _forward(cand.fn, case.inputs, case.grad_input_names if check_grad else ())
    problem = run.error
    if problem is None and len(run.outputs) != n_out:
        problem = f"returned {len(run.outputs)} outputs, expected {n_out}"
    if problem:
        reports = [_failed(case.name, 0, "output", fwd_tol, problem)]
        reports += [_failed(case.name, i, role, grad_tol, f"no backward: {problem}") for i, role in grad_roles]
        return reports, run, {}

    base_out, base_grads = gold.baseline() if fwd_tol.mode == "baseline_relative" or (
        check_grad and grad_tol.mode == "baseline_relative") else ([None] * n_out, {})
    reports = [
        compare_tensor(out.detach(), ref, fwd_tol, base, case=case.name, output_index=i, role="output")
        for i, (out, ref, base) in enumerate(zip(run.outputs, gold.outputs, base_out))
    ]
    grads = {}
    if check_grad:
        why = None
        if any(tuple(o.shape) != tuple(r.shape) for o, r in zip(run.outputs, gold.outputs)):
            why = "no backward: the outputs have the wrong shape"
        else:
            grads, why = _backward(run, gold.upstream, case.grad_input_names)
        for (i, role), name in zip(grad_roles, case.grad_input_names):
            if why or isinstance(grads[name], str):
                reports.append(_failed(case.name, i, role, grad_tol, why or grads[name]))
            else:
                reports.append(compare_tensor(grads[name], gold.grads[name], grad_tol, base_grads.get(name),
                                              case=case.name, output_index=i, role=role))
    return reports, run, grads


def _check_invariance(case, cand, full: _Run, full_grads: dict, gold: _Gold, contract, check_grad) -> list:
    """Bitwise: each batch row run alone vs the same row of the full-batch run, outputs and row gradients."""
    batched = case.batched_names()
    if not batched or full.outputs is None:
        return []
    rows_in = case.rows()
    lead = tuple(case.inputs[batched[0]].shape[:len(rows_in[0][1])]) if rows_in else ()
    outputs = [o.detach() for o in full.outputs]
    row_outputs = [i for i, o in enumerate(outputs) if o.dim() >= len(lead) and tuple(o.shape[:len(lead)]) == lead]
    row_grads = [n for n in case.grad_input_names
                 if n in batched and isinstance(full_grads.get(n), torch.Tensor)] if check_grad else []
    per_row_upstream = check_grad and len(row_outputs) == len(outputs)
    fwd_tol, grad_tol = (
        resolve_tolerance(contract, judgment=j, op_class=case.op_class, dtype=case.dtype, arch_key=cand.arch_key)
        for j in ("forward_invariance", "gradient_invariance")
    )
    # rows[b] = (outputs, grads) or an error message
    rows = []
    for inputs, index in rows_in:
        # The same autograd setting as the full-batch run: a kernel may pick another path without grad.
        run = _forward(cand.fn, inputs, case.grad_input_names if check_grad else ())
        if run.error or len(run.outputs) != len(outputs):
            rows.append(run.error or f"returned {len(run.outputs)} outputs for one row, expected {len(outputs)}")
            continue
        grads = {}
        if per_row_upstream and row_grads:
            upstream = [g[index] if g is not None else None for g in gold.upstream]
            if all(tuple(o.shape) == tuple(g.shape) for o, g in zip(run.outputs, upstream) if g is not None):
                grads, why = _backward(run, upstream, row_grads)
                if why:
                    grads = why
        rows.append(([o.detach() for o in run.outputs], grads))

    targets = [(i, "output", fwd_tol, outputs[i], lambda r, i=i: r[0][i]) for i in row_outputs]
    if per_row_upstream:
        n_out = len(outputs)
        for name in row_grads:
            index = n_out + list(case.grad_input_names).index(name)
            targets.append((index, f"gradient:{name}", grad_tol, full_grads[name], lambda r, n=name: r[1].get(n)))
    indices = [index for _, index in rows_in]
    return [_compare_rows(case.name, i, role, tol, whole, rows, pick, indices) for i, role, tol, whole, pick in targets]


def _compare_rows(case_name, index, role, tol, whole, rows, pick, indices) -> OutputReport:
    report = OutputReport(case=case_name, output_index=index, role=role, judgment=tol.judgment, passed=False,
                          tolerance=tol, shape=tuple(whole.shape), dtype=dtype_key(whole.dtype),
                          reference_dtype=dtype_key(whole.dtype), mismatches=0, max_ulp=0, max_abs=0.0, mean_abs=0.0,
                          max_rel=0.0)
    failing, problems = [], []
    total_abs, count = 0.0, 0
    for b, row in enumerate(rows):
        if isinstance(row, str):
            failing.append(b)
            problems.append(f"row {b}: {row}")
            continue
        if role != "output" and isinstance(row[1], str):
            failing.append(b)
            problems.append(f"row {b}: {row[1]}")
            continue
        got, expected = pick(row), whole[indices[b]]
        if isinstance(got, str):
            failing.append(b)
            problems.append(f"row {b}: {got}")
            continue
        if got is None:
            failing.append(b)
            problems.append(f"row {b}: no gradient (the row's outputs had the wrong shape)")
            continue
        if tuple(got.shape) != tuple(expected.shape):
            failing.append(b)
            problems.append(f"row {b}: shape {tuple(got.shape)}, expected {tuple(expected.shape)}")
            continue
        mismatches, ulp = bit_mismatch(got, expected)
        diff, ref_abs = _finite_error(got.double(), expected.double())
        if diff.numel():
            report.max_abs = max(report.max_abs, float(diff.max()))
            total_abs, count = total_abs + float(diff.sum()), count + diff.numel()
            nonzero = ref_abs > 0
            if nonzero.any():
                report.max_rel = max(report.max_rel, float((diff[nonzero] / ref_abs[nonzero]).max()))
        report.mismatches += mismatches
        report.max_ulp = max(report.max_ulp, ulp)
        if mismatches:
            failing.append(b)
    report.mean_abs = total_abs / count if count else 0.0
    if report.mismatches:
        problems.insert(0, f"rows {failing} alone differ in {report.mismatches} elements from the full batch "
                           f"(max {report.max_ulp} ulp)")
    report.passed = not failing
    report.message = "; ".join(problems)
    return report


def _device(cases):
    for case in cases:
        for value in case.inputs.values():
            if isinstance(value, torch.Tensor):
                return value.device
    return None


def run_operator_suite(
    suite_name: str,
    *,
    candidates,
    cases,
    contract=None,
    check_grad: bool = False,
    grad_mode: str = "random",
    grad_seed: int = 123,
    check_invariance: bool = False,
    seed: int | None = None,
    case_timeout_s: float | None = None,
) -> SuiteReport:
    """Check every candidate on every case; `contract` is a contract dict (default: the packaged one).
    `case_timeout_s`: the most one candidate may take on one case (see `time_limit`); None: no limit."""
    if grad_mode not in GRAD_MODES:
        raise ValueError(f"grad_mode: expected one of {GRAD_MODES}, got {grad_mode!r}")
    contract = load_contract() if contract is None else contract
    validate_contract(contract)
    cases, candidates = list(cases), list(candidates)
    if check_grad and any(not case.grad_input_names for case in cases):
        raise ValueError("check_grad: a case declares no gradient inputs (a forward-only op has no backward)")
    reports = [CandidateReport(c.name, c.backend, c.arch_key) for c in candidates]
    notes = []
    for case in cases:
        gold = _Gold(case, check_grad, grad_mode, grad_seed)
        for cand, report in zip(candidates, reports):
            try:
                with time_limit(case_timeout_s, f"candidate {cand.name} on case {case.name}"):
                    outputs, run, grads = _check_accuracy(case, cand, gold, contract, check_grad)
                    if check_invariance:
                        outputs += _check_invariance(case, cand, run, grads, gold, contract, check_grad)
            except CandidateTimeout as exc:
                tol = resolve_tolerance(contract, judgment="forward_accuracy", op_class=case.op_class,
                                        dtype=case.dtype, arch_key=cand.arch_key)
                outputs = [_failed(case.name, 0, "output", tol, str(exc))]
            report.outputs += outputs
        batched = case.batched_names()
        if check_invariance and batched and len(case.rows()) < 2:
            notes.append(f"{case.name}: one row, so invariance compares the only row with itself; use batch >= 2")
        if check_invariance and check_grad:
            skipped = [n for n in case.grad_input_names if n not in case.batched_names()]
            if skipped:
                note = (f"{case.name}: gradient invariance compares per-row input gradients only; "
                        f"the gradients of {', '.join(skipped)} sum over the batch and are not compared")
                notes.append(note)
    settings = {"seed": seed, "check_grad": check_grad, "grad_mode": grad_mode, "grad_seed": grad_seed,
                "check_invariance": check_invariance, "case_timeout_s": case_timeout_s}
    return SuiteReport(suite=suite_name, candidates=reports, contract_fingerprint=contract_fingerprint(contract),
                       settings=settings, environment=environment(_device(cases)), notes=notes)
