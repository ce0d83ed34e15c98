"""The layer contract of one mHC site, its inputs and parameters, with validation.

`LayerContract` pins every choice that changes the bytes: geometry, epsilons and where the RMS eps
sits, the reduction lane count, fusion mode, trainability, placement and numeric profile. Its
fingerprint (sha256 of the canonical JSON of every field) goes into every report and golden row.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from dataclasses import dataclass

import torch

from rl_engine.mhc.numerics import PROFILE

SCHEMA_VERSION = "mhc-contract-v1"
FUSION_MODES = ("unfused", "fused_pre_norm")  # unfused is canonical: every boundary observable
TRAINABILITY = ("full", "mixer_frozen")  # mixer_frozen: no gradients for phi, alpha, bias
PLACEMENTS = ("replicated", "tp_sharded", "cp_token_sharded")  # the last two: rl_engine/parallel
RMS_EPS_PLACEMENTS = ("inside", "outside")  # 1/sqrt(s/K + eps) (DeepSeek-V4) or 1/(sqrt(s/K) + eps)
PRODUCTION_HIDDEN = {"deepseek-v4-flash": 4096, "deepseek-v4-pro": 7168}

# How acceptance judges a provider's boundaries, keyed by the numeric profile the provider declares.
# The contract decides, never the candidate: a profile not named here (None, "", a typo) fails.
# allclose: |cand − ref| ≤ atol_rel · max|ref| + rtol · |ref| elementwise, per boundary; NaN/Inf
# where the oracle is finite always fails; the golden hashes don't apply.
JUDGMENTS = {
    PROFILE: {"mode": "bitwise",
              "rationale": "the profile promises the oracle's bytes: every boundary equals the oracle and the "
                           "golden hashes"},
    "fp32-relaxed": {"mode": "allclose", "rtol": 1.6e-2, "atol_rel": 1e-3,
                     "rationale": "fp32 with library exp/sqrt/division and its own reduction order: rtol is four "
                                  "bf16 ulps, since a flipped bf16 rounding of an activation feeds every later "
                                  "boundary; atol is relative to the boundary's own scale because gradients are "
                                  "sums with cancellation"},
}


def judgment_for(profile) -> dict:
    """{"profile", "mode", ...} for a declared numeric profile; ValueError (one line) if the contract
    names no judgment for it."""
    if profile is None or (isinstance(profile, str) and not profile.strip()):
        raise ValueError(f"provider declares no numeric_profile (got {profile!r}); "
                         f"the contract knows {sorted(JUDGMENTS)}")
    if not isinstance(profile, str) or profile not in JUDGMENTS:
        raise ValueError(f"provider declares numeric_profile {profile!r}, which the contract does not know "
                         f"(known: {sorted(JUDGMENTS)})")
    return {"profile": profile, **JUDGMENTS[profile]}


@dataclass(frozen=True)
class LayerContract:
    hidden: int
    hc_mult: int = 4
    controller_n: int = 24
    sinkhorn_iters: int = 20
    mhc_eps: float = 1e-6
    rmsnorm_eps: float = 1e-6
    rms_eps_placement: str = "inside"
    lanes: int = 64
    fusion_mode: str = "unfused"
    trainability: str = "full"
    placement: str = "replicated"
    numeric_profile: str = PROFILE
    schema_version: str = SCHEMA_VERSION

    def __post_init__(self):
        self.validate()

    @property
    def k(self) -> int:
        """Length of the flattened streams x = vec(X): hc_mult · hidden."""
        return self.hc_mult * self.hidden

    def validate(self) -> None:
        if not isinstance(self.hidden, int) or self.hidden < 1:
            raise ValueError(f"hidden must be a positive int, got {self.hidden!r}")
        if self.hc_mult != 4:
            raise ValueError(f"hc_mult must be 4 (the four-term tree is pinned), got {self.hc_mult}")
        if self.controller_n != self.hc_mult * (2 + self.hc_mult):
            raise ValueError(f"controller_n must be hc_mult·(2 + hc_mult) = 24, got {self.controller_n}")
        if self.sinkhorn_iters < 1:
            raise ValueError(f"sinkhorn_iters must be ≥ 1, got {self.sinkhorn_iters}")
        for name in ("mhc_eps", "rmsnorm_eps"):
            value = getattr(self, name)
            if not (isinstance(value, float) and value > 0.0):
                raise ValueError(f"{name} must be a positive float, got {value!r}")
        if self.lanes < 1 or self.lanes & (self.lanes - 1):
            raise ValueError(f"lanes must be a power of two, got {self.lanes}")
        for name, allowed in (("rms_eps_placement", RMS_EPS_PLACEMENTS), ("fusion_mode", FUSION_MODES),
                              ("trainability", TRAINABILITY), ("placement", PLACEMENTS)):
            if getattr(self, name) not in allowed:
                raise ValueError(f"{name} must be one of {allowed}, got {getattr(self, name)!r}")
        if self.schema_version != SCHEMA_VERSION:
            raise ValueError(f"schema_version must be {SCHEMA_VERSION!r}, got {self.schema_version!r}")

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    def fingerprint(self) -> str:
        """sha256 over the canonical JSON of every field (floats by repr, so 1e-6 ≠ 1.0000001e-6)."""
        fields = {k: repr(v) if isinstance(v, float) else v for k, v in self.to_dict().items()}
        return hashlib.sha256(json.dumps(fields, sort_keys=True).encode()).hexdigest()

    def assert_production(self, model: str | None = None) -> None:
        """Raise ValueError unless this is DeepSeek-V4-Flash (hidden 4096) or -Pro (7168) geometry."""
        expected = PRODUCTION_HIDDEN if model is None else {model: PRODUCTION_HIDDEN[model]}
        problems = []
        if self.hidden not in expected.values():
            problems.append(f"hidden {self.hidden} not in {sorted(expected.values())}")
        for name, want in (("hc_mult", 4), ("controller_n", 24), ("sinkhorn_iters", 20),
                           ("mhc_eps", 1e-6), ("rmsnorm_eps", 1e-6)):
            if getattr(self, name) != want:
                problems.append(f"{name} {getattr(self, name)} != {want}")
        if problems:
            raise ValueError("not DeepSeek-V4 production geometry: " + "; ".join(problems))


def _check(name: str, t: torch.Tensor, shape: tuple, dtype: torch.dtype) -> None:
    if not isinstance(t, torch.Tensor):
        raise ValueError(f"{name} must be a tensor of shape {list(shape)} {dtype}, got {type(t).__name__}")
    if tuple(t.shape) != tuple(shape) or t.dtype != dtype:
        raise ValueError(f"{name} must have shape {list(shape)} and dtype {dtype}, "
                         f"got {list(t.shape)} {t.dtype}")
    if not bool(torch.isfinite(t.float()).all()):
        raise ValueError(f"{name} must be finite")


@dataclass(frozen=True)
class ResidualBatch:
    """The four residual streams of T tokens, [T, hc_mult, hidden] bf16, and the incoming gradient of
    the site's output streams (same shape, bf16). Rows are tokens: mHC is per token."""

    streams: torch.Tensor
    grad_out: torch.Tensor

    @property
    def tokens(self) -> int:
        return self.streams.shape[0]

    def validate(self, contract: LayerContract) -> None:
        if not isinstance(self.streams, torch.Tensor) or self.streams.dim() != 3 or self.streams.shape[0] < 1:
            raise ValueError("streams must be a [T, hc_mult, hidden] bf16 tensor with T ≥ 1")
        shape = (self.streams.shape[0], contract.hc_mult, contract.hidden)
        _check("streams", self.streams, shape, torch.bfloat16)
        _check("grad_out", self.grad_out, shape, torch.bfloat16)

    def row(self, t: int) -> ResidualBatch:
        """Token t alone (a batch of one), for batch-invariance checks."""
        return ResidualBatch(self.streams[t : t + 1].clone(), self.grad_out[t : t + 1].clone())

    def to(self, device) -> ResidualBatch:
        return ResidualBatch(self.streams.to(device), self.grad_out.to(device))


