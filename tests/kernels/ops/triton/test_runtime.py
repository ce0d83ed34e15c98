import functools
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
import triton
import triton.language as tl

from rl_engine.kernels.ops.triton import runtime

# Measured pairings (runtime.py): Triton 3.6 fails under the interpreter with numpy 2.4, not 2.3.
REFUSED = [("3.6.0", "2.4.0"), ("3.6.0", "2.4.6"), ("3.5.1", "2.5.0.dev0")]
ACCEPTED = [("3.6.0", "2.2.6"), ("3.6.0", "2.3.5"), ("3.7.0", "2.4.0"), ("3.9.0", "2.4.6"), ("3.10.0+git1", "3.0.0")]


@pytest.mark.parametrize("triton_version, numpy_version", REFUSED)
def test_the_interpreter_refuses_an_old_triton_with_a_new_numpy_in_one_line(monkeypatch, triton_version,
                                                                              numpy_version):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    with pytest.raises(ImportError) as info:
        runtime.check_interpreter_versions(triton_version, numpy_version)
    message = str(info.value)
    assert "\n" not in message
    assert f"Triton {triton_version}" in message and f"numpy {numpy_version}" in message
    assert 'install "numpy<2.4" or Triton >= 3.7' in message


@pytest.mark.parametrize("triton_version, numpy_version", ACCEPTED)
def test_working_pairings_pass(monkeypatch, triton_version, numpy_version):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    runtime.check_interpreter_versions(triton_version, numpy_version)


def test_a_gpu_launch_is_not_refused(monkeypatch):
    # The numpy limit is the interpreter's: compiled kernels never touch numpy.
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    runtime.check_interpreter_versions("3.6.0", "2.4.6")


def test_check_op_reports_the_pairing_in_one_line_and_exits_2():
    # The check runs when a kernel module is first imported; fake the versions before that import.
    code = (
        "import sys, numpy, triton\n"
        "numpy.__version__ = '2.4.1'\n"
        "triton.__version__ = '3.6.0'\n"
        "from rl_engine.cli import main\n"
        "sys.exit(main(['check-op', '--op', 'silu', '--candidate', 'triton', '--device', 'cpu', '--dtype', 'fp32']))\n"
    )
    root = str(Path(runtime.__file__).resolve().parents[4])  # the checkout under test, wherever pytest runs
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=os.pathsep.join([root, os.environ.get("PYTHONPATH", "")]))
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, proc.stderr
    assert "Triton 3.6.0's CPU interpreter (TRITON_INTERPRET=1) fails with numpy 2.4.1" in lines[0]


@functools.cache  # a custom op's name registers once per process
def _toy_op():
    """y = 3x as a custom op whose autograd goes through runtime.register_autograd."""
    import torch

    @torch.library.custom_op("rl_engine_test::triple", mutates_args=())
    def triple_op(x: torch.Tensor) -> torch.Tensor:
        return x * 3

    triple_op.register_fake(lambda x: torch.empty_like(x))

    def setup_context(ctx, inputs, output):
        pass

    def backward(ctx, grad):
        return grad * 3

    return runtime.register_autograd(triple_op, backward, setup_context)


def test_register_autograd_takes_the_function_on_plain_tensors_and_the_op_otherwise():
    """Plain tensors: the eager Function (no custom-op dispatch), with the op's own forward and backward; meta
    tensors and FakeTensors: the custom op's registered autograd, which knows their shapes."""
    import torch
    from torch._subclasses.fake_tensor import FakeTensorMode

    triple = _toy_op()
    x = torch.arange(4.0, requires_grad=True)
    y = triple(x)
    assert type(y.grad_fn).__name__.startswith("Eager_triple_op")
    (g,) = torch.autograd.grad(y.sum(), x)
    assert torch.equal(y.detach(), x.detach() * 3) and torch.equal(g, torch.full((4,), 3.0))
    meta = triple(torch.empty(4, device="meta", requires_grad=True))
    assert "GeneratedBackwardFor" in type(meta.grad_fn).__name__
    with FakeTensorMode() as mode:
        fake = triple(mode.from_tensor(torch.empty(4)).requires_grad_())
    assert "GeneratedBackwardFor" in type(fake.grad_fn).__name__ and fake.shape == (4,)


