"""tests/interpreter_memos.py: installed under the interpreter, a kernel with nested @triton.jit helpers (one calling
through triton.language.core) computes what torch does, and every launch leaves triton.language as it found it."""

import pytest
import torch
import triton
import triton.language as tl
from triton.language import core

pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="the memos are for the CPU interpreter")


@triton.jit
def _square(x):
    return x * x


@triton.jit
def _plus_one(x):
    return core.full(x.shape, 1.0, x.dtype) + x


@triton.jit
def _kernel(x_ptr, y_ptr, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    x = tl.load(x_ptr + offs, mask=offs < n, other=0.0)
    tl.store(y_ptr + offs, _plus_one(_square(x)), mask=offs < n)


def test_nested_helpers_compute_and_each_launch_restores_the_language():
    from triton.runtime import interpreter

    assert interpreter._get_np_dtype.__name__ == "np_dtype_memo"  # installed by conftest
    load, full = tl.load, core.full
    x = torch.randn(37)
    for _ in range(2):  # the second launch patches anew after the first one's restore
        y = torch.empty_like(x)
        _kernel[(3,)](x, y, x.numel(), BLOCK=16)
        torch.testing.assert_close(y, x * x + 1, rtol=0, atol=0)
        assert tl.load is load and core.full is full
