"""Launch settings every strict-fp32 kernel shares."""

from rl_engine.kernels.ops.triton.runtime import interpreting
from rl_engine.mhc.contract import LayerContract

# Under the CPU interpreter every program costs Python overhead: fewer, larger blocks. Block sizes never
# change the bits (every reduction order is fixed by the contract), only the speed.
INTERPRET = interpreting()

# No FMA contraction: a·b + c must round twice, as in the oracle (DESIGN.md, strict fp32 profile).
STRICT = {"enable_fp_fusion": False}


def log2(n: int) -> int:
    """log2 of a power of two (the contract validates lanes; block sizes are ours)."""
    if n < 1 or n & (n - 1):
        raise ValueError(f"expected a power of two, got {n}")
    return n.bit_length() - 1


def lanes(contract: LayerContract) -> tuple[int, int]:
    """(L, log2 L) of the contract's lane fold."""
    return contract.lanes, log2(contract.lanes)
