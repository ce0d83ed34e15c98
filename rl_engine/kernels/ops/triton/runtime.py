"""Launch facts every Triton kernel here needs: are we under the CPU interpreter?

Under `TRITON_INTERPRET=1`, `tl.dot` with bf16/fp16 operands returns garbage (Triton 3.6 and 3.9,
DESIGN.md), while fp32 operands are right. Kernels that use `tl.dot` take a constexpr
`DOT_FP32` chosen here at launch and upcast their operands when it is set.

Also under the interpreter (Triton 3.6), `x.to(tl.bfloat16)` from fp32 *truncates* instead of
rounding to nearest even (and flushes bf16 subnormals), so about half of all bf16 outputs differ by
one ulp from the GPU's. Kernels store bf16 through `cast_rne(x, dtype)`: the plain `.to` on the GPU,
an explicit round-to-nearest-even of the fp32 bits under the interpreter.
"""

from __future__ import annotations

import os

import triton
import triton.language as tl


def interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def dot_fp32(dtype) -> bool:
    """Whether a kernel must upcast `tl.dot` operands of this dtype to fp32 (interpreter only)."""
    import torch

    return interpreting() and dtype in (torch.bfloat16, torch.float16)


if interpreting():

    @triton.jit
    def cast_rne(x, dtype: tl.constexpr):
        """fp32 x cast to dtype with round-to-nearest-even (bf16 rounded by hand, NaN kept NaN)."""
        if dtype == tl.bfloat16:
            bits = x.to(tl.uint32, bitcast=True)
            rounded = (bits + (0x7FFF + ((bits >> 16) & 1))) >> 16
            rounded = tl.where(x != x, 0x7FC0, rounded)
            out = rounded.to(tl.uint16).to(tl.bfloat16, bitcast=True)
        else:
            out = x.to(dtype)
        return out

else:

    @triton.jit
    def cast_rne(x, dtype: tl.constexpr):
        """fp32 x cast to dtype; the GPU's conversion already rounds to nearest even."""
        return x.to(dtype)
