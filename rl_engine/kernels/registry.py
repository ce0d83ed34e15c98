"""Op -> backend -> implementation, and the record of what actually ran.

Models reach kernels only through `Registry.dispatch(op, backend, node, params, **inputs)`. Each
implementation names its `target`: the dotted path ("module:attribute") of the kernel that runs.
Targets are imported lazily, so a missing Triton kernel fails the call that needs it, with a
message naming the op, the backend and the path; nothing falls back to another backend.

Every dispatch appends a `DispatchRecord` (node, op, backend, target, output dtype, TF32 state)
to the recorder passed in; `rl_engine.invariance.provenance` judges those records.

Backends:
- `reference`: the gold ops (rl_engine.kernels.ops.pytorch) called as references: fp32, TF32 off.
- `torch`: plain PyTorch in the inputs' dtype, the calls users make today (F.rms_norm, SDPA, @).
- `triton`: our kernels (rl_engine.kernels.ops.triton).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from rl_engine.errors import UsageError
from rl_engine.kernels.ops.pytorch.base import tf32_off
from rl_engine.kernels.ops.pytorch.loss.logp import selected_logprobs
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
            dtype = str(out.dtype).removeprefix("torch.")
            recorder.add(DispatchRecord(node, op, impl.backend, impl.target, dtype, tf32))
        return out


# ----------------------------------------------------------------------------------------------
# Attention masks shared by the reference and torch implementations. Layouts:
#   padded: q/k/v [B,S,H,D]; seq_starts [B] (left padding: first valid index) or None (right
#           padding needs no mask: causality already hides the padding behind each valid token);
#   packed: q/k/v [1,T,H,D] with cu_seqlens [N+1]: block-diagonal causal.
# Padding queries get their own diagonal so no row is empty (plain SDPA would return NaN there, and
# a NaN value row poisons valid rows through 0 * NaN in the probability-value product).


def attention_mask(q, seq_starts=None, cu_seqlens=None) -> torch.Tensor:
    b, s = q.shape[0], q.shape[1]
    idx = torch.arange(s, device=q.device)
    mask = (idx[None, :] <= idx[:, None]).unsqueeze(0).expand(b, s, s)
    if seq_starts is not None:
        mask = mask & (idx[None, None, :] >= seq_starts.long().to(q.device)[:, None, None])
    if cu_seqlens is not None:
        seq_id = torch.searchsorted(cu_seqlens.long().to(q.device)[1:], idx, right=True)
        mask = mask & (seq_id[:, None] == seq_id[None, :]).unsqueeze(0)
    return mask | torch.eye(s, dtype=torch.bool, device=q.device).unsqueeze(0)


def kv_cache_mask(q, k_cache, cache_seqlens) -> torch.Tensor:
    sq, smax = q.shape[1], k_cache.shape[1]
    query_pos = cache_seqlens.long().to(q.device)[:, None] - sq + torch.arange(sq, device=q.device)[None, :]
    return torch.arange(smax, device=q.device)[None, None, :] <= query_pos[:, :, None]


def _scale(params, q):
    return params.get("scale") or 1.0 / math.sqrt(q.shape[-1])


def reference_attention(kernel, params, inputs):
    # Narrow floats go up to fp32 as in the gold ops; float64 stays (exact test profiles use it).
    q, k, v = (
        inputs[n].float() if inputs[n].dtype in (torch.bfloat16, torch.float16) else inputs[n] for n in ("q", "k", "v")
    )
    mask = attention_mask(q, inputs.get("seq_starts"), inputs.get("cu_seqlens"))
    with tf32_off():
        return kernel(q, k, v, mask, _scale(params, q))


def reference_kv_cache_attention(kernel, params, inputs):
    with tf32_off():
        return kernel(scale=params.get("scale"))(**inputs)


def _sdpa(q, k, v, mask, scale):
    group = q.shape[2] // k.shape[2]
    k, v = k.repeat_interleave(group, dim=2), v.repeat_interleave(group, dim=2)
    out = F.scaled_dot_product_attention(
        q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), attn_mask=mask.unsqueeze(1), scale=scale
    )
    return out.transpose(1, 2)


def torch_attention(kernel, params, inputs):
    q, k, v = inputs["q"], inputs["k"], inputs["v"]
    return _sdpa(q, k, v, attention_mask(q, inputs.get("seq_starts"), inputs.get("cu_seqlens")), _scale(params, q))


def torch_kv_cache_attention(kernel, params, inputs):
    q, k_cache, v_cache = inputs["q"], inputs["k_cache"], inputs["v_cache"]
    return _sdpa(q, k_cache, v_cache, kv_cache_mask(q, k_cache, inputs["cache_seqlens"]), _scale(params, q))


def torch_linear_logp(kernel, params, inputs):
    """What RL trainers do today: bf16 logits from a bf16 matmul, log-softmax after an fp32 upcast."""
    logits = inputs["hidden"] @ inputs["lm_head_weight"].t()
    return selected_logprobs(logits.float(), inputs["target_ids"])


def _call_op_class(kernel, params, inputs):
    return kernel(**params)(**inputs)


def _call_function(kernel, params, inputs):
    return kernel(**inputs, **params)


REGISTRY = Registry()
_GOLD = "rl_engine.kernels.ops.pytorch"
_TRITON = "rl_engine.kernels.ops.triton"

# (op, module under ops/<backend>/, class name stem)
_OP_CLASSES = {
    "embedding": ("embedding.embedding", "Embedding"),
    "rms_norm": ("norm.rms_norm", "RmsNorm"),
    "matmul": ("linear.matmul", "Matmul"),
    "lm_head": ("linear.lm_head", "LmHead"),
    "rope": ("position.rope", "Rope"),
    "swiglu": ("activation.swiglu", "Swiglu"),
    "logp": ("loss.logp", "Logp"),
    "linear_logp": ("loss.linear_logp", "LinearLogp"),
}

for _op, (_module, _stem) in _OP_CLASSES.items():
    REGISTRY.register(Implementation(_op, "reference", f"{_GOLD}.{_module}:Native{_stem}Op", _call_op_class))
    REGISTRY.register(Implementation(_op, "triton", f"{_TRITON}.{_module}:Triton{_stem}Op", _call_op_class))

REGISTRY.register(
    Implementation("attention", "reference", f"{_GOLD}.attention.attention:grouped_attention", reference_attention)
)
REGISTRY.register(
    Implementation(
        "kv_cache_attention",
        "reference",
        f"{_GOLD}.attention.kv_cache_attention:NativeKvCacheAttentionOp",
        reference_kv_cache_attention,
    )
)
REGISTRY.register(
    Implementation("attention", "triton", f"{_TRITON}.attention.attention:triton_attention", _call_function)
)
REGISTRY.register(
    Implementation(
        "kv_cache_attention",
        "triton",
        f"{_TRITON}.attention.kv_cache_attention:triton_kv_cache_attention",
        _call_function,
    )
)

# Plain PyTorch: the natural call in the inputs' dtype.
_TORCH = {
    "embedding": ("torch.nn.functional:embedding", lambda f, p, i: f(i["token_ids"].long(), i["weight"])),
    "rms_norm": (
        "torch.nn.functional:rms_norm",
        lambda f, p, i: f(i["x"], (i["x"].shape[-1],), i["weight"], p.get("eps", 1e-6)),
    ),
    "matmul": ("torch:matmul", lambda f, p, i: f(i["a"], i["b"])),
    "lm_head": ("torch:matmul", lambda f, p, i: f(i["hidden"], i["weight"].t())),
    "rope": (f"{_GOLD}.position.rope:NativeRopeOp", lambda f, p, i: f(**p).baseline(**i)),
    "swiglu": ("torch.nn.functional:silu", lambda f, p, i: f(i["gate"]) * i["up"]),
    "logp": (f"{_GOLD}.loss.logp:selected_logprobs", lambda f, p, i: f(i["logits"].float(), i["target_ids"])),
    "linear_logp": ("torch:matmul", torch_linear_logp),
    "attention": ("torch.nn.functional:scaled_dot_product_attention", torch_attention),
    "kv_cache_attention": ("torch.nn.functional:scaled_dot_product_attention", torch_kv_cache_attention),
}
for _op, (_target, _adapter) in _TORCH.items():
    REGISTRY.register(Implementation(_op, "torch", _target, _adapter))
