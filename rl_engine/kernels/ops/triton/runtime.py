"""Launch facts every Triton kernel here needs: are we under the CPU interpreter?

Under `TRITON_INTERPRET=1`, `tl.dot` with bf16/fp16 operands returns garbage (Triton 3.6 and 3.9,
DESIGN.md), while fp32 operands are right. Kernels that use `tl.dot` take a constexpr
`DOT_FP32` chosen here at launch and upcast their operands when it is set.
"""

from __future__ import annotations

import os


def interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def dot_fp32(dtype) -> bool:
    """Whether a kernel must upcast `tl.dot` operands of this dtype to fp32 (interpreter only)."""
    import torch

    return interpreting() and dtype in (torch.bfloat16, torch.float16)