@triton.jit
def _dot_tile(A, B, C, M: tl.constexpr, K: tl.constexpr, N: tl.constexpr):
    m, k, n = tl.arange(0, M), tl.arange(0, K), tl.arange(0, N)
    a = tl.load(A + m[:, None] * K + k[None, :])
    b = tl.load(B + k[:, None] * N + n[None, :])
    tl.store(C + m[:, None] * N + n[None, :], tl.dot(a, b))


def _rows_that_change_with_position(m=32, k=32, n=32):
    """Row 0 of A moved to each position of the tile: at how many positions its product row changes."""
    g = torch.Generator().manual_seed(0)
    a, b = torch.randn(m, k, generator=g), torch.randn(k, n, generator=g)
    out = torch.empty(m, n)
    _dot_tile[(1,)](a, b, out, m, k, n)
    want = out[0].clone()
    changed = 0
    for r in range(1, m):
        _dot_tile[(1,)](a.roll(r, 0).contiguous(), b, out, m, k, n)
        changed += not torch.equal(out[r], want)
    return changed


@pytest.mark.skipif(not runtime.interpreting(), reason="the CPU interpreter's tl.dot")
def test_the_interpreters_fp32_dot_gives_a_row_the_same_bits_at_any_position(monkeypatch):
    """numpy's sgemm may not (runtime.py: OpenBLAS's default kernel on an AMD EPYC changed this row at 20 of the 31
    other positions); GPU tiles do, and the batch-invariance tests rely on it."""
    assert _rows_that_change_with_position() == 0
    from triton.runtime import interpreter

    def planted(self, a, b, d, input_precision, max_num_imprecise_acc):  # the tile's lower half sums k backwards
        out = np.matmul(a.data, b.data)
        half = a.data.shape[0] // 2
        out[half:] = np.matmul(a.data[half:, ::-1], b.data[::-1])
        return interpreter.TensorHandle(out + d.data, d.dtype.scalar)

    monkeypatch.setattr(interpreter.InterpreterBuilder, "create_dot", planted)
    assert _rows_that_change_with_position() > 0


# --- devices: a Triton op refuses tensors it cannot read, in one line, before any kernel runs (#56) ------------

def _triton_op_and_inputs(op):
    from rl_engine.checks.operators.operator_inputs import OperatorDims
    from rl_engine.checks.operators.operator_specs import make_candidate, make_operator_case

    dims = OperatorDims(batch=1, seq=2, vocab=17, normalized_dim=8, intermediate=8, n_heads=2, n_kv_heads=1,
                        head_dim=4, k_dim=8, n_dim=8, experts=2)
    case = make_operator_case(op, dtype="fp32", device="cpu", dims=dims)
    return make_candidate(op, "triton", dims=dims).fn, case.inputs


def _ops():
    from rl_engine.kernels.records import OPS

    return sorted(OPS)


@pytest.mark.parametrize("op", _ops())
def test_every_triton_op_refuses_meta_tensors_in_one_line(op):
    fn, inputs = _triton_op_and_inputs(op)
    moved = {k: v.to("meta") if isinstance(v, torch.Tensor) else v for k, v in inputs.items()}
    with pytest.raises(ValueError) as exc:
        fn(**moved)
    assert "is on meta; Triton kernels need CUDA tensors" in str(exc.value) and "\n" not in str(exc.value)


def test_cpu_tensors_without_the_interpreter_are_refused(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(ValueError, match=r"op: x is on cpu; .*TRITON_INTERPRET=1"):
        runtime.check_devices("op", x=torch.ones(2), y=None)
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    runtime.check_devices("op", x=torch.ones(2), y=None, n=3)
    with pytest.raises(ValueError, match=r"op: y is on meta"):
        runtime.check_devices("op", x=torch.ones(2), y=torch.ones(2, device="meta"))
