"""A CUDA C++ candidate for the `logp` op, built with torch.utils.cpp_extension from `cuda_logp.cu`.

    rl-engine check-op --op logp --candidate examples.cuda_logp:CudaLogp --device cuda --dtype bf16 \
        --check-grad --check-invariance

It shows that check-op judges any callable, a compiled extension included: forward and an
autograd-connected backward (`CudaLogp(logits=..., target_ids=...)` -> fp32 logprobs [B,S]). Where it
cannot be built (no GPU, no nvcc) constructing it raises one line, which check-op reports with exit 2.
"""

from __future__ import annotations

import functools
import shutil
from pathlib import Path

import torch

SOURCE = Path(__file__).with_name("cuda_logp.cu")


@functools.cache
def _extension():
    from torch.utils.cpp_extension import load

    return load(name="rl_engine_example_cuda_logp", sources=[str(SOURCE)], extra_cuda_cflags=["-O3"], verbose=False)


class _Logp(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, target_ids):
        rows = logits.reshape(-1, logits.shape[-1])
        targets = target_ids.reshape(-1).long()
        logp, lse = _extension().forward(rows, targets)
        ctx.save_for_backward(rows, targets, lse)
        ctx.shape = logits.shape
        return logp.view(target_ids.shape)

    @staticmethod
    def backward(ctx, grad):
        rows, targets, lse = ctx.saved_tensors
        grad_rows = _extension().backward(rows, targets, lse, grad.reshape(-1))
        return grad_rows.view(ctx.shape), None


class CudaLogp:
    """Built on construction (first use compiles, about a minute; later ones load the cached build)."""

    def __init__(self):
        if not torch.cuda.is_available():
            raise RuntimeError("the CUDA logp example needs a CUDA GPU; this machine has none")
        from torch.utils.cpp_extension import CUDA_HOME

        if shutil.which("nvcc") is None and not Path(CUDA_HOME or "/nonexistent").joinpath("bin", "nvcc").exists():
            raise RuntimeError("the CUDA logp example needs nvcc (the CUDA toolkit) to build; none was found")
        _extension()

    def __call__(self, *, logits, target_ids):
        return _Logp.apply(logits, target_ids)
