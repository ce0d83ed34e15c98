"""TritonProvider: the mHC operators as Triton kernels, promising the strict-fp32 oracle's bytes.

Each operator has the oracle's signature and returns the oracle's shapes and dtypes (see
`rl_engine.mhc.oracle` and `trace.OPERATORS`); the kernels are in `rl_engine.mhc.kernels`, one file per
operator, all launched with `enable_fp_fusion=False`.

Declared capabilities: both fusion modes (fused_pre_norm has a fused forward kernel), both
trainabilities, replicated placement. Not covered, and refused with a ValueError naming the field:
contracts whose lane count is below 32 (the kernels tree the 24 controller outputs in one level of
lanes, which the oracle's lane fold matches only when lanes ≥ 24), or whose hc_mult/controller_n differ
from 4/24 (the contract already pins those).
"""

from __future__ import annotations

from rl_engine.mhc.contract import FUSION_MODES, PLACEMENTS, TRAINABILITY, LayerContract
from rl_engine.mhc.kernels import (
    controller_affine,
    fp32_gemm_rms,
    hc_split_sinkhorn,
    mhc_post,
    mhc_pre,
    mhc_pre_rmsnorm,
    rmsnorm_residual,
)
from rl_engine.mhc.numerics import PROFILE
from rl_engine.mhc.trace import OPERATORS

MIN_LANES = 32

_KERNEL_MODULES = (fp32_gemm_rms, controller_affine, hc_split_sinkhorn, mhc_pre, rmsnorm_residual,
                   mhc_pre_rmsnorm, mhc_post)


def _supported(contract: LayerContract) -> None:
    if contract.lanes < MIN_LANES:
        raise ValueError(f"contract.lanes must be ≥ {MIN_LANES} for TritonProvider, got {contract.lanes}")


class TritonProvider:
    numeric_profile = PROFILE

    def capabilities(self) -> dict:
        return {"fusion_modes": list(FUSION_MODES), "trainability": list(TRAINABILITY),
                "placements": list(PLACEMENTS)}


def _operator(name: str):
    kernel_fn = next(getattr(m, name) for m in _KERNEL_MODULES if hasattr(m, name))

    def operator(self, *args):
        _supported(args[-1])
        return kernel_fn(*args)

    operator.__name__ = name
    operator.__doc__ = kernel_fn.__doc__
    return operator


for _name in OPERATORS:
    setattr(TritonProvider, _name, _operator(_name))
