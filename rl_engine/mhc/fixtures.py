"""Seeded mHC cases and their golden hashes; `rl-engine mhc-golden` checks or (with --write) rewrites them.

A case is a seed, a geometry and contract choices; its inputs are drawn on the CPU from a
`torch.Generator` (so every device gets the same bytes) and moved to the device. The manifest
(`golden_hashes.json`, beside this file) holds, per case, the contract fingerprint and the sha256
of every boundary the oracle produces. It changes only through `rl-engine mhc-golden --write`.
"""

from __future__ import annotations

import argparse
import json
import math
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from rl_engine.errors import UsageError
from rl_engine.mhc import oracle
from rl_engine.mhc.contract import ControllerParams, LayerContract, NormParams, ResidualBatch
from rl_engine.mhc.trace import describe
from rl_engine.outputs import check_writable, write_atomic

GOLDEN_PATH = Path(__file__).with_name("golden_hashes.json")
GOLDEN_SCHEMA = "mhc-golden-v1"


@dataclass(frozen=True)
class Case:
    name: str
    tokens: int
    hidden: int
    seed: int
    fusion_mode: str = "unfused"
    trainability: str = "full"
    rms_eps_placement: str = "inside"
    zero_rows: tuple[int, ...] = ()  # tokens whose streams are all zero (padding-like rows)
    production: bool = False
    note: str = field(default="", compare=False)

    def contract(self) -> LayerContract:
        c = LayerContract(hidden=self.hidden, fusion_mode=self.fusion_mode, trainability=self.trainability,
                          rms_eps_placement=self.rms_eps_placement)
        if self.production:
            c.assert_production()
        return c


CASES = (
    Case("one_row", tokens=1, hidden=128, seed=101, note="a single token"),
    Case("packed_t16", tokens=16, hidden=128, seed=102, zero_rows=(3,), note="packed batch, one all-zero row"),
    Case("odd_t7", tokens=7, hidden=96, seed=103, note="odd T; C = 96 leaves a partial lane chunk"),
    Case("fused_pre_norm", tokens=8, hidden=128, seed=104, fusion_mode="fused_pre_norm"),
    Case("mixer_frozen", tokens=8, hidden=128, seed=105, trainability="mixer_frozen"),
    Case("eps_outside", tokens=5, hidden=64, seed=106, rms_eps_placement="outside", zero_rows=(1,),
         note="Megatron's eps placement, with an all-zero row"),
    Case("production", tokens=64, hidden=4096, seed=107, production=True,
         note="DeepSeek-V4-Flash geometry (K = 16384)"),
)
CASES_BY_NAME = {c.name: c for c in CASES}


def build_inputs(case: Case, device="cpu"):
    """(contract, batch, controller, norm) for `case`, drawn on the CPU and moved to `device`."""
    contract = case.contract()
    gen = torch.Generator().manual_seed(case.seed)
    t, n, c, k = case.tokens, contract.hc_mult, case.hidden, contract.k
    streams = torch.randn(t, n, c, generator=gen)
    for row in case.zero_rows:
        streams[row] = 0.0
    grad_out = torch.randn(t, n, c, generator=gen) * 0.5
    phi = torch.randn(contract.controller_n, k, generator=gen) / math.sqrt(k)
    alpha = torch.tensor([0.8, 0.6, 1.5]) + 0.1 * torch.randn(3, generator=gen)
    bias = 0.5 * torch.randn(contract.controller_n, generator=gen)
    gamma = 1.0 + 0.1 * torch.randn(c, generator=gen)
    scale = 0.5 * torch.randn(c, generator=gen)
    batch = ResidualBatch(streams.to(torch.bfloat16), grad_out.to(torch.bfloat16)).to(device)
    return (contract, batch, ControllerParams(phi, alpha, bias).to(device),
            NormParams(gamma, scale).to(device))


def oracle_trace(case: Case, device="cpu") -> dict[str, torch.Tensor]:
    contract, batch, controller, norm = build_inputs(case, device)
    return oracle.mhc_site(batch, controller, norm, contract)


def golden_row(case: Case, trace: dict[str, torch.Tensor]) -> dict:
    return {
        "layer_contract_fingerprint": case.contract().fingerprint(),
        "tokens": case.tokens, "hidden": case.hidden, "seed": case.seed,
        "boundaries": {name: describe(t) for name, t in trace.items()},
    }


