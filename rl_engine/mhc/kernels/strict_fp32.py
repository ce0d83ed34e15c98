"""Device functions of the strict-fp32-v1 profile: `rl_engine.mhc.numerics` written in Triton.

Same constants, same parenthesisation, one IEEE round-to-nearest-even operation per `+ − × ÷`
(kernels launch with `enable_fp_fusion=False`, so no multiply-add contracts into an FMA); division
is `div_rn`, square root `sqrt_rn`; 2^n is built from the exponent bits, as in the oracle.

Reductions. The oracle's `lane_sum` is a lane fold followed by a pairwise tree over the lanes. A
kernel holds the lanes as the last axis of an accumulator `[R, L]`, adds one `[R, L]` tile of
consecutive elements per step (tile s holds elements s·L + j, so lane j sees j, j+L, … in order),
and then calls `pairwise_tree`: each level reshapes `[R, n]` to `[R, n/2, 2]` and adds the two
halves of `tl.split`, i.e. (v0+v1), (v2+v3), … exactly the oracle's pairing. Lanes start at +0.0
and missing elements load as +0.0; the oracle instead starts each lane at its first element and adds
+0.0 once at the end. Both give the same bits: the two differ only in the sign of intermediate
zeros, which never changes a non-zero sum, and both results are +0.0 when the sum is zero. The same
argument makes a tree over n < L values padded with +0.0 to a power of two equal to the oracle's
tree with odd elements passed through.
"""

import triton
import triton.language as tl

from rl_engine.mhc import numerics

LOG2E = tl.constexpr(numerics.LOG2E)
EXP_C1 = tl.constexpr(numerics.EXP_C1)
EXP_C2 = tl.constexpr(numerics.EXP_C2)
P0 = tl.constexpr(numerics.EXP_POLY[0])
P1 = tl.constexpr(numerics.EXP_POLY[1])
P2 = tl.constexpr(numerics.EXP_POLY[2])
P3 = tl.constexpr(numerics.EXP_POLY[3])
P4 = tl.constexpr(numerics.EXP_POLY[4])
P5 = tl.constexpr(numerics.EXP_POLY[5])
EXP_N_MIN = tl.constexpr(float(numerics.EXP_N_MIN))
EXP_N_MAX = tl.constexpr(float(numerics.EXP_N_MAX))


@triton.jit
def exp(x):
    """numerics.exp: Cody–Waite reduction, degree-7 polynomial, exact 2^n from the exponent bits."""
    nan = x != x
    xc = tl.where(nan, 0.0, tl.minimum(tl.maximum(x, -100.0), 100.0))
    n = tl.floor(xc * LOG2E + 0.5)
    r = (xc - n * EXP_C1) - n * EXP_C2
    z = r * r
    p = P0 * r + P1
    p = p * r + P2
    p = p * r + P3
    p = p * r + P4
    p = p * r + P5
    p = ((p * z) + r) + 1.0
    n_int = tl.minimum(tl.maximum(n, EXP_N_MIN), 127.0).to(tl.int32)
    y = p * ((n_int + 127) << 23).to(tl.float32, bitcast=True)
    y = tl.where(n == EXP_N_MAX, y * 2.0, y)
    y = tl.where(n < EXP_N_MIN, 0.0, y)
    y = tl.where(n > EXP_N_MAX, float("inf"), y)
    return tl.where(nan, x, y)


@triton.jit
def div(a, b):
    """Correctly rounded a ÷ b (b broadcast to a's shape first: div_rn wants equal shapes)."""
    return tl.math.div_rn(a, tl.broadcast_to(b, a.shape))


@triton.jit
def rsqrt(x):
    """numerics.rsqrt: 1 ÷ sqrt_rn(x), two correctly rounded operations."""
    return tl.math.div_rn(tl.zeros_like(x) + 1.0, tl.math.sqrt_rn(x))


@triton.jit
def sigmoid(x):
    """numerics.sigmoid: q = n ÷ (e + 1) corrected by the rounding error of e + 1."""
    e = exp(-tl.abs(x))
    d = e + 1.0
    err = (d - 1.0) - e
    q = tl.math.div_rn(tl.where(x >= 0, 1.0, e), d)
    return q + q * tl.math.div_rn(err, d)


@triton.jit
def pairwise_tree(v, R: tl.constexpr, N: tl.constexpr, LOG2N: tl.constexpr):
    """[R, N] → [R]: the oracle's pairwise tree over the last axis (N = 2^LOG2N)."""
    for level in tl.static_range(LOG2N):
        a, b = tl.split(tl.reshape(v, [R, N >> (level + 1), 2]))
        v = a + b
    return tl.reshape(v, [R])


@triton.jit
def tree4_last(v, A: tl.constexpr, B: tl.constexpr):
    """[A, B, 4] → [A, B]: numerics.tree4 over the last axis, (v0 + v1) + (v2 + v3)."""
    return tl.reshape(pairwise_tree(tl.reshape(v, [A * B, 4]), A * B, 4, 2), [A, B])


@triton.jit
def tree4_middle(v, A: tl.constexpr, B: tl.constexpr):
    """[A, 4, B] → [A, B]: numerics.tree4 over the middle axis."""
    return tree4_last(tl.permute(v, (0, 2, 1)), A, B)
