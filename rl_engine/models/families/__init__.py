"""The model families, one module each: a module here that defines `FAMILY` is a family.

Adding a family is adding a file; the named configs (`--model NAME`) are the families' `configs`.
"""

from __future__ import annotations

import importlib
import pkgutil

from rl_engine.models.config import Family, ModelConfig


def _discover() -> dict[str, Family]:
    families = {}
    for info in sorted(pkgutil.iter_modules(__path__), key=lambda m: m.name):
        family = getattr(importlib.import_module(f"{__name__}.{info.name}"), "FAMILY", None)
        if isinstance(family, Family):
            families[family.name] = family
    return families


FAMILIES: dict[str, Family] = _discover()
CONFIGS: dict[str, ModelConfig] = {c.name: c for f in FAMILIES.values() for c in f.configs}
if len(CONFIGS) != sum(len(f.configs) for f in FAMILIES.values()):
    raise ValueError("two families name a config the same")


def get_config(name: str) -> ModelConfig:
    if name not in CONFIGS:
        raise ValueError(f"model: expected one of {sorted(CONFIGS)}, got {name!r}")
    return CONFIGS[name]


def get_family(name: str) -> Family:
    if name not in FAMILIES:
        raise ValueError(f"family: expected one of {sorted(FAMILIES)}, got {name!r}")
    return FAMILIES[name]


def family_for_model_type(model_type) -> Family | None:
    """The family whose HF model_type this is, or None."""
    return next((f for f in FAMILIES.values() if model_type in f.model_types), None)
