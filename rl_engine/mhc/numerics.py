"""Strict-fp32 building blocks (profile `strict-fp32-v1`): the exact operation order, written down.

Everything here takes and returns fp32 tensors and uses only these torch operations, each of which
is exact or a single IEEE binary32 round-to-nearest-even operation on both CPU and CUDA:
`+ − ×` (separate kernels, so nothing contracts into an FMA), `÷` through `div` with a *tensor*
divisor (torch on CUDA turns a division by a CPU scalar into a multiplication by its reciprocal, so
a scalar divisor is always expanded to a tensor first), `floor`, `clamp`, `where`, `maximum`,
integer shifts/masks on the bit pattern (exact powers of two, exponent extraction), and `sqrt` of
an fp64 value rounded once to fp32 (correctly rounded: 53 ≥ 2·24 + 2, so the double rounding is
innocuous). No `torch.sum`, `matmul`, `mean`, `einsum` or `norm` over a contracted axis: their
order is the library's business, and differs between devices and batch sizes.

A Triton kernel mirrors this file with `enable_fp_fusion=False`, `tl.math.div_rn`, `tl.sqrt_rn`,
the same constants and the same parenthesisation. Every function's docstring states its order;
"a·b + c" always means `t = a * b` rounded, then `t + c` rounded.

Reductions (`lane_sum`): the contract pins a lane count L (a power of two, e.g. 64). Over an axis of
n elements, lane j (0 ≤ j < L) starts at +0.0 and adds elements j, j+L, j+2L, … in increasing order
(missing elements count as +0.0). The L lane values are then combined by a pairwise tree: level by
level, (v0+v1), (v2+v3), …, until one value remains. Because every lane starts at +0.0, no lane
holds −0.0, so lanes beyond n (all +0.0) change nothing: the implementation may skip them and pass
an odd last element through a level unchanged. The four-stream reduction is this same tree over
four terms, `(a0 + a1) + (a2 + a3)` (`tree4`).
"""

from __future__ import annotations

import torch

PROFILE = "strict-fp32-v1"

# --- pinned exp (Cephes expf: Cody–Waite reduction + degree-7 polynomial) ----------------------------
LOG2E = 1.44269504088896341  # rounded to fp32 at use
EXP_C1 = 0.693359375  # ln 2 high part: 9 significant bits, so n·C1 is exact for |n| ≤ 2^15
EXP_C2 = -2.12194440e-4  # ln 2 low part (note the sign: r = (x − n·C1) − n·C2)
EXP_POLY = (1.9875691500e-4, 1.3981999507e-3, 8.3334519073e-3, 4.1665795894e-2, 1.6666665459e-1,
            5.0000001201e-1)
EXP_N_MIN = -125  # below this the result would be subnormal or zero: it is flushed to +0.0
EXP_N_MAX = 128  # n = 128 is scaled in two steps (·2^127 then ·2); above it the result is +inf

# --- pinned log (fdlibm/musl logf) --------------------------------------------------------------------
LN2_HI = 6.9313812256e-01  # 0x3f317180: trailing zeros, so k·LN2_HI is exact
LN2_LO = 9.0580006145e-06  # 0x3717f7d1
LOG_LG = (0.66666662693, 0.40000972152, 0.28498786688, 0.24279078841)  # Lg1..Lg4
SQRT_HALF_BITS = 0x3F3504F3  # bit pattern of fp32 sqrt(1/2)
ONE_BITS = 0x3F800000
FLT_MIN_NORMAL = 2.0**-126


def _f32(value: float, like: torch.Tensor) -> torch.Tensor:
    """A full tensor of `value` rounded to fp32, on `like`'s device and shape (never a CPU scalar)."""
    return torch.full_like(like, value, dtype=torch.float32)


def div(a: torch.Tensor, b) -> torch.Tensor:
    """IEEE fp32 division a ÷ b, correctly rounded. A scalar b is expanded to a tensor first."""
    if not isinstance(b, torch.Tensor):
        b = _f32(float(b), a)
    return torch.div(a, b)


def sqrt_rn(x: torch.Tensor) -> torch.Tensor:
    """Correctly rounded fp32 sqrt: the fp64 sqrt, rounded once to fp32 (torch's fp32 CPU sqrt isn't)."""
    return torch.sqrt(x.to(torch.float64)).to(torch.float32)


def rsqrt(x: torch.Tensor) -> torch.Tensor:
    """1 ÷ sqrt_rn(x): two correctly rounded operations (never a hardware rsqrt approximation)."""
    root = sqrt_rn(x)
    return div(torch.ones_like(root), root)


