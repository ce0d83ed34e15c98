"""Backend profiles: which backend runs each op, in which activation dtype, and what it must output.

A profile is declared once here. Its `declared` table (op -> backend, kernel target, output dtype)
is fixed when the profile is built, from the registry as it stands at import; the provenance check
compares every dispatch the model made against it, so a registry entry swapped later (a silent
fallback) is caught, not trusted.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from rl_engine.bits import dtype_key
from rl_engine.kernels.records import MODEL_OPS
from rl_engine.kernels.records import OPS as RECORDS
from rl_engine.kernels.registry import REGISTRY, MissingImplementation, Recorder, Registry


@dataclass(frozen=True)
class Declared:
    backend: str
    target: str
    output_dtype: str


@dataclass(frozen=True)
class Profile:
    name: str
    dtype: torch.dtype  # activation (and KV cache) dtype
    declared: dict  # op -> Declared

    def backend(self, op: str) -> str:
        return self.declared[op].backend


def build_profile(name: str, dtype: torch.dtype, backends: dict, registry: Registry = REGISTRY) -> Profile:
    declared = {}
    for op in MODEL_OPS:
        backend = backends[op]
        # Logprob outputs are fp32 in every profile (DESIGN.md, rule 4).
        out = torch.float32 if RECORDS[op].fp32_output else dtype
        declared[op] = Declared(backend, registry.lookup(op, backend).target, dtype_key(out))
    return Profile(name, dtype, declared)


PROFILES = {
    "reference_fp32": build_profile("reference_fp32", torch.float32, dict.fromkeys(MODEL_OPS, "reference")),
    "torch_bf16": build_profile("torch_bf16", torch.bfloat16, dict.fromkeys(MODEL_OPS, "torch")),
    "triton_bf16": build_profile("triton_bf16", torch.bfloat16, dict.fromkeys(MODEL_OPS, "triton")),
}


def get_profile(name: str) -> Profile:
    if name not in PROFILES:
        raise ValueError(f"profile: expected one of {sorted(PROFILES)}, got {name!r}")
    return PROFILES[name]


class ProfileOps:
    """What the model calls: `ops(op, node, params, **inputs)` dispatches per the profile and records."""

    def __init__(self, profile: Profile, registry: Registry = REGISTRY, recorder: Recorder | None = None):
        self.profile = profile
        self.registry = registry
        self.recorder = recorder if recorder is not None else Recorder()
        # Import every kernel now: an import inside torch.compile's trace is a graph break. A kernel that
        # cannot load raises its MissingImplementation at its first dispatch, as before.
        for op in profile.declared:
            try:
                registry.kernel(registry.lookup(op, profile.backend(op)))
            except MissingImplementation:
                pass

    def __call__(self, op: str, node: str, params: dict | None = None, **inputs):
        return self.registry.dispatch(op, self.profile.backend(op), node, self.recorder, params or {}, **inputs)
