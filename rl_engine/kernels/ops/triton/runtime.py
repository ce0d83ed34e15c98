"""Launch facts every Triton kernel here needs: are we under the CPU interpreter? And the host side of
TMA loads (`host_descriptor`, `ensure_cuda_context`) and of two kernels run side by side (`SideStream`),
shared by the matmul, attention and loss kernels.

Under `TRITON_INTERPRET=1`, `tl.dot` with bf16/fp16 operands returns garbage (Triton 3.6 and 3.9,
DESIGN.md), while fp32 operands are right. Kernels that use `tl.dot` take a constexpr
`DOT_FP32` chosen here at launch and upcast their operands when it is set.

Also under the interpreter (Triton 3.6), `x.to(tl.bfloat16)` from fp32 *truncates* instead of
rounding to nearest even (and flushes bf16 subnormals), so about half of all bf16 outputs differ by
one ulp from the GPU's. Kernels store bf16 through `cast_rne(x, dtype)`: the plain `.to` on the GPU,
an explicit round-to-nearest-even of the fp32 bits under the interpreter.

Triton < 3.7's interpreter turns 1-element arrays into Python scalars, which numpy 2.4 refuses
("only 0-dimensional arrays can be converted to Python scalars", deep inside the first kernel).
Measured: Triton 3.6 runs with numpy 2.2 and 2.3 and fails with 2.4.0; Triton 3.7.1, 3.8 and 3.9
run with numpy 2.4. Importing this module under the interpreter refuses that pairing in one line.

The interpreter's `tl.dot` is numpy's matmul, and OpenBLAS's sgemm on some CPUs gives a row different bits at
different positions in the tile (measured 2026-12-02 on an AMD EPYC with AVX-512, OpenBLAS 0.3.30: its default and
Haswell kernels do, its SkylakeX kernel does not; CI had passed on earlier machines), which no GPU tile does: 15 CPU
batch-invariance tests failed there on the machine, not the kernels. Under the interpreter this module makes fp32 dots
position-independent (`_interpreter_dot`).
"""

from __future__ import annotations

import functools
import os
import re
import threading
from typing import TYPE_CHECKING

import numpy
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

if TYPE_CHECKING:
    import torch


def interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def pdl_launch() -> dict:
    """Launch options of a kernel that takes a `PDL` constexpr: on the GPU it is launched as a programmatic dependent
    (it may start while the kernel before it runs: its programs let their own dependents launch, then wait for that
    kernel to end and its writes to land before they touch memory), which hides launch latency between the many
    small kernels of a decode step. Scheduling only: no arithmetic changes. Off under the interpreter."""
    on = not interpreting()
    return {"PDL": on, "launch_pdl": on}


def unit_column_rows(x: torch.Tensor, cols: int) -> torch.Tensor:
    """x as [rows, cols] with unit column stride: a view where the layout allows (a part of a stacked product, read
    at its row stride), else a contiguous copy."""
    x2 = x.reshape(-1, cols)
    return x2 if cols <= 1 or x2.stride(1) == 1 else x2.contiguous()


def check_devices(op: str, **inputs) -> None:
    """One-line ValueError unless every tensor input is where a Triton kernel can read it: on one CUDA device,
    or on the CPU under the interpreter (TRITON_INTERPRET=1). A meta tensor has no data to compute on."""
    import torch

    first = None
    for name, value in inputs.items():
        if not isinstance(value, torch.Tensor):
            continue
        device = value.device
        if device.type not in ("cuda", "cpu") or (device.type == "cpu" and not interpreting()):
            where = ("Triton kernels need CUDA tensors, or CPU tensors with TRITON_INTERPRET=1 set before Triton "
                     "is imported")
            raise ValueError(f"{op}: {name} is on {device}; {where}")
        if first is None:
            first = (name, device)
        elif device != first[1]:
            raise ValueError(f"{op}: {name} is on {device}, {first[0]} on {first[1]}; all inputs must be on one device")


def _major_minor(version: str) -> tuple[int, int]:
    match = re.match(r"(\d+)\.(\d+)", version)
    if match is None:
        raise ValueError(f"not a version: {version!r}")
    return int(match.group(1)), int(match.group(2))


def check_interpreter_versions(triton_version: str | None = None, numpy_version: str | None = None) -> None:
    """ImportError (one line) under TRITON_INTERPRET=1 when this Triton's interpreter cannot run on this numpy."""
    triton_version = triton_version or triton.__version__
    numpy_version = numpy_version or numpy.__version__
    if interpreting() and _major_minor(triton_version) < (3, 7) and _major_minor(numpy_version) >= (2, 4):
        raise ImportError(
            f"Triton {triton_version}'s CPU interpreter (TRITON_INTERPRET=1) fails with numpy {numpy_version}: "
            'install "numpy<2.4" or Triton >= 3.7'
        )


check_interpreter_versions()


def _interpreter_dot() -> None:
    """Under TRITON_INTERPRET=1: fp32 `tl.dot` formed in fp64 and rounded to fp32 once (then the accumulator added
    in fp32, as before). Products of fp32 operands (and of upcast bf16 ones) are exact in fp64, so BLAS's order of
    the sum changes the fp32 result only at a rounding tie; the K-block order around each dot still rounds in fp32,
    so a kernel whose reduction order depends on the batch still shows it."""
    from triton.runtime import interpreter

    original = interpreter.InterpreterBuilder.create_dot
    if getattr(original, "position_independent", False):
        return

    def create_dot(self, a, b, d, input_precision, max_num_imprecise_acc):
        if a.data.dtype == b.data.dtype == d.data.dtype == numpy.float32:
            product = numpy.matmul(a.data.astype(numpy.float64), b.data.astype(numpy.float64)).astype(numpy.float32)
            return interpreter.TensorHandle(product + d.data, d.dtype.scalar)
        return original(self, a, b, d, input_precision, max_num_imprecise_acc)

    create_dot.position_independent = True
    interpreter.InterpreterBuilder.create_dot = create_dot