@dataclass(frozen=True)
class ControllerParams:
    """phi [controller_n, K] fp32; alpha [3] fp32 = (α_pre, α_post, α_res); bias [controller_n] fp32."""

    phi: torch.Tensor
    alpha: torch.Tensor
    bias: torch.Tensor

    def validate(self, contract: LayerContract) -> None:
        _check("phi", self.phi, (contract.controller_n, contract.k), torch.float32)
        _check("alpha", self.alpha, (3,), torch.float32)
        _check("bias", self.bias, (contract.controller_n,), torch.float32)

    def to(self, device) -> ControllerParams:
        return ControllerParams(self.phi.to(device), self.alpha.to(device), self.bias.to(device))


@dataclass(frozen=True)
class NormParams:
    """RMSNorm weight gamma [hidden] fp32, and the sublayer stand-in's per-channel scale [hidden] fp32.

    The site composition needs *some* sublayer between mhc_pre/RMSNorm and mhc_post so that gradients
    flow through every operator; the oracle uses o = bf16(y · sublayer_scale), which is no provider
    operator (attention and MLP are other ops' business)."""

    gamma: torch.Tensor
    sublayer_scale: torch.Tensor

    def validate(self, contract: LayerContract) -> None:
        _check("gamma", self.gamma, (contract.hidden,), torch.float32)
        _check("sublayer_scale", self.sublayer_scale, (contract.hidden,), torch.float32)

    def to(self, device) -> NormParams:
        return NormParams(self.gamma.to(device), self.sublayer_scale.to(device))