def load_golden(path: Path = GOLDEN_PATH) -> dict:
    """The golden manifest at `path`, its shape checked: a broken file is a UsageError (one line), not
    a KeyError halfway through a run."""
    path = Path(path)
    where = f"golden manifest {path}"
    try:
        manifest = json.loads(path.read_text())
    except FileNotFoundError:
        raise UsageError(f"{where} not found; create it with `rl-engine mhc-golden --write`") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise UsageError(f"{where}: cannot read ({exc})") from None
    if not isinstance(manifest, dict):
        raise UsageError(f"{where}: expected a JSON object, got {type(manifest).__name__}")
    if manifest.get("schema") != GOLDEN_SCHEMA:
        raise UsageError(f"{where} has schema {manifest.get('schema')!r}, want {GOLDEN_SCHEMA!r}")
    cases = manifest.get("cases")
    if not isinstance(cases, dict):
        raise UsageError(f"{where}: 'cases' must be an object of case name -> row")
    for name, row in cases.items():
        row = row if isinstance(row, dict) else {}
        boundaries = row.get("boundaries")
        if not (isinstance(row.get("layer_contract_fingerprint"), str) and isinstance(boundaries, dict)
                and all(isinstance(b, dict) and isinstance(b.get("sha256"), str) for b in boundaries.values())):
            raise UsageError(f"{where}: case {name!r} needs a layer_contract_fingerprint and boundaries with a "
                             "sha256 each")
    return manifest


def select_cases(names: list[str] | None) -> list[Case]:
    if not names:
        return list(CASES)
    unknown = [n for n in names if n not in CASES_BY_NAME]
    if unknown:
        raise UsageError(f"unknown case(s) {', '.join(unknown)}; known: {', '.join(CASES_BY_NAME)}")
    return [CASES_BY_NAME[n] for n in names]


def row_differences(expected: dict | None, actual: dict) -> list[str]:
    """Names of what differs between a stored golden row and a fresh one ([] when they agree)."""
    if expected is None:
        return ["<case missing from manifest>"]
    keys = ("layer_contract_fingerprint", "tokens", "hidden", "seed")
    diffs = [key for key in keys if expected.get(key) != actual[key]]
    want, got = expected.get("boundaries", {}), actual["boundaries"]
    diffs += [name for name in sorted(set(want) | set(got)) if want.get(name) != got.get(name)]
    return diffs


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--write", action="store_true",
                        help="rewrite the manifest with the oracle's hashes (the only way it changes)")
    parser.add_argument("--cases", nargs="+", metavar="CASE", help=f"subset of: {', '.join(CASES_BY_NAME)}")
    parser.add_argument("--device", default="cpu", help="device to run the oracle on (default cpu)")
    parser.add_argument("--manifest", type=Path, default=GOLDEN_PATH, help=argparse.SUPPRESS)


def run(args: argparse.Namespace) -> int:
    if args.device == "cpu":
        # The oracle is many small elementwise ops: on a shared CPU, OpenMP threads only add contention
        # (measured 4 s vs 40 s at production geometry on a loaded 2-core machine). Bytes don't change.
        torch.set_num_threads(1)
    cases = select_cases(args.cases)
    try:
        device = torch.device(args.device)
    except RuntimeError:
        device = None
    if device is None or device.type not in ("cpu", "cuda") or (device.type == "cpu" and device.index not in (None, 0)):
        raise UsageError(f"--device: expected cpu or cuda[:N], got {args.device!r}")
    if device.type == "cuda" and not torch.cuda.is_available():
        raise UsageError("--device cuda requested but CUDA is not available")
    if args.write:
        check_writable(args.manifest, "--manifest")
        manifest = load_golden(args.manifest) if args.manifest.exists() else {"schema": GOLDEN_SCHEMA, "cases": {}}
    else:
        manifest = load_golden(args.manifest)
    manifest["schema"] = GOLDEN_SCHEMA
    manifest["profile"] = LayerContract(hidden=1).numeric_profile
    stale = 0
    for case in cases:
        start = time.perf_counter()
        row = golden_row(case, oracle_trace(case, args.device))
        diffs = row_differences(manifest["cases"].get(case.name), row)
        seconds = time.perf_counter() - start
        status = "same" if not diffs else ("written" if args.write else "DIFFERS: " + ", ".join(diffs))
        print(f"{case.name:16s} {len(row['boundaries']):3d} boundaries  {seconds:6.2f}s  {status}", flush=True)
        stale += bool(diffs)
        manifest["cases"][case.name] = row
    if args.write:
        manifest["cases"] = {name: manifest["cases"][name] for name in CASES_BY_NAME if name in manifest["cases"]}
        write_atomic(args.manifest, json.dumps(manifest, indent=1, sort_keys=False) + "\n", "--manifest")
        print(f"wrote {args.manifest}")
        return 0
    return 1 if stale else 0
