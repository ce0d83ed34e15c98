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

# What each operator returns, in order: (name, shape, dtype). Shape symbols: T tokens, n hc_mult, C hidden,
# N controller_n, K = n·C. Mixer gradients (MIXER_GRADS) are None under mixer_frozen and unchecked there.
_F32, _BF16 = torch.float32, torch.bfloat16
OPERATOR_OUTPUTS = {
    "fp32_gemm_rms_fwd": (("p", "T N", _F32), ("r", "T", _F32)),
    "fp32_gemm_rms_bwd": (("d_streams", "T n C", _F32), ("d_phi", "N K", _F32)),
    "controller_affine_fwd": (("h", "T N", _F32),),
    "controller_affine_bwd": (("d_p", "T N", _F32), ("d_r", "T", _F32), ("d_alpha", "3", _F32),
                              ("d_bias", "N", _F32)),
    "hc_split_sinkhorn_fwd": (("h_pre", "T n", _F32), ("h_post", "T n", _F32), ("h_res", "T n n", _F32)),
    "hc_split_sinkhorn_bwd": (("d_h", "T N", _F32),),
    "mhc_pre_fwd": (("u", "T C", _BF16),),
    "mhc_pre_bwd": (("d_streams", "T n C", _F32), ("d_h_pre", "T n", _F32)),
    "rmsnorm_residual_fwd": (("y", "T C", _BF16), ("h", "T C", _BF16)),
    "rmsnorm_residual_bwd": (("d_x", "T C", _F32), ("d_gamma", "C", _F32)),
    "mhc_pre_rmsnorm_fwd": (("y", "T C", _BF16), ("u", "T C", _BF16)),
    "mhc_pre_rmsnorm_bwd": (("d_streams", "T n C", _F32), ("d_h_pre", "T n", _F32), ("d_gamma", "C", _F32)),
    "mhc_post_fwd": (("out", "T n C", _BF16),),
    "mhc_post_bwd": (("d_o", "T C", _F32), ("d_streams", "T n C", _F32), ("d_h_post", "T n", _F32),
                     ("d_h_res", "T n n", _F32)),
}
MIXER_GRADS = ("d_phi", "d_alpha", "d_bias")


def check_outputs(name: str, result, contract: LayerContract, tokens: int, device: torch.device):
    """Return `result` if it is what operator `name` must return (count, and each output's shape, dtype and
    device); else raise ValueError naming the operator and the output."""
    specs = OPERATOR_OUTPUTS[name]
    if len(specs) == 1:
        values = (result,)
    elif not isinstance(result, (tuple, list)):
        raise ValueError(f"{name} returned {_what(result)}, expected {len(specs)} values "
                         f"({', '.join(s[0] for s in specs)})")
    else:
        values = tuple(result)
        if len(values) != len(specs):
            raise ValueError(f"{name} returned {len(values)} values, expected {len(specs)} "
                             f"({', '.join(s[0] for s in specs)})")
    dims = {"T": tokens, "n": contract.hc_mult, "C": contract.hidden, "N": contract.controller_n, "K": contract.k}
    for i, ((label, symbols, dtype), value) in enumerate(zip(specs, values)):
        if label in MIXER_GRADS and contract.trainability != "full":
            continue  # discarded by the site
        shape = [dims[s] if s in dims else int(s) for s in symbols.split()]
        if not (isinstance(value, torch.Tensor) and list(value.shape) == shape and value.dtype == dtype
                and value.device == device):
            raise ValueError(f"{name} output {i} ({label}): expected [{', '.join(symbols.split())}] = {shape} "
                             f"{str(dtype).removeprefix('torch.')} on {device}, got {_what(value)}")
    return result


def _what(value) -> str:
    if isinstance(value, torch.Tensor):
        return f"{list(value.shape)} {str(value.dtype).removeprefix('torch.')} on {value.device}"
    if isinstance(value, (tuple, list)):
        return f"a {type(value).__name__} of {len(value)} values"
    return "None" if value is None else f"a {type(value).__name__}"


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
    """Byte equality and, where they differ, how: `mismatched` counts elements whose bits differ (a NaN
    against a number is one element, counted also in `nan_mismatched`); max abs error; max ulp distance
    over the elements where neither is NaN; the worst element (the first NaN mismatch, else the max ulp)."""
    if a.shape != b.shape or a.dtype != b.dtype:
        return {"equal": False, "reason": f"shape/dtype {list(b.shape)} {b.dtype} != {list(a.shape)} {a.dtype}"}
    a, b = a.detach().cpu(), b.detach().cpu()
    int_dtype = _INT_VIEW[a.dtype][0]
    differs = a.contiguous().view(int_dtype) != b.contiguous().view(int_dtype)
    if not bool(differs.any()):
        return {"equal": True}
    diff = (a.double() - b.double()).abs()
    either_nan = torch.isnan(a) | torch.isnan(b)
    nan_mismatch = torch.isnan(a) != torch.isnan(b)
    ulp = torch.where(either_nan, 0, (_ordered(a) - _ordered(b)).abs())
    flat = nan_mismatch.reshape(-1)
    worst = int(torch.argmax(flat.to(torch.uint8))) if bool(flat.any()) else int(torch.argmax(ulp.reshape(-1)))
    return {
        "equal": False,
        "mismatched": int(differs.sum()),
        "nan_mismatched": int(nan_mismatch.sum()),
        "max_abs_error": float(torch.nan_to_num(diff, nan=float("inf")).max()),
        "max_ulp": int(ulp.max()),
        "worst_index": [int(i) for i in torch.unravel_index(torch.tensor(worst), a.shape)] if a.dim() else [],
    }