def pow2(n: torch.Tensor) -> torch.Tensor:
    """Exact 2^n as fp32 for integer-valued int32 n in [-126, 127], built from the bit pattern."""
    return torch.bitwise_left_shift(n + 127, 23).view(torch.float32)


def exp(x: torch.Tensor) -> torch.Tensor:
    """Pinned exp (Cephes expf), ≤ 2 ulp from the true value on [-86.9, 88.7] (measured in tests).

    Order, all in fp32:
      xc = clamp(x, -100, 100)          (NaN is replaced by 0 here and restored at the end)
      n  = floor(xc·LOG2E + 0.5)
      r  = (xc − n·C1) − n·C2
      z  = r·r
      p  = ((((((P0·r + P1)·r + P2)·r + P3)·r + P4)·r + P5)·z + r) + 1
      result = p·2^n                    (2^n exact from bits; for n = 128: (p·2^127)·2)
    n < -125 → +0.0 (the result would be subnormal: flushed so no device's denormal mode matters);
    n > 128 → +inf; NaN → NaN.
    """
    nan = torch.isnan(x)
    xc = torch.where(nan, torch.zeros_like(x), torch.clamp(x, -100.0, 100.0))
    n = torch.floor(xc * LOG2E + 0.5)
    r = (xc - n * EXP_C1) - n * EXP_C2
    z = r * r
    p = EXP_POLY[0] * r + EXP_POLY[1]
    for coef in EXP_POLY[2:]:
        p = p * r + coef
    p = ((p * z) + r) + 1.0
    n_int = torch.clamp(n, EXP_N_MIN, 127).to(torch.int32)
    y = p * pow2(n_int)
    y = torch.where(n == EXP_N_MAX, y * 2.0, y)
    y = torch.where(n < EXP_N_MIN, torch.zeros_like(y), y)
    y = torch.where(n > EXP_N_MAX, torch.full_like(y, float("inf")), y)
    return torch.where(nan, x, y)


def log(x: torch.Tensor) -> torch.Tensor:
    """Pinned natural log (fdlibm/musl logf), ≤ 2 ulp over all positive finite fp32 (measured).

    Order, all in fp32 (ix is the int32 bit pattern):
      subnormal x: x = x·2^25, k = −25, else k = 0
      ix = bits(x) + (ONE_BITS − SQRT_HALF_BITS);  k = k + (ix >> 23) − 127
      m  = float(bits (ix & 0x7fffff) + SQRT_HALF_BITS)      m ∈ [sqrt(1/2), sqrt(2))
      f = m − 1;  s = f ÷ (2 + f);  z = s·s;  w = z·z
      R = z·(Lg1 + w·Lg3) + w·(Lg2 + w·Lg4)                   (t2 + t1, each as written)
      hfsq = (0.5·f)·f
      result = ((((s·(hfsq + R)) + k·LN2_LO) − hfsq) + f) + k·LN2_HI
    x = 0 → −inf; x < 0 or NaN → NaN; +inf → +inf.
    """
    sub = x < FLT_MIN_NORMAL
    xs = torch.where(sub, x * 33554432.0, x)  # 2^25, exact
    k = torch.where(sub, torch.full_like(x, -25, dtype=torch.int32), torch.zeros_like(x, dtype=torch.int32))
    ix = xs.view(torch.int32) + (ONE_BITS - SQRT_HALF_BITS)
    k = k + torch.bitwise_right_shift(ix, 23) - 127
    m = (torch.bitwise_and(ix, 0x007FFFFF) + SQRT_HALF_BITS).view(torch.float32)
    f = m - 1.0
    s = div(f, f + 2.0)
    z = s * s
    w = z * z
    t1 = w * (w * LOG_LG[3] + LOG_LG[1])
    t2 = z * (w * LOG_LG[2] + LOG_LG[0])
    big_r = t2 + t1
    hfsq = (f * 0.5) * f
    dk = k.to(torch.float32)
    y = (((s * (hfsq + big_r)) + dk * LN2_LO) - hfsq + f) + dk * LN2_HI
    y = torch.where(x == 0, torch.full_like(y, float("-inf")), y)
    y = torch.where(x == float("inf"), x, y)
    return torch.where((x < 0) | torch.isnan(x), torch.full_like(y, float("nan")), y)


