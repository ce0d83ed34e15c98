"""The tolerance contract: which comparison a judgment of an op class in a dtype must pass.

A contract (`tolerance_contract.json`) is a list of rows, each
`{judgment, op_class, dtype, mode, <mode parameters>, rationale[, arch_key]}`:
- mode `bitwise`: every bit equal; no parameters. Invariance rows are always bitwise.
- mode `allclose`: |cand - ref| <= atol + rtol * |ref| elementwise; parameters atol, rtol.
- mode `baseline_relative`: max|cand - ref| <= k * max|baseline - ref| + atol, where the baseline is
  plain PyTorch in the candidate's dtype; parameters k, atol.
A row with `arch_key` overrides the default row (no arch_key) of the same judgment, class and dtype
when the caller passes that arch key. Every judgment x class x dtype needs a default row.
The fingerprint is the sha256 of the contract's canonical JSON; every report records it.
"""

from __future__ import annotations

import hashlib
import json
import math
from dataclasses import asdict, dataclass
from pathlib import Path

from rl_engine.bits import DTYPES, dtype_key

DEFAULT_CONTRACT_PATH = Path(__file__).with_name("tolerance_contract.json")

JUDGMENTS = ("forward_accuracy", "gradient_accuracy", "forward_invariance", "gradient_invariance")
INVARIANCE_JUDGMENTS = ("forward_invariance", "gradient_invariance")
MODE_PARAMETERS = {"bitwise": (), "allclose": ("atol", "rtol"), "baseline_relative": ("k", "atol")}
TOP_LEVEL_KEYS = {"schema_version": True, "description": False, "op_classes": True, "rows": True}
ROW_KEYS = {"judgment", "op_class", "dtype", "mode", "rationale", "arch_key", "atol", "rtol", "k"}
SCHEMA_VERSION = 1


class ContractError(ValueError):
    """The contract is unreadable or breaks the schema; the message names the offending key."""


@dataclass(frozen=True)
class Tolerance:
    judgment: str
    op_class: str
    dtype: str
    mode: str
    rationale: str
    atol: float | None = None
    rtol: float | None = None
    k: float | None = None
    arch_key: str | None = None  # the override applied, None for the default row

    def describe(self) -> str:
        params = ", ".join(f"{name}={getattr(self, name):.3e}" for name in MODE_PARAMETERS[self.mode])
        return f"mode={self.mode}" + (f", {params}" if params else "")

    def to_dict(self) -> dict:
        return asdict(self)

    def max_abs_bound(self, baseline_max_abs: float = 0.0, reference_max_abs: float = 0.0) -> float:
        """The largest max|cand - ref| the row allows for a whole output (allclose: at its largest |ref|,
        a summary looser than the per-element rule); 0 for bitwise."""
        if self.mode == "baseline_relative":
            return self.k * baseline_max_abs + self.atol
        if self.mode == "allclose":
            return self.atol + self.rtol * reference_max_abs
        return 0.0