if interpreting():
    _interpreter_dot()


def needs_autograd(*tensors) -> bool:
    """Whether a call must go through its differentiable form (`register_autograd`'s call): autograd will need its
    backward, or torch.compile is tracing. Otherwise the kernel is called directly: a custom op's dispatch alone
    costs about 10 us of host time per call, as much as the rest of a launch."""
    import torch

    return torch.compiler.is_compiling() or (torch.is_grad_enabled() and any(t.requires_grad for t in tensors))


def register_autograd(op, backward, setup_context):
    """`op.register_autograd(backward, setup_context=setup_context)`, and returns the differentiable call an op's users
    make: the custom op when torch.compile traces it or on meta tensors and tensor subclasses (FakeTensor, DTensor:
    they know its fake and its dispatch); on plain tensors, an autograd.Function with the op's own implementation,
    setup_context and backward, so the same kernels and bits without the custom op's dispatch. On the H200 (torch
    2.11) that dispatch with its autograd cost 0.36 ms of host time per attention forward, the Function 0.01 ms."""
    import torch

    op.register_autograd(backward, setup_context=setup_context)
    impl = op._init_fn  # the decorated function (torch's CustomOpDef keeps it)

    def forward(ctx, *args):
        output = impl(*args)
        setup_context(ctx, args, output)
        return output

    eager = type(f"Eager_{impl.__name__}", (torch.autograd.Function,),
                 {"forward": staticmethod(forward), "backward": staticmethod(backward)})

    def call(*args):
        traced = torch.compiler.is_compiling() or any(
            isinstance(a, torch.Tensor) and (type(a) is not torch.Tensor or a.is_meta) for a in args)
        return op(*args) if traced else eager.apply(*args)

    return call


def dot_precision(dtype) -> str:
    """`tl.dot`'s input_precision: fp32 operands (fp32 inputs, or the interpreter's upcast of 16-bit ones)
    multiply in IEEE fp32, never TF32; bf16/fp16 operands take the tensor cores."""
    import torch

    return "ieee" if dtype == torch.float32 or dot_fp32(dtype) else "tf32"


def dot_fp32(dtype) -> bool:
    """Whether a kernel must upcast `tl.dot` operands of this dtype to fp32 (interpreter only)."""
    import torch

    return interpreting() and dtype in (torch.bfloat16, torch.float16)


def host_descriptor(base: torch.Tensor, shape: list[int], strides: list[int], block_shape: list[int]):
    """A host TensorDescriptor without its per-call checks, which the caller makes once: a 16-byte
    aligned base and row stride, a unit last stride, positive sizes, a valid block shape. The checks
    cost more than the rest of the descriptor (a decode step's host time counts)."""
    desc = object.__new__(TensorDescriptor)
    desc.base, desc.shape, desc.strides, desc.block_shape, desc.padding = base, shape, strides, block_shape, "zero"
    return desc


_threads_with_context = threading.local()


def ensure_cuda_context(device_index: int) -> None:
    """Make the primary CUDA context current on this thread, once.

    Host TMA descriptors are encoded through the driver API on the calling thread; autograd's
    backward thread may have no current context yet (seen on the H200: "Failed to create tensor
    map descriptor: invalid device context"). Any runtime-API call binds the primary context.
    """
    import torch

    ready = getattr(_threads_with_context, "devices", None)
    if ready is None:
        ready = _threads_with_context.devices = set()
    if device_index not in ready:
        torch.cuda.synchronize(device_index)
        ready.add(device_index)


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


@functools.cache
def sm_count(device_index: int) -> int:
    """The device's SMs: a persistent kernel's programs."""
    import torch

    return torch.cuda.get_device_properties(device_index).multi_processor_count


@functools.cache
def _side_stream(device_index: int):
    import torch

    return torch.cuda.Stream(device_index)


class SideStream:
    """Kernels launched inside `with side:` run on a side stream, concurrently with what the caller's
    stream queues next, and `side.join()` makes the caller's stream wait for them. The side stream first
    waits for all the caller's stream has queued: a fork and a join, which a CUDA graph capture records
    too. For kernels that read the same inputs and write different outputs (attention's dQ beside dK/dV):
    the same kernels, so the same bits, with each one's tail filled by the other. Not for linear_logp's
    weight and hidden gradients: each fills the GPU, and side by side they ran no faster (H200, 2026-12-01).
    Off the GPU everything runs in order."""

    def __init__(self, device):
        import torch

        self._stream_context = torch.cuda.stream
        gpu = device.type == "cuda" and not interpreting()
        self.main = torch.cuda.current_stream(device) if gpu else None
        index = device.index if device.index is not None else (torch.cuda.current_device() if gpu else 0)
        self.side = _side_stream(index) if gpu else None
        self._context = None

    def __enter__(self):
        if self.side is not None:
            self.side.wait_stream(self.main)
        self._context = self._stream_context(self.side)  # None: the current stream
        self._context.__enter__()
        return self

    def __exit__(self, *exc):
        self._context.__exit__(*exc)

    def join(self) -> None:
        if self.side is not None:
            self.main.wait_stream(self.side)