def sigmoid(x: torch.Tensor) -> torch.Tensor:
    """Logistic function, ≤ 2 ulp on [-86, 86] (measured in tests); NaN → NaN.

      e = exp(−|x|);  n = 1 if x ≥ 0 else e      (the tail toward −∞ carries only exp's error)
      d = e + 1;  err = (d − 1) − e              (exact: the rounding error of e + 1, as d ≥ 1 ≥ e)
      q = n ÷ d;  result = q + q · (err ÷ d)     (n ÷ (1 + e) = n ÷ (d − err) ≈ q · (1 + err ÷ d))
    """
    e = exp(-torch.abs(x))
    d = e + 1.0
    err = (d - 1.0) - e
    q = div(torch.where(x >= 0, torch.ones_like(e), e), d)
    return q + q * div(err, d)


def tree4(a0: torch.Tensor, a1: torch.Tensor, a2: torch.Tensor, a3: torch.Tensor) -> torch.Tensor:
    """The four-stream reduction: (a0 + a1) + (a2 + a3)."""
    return (a0 + a1) + (a2 + a3)


def _take(x: torch.Tensor, dim: int, start: int, stop: int | None, step: int = 1) -> torch.Tensor:
    index = [slice(None)] * x.dim()
    index[dim] = slice(start, stop, step)
    return x[tuple(index)]


def pairwise_tree(v: torch.Tensor, dim: int = -1) -> torch.Tensor:
    """Pairwise tree over `dim`: (v0+v1), (v2+v3), … level by level; an odd last element passes
    through its level unchanged (the same as adding a +0.0 lane). Returns `dim` reduced away."""
    dim = dim % v.dim()
    while v.shape[dim] > 1:
        n = v.shape[dim]
        pairs = _take(v, dim, 0, n - 1, 2) + _take(v, dim, 1, n, 2)
        v = torch.cat([pairs, _take(v, dim, n - 1, n)], dim=dim) if n % 2 else pairs
    return v.squeeze(dim)


def lane_sum(x: torch.Tensor, lanes: int, dim: int = -1) -> torch.Tensor:
    """Lane fold + pairwise tree over `dim` (see the module docstring); `dim` is removed.

    Lane j = ((+0.0 + x[j]) + x[j+L]) + x[j+2L] + …, then `pairwise_tree` over the lanes.
    """
    if lanes < 1 or lanes & (lanes - 1):
        raise ValueError(f"lanes must be a power of two, got {lanes}")
    dim = dim % x.dim()
    n = x.shape[dim]
    if n == 0:
        return torch.zeros(x.shape[:dim] + x.shape[dim + 1 :], dtype=x.dtype, device=x.device)
    width = min(lanes, n)
    # Starting the lanes at +0.0 only ever turns a −0.0 result into +0.0 (an IEEE sum is −0.0 only
    # when every addend is −0.0), so the +0.0 is added once, to the result: the same bits, one pass less.
    acc = x.narrow(dim, 0, width)
    for start in range(width, n, lanes):
        w = min(lanes, n - start)
        chunk = x.narrow(dim, start, w)
        acc = acc + chunk if w == width else torch.cat([acc.narrow(dim, 0, w) + chunk,
                                                        acc.narrow(dim, w, width - w)], dim=dim)
    return pairwise_tree(acc, dim) + 0.0


def lane_dot(a: torch.Tensor, b: torch.Tensor, lanes: int, dim: int = -1) -> torch.Tensor:
    """Σ a·b over `dim` (broadcasting a and b): each product rounded to fp32, then `lane_sum`."""
    return lane_sum(a * b, lanes, dim)


def sum_of_squares(x: torch.Tensor, lanes: int, dim: int = -1) -> torch.Tensor:
    """Σ x·x over `dim`: each square rounded to fp32, then `lane_sum`."""
    return lane_sum(x * x, lanes, dim)


def softmax4(logits: torch.Tensor) -> torch.Tensor:
    """Softmax over the last axis of size 4: m = max((l0, l1), (l2, l3)); e_i = exp(l_i − m);
    p_i = e_i ÷ ((e0 + e1) + (e2 + e3))."""
    l0, l1, l2, l3 = logits.unbind(-1)
    m = torch.maximum(torch.maximum(l0, l1), torch.maximum(l2, l3))
    e = exp(logits - m.unsqueeze(-1))
    total = tree4(*e.unbind(-1))
    return div(e, total.unsqueeze(-1).expand_as(e))


def to_bf16(x: torch.Tensor) -> torch.Tensor:
    """The one round-to-nearest-even cast to bf16 at an operator output."""
    return x.to(torch.bfloat16)
