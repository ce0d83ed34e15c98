"""The workload manifest: what the invariance and parity harness runs, pinned by hashes.

manifest.json holds seeds, shapes, the configuration matrix and hashes, never token ids: the
fixtures are generated from the seed for each model's vocabulary, and their hash is recomputed and
checked against the pinned one on load. The model's config fingerprint is checked the same way; the
synthetic weight hash is pinned where the weights are drawn on the CPU (the tiny model).
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path

import torch

from rl_engine.models.config import ModelConfig
from rl_engine.workload.layouts import Sample

MANIFEST_PATH = Path(__file__).with_name("manifest.json")
SCHEMA = "rl_engine.workload/v1"
LAYOUTS = ("packed", "pad_right", "pad_left")
BATCHINGS = ("bn", "b1")


class ManifestError(ValueError):
    """A manifest that is malformed or whose pinned hashes do not match what it generates."""


@dataclass(frozen=True)
class Cell:
    """One configuration of the matrix: batching, layout, chunked prefill, sample permutation."""

    name: str
    batching: str  # "bn": all samples in one batch; "b1": one sample per forward
    layout: str  # "packed" | "pad_right" | "pad_left"
    chunked: bool = False
    permuted: bool = False


@dataclass(frozen=True)
class Workload:
    model: str
    samples: list
    permutation: list
    chunk_size: int
    pad_id: int
    cells: list  # [Cell]; cells[0] is the canonical one
    parity: list  # infer batchings: "b1", "bn"
    weight_seed: int
    weight_hash: str | None  # pinned for CPU-drawn synthetic weights only
    fixture_hash: str

    @property
    def canonical(self) -> Cell:
        return self.cells[0]

    def lengths(self) -> dict[int, int]:
        return {s.sample_id: s.length for s in self.samples}


def generate_samples(spec: dict, vocab_size: int) -> list[Sample]:
    """Token ids in [1, vocab) (0 is the pad id) from the fixture seed; prompts of `prompt_len`."""
    gen = torch.Generator().manual_seed(spec["seed"])
    samples = []
    for sid, length in enumerate(spec["lengths"]):
        if length <= spec["prompt_len"]:
            raise ManifestError(f"fixtures.lengths: sample {sid} length {length} leaves no completion token")
        ids = torch.randint(1, vocab_size, (length,), generator=gen)
        samples.append(Sample(sid, tuple(ids.tolist()), spec["prompt_len"]))
    return samples


def fixture_hash(samples: list[Sample]) -> str:
    """sha256 of the canonical JSON of the tokens, prompt lengths and completion loss masks."""
    payload = [
        {"id": s.sample_id, "tokens": list(s.token_ids), "loss_mask": [int(p >= s.prompt_len) for p in range(s.length)]}
        for s in samples
    ]
    return hashlib.sha256(json.dumps(payload, sort_keys=True).encode()).hexdigest()


def _require(raw: dict, key: str, where: str, kind: type | None = None):
    if key not in raw:
        raise ManifestError(f"{where}: missing key {key!r}")
    if kind is not None and not isinstance(raw[key], kind):
        raise ManifestError(f"{where}.{key}: expected a JSON {_JSON_NAMES[kind]}, got {type(raw[key]).__name__}")
    return raw[key]


_JSON_NAMES = {dict: "object", list: "list"}


def load_workload(config: ModelConfig, path: Path | None = None, *, pinned: bool = True) -> Workload:
    """The workload for a named (full-depth) model config; its fingerprint must match the pinned one.

    `pinned=False` is for a config read from a config.json, which the manifest cannot know: the
    fixtures are generated for its vocabulary and their hash reported, nothing is checked against a
    pin, and synthetic weights are drawn from the fixture seed. Every ManifestError is one line that
    names the file.
    """
    path = Path(path) if path is not None else MANIFEST_PATH
    try:
        raw = json.loads(path.read_text())
    except (OSError, ValueError) as exc:  # ValueError: invalid JSON or bytes that are not UTF-8
        raise ManifestError(f"manifest {path}: cannot read ({' '.join(str(exc).split())})") from None
    try:
        return _parse(raw, config, pinned)
    except ManifestError as exc:
        raise ManifestError(f"manifest {path}: {exc}") from None


def _parse(raw, config: ModelConfig, pinned: bool = True) -> Workload:
    model_name = config.name
    if not isinstance(raw, dict):
        raise ManifestError(f"expected a JSON object, got a {type(raw).__name__}")
    if raw.get("schema") != SCHEMA:
        raise ManifestError(f"schema {raw.get('schema')!r}, expected {SCHEMA!r}")
    spec = _require(raw, "fixtures", "manifest", dict)
    if pinned:
        pins = _require(_require(raw, "models", "manifest", dict), model_name, "manifest.models", dict)
    else:
        pins = {"config_fingerprint": config.fingerprint(), "weight_seed": _require(spec, "seed", "fixtures")}
    if pins.get("config_fingerprint") != config.fingerprint():
        raise ManifestError(
            f"models.{model_name}.config_fingerprint {pins.get('config_fingerprint')!r} "
            f"does not match the config ({config.fingerprint()})"
        )
    try:
        samples = generate_samples(spec, config.vocab_size)
    except (KeyError, TypeError, RuntimeError) as exc:  # a missing key, or a seed/length of the wrong type
        raise ManifestError(f"fixtures: cannot generate samples ({type(exc).__name__}: {exc})") from None
    got = fixture_hash(samples)
    if pinned and got != _require(pins, "fixture_hash", f"models.{model_name}"):
        raise ManifestError(f"models.{model_name}.fixture_hash: pinned {pins['fixture_hash']}, generated {got}")
    permutation = _require(spec, "permutation", "fixtures", list)
    if sorted(permutation) != list(range(len(samples))):
        raise ManifestError(f"fixtures.permutation: expected a permutation of 0..{len(samples) - 1}")
    cells = []
    for c in _require(raw, "matrix", "manifest", list):
        try:
            cell = Cell(**c)
        except TypeError:  # not an object, or a key that Cell lacks / a missing name, batching or layout
            raise ManifestError(f"matrix: cell {c!r} is not an object with keys name, batching, layout"
                                "[, chunked, permuted]") from None
        if cell.batching not in BATCHINGS or cell.layout not in LAYOUTS:
            raise ManifestError(f"matrix cell {cell.name}: batching must be in {BATCHINGS}, layout in {LAYOUTS}")
        if cell.chunked and cell.layout != "pad_right":
            raise ManifestError(f"matrix cell {cell.name}: chunked prefill needs the pad_right layout")
        cells.append(cell)
    if not cells or cells[0].layout != "packed" or cells[0].batching != "bn":
        raise ManifestError("matrix: the first (canonical) cell must be the packed BN layout")
    parity = _require(raw, "parity", "manifest", list)
    if not set(parity) <= set(BATCHINGS):
        raise ManifestError(f"parity: expected infer batchings from {BATCHINGS}, got {parity}")
    return Workload(
        model=model_name,
        samples=samples,
        permutation=permutation,
        chunk_size=_require(spec, "chunk_size", "fixtures"),
        pad_id=spec.get("pad_id", 0),
        cells=cells,
        parity=parity,
        weight_seed=_require(pins, "weight_seed", f"models.{model_name}"),
        weight_hash=pins.get("weight_hash"),
        fixture_hash=got,
    )
