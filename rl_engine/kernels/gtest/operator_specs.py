"""One declaration per operator: its class, gold path, candidates, differentiated and per-row inputs.

Adding an op means adding an `OperatorSpec` here and an input builder in `operator_inputs`; the
runner and the commands read everything from these declarations. A dotted path names a class
(instantiated with the spec's constructor dims, e.g. `eps`) or a callable. Gold paths must lie in
`rl_engine.kernels.ops.pytorch` (checked at import); candidate `pytorch` is the gold class itself,
the checker's own smoke test.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from rl_engine.errors import UsageError
from rl_engine.kernels.gtest.op_checks import CandidateSpec, OperatorCase
from rl_engine.kernels.gtest.operator_inputs import INPUT_BUILDERS, OperatorDims, make_operator_inputs, shape_name
from rl_engine.kernels.gtest.tolerance import DTYPES, dtype_key
from rl_engine.loading import load_callable

GOLD_PACKAGE = "rl_engine.kernels.ops.pytorch"
TRITON_PACKAGE = "rl_engine.kernels.ops.triton"
OP_CLASSES = ("elementwise", "reduction", "logprob", "matmul", "attention", "policy_loss")


@dataclass(frozen=True)
class OperatorSpec:
    name: str
    op_class: str
    gold_path: str
    candidate_paths: dict
    grad_input_names: tuple  # empty: a forward-only op, `--check-grad` is refused
    batch_input_names: tuple  # inputs with a leading batch dim, sliced per row by the invariance check
    constructor_dims: tuple = field(default=())  # OperatorDims fields passed to the op's constructor


def _declare(name, family, stem, op_class, grads, batched, constructor_dims=()) -> OperatorSpec:
    gold = f"{GOLD_PACKAGE}.{family}.{name}.Native{stem}Op"
    return OperatorSpec(
        name=name, op_class=op_class, gold_path=gold,
        candidate_paths={"pytorch": gold, "triton": f"{TRITON_PACKAGE}.{family}.{name}.Triton{stem}Op"},
        grad_input_names=tuple(grads), batch_input_names=tuple(batched), constructor_dims=tuple(constructor_dims),
    )


_SPECS = [
    _declare("logp", "loss", "Logp", "logprob", ["logits"], ["logits", "target_ids"]),
    _declare("linear_logp", "loss", "LinearLogp", "logprob", ["hidden", "lm_head_weight"], ["hidden", "target_ids"]),
    _declare("rms_norm", "norm", "RmsNorm", "reduction", ["x", "weight"], ["x"], ["eps"]),
    _declare("matmul", "linear", "Matmul", "matmul", ["a", "b"], ["a"]),
    _declare("lm_head", "linear", "LmHead", "matmul", ["hidden", "weight"], ["hidden"]),
    _declare("attention", "attention", "Attention", "attention", ["q", "k", "v"], ["q", "k", "v"]),
    # An inference op (decode and chunked prefill against a KV cache): no gradient inputs, no backward.
    _declare("kv_cache_attention", "attention", "KvCacheAttention", "attention", [],
             ["q", "k_cache", "v_cache", "cache_seqlens"]),
    _declare("silu", "activation", "Silu", "elementwise", ["x"], ["x"]),
    _declare("swiglu", "activation", "Swiglu", "elementwise", ["gate", "up"], ["gate", "up"]),
    _declare("rope", "position", "Rope", "elementwise", ["x"], ["x", "positions"], ["theta"]),
    _declare("embedding", "embedding", "Embedding", "elementwise", ["weight"], ["token_ids"]),
    # Judged as masked per-token losses [B,T]: each sequence alone vs its row of the batch.
    _declare("linear_policy_loss", "loss", "LinearPolicyLoss", "policy_loss", ["hidden", "lm_head_weight"],
             ["hidden", "target_ids", "advantages", "old_logprobs", "ref_logprobs", "mask"]),
]
OP_SPECS: dict[str, OperatorSpec] = {spec.name: spec for spec in _SPECS}


def _validate_specs() -> None:
    for spec in OP_SPECS.values():
        if not spec.gold_path.startswith(GOLD_PACKAGE + "."):
            raise ValueError(f"{spec.name}.gold_path: must lie in {GOLD_PACKAGE}, got {spec.gold_path}")
        if spec.op_class not in OP_CLASSES:
            raise ValueError(f"{spec.name}.op_class: expected one of {OP_CLASSES}, got {spec.op_class!r}")
        if spec.name not in INPUT_BUILDERS:
            raise ValueError(f"{spec.name}: no input builder in operator_inputs")
        if "pytorch" not in spec.candidate_paths:
            raise ValueError(f"{spec.name}.candidate_paths: the pytorch smoke candidate is required")


_validate_specs()


def operator_names() -> list[str]:
    return list(OP_SPECS)


def get_spec(op: str) -> OperatorSpec:
    if op not in OP_SPECS:
        raise UsageError(f"unknown op {op!r}; valid ops: {', '.join(OP_SPECS)}")
    return OP_SPECS[op]


def _constructor_kwargs(spec: OperatorSpec, dims: OperatorDims) -> dict:
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
) -> OperatorCase:
    """The case of `op`: its inputs in `dtype` on `device`, the gold op as reference and baseline."""
    spec = get_spec(op)
    dims = dims or OperatorDims()
    key = dtype_key(dtype)
    inputs = make_operator_inputs(op, dims, dtype=DTYPES[key], device=device, input_mode=input_mode,
                                  constant_value=constant_value, token_value=token_value, seed=seed)
    gold = load_callable(spec.gold_path, "gold op", **_constructor_kwargs(spec, dims))
    return OperatorCase(
        name=f"{op}-{key}-{shape_name(inputs)}", op_class=spec.op_class, dtype=DTYPES[key], inputs=inputs,
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
