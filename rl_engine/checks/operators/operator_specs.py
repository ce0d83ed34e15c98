"""The harness's view of the op records (rl_engine.kernels.records): cases and candidates.

A case is an op's sample inputs (operator_inputs) in one dtype and layout, judged against its gold op;
a candidate is a built-in backend ("pytorch": the gold class itself, the checker's own smoke test;
"triton") or any callable a user names as "module:attr".
"""

from __future__ import annotations

from rl_engine.checks.operators.op_checks import CandidateSpec, OperatorCase
from rl_engine.checks.operators.operator_inputs import INPUT_BUILDERS, OperatorDims, make_operator_inputs, shape_name
from rl_engine.checks.operators.tolerance import DTYPES, dtype_key
from rl_engine.errors import UsageError
from rl_engine.kernels.records import OPS, OpRecord
from rl_engine.loading import load_callable


def _validate_specs() -> None:
    for spec in OPS.values():
        if spec.name not in INPUT_BUILDERS:
            raise ValueError(f"{spec.name}: no input builder in operator_inputs")


_validate_specs()


def operator_names() -> list[str]:
    return list(OPS)


def get_spec(op: str) -> OpRecord:
    if op not in OPS:
        raise UsageError(f"unknown op {op!r}; valid ops: {', '.join(OPS)}")
    return OPS[op]


def _constructor_kwargs(spec: OpRecord, dims: OperatorDims) -> dict:
    return {name: getattr(dims, name) for name in spec.constructor_dims}


def make_operator_case(
    op: str,
    *,
    dtype="fp32",
    device="cpu",
    dims: OperatorDims | None = None,
    input_mode: str = "random",
    constant_value: float = 1.0,
    token_value: int = 0,
    seed: int = 0,
    layout: str | None = None,
) -> OperatorCase:
    """The case of `op`: its inputs in `dtype` on `device` in `layout` (default: the op's first), the gold
    op as reference and its baseline."""
    spec = get_spec(op)
    if layout is not None and layout not in spec.layouts:
        raise UsageError(f"--layout {layout}: op {op} takes {', '.join(spec.layouts)}")
    dims = dims or OperatorDims()
    key = dtype_key(dtype)
    inputs = make_operator_inputs(op, dims, dtype=DTYPES[key], device=device, input_mode=input_mode,
                                  constant_value=constant_value, token_value=token_value, seed=seed, layout=layout)
    gold = load_callable(spec.gold_path, "gold op", **_constructor_kwargs(spec, dims))
    label = "" if layout in (None, spec.layouts[0]) else f"{layout}-"
    return OperatorCase(
        name=f"{op}-{key}-{label}{shape_name(inputs)}", op_class=spec.op_class, dtype=DTYPES[key], inputs=inputs,
        gold_fn=gold, grad_input_names=spec.grad_input_names, baseline_fn=getattr(gold, "baseline", None),
        batch_input_names=spec.batch_input_names,
    )


def make_candidate(op: str, candidate: str, *, dims: OperatorDims | None = None, arch_key: str | None = None):
    """A built-in backend of `op` ("pytorch", "triton") or any callable named "module:attr" (backend
    "external") as a CandidateSpec; UsageError (one line) when it is unknown or won't load."""
    spec = get_spec(op)
    kwargs = _constructor_kwargs(spec, dims or OperatorDims())
    if candidate in spec.candidate_paths:
        path = spec.candidate_paths[candidate]
        try:
            fn = load_callable(path, "candidate", **kwargs)
        except UsageError as exc:  # a module not written yet, or one that fails to import
            raise UsageError(f"candidate {candidate!r} for op {op!r} cannot be loaded: {exc}") from None
        return CandidateSpec(name=f"{candidate}-{op}", fn=fn, backend=candidate, arch_key=arch_key)
    if ":" not in candidate:
        raise UsageError(f"unknown candidate {candidate!r} for op {op!r}; valid candidates: "
                         f"{', '.join(spec.candidate_paths)}, or module:attr for your own")
    # Constructed like the gold: a class gets the op's constructor dims (e.g. eps), then takes the inputs.
    return CandidateSpec(name=candidate, fn=load_callable(candidate, "candidate", **kwargs), backend="external",
                         arch_key=arch_key)
