"""Bit-level comparison of tensors, the one used by every harness: equal bits, differing elements and
their ulp distance, and dtype spelling.

Bitwise means the same bit patterns, so -0.0 differs from 0.0 and a NaN equals only the same NaN:
a reduction-order change that flips a zero's sign is a change.
"""

from __future__ import annotations

import torch

_INT_VIEW = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
# Short names used in reports, contracts and flags (fp64 is named in reports, never a case dtype).
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
_NAMES = {**DTYPES, "fp64": torch.float64}


def dtype_key(dtype) -> str:
    """'fp32' / 'bf16' / 'fp16' (/ 'fp64') for a torch dtype, or one of the case names: the one spelling
    in reports. Other dtypes (integers) are named as torch names them, without the prefix."""
    if isinstance(dtype, str):
        if dtype in DTYPES:
            return dtype
    elif isinstance(dtype, torch.dtype) and not dtype.is_floating_point:
        return str(dtype).removeprefix("torch.")
    else:
        for key, value in _NAMES.items():
            if value == dtype:
                return key
    raise ValueError(f"dtype: expected one of {', '.join(DTYPES)}, got {dtype!r}")


def raw_bits(t: torch.Tensor) -> torch.Tensor:
    """The tensor's bit patterns as a flat signed-integer tensor of its element size."""
    return t.detach().contiguous().reshape(-1).view(_INT_VIEW[t.element_size()])


def ordered_bits(t: torch.Tensor) -> torch.Tensor:
    """Bit patterns as int64 ordered like the floats (sign-magnitude to two's complement), so that the
    difference of two is their distance in ulps."""
    bits = raw_bits(t).long()
    lowest = -(1 << (8 * t.element_size() - 1))
    return torch.where(bits < 0, lowest - bits, bits)


def bitwise_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Same dtype, shape and bits (on any devices)."""
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    return torch.equal(raw_bits(a).cpu(), raw_bits(b).cpu())


def bit_mismatch(got: torch.Tensor, expected: torch.Tensor) -> tuple[int, int]:
    """(elements whose bits differ, largest ulp distance) in `got`'s dtype; integers compare by value."""
    if not got.is_floating_point():
        diff = got.long() != expected.long()
        return int(diff.sum()), int((got.long() - expected.long()).abs().max()) if diff.any() else 0
    expected = expected.to(got.dtype)
    differs = raw_bits(got) != raw_bits(expected)
    if not differs.any():
        return 0, 0
    return int(differs.sum()), int((ordered_bits(got) - ordered_bits(expected)).abs().max())
