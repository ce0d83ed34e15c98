"""The names everyone relies on: provider operators and site boundaries, in one place; and how a
boundary tensor is hashed and compared (sha256 of raw little-endian bytes; ulp distance).

A boundary name is `<pass>.<operator>.<tensor>`. Boundaries are listed in execution order, so the
first diverging boundary of a trace is the earliest point where two computations part.
"""

from __future__ import annotations

import hashlib
import sys
from dataclasses import dataclass

import torch

from rl_engine.mhc.contract import LayerContract

# The provider protocol: a provider implements these functions with the oracle's signatures.
OPERATORS = (
    "fp32_gemm_rms_fwd", "fp32_gemm_rms_bwd",
    "controller_affine_fwd", "controller_affine_bwd",
    "hc_split_sinkhorn_fwd", "hc_split_sinkhorn_bwd",
    "mhc_pre_fwd", "mhc_pre_bwd",
    "rmsnorm_residual_fwd", "rmsnorm_residual_bwd",
    "mhc_pre_rmsnorm_fwd", "mhc_pre_rmsnorm_bwd",  # fused_pre_norm only
    "mhc_post_fwd", "mhc_post_bwd",
)
FUSED_OPERATORS = ("mhc_pre_rmsnorm_fwd", "mhc_pre_rmsnorm_bwd")
FUSED_REPLACES = ("mhc_pre_fwd", "mhc_pre_bwd", "rmsnorm_residual_fwd", "rmsnorm_residual_bwd")


@dataclass(frozen=True)
class Boundary:
    name: str
    per_token: bool = True  # dim 0 is the token: must be batch invariant
    unfused_only: bool = False  # internal to the fused operator, so absent under fused_pre_norm
    mixer_grad: bool = False  # gradient of a mixer parameter, absent under mixer_frozen


BOUNDARIES = (
    Boundary("fwd.gemm_rms.p"),
    Boundary("fwd.gemm_rms.r"),
    Boundary("fwd.affine.h"),
    Boundary("fwd.sinkhorn.h_pre"),
    Boundary("fwd.sinkhorn.h_post"),
    Boundary("fwd.sinkhorn.h_res"),
    Boundary("fwd.pre.u"),
    Boundary("fwd.norm.y"),
    Boundary("fwd.sublayer.o"),
    Boundary("fwd.post.out"),
    Boundary("bwd.post.d_o"),
    Boundary("bwd.post.d_streams"),
    Boundary("bwd.post.d_h_post"),
    Boundary("bwd.post.d_h_res"),
    Boundary("bwd.sublayer.d_y"),
    Boundary("bwd.norm.d_u", unfused_only=True),
    Boundary("bwd.norm.d_gamma", per_token=False),
    Boundary("bwd.pre.d_streams"),
    Boundary("bwd.pre.d_h_pre"),
    Boundary("bwd.sinkhorn.d_h"),
    Boundary("bwd.affine.d_p"),
    Boundary("bwd.affine.d_r"),
    Boundary("bwd.affine.d_alpha", per_token=False, mixer_grad=True),
    Boundary("bwd.affine.d_bias", per_token=False, mixer_grad=True),
    Boundary("bwd.gemm_rms.d_streams"),
    Boundary("bwd.gemm_rms.d_phi", per_token=False, mixer_grad=True),
    Boundary("bwd.site.d_streams"),
)
BOUNDARY_NAMES = tuple(b.name for b in BOUNDARIES)


def boundaries_for(contract: LayerContract) -> tuple[Boundary, ...]:
    """The boundaries a site under `contract` produces, in execution order."""
    return tuple(
        b for b in BOUNDARIES
        if not (b.unfused_only and contract.fusion_mode != "unfused")
        and not (b.mixer_grad and contract.trainability != "full")
    )


def operators_for(contract: LayerContract) -> tuple[str, ...]:
    """The operators a site under `contract` calls."""
    skip = FUSED_REPLACES if contract.fusion_mode == "fused_pre_norm" else FUSED_OPERATORS
    return tuple(n for n in OPERATORS if n not in skip)


def tensor_bytes(t: torch.Tensor) -> bytes:
    """Raw little-endian bytes of a tensor in row-major order (the hash input)."""
    if sys.byteorder != "little":
        raise RuntimeError("golden hashes are defined over little-endian bytes")
    return t.detach().contiguous().cpu().reshape(-1).view(torch.uint8).numpy().tobytes()


def tensor_sha256(t: torch.Tensor) -> str:
    return hashlib.sha256(tensor_bytes(t)).hexdigest()


def describe(t: torch.Tensor) -> dict:
    """{shape, dtype, sha256}: one golden row."""
    return {"shape": list(t.shape), "dtype": str(t.dtype).removeprefix("torch."), "sha256": tensor_sha256(t)}


_INT_VIEW = {torch.float32: (torch.int32, 0x7FFFFFFF), torch.bfloat16: (torch.int16, 0x7FFF)}


def _ordered(t: torch.Tensor) -> torch.Tensor:
    """Map float bits to integers whose order is the float order (±0 both map to 0)."""
    int_dtype, mask = _INT_VIEW[t.dtype]
    i = t.contiguous().view(int_dtype).to(torch.int64)
    return torch.where(i < 0, -(i & mask), i)


def compare(a: torch.Tensor, b: torch.Tensor) -> dict:
    """Byte equality and, where they differ, the worst element: max abs error and max ulp distance."""
    if a.shape != b.shape or a.dtype != b.dtype:
        return {"equal": False, "reason": f"shape/dtype {list(b.shape)} {b.dtype} != {list(a.shape)} {a.dtype}"}
    a, b = a.detach().cpu(), b.detach().cpu()
    if torch.equal(a.contiguous().view(_INT_VIEW[a.dtype][0]), b.contiguous().view(_INT_VIEW[b.dtype][0])):
        return {"equal": True}
    diff = (a.double() - b.double()).abs()
    ulp = (_ordered(a) - _ordered(b)).abs()
    worst = int(torch.argmax(ulp.reshape(-1)))
    return {
        "equal": False,
        "mismatched": int((ulp != 0).sum()) + int((torch.isnan(a) != torch.isnan(b)).sum()),
        "max_abs_error": float(torch.nan_to_num(diff, nan=float("inf")).max()),
        "max_ulp": int(ulp.max()),
        "worst_index": [int(i) for i in torch.unravel_index(torch.tensor(worst), a.shape)] if a.dim() else [],
    }
