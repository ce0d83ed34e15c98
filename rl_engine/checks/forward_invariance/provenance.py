"""Backend provenance, judged fail-closed from what the registry recorded at dispatch.

A run fails, with a message naming the node, when a node ran a backend or kernel other than its
profile declares for the op, produced an output dtype other than declared, ran with TF32 enabled,
was never run although required, or is not a node of the model at all.
"""

from __future__ import annotations

from rl_engine.kernels.registry import DispatchRecord
from rl_engine.models.profiles import Profile


class ProvenanceError(RuntimeError):
    """The recorded dispatches disagree with the profile."""


def provenance_failures(
    records: list[DispatchRecord], profile: Profile, required_nodes: list[str], known_nodes: list[str]
) -> list[str]:
    failures = []
    seen = set()
    known = set(known_nodes)
    for r in records:
        key = (r.node, r.op, r.backend, r.target, r.output_dtype, r.tf32)
        if key in seen:
            continue
        seen.add(key)
        if r.node not in known:
            failures.append(f"node {r.node}: not a node of the model (op {r.op})")
        declared = profile.declared.get(r.op)
        if declared is None:
            failures.append(f"node {r.node}: op {r.op} is not declared by profile {profile.name}")
            continue
        if (r.backend, r.target) != (declared.backend, declared.target):
            failures.append(
                f"node {r.node}: op {r.op} ran {r.backend}:{r.target}, profile {profile.name} declares "
                f"{declared.backend}:{declared.target}"
            )
        if r.output_dtype != declared.output_dtype:
            failures.append(
                f"node {r.node}: op {r.op} returned {r.output_dtype}, profile {profile.name} declares "
                f"{declared.output_dtype}"
            )
        if r.tf32:
            failures.append(f"node {r.node}: op {r.op} ran with TF32 enabled")
    ran = {r.node for r in records}
    failures += [f"node {n}: required but never dispatched" for n in required_nodes if n not in ran]
    # One failure per distinct message, in first-seen order.
    return list(dict.fromkeys(failures))


def check_provenance(records, profile, required_nodes, known_nodes) -> None:
    failures = provenance_failures(records, profile, required_nodes, known_nodes)
    if failures:
        raise ProvenanceError("; ".join(failures))


def node_table(records: list[DispatchRecord]) -> dict:
    """node -> op -> {backend, target, output_dtype}: what actually ran, for the report."""
    table: dict = {}
    for r in records:
        table.setdefault(r.node, {})[r.op] = {"backend": r.backend, "target": r.target, "output_dtype": r.output_dtype}
    return table
