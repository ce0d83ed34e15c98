"""The mHC provider protocol, the reference and stub providers, and provider resolution.

A provider is a class whose instances expose
  numeric_profile: str          "strict-fp32-v1" promises the oracle's bytes and is judged bitwise; another
                                profile is judged by the tolerance the contract names for it
                                (`contract.JUDGMENTS`); a profile the contract does not name fails;
  capabilities() -> dict        {"fusion_modes": [...], "trainability": [...], "placements": [...]};
  one method per name in `trace.OPERATORS`, with the oracle function's signature and return values.
`check_capability` rejects a contract the provider does not declare before any operator runs; a
missing declaration counts as declaring nothing (fail closed).
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable

from rl_engine.errors import UsageError
from rl_engine.loading import construct, load_object
from rl_engine.mhc import oracle
from rl_engine.mhc.contract import FUSION_MODES, PLACEMENTS, TRAINABILITY, LayerContract
from rl_engine.mhc.numerics import PROFILE
from rl_engine.mhc.trace import OPERATORS, operators_for

CAPABILITY_FIELDS = {"fusion_modes": "fusion_mode", "trainability": "trainability", "placements": "placement"}


@runtime_checkable
class MHCProvider(Protocol):
    numeric_profile: str

    def capabilities(self) -> dict: ...


class ReferenceProvider:
    """The oracle itself, as a provider: declares every mode the oracle implements."""

    numeric_profile = PROFILE

    def capabilities(self) -> dict:
        return {"fusion_modes": list(FUSION_MODES), "trainability": list(TRAINABILITY),
                "placements": list(PLACEMENTS)}


for _name in OPERATORS:
    setattr(ReferenceProvider, _name, staticmethod(getattr(oracle, _name)))


class ProviderUnavailable(NotImplementedError):
    """Raised by every StubProvider operator."""


class StubProvider:
    """Fail-closed placeholder: declares no capability, and every operator raises."""

    numeric_profile = PROFILE

    def capabilities(self) -> dict:
        return {"fusion_modes": [], "trainability": [], "placements": []}


def _unavailable(name: str):
    def operator(self, *args, **kwargs):
        raise ProviderUnavailable(f"StubProvider does not implement {name}")
    operator.__name__ = name
    return operator


for _name in OPERATORS:
    setattr(StubProvider, _name, _unavailable(_name))


def check_capability(provider, contract: LayerContract) -> None:
    """Raise UsageError (one line) unless `provider` declares the contract's fusion mode, trainability
    and placement, and implements every operator the contract needs. Runs no operator."""
    name = getattr(provider, "class_name", None) or type(provider).__name__  # an isolated provider's own class
    try:
        declared = provider.capabilities()
    except KeyboardInterrupt:
        raise
    except BaseException as exc:  # noqa: BLE001 - a provider that cannot say what it does declares nothing
        raise UsageError(f"{name}.capabilities() raised {type(exc).__name__}: {exc}") from exc
    if not isinstance(declared, dict):
        raise UsageError(f"{name}.capabilities() must return a dict, got {type(declared).__name__}")
    for key, field in CAPABILITY_FIELDS.items():
        want, values = getattr(contract, field), declared.get(key)
        if want not in (values if isinstance(values, (list, tuple, set, frozenset)) else ()):  # a str is no list
            raise UsageError(f"{name} does not declare {field} {want!r} "
                             f"(capabilities {key}: {declared.get(key)!r})")
    missing = [n for n in operators_for(contract) if not callable(getattr(provider, n, None))]
    if missing:
        raise UsageError(f"{name} lacks operator(s) {', '.join(missing)}")


def check_spec(spec: str) -> str:
    """`spec` has the form 'package.module:ClassName' (nothing is imported); else UsageError."""
    module_name, sep, class_name = spec.partition(":")
    if not sep or not module_name or not class_name:
        raise UsageError(f"provider must be 'module:Class', got {spec!r}")
    return spec


def resolve_provider(spec: str):
    """'package.module:ClassName' → an instance. Any failure is a UsageError with one line."""
    check_spec(spec)
    provider = construct(load_object(spec, "provider"), spec, "provider")
    if not isinstance(provider, MHCProvider):
        raise UsageError(f"{spec} is not an mHC provider (needs numeric_profile and capabilities())")
    return provider
