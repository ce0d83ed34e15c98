"""Reports of an operator suite: one line per compared output, pass rates, JSON and text forms.

Text form (first line fixed, scripts parse it):
    suite=<op> passed=<True|False> pass_rate=<x.xxxx>
    candidate=<name> backend=<backend> passed=<bool> pass_rate=<x.xxxx>
      case=<case> output=<i> role=<output|gradient:NAME> judgment=<judgment> shape=... max_abs=... passed=...
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field

from rl_engine.checks.operators.tolerance import Tolerance


def _num(value) -> str:
    return "nan" if value is None else f"{value:.8e}"


@dataclass
class OutputReport:
    """One compared tensor: an output or an input gradient, under one judgment."""

    case: str
    output_index: int
    role: str  # "output" or "gradient:<input name>"
    judgment: str
    passed: bool
    message: str = ""
    shape: tuple | None = None
    dtype: str | None = None  # the candidate's
    reference_dtype: str | None = None
    max_abs: float | None = None
    mean_abs: float | None = None
    max_rel: float | None = None
    baseline_max_abs: float | None = None  # baseline_relative rows only
    mismatches: int | None = None  # bitwise rows only: elements whose bits differ
    max_ulp: int | None = None  # bitwise rows only: largest distance in units in the last place
    tolerance: Tolerance | None = None

    def to_dict(self) -> dict:
        data = {k: getattr(self, k) for k in self.__dataclass_fields__ if k != "tolerance"}
        data["shape"] = list(self.shape) if self.shape is not None else None
        data["tolerance"] = self.tolerance.to_dict() if self.tolerance else None
        return data

    def to_text(self) -> str:
        parts = [f"case={self.case}", f"output={self.output_index}", f"role={self.role}", f"judgment={self.judgment}"]
        if self.shape is not None:
            parts += [f"shape={tuple(self.shape)}", f"dtype={self.dtype}", f"ref_dtype={self.reference_dtype}"]
        if self.max_abs is not None:
            parts += [f"max_abs={_num(self.max_abs)}", f"mean_abs={_num(self.mean_abs)}"]
            parts.append(f"max_rel={_num(self.max_rel)}")
        if self.baseline_max_abs is not None:
            parts.append(f"baseline_max_abs={_num(self.baseline_max_abs)}")
        if self.mismatches is not None:
            parts += [f"mismatches={self.mismatches}", f"max_ulp={self.max_ulp}"]
        if self.tolerance is not None:
            parts.append(f"tol=({self.tolerance.describe()})")
        parts.append(f"passed={self.passed}")
        if self.message:
            parts.append(f"message={self.message}")
        return "  " + " ".join(parts)


def _rate(flags: list[bool]) -> float:
    return sum(flags) / len(flags) if flags else 0.0


@dataclass
class CandidateReport:
    name: str
    backend: str
    arch_key: str | None = None
    outputs: list[OutputReport] = field(default_factory=list)

    @property
    def passed(self) -> bool:
        return bool(self.outputs) and all(o.passed for o in self.outputs)

    @property
    def pass_rate(self) -> float:
        return _rate([o.passed for o in self.outputs])

    def to_dict(self) -> dict:
        return {
            "name": self.name, "backend": self.backend, "arch_key": self.arch_key, "passed": self.passed,
            "pass_rate": self.pass_rate, "outputs": [o.to_dict() for o in self.outputs],
        }

    def to_text(self) -> str:
        head = f"candidate={self.name} backend={self.backend} passed={self.passed} pass_rate={self.pass_rate:.4f}"
        return "\n".join([head] + [o.to_text() for o in self.outputs])


@dataclass
class SuiteReport:
    suite: str
    candidates: list[CandidateReport]
    contract_fingerprint: str
    settings: dict  # seed, check_grad, grad_mode, grad_seed, check_invariance
    environment: dict  # torch, triton, device
    notes: list[str] = field(default_factory=list)

    @property
    def passed(self) -> bool:
        return bool(self.candidates) and all(c.passed for c in self.candidates)

    @property
    def pass_rate(self) -> float:
        """The fraction of candidates that passed every check."""
        return _rate([c.passed for c in self.candidates])

    def to_dict(self) -> dict:
        return {
            "suite": self.suite, "passed": self.passed, "pass_rate": self.pass_rate,
            "contract_fingerprint": self.contract_fingerprint, **self.settings, **self.environment,
            "notes": list(self.notes), "candidates": [c.to_dict() for c in self.candidates],
        }

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2)

    def to_text(self) -> str:
        lines = [f"suite={self.suite} passed={self.passed} pass_rate={self.pass_rate:.4f}"]
        lines += [c.to_text() for c in self.candidates]
        env = " ".join(f"{k}={v}" for k, v in self.environment.items())
        lines.append(f"contract={self.contract_fingerprint} seed={self.settings.get('seed')} {env}")
        lines += [f"note: {n}" for n in self.notes]
        return "\n".join(lines)
