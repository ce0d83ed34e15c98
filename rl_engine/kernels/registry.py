"""Op -> backend -> implementation, and the record of what actually ran.

Models reach kernels only through `Registry.dispatch(op, backend, node, params, **inputs)`. Each
implementation names its `target`: the dotted path ("module:attribute") of the kernel that runs.
Targets are imported lazily, so a missing Triton kernel fails the call that needs it, with a
message naming the op, the backend and the path; nothing falls back to another backend.

Every dispatch appends a `DispatchRecord` (node, op, backend, target, output dtype, TF32 state)
to the recorder passed in; `rl_engine.checks.forward_invariance.provenance` judges those records.

Every op's three backends come from its record (rl_engine.kernels.records):
- `reference`: the gold op called as a reference: fp32, TF32 off;
- `torch`: the gold op's `baseline`, plain PyTorch in the inputs' dtype (F.rms_norm, SDPA, @);
- `triton`: our kernel.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from rl_engine.bits import dtype_key
from rl_engine.errors import UsageError
from rl_engine.kernels.records import OPS
from rl_engine.loading import load_object

BACKENDS = ("reference", "torch", "triton")


class MissingImplementation(RuntimeError):
    """An op has no implementation for a backend, or its kernel cannot be imported."""


@dataclass(frozen=True)
class Implementation:
    op: str
    backend: str
    target: str  # "module:attribute" of the kernel that runs; recorded as provenance
    adapter: Callable  # adapter(kernel, params, inputs) -> output


@dataclass(frozen=True)
class DispatchRecord:
    node: str
    op: str
    backend: str
    target: str
    output_dtype: str
    tf32: bool


@dataclass
class Recorder:
    """Collects one record per dispatch."""

    records: list[DispatchRecord] = field(default_factory=list)

    def add(self, record: DispatchRecord) -> None:
        self.records.append(record)


def tf32_enabled() -> bool:
    """Whether fp32 matmuls may run in TF32 (legacy flag, or the fp32_precision API of torch >= 2.9)."""
    matmul = torch.backends.cuda.matmul
    try:
        return bool(matmul.allow_tf32)
    except RuntimeError:  # torch >= 2.9 refuses the legacy getter once both APIs were used
        return getattr(matmul, "fp32_precision", "tf32") == "tf32"


class Registry:
    def __init__(self):
        self._table: dict[tuple[str, str], Implementation] = {}
        self._kernels: dict[str, object] = {}

    def register(self, impl: Implementation) -> None:
        if impl.backend not in BACKENDS:
            raise ValueError(f"backend: expected one of {BACKENDS}, got {impl.backend!r}")
        self._table[(impl.op, impl.backend)] = impl

    def implementations(self) -> list[Implementation]:
        return list(self._table.values())

    def ops(self) -> list[str]:
        return sorted({op for op, _ in self._table})

    def lookup(self, op: str, backend: str) -> Implementation:
        try:
            return self._table[(op, backend)]
        except KeyError:
            raise MissingImplementation(f"op {op!r} has no implementation for backend {backend!r}") from None

    def kernel(self, impl: Implementation):
        if impl.target not in self._kernels:
            try:
                self._kernels[impl.target] = load_object(impl.target, "kernel")
            except UsageError as exc:
                raise MissingImplementation(
                    f"op {impl.op!r}, backend {impl.backend!r}: kernel {impl.target} is not available ({exc}); "
                    "no fallback is taken"
                ) from exc
        return self._kernels[impl.target]

    def dispatch(self, op: str, backend: str, node: str, recorder: Recorder | None, params: dict, **inputs):
        impl = self.lookup(op, backend)
        tf32 = tf32_enabled()
        out = impl.adapter(self.kernel(impl), params, inputs)
        if recorder is not None:
            dtype = dtype_key(out.dtype)
            recorder.add(DispatchRecord(node, op, impl.backend, impl.target, dtype, tf32))
        return out


def _call_op(kernel, params, inputs):
    return kernel(**params)(**inputs)


def _baseline_caller(gold_path: str) -> Callable:
    """Adapter of a `torch` implementation: the kernel is the gold class's `baseline` (recorded as the
    target); it is called on an instance of the gold class built with the params."""
    owner = []

    def call(baseline, params, inputs):
        if not owner:
            owner.append(load_object(gold_path, "gold op"))
        return baseline(owner[0](**params), **inputs)

    return call


REGISTRY = Registry()
for _record in OPS.values():
    REGISTRY.register(Implementation(_record.name, "reference", _record.gold_path, _call_op))
    REGISTRY.register(
        Implementation(_record.name, "torch", f"{_record.gold_path}.baseline", _baseline_caller(_record.gold_path))
    )
    REGISTRY.register(Implementation(_record.name, "triton", _record.triton_path, _call_op))