def _is_number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def validate_contract(data) -> None:
    """Raise ContractError naming the first bad key; return None when the contract is well formed."""
    if not isinstance(data, dict):
        raise ContractError(f"contract: expected a JSON object, got {type(data).__name__}")
    for key in data:
        if key not in TOP_LEVEL_KEYS:
            raise ContractError(f"{key}: unknown top-level key; expected {sorted(TOP_LEVEL_KEYS)}")
    for key, required in TOP_LEVEL_KEYS.items():
        if required and key not in data:
            raise ContractError(f"{key}: missing required top-level key")
    if data["schema_version"] != SCHEMA_VERSION:
        raise ContractError(f"schema_version: expected {SCHEMA_VERSION}, got {data['schema_version']!r}")
    classes = data["op_classes"]
    if not isinstance(classes, list) or not classes or not all(isinstance(c, str) and c for c in classes):
        raise ContractError(f"op_classes: expected a non-empty list of names, got {classes!r}")
    if not isinstance(data["rows"], list):
        raise ContractError(f"rows: expected a list, got {type(data['rows']).__name__}")

    seen = {}
    for i, row in enumerate(data["rows"]):
        where = f"rows[{i}]"
        if not isinstance(row, dict):
            raise ContractError(f"{where}: expected an object, got {type(row).__name__}")
        for key in row:
            if key not in ROW_KEYS:
                raise ContractError(f"{where}.{key}: unknown key; expected some of {sorted(ROW_KEYS)}")
        for key in ("judgment", "op_class", "dtype", "mode", "rationale"):
            if key not in row:
                raise ContractError(f"{where}.{key}: missing required key")
        choices = {"judgment": JUDGMENTS, "op_class": classes, "dtype": tuple(DTYPES), "mode": tuple(MODE_PARAMETERS)}
        for key, allowed in choices.items():
            if row[key] not in allowed:
                raise ContractError(f"{where}.{key}: expected one of {list(allowed)}, got {row[key]!r}")
        if not isinstance(row["rationale"], str) or not row["rationale"].strip():
            raise ContractError(f"{where}.rationale: expected a one-line explanation, got {row['rationale']!r}")
        if "\n" in row["rationale"]:
            raise ContractError(f"{where}.rationale: must be one line")
        if "arch_key" in row and (not isinstance(row["arch_key"], str) or not row["arch_key"]):
            raise ContractError(f"{where}.arch_key: expected a non-empty string, got {row['arch_key']!r}")
        if row["judgment"] in INVARIANCE_JUDGMENTS and row["mode"] != "bitwise":
            raise ContractError(f"{where}.mode: {row['judgment']} rows must be bitwise, got {row['mode']!r}")
        params = MODE_PARAMETERS[row["mode"]]
        for key in ("atol", "rtol", "k"):
            if key in params and key not in row:
                raise ContractError(f"{where}.{key}: missing; mode {row['mode']} needs {list(params)}")
            if key not in params and key in row:
                raise ContractError(f"{where}.{key}: not a parameter of mode {row['mode']} (takes {list(params)})")
            if key in row and (not _is_number(row[key]) or row[key] < 0):
                raise ContractError(f"{where}.{key}: expected a finite non-negative number, got {row[key]!r}")
        if row["mode"] == "baseline_relative" and row["k"] < 1:
            raise ContractError(f"{where}.k: expected k >= 1 (the candidate may not be held above the baseline)")
        ident = (row["judgment"], row["op_class"], row["dtype"], row.get("arch_key"))
        if ident in seen:
            raise ContractError(f"{where}: duplicates {seen[ident]} for {ident}")
        seen[ident] = where

    for judgment in JUDGMENTS:
        for op_class in classes:
            for dtype in DTYPES:
                if (judgment, op_class, dtype, None) not in seen:
                    raise ContractError(
                        f"rows: missing the default row for judgment={judgment} op_class={op_class} dtype={dtype}"
                    )


def load_contract(path=None) -> dict:
    """Read and validate a contract (the packaged one when `path` is None)."""
    path = Path(path) if path is not None else DEFAULT_CONTRACT_PATH
    try:
        text = path.read_text()
    except OSError as exc:
        raise ContractError(f"contract {path}: cannot read ({exc.strerror or exc})") from None
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ContractError(f"contract {path}: not JSON ({exc.msg} at line {exc.lineno})") from None
    try:
        validate_contract(data)
    except ContractError as exc:
        raise ContractError(f"contract {path}: {exc}") from None
    return data


def contract_fingerprint(data: dict) -> str:
    canonical = json.dumps(data, sort_keys=True, separators=(",", ":"), ensure_ascii=False)
    return "sha256:" + hashlib.sha256(canonical.encode()).hexdigest()


def resolve_tolerance(contract: dict, *, judgment: str, op_class: str, dtype, arch_key: str | None = None) -> Tolerance:
    """The row for (judgment, op_class, dtype): the `arch_key` override if there is one, else the default."""
    dtype = dtype_key(dtype)
    default = override = None
    for row in contract["rows"]:
        if (row["judgment"], row["op_class"], row["dtype"]) != (judgment, op_class, dtype):
            continue
        if "arch_key" not in row:
            default = row
        elif arch_key is not None and row["arch_key"] == arch_key:
            override = row
    row = override or default
    if row is None:
        raise ContractError(f"rows: no row for judgment={judgment} op_class={op_class} dtype={dtype}")
    return Tolerance(
        judgment=judgment, op_class=op_class, dtype=dtype, mode=row["mode"], rationale=row["rationale"],
        atol=row.get("atol"), rtol=row.get("rtol"), k=row.get("k"), arch_key=row.get("arch_key"),
    )
