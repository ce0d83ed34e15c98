"""Batch-invariant persistent GEMM, matmul and lm_head ops: accuracy, bitwise batch invariance,
determinism, gradients. Without CUDA these run under the Triton interpreter at small shapes (the
fp32-upcast `tl.dot` path for bf16/fp16); the `gpu` tests run the compiled kernels at Qwen3-8B
shapes on the H200.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from rl_engine.kernels.ops.pytorch.linear.lm_head import NativeLmHeadOp
from rl_engine.kernels.ops.pytorch.linear.matmul import NativeMatmulOp
from rl_engine.kernels.ops.triton.linear import TritonLmHeadOp, TritonMatmulOp, batch_invariant_mm
from rl_engine.kernels.ops.triton.linear.matmul import (
    GPU_CONFIG_OVERRIDES,
    GPU_CONFIGS,
    INTERPRETER_CONFIG,
    MatmulConfig,
    matmul_config,
)
from rl_engine.kernels.ops.triton.runtime import dot_fp32, register_autograd

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
# Both kernels, whatever the fixed table picks on this machine: pointer loads and TMA descriptors.
POINTER = dataclasses.replace(INTERPRETER_CONFIG, tma=False)
TMA = dataclasses.replace(INTERPRETER_CONFIG, tma=True)
CONFIGS = pytest.mark.parametrize("config", [POINTER, TMA], ids=["pointer", "tma"])
DTYPES = pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)


def _randn(*shape, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=g).to(dtype=dtype, device=DEVICE)


def assert_close_to_reference(cand, ref, baseline, *, what: str):
    """Max error within 2x that of plain PyTorch in the same dtype (baseline-relative, bf16/fp16)."""
    cand, ref, baseline = cand.float(), ref.float(), baseline.float()
    assert torch.isfinite(cand).all(), f"{what}: non-finite candidate"
    err = (cand - ref).abs().max().item()
    bound = 2 * (baseline - ref).abs().max().item() + 1e-5 * (1 + ref.abs().max().item())
    assert err <= bound, f"{what}: max error {err:.3g} > bound {bound:.3g}"


def assert_bitwise(a: torch.Tensor, b: torch.Tensor, what: str) -> None:
    """Every bit equal (compares the raw bits, so -0.0 vs 0.0 and NaN payloads count)."""
    assert a.shape == b.shape and a.dtype == b.dtype, f"{what}: {a.shape}/{a.dtype} vs {b.shape}/{b.dtype}"
    bits = {2: torch.int16, 4: torch.int32}[a.element_size()]
    differ = (a.view(bits) != b.view(bits)).sum().item()
    assert differ == 0, f"{what}: {differ} of {a.numel()} elements differ"


def test_interpreter_path_is_the_one_claimed():
    """Under the interpreter bf16/fp16 operands are upcast before tl.dot; on the GPU they are not."""
    assert dot_fp32(torch.bfloat16) == (DEVICE == "cpu")
    assert dot_fp32(torch.float32) is False


# --- accuracy ------------------------------------------------------------------------------------


@CONFIGS
@DTYPES
@pytest.mark.parametrize("m,k,n", [(1, 48, 40), (7, 48, 40), (33, 40, 24), (64, 48, 40)])
def test_matmul_matches_reference(config, dtype, m, k, n):
    a = _randn(m, k, dtype=dtype, seed=1)
    w = _randn(n, k, dtype=dtype, seed=2)  # b = w.t(): a transposed weight view, as in a linear layer
    out = batch_invariant_mm(a, w.t(), config=config)
    assert out.dtype == dtype and out.shape == (m, n)
    ref = NativeMatmulOp()(a=a[None], b=w.t())[0]
    if dtype == torch.float32:
        torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
    else:
        assert_close_to_reference(out, ref, NativeMatmulOp().baseline(a=a[None], b=w.t())[0], what=str(dtype))


@CONFIGS
@pytest.mark.parametrize("layout", ["row_major", "a_transposed", "strided", "broadcast"])
def test_matmul_operand_layouts(config, layout):
    """Transposed and strided operands are read in place and give the reference result."""
    a = _randn(33, 48, dtype=torch.float32, seed=3)
    b = _randn(48, 40, dtype=torch.float32, seed=4)
    if layout == "a_transposed":
        a = a.t().contiguous().t()
    elif layout == "strided":
        a = _randn(33, 96, dtype=torch.float32, seed=3)[:, ::2]
        b = _randn(48, 80, dtype=torch.float32, seed=4)[:, 1::2]
    elif layout == "broadcast":  # stride-0 operands, as autograd hands out for out.sum().backward()
        a = a[:1].expand(33, 48)
        b = b[:, :1].expand(48, 40)
    out = batch_invariant_mm(a, b, config=config)
    torch.testing.assert_close(out, NativeMatmulOp()(a=a[None], b=b)[0], atol=1e-5, rtol=1e-5)


def test_matmul_rounds_bf16_to_nearest_even():
    """The interpreter truncates fp32 -> bf16 casts; the op must still round like the GPU."""
    a = _randn(16, 48, dtype=torch.bfloat16, seed=5)
    b = _randn(48, 32, dtype=torch.bfloat16, seed=6)
    ref = (a.double() @ b.double()).float()
    # fp32 accumulation of bf16 products is within a few fp32 ulps of exact; rounding once to bf16
    # must land on the nearest bf16 almost everywhere (all, for these inputs).
    assert_bitwise(batch_invariant_mm(a, b), ref.to(torch.bfloat16), "bf16 rounding")


# --- batch invariance and determinism --------------------------------------------------------------


@CONFIGS
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_rows_do_not_depend_on_batch_size(config, dtype):
    a = _randn(64, 48, dtype=dtype, seed=7)
    w = _randn(40, 48, dtype=dtype, seed=8)
    full = batch_invariant_mm(a, w.t(), config=config)
    for start, m in [(0, 1), (0, 7), (0, 33), (20, 7), (63, 1), (30, 33)]:
        part = batch_invariant_mm(a[start : start + m].clone(), w.t(), config=config)
        assert_bitwise(part, full[start : start + m], f"rows {start}..{start + m} computed with M={m}")


def test_invariance_check_catches_a_batch_dependent_config():
    """Planted bug: a config that changes BLOCK_K with M changes the reduction order, and the bits."""
    a = _randn(64, 48, dtype=torch.float32, seed=9)
    b = _randn(48, 40, dtype=torch.float32, seed=10)
    full = batch_invariant_mm(a, b, config=POINTER)
    alone = batch_invariant_mm(a[:7].clone(), b, config=dataclasses.replace(POINTER, block_k=32))
    with pytest.raises(AssertionError, match="differ"):
        assert_bitwise(alone, full[:7], "M-dependent BLOCK_K")


def test_bitwise_check_catches_one_ulp():
    x = _randn(8, 8, dtype=torch.bfloat16, seed=11)
    y = x.clone()
    y.view(torch.int16)[3, 4] += 1
    with pytest.raises(AssertionError, match="1 of 64"):
        assert_bitwise(x, y, "one ulp")


@CONFIGS
def test_matmul_is_deterministic(config):
    a = _randn(33, 48, dtype=torch.bfloat16, seed=12)
    b = _randn(48, 40, dtype=torch.bfloat16, seed=13)
    assert_bitwise(batch_invariant_mm(a, b, config=config), batch_invariant_mm(a, b, config=config), "rerun")


# --- the ops and their gradients ------------------------------------------------------------------


def _grads(fn, *inputs, grad_out):
    leaves = [x.detach().clone().requires_grad_(True) for x in inputs]
    out = fn(*leaves)
    out.backward(grad_out.to(out.dtype))
    return out.detach(), [leaf.grad for leaf in leaves]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_matmul_op_forward_and_gradients(dtype):
    a = _randn(2, 7, 48, dtype=dtype, seed=14)
    b = _randn(48, 40, dtype=dtype, seed=15)
    g = _randn(2, 7, 40, dtype=torch.float32, seed=16)
    out, (ga, gb) = _grads(lambda a, b: TritonMatmulOp()(a=a, b=b), a, b, grad_out=g)
    ref, (ra, rb) = _grads(lambda a, b: NativeMatmulOp()(a=a, b=b), a.float(), b.float(), grad_out=g)
    assert out.shape == (2, 7, 40) and out.dtype == dtype and ga.dtype == dtype and gb.dtype == dtype
    if dtype == torch.float32:
        for name, x, y in [("out", out, ref), ("grad a", ga, ra), ("grad b", gb, rb)]:
            torch.testing.assert_close(x, y, atol=1e-5, rtol=1e-5, msg=name)
    else:
        base, (ba, bb) = _grads(lambda a, b: NativeMatmulOp().baseline(a=a, b=b), a, b, grad_out=g)
        assert_close_to_reference(out, ref, base, what="out")
        assert_close_to_reference(ga, ra, ba, what="grad a")
        assert_close_to_reference(gb, rb, bb, what="grad b")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_lm_head_op_forward_and_gradients(dtype):
    hidden = _randn(3, 5, 48, dtype=dtype, seed=17)
    weight = _randn(72, 48, dtype=dtype, seed=18)
    g = _randn(3, 5, 72, dtype=torch.float32, seed=19)
    out, (gh, gw) = _grads(lambda h, w: TritonLmHeadOp()(hidden=h, weight=w), hidden, weight, grad_out=g)
    ref, (rh, rw) = _grads(
        lambda h, w: NativeLmHeadOp()(hidden=h, weight=w), hidden.float(), weight.float(), grad_out=g
    )
    assert out.shape == (3, 5, 72) and gw.shape == weight.shape and gw.is_contiguous()
    if dtype == torch.float32:
        for name, x, y in [("logits", out, ref), ("grad hidden", gh, rh), ("grad weight", gw, rw)]:
            torch.testing.assert_close(x, y, atol=1e-5, rtol=1e-5, msg=name)
    else:
        base, (bh, bw) = _grads(lambda h, w: NativeLmHeadOp().baseline(hidden=h, weight=w), hidden, weight, grad_out=g)
        assert_close_to_reference(out, ref, base, what="logits")
        assert_close_to_reference(gh, rh, bh, what="grad hidden")
        assert_close_to_reference(gw, rw, bw, what="grad weight")


def test_gradient_check_catches_a_wrong_backward():
    """Planted bug: a backward that scales grad a by 2; the gradient comparison must say so."""
    from rl_engine.kernels.ops.triton.linear import matmul as module

    def bad_backward(ctx, grad_c):
        grad_a, grad_b = module._mm_backward(ctx, grad_c)
        return grad_a * 2, grad_b

    a, b = _randn(1, 7, 48, dtype=torch.float32, seed=20), _randn(48, 40, dtype=torch.float32, seed=21)
    g = _randn(1, 7, 40, dtype=torch.float32, seed=22)
    real = module.batch_invariant_mm_autograd
    module.batch_invariant_mm_autograd = register_autograd(module.batch_invariant_mm_op, bad_backward,
                                                           module._mm_setup_context)
    try:
        _, (ga, _) = _grads(lambda a, b: TritonMatmulOp()(a=a, b=b), a, b, grad_out=g)
    finally:
        module.batch_invariant_mm_autograd = register_autograd(module.batch_invariant_mm_op, module._mm_backward,
                                                               module._mm_setup_context)
    assert module.batch_invariant_mm_autograd is not real
    _, (ra, _) = _grads(lambda a, b: NativeMatmulOp()(a=a, b=b), a, b, grad_out=g)
    with pytest.raises(AssertionError):
        torch.testing.assert_close(ga, ra, atol=1e-5, rtol=1e-5)
    _, (ga, _) = _grads(lambda a, b: TritonMatmulOp()(a=a, b=b), a, b, grad_out=g)
    torch.testing.assert_close(ga, ra, atol=1e-5, rtol=1e-5, msg="the real backward is back")


def test_registered_as_torch_custom_ops():
    """torch.library's own checks (schema, fake tensor, autograd registration), and a compiled trace."""
    from rl_engine.kernels.ops.triton.linear.lm_head import lm_head_op
    from rl_engine.kernels.ops.triton.linear.matmul import batch_invariant_mm_op

    CHECKS = ("test_schema", "test_faketensor", "test_autograd_registration")
    a = _randn(7, 48, dtype=torch.float32, seed=26).requires_grad_(True)
    b = _randn(48, 40, dtype=torch.float32, seed=27).requires_grad_(True)
    torch.library.opcheck(batch_invariant_mm_op, (a, b), test_utils=CHECKS)
    torch.library.opcheck(lm_head_op, (a, b.t()), test_utils=CHECKS)
    compiled = torch.compile(lambda a, b: TritonMatmulOp()(a=a, b=b), backend="aot_eager", fullgraph=True)
    assert_bitwise(compiled(a[None], b), TritonMatmulOp()(a=a[None], b=b), "compiled vs eager")
    # Without autograd the eager call skips the op; a compiled graph still traces through it.
    a, b = a.detach(), b.detach()
    assert_bitwise(compiled(a[None], b), TritonMatmulOp()(a=a[None], b=b), "compiled vs eager, no grad")


@pytest.fixture
def autograd_calls(monkeypatch):
    """Records every differentiable call (runtime.register_autograd's) of matmul and lm_head made by the functional
    entries."""
    from rl_engine.kernels.ops.triton.linear import lm_head as lm_head_module
    from rl_engine.kernels.ops.triton.linear import matmul as matmul_module

    calls = []
    for module, name in [(matmul_module, "batch_invariant_mm_autograd"), (lm_head_module, "lm_head_autograd")]:
        real = getattr(module, name)
        monkeypatch.setattr(module, name, lambda *args, real=real, name=name: calls.append(name) or real(*args))
    return calls


@pytest.mark.parametrize("which", ["matmul", "lm_head"])
def test_autograd_only_where_it_is_needed(which, autograd_calls):
    """Without autograd the GEMM is called directly (autograd's wrapping is pure host cost), with the
    same bits; with an input needing a gradient the differentiable call runs and the result has a backward."""
    x = _randn(2, 5, 48, dtype=torch.bfloat16, seed=29)
    w = _randn(40, 48, dtype=torch.bfloat16, seed=30)
    op = (
        (lambda x, w: TritonMatmulOp()(a=x, b=w.t()))
        if which == "matmul"
        else (lambda x, w: TritonLmHeadOp()(hidden=x, weight=w))
    )
    direct = op(x, w)
    assert autograd_calls == []
    with torch.no_grad():
        op(x, w.requires_grad_(True))
    assert autograd_calls == []
    through_op = op(x, w)
    assert len(autograd_calls) == 1 and through_op.grad_fn is not None
    assert_bitwise(direct, through_op.detach(), f"{which}: direct call vs differentiable call")


def test_lm_head_and_input_gradient_rows_are_batch_invariant():
    hidden = _randn(1, 33, 48, dtype=torch.bfloat16, seed=23)
    weight = _randn(40, 48, dtype=torch.bfloat16, seed=24)
    g = _randn(1, 33, 40, dtype=torch.bfloat16, seed=25)
    logits, (gh, _) = _grads(lambda h, w: TritonLmHeadOp()(hidden=h, weight=w), hidden, weight, grad_out=g)
    part, (gh_part, _) = _grads(
        lambda h, w: TritonLmHeadOp()(hidden=h, weight=w), hidden[:, 9:16], weight, grad_out=g[:, 9:16]
    )
    assert_bitwise(part, logits[:, 9:16], "logits rows 9..16 alone")
    assert_bitwise(gh_part, gh[:, 9:16], "grad hidden rows 9..16 alone")


# --- input errors and the config table --------------------------------------------------------------


def test_bad_inputs_name_the_input():
    a = torch.zeros(2, 3, 8, device=DEVICE)
    with pytest.raises(ValueError, match="b: expected shape"):
        TritonMatmulOp()(a=a, b=torch.zeros(5, 4, device=DEVICE))
    with pytest.raises(ValueError, match="a: expected shape"):
        TritonMatmulOp()(a=a[0], b=torch.zeros(8, 4, device=DEVICE))
    with pytest.raises(ValueError, match="weight"):
        TritonLmHeadOp()(hidden=a, weight=torch.zeros(4, 5, device=DEVICE))
    with pytest.raises(ValueError, match="dtype"):
        batch_invariant_mm(a[0], torch.zeros(8, 4, dtype=torch.float16, device=DEVICE))


@CONFIGS
@DTYPES
def test_out_rows_of_a_larger_matrix_get_the_bits_of_a_fresh_result(config, dtype):
    # `out=`: the product written into rows of a larger matrix (a weight gradient's vocabulary chunk)
    # gives the allocated result's bits and leaves the other rows alone; a layout it cannot take is one
    # clear error. Planted: a column slice (row stride too wide) is refused, not written past its rows.
    a, b = _randn(40, 24, dtype=dtype, seed=1), _randn(24, 32, dtype=dtype, seed=2)
    big = torch.full((50, 32), 7.0, dtype=dtype, device=DEVICE)
    got = batch_invariant_mm(a, b, config=config, out=big[5:45])
    assert got.data_ptr() == big[5:45].data_ptr()
    assert_bitwise(big[5:45], batch_invariant_mm(a, b, config=config), "out rows")
    assert (big[:5] == 7).all() and (big[45:] == 7).all()
    with pytest.raises(ValueError, match="out: expected"):
        batch_invariant_mm(a, b, config=config, out=torch.zeros(40, 64, dtype=dtype, device=DEVICE)[:, :32])
    with pytest.raises(ValueError, match="out: expected"):
        batch_invariant_mm(a, b, config=config, out=torch.zeros(40, 32, dtype=torch.float64, device=DEVICE))


def test_empty_reduction_gives_zeros():
    out = batch_invariant_mm(torch.zeros(3, 0, device=DEVICE), torch.zeros(0, 4, device=DEVICE))
    assert out.shape == (3, 4) and not out.any()


def _smem_bytes(cfg: MatmulConfig, elem: int) -> int:
    operands = (cfg.block_m + cfg.block_n) * cfg.block_k * elem * cfg.num_stages
    epilogue = cfg.block_m * cfg.block_n * elem if cfg.tma else 0  # TMA store staging tile
    return operands + epilogue


TABLE = [(name, cfg) for name, cfg in GPU_CONFIGS.items()] + [
    (f"{name}-N{n}-K{k}", cfg) for (name, n, k), cfg in GPU_CONFIG_OVERRIDES.items()
]


@pytest.mark.parametrize("name,cfg", TABLE, ids=[name for name, _ in TABLE])
def test_gpu_config_table_is_launchable(name, cfg):
    """The H200 table: power-of-two tiles that fit in 227 KB of shared memory."""
    elem = 4 if name.startswith("float32") else 2
    for size in (cfg.block_m, cfg.block_n, cfg.block_k, cfg.num_warps):
        assert size & (size - 1) == 0, f"{name}: {size} is not a power of two"
    assert _smem_bytes(cfg, elem) <= 227 * 1024, f"{name}: {_smem_bytes(cfg, elem)} bytes of shared memory"


def test_config_depends_on_n_and_k_only():
    import inspect

    assert list(inspect.signature(matmul_config).parameters) == ["dtype", "n", "k"]


# --- the host path: one plan per (dtype, N, K, device, config), direct launches of the compiled kernel ---


class _FakeCompiledKernel:
    """Stands in for Triton's CompiledKernel: records what a direct launch passes."""

    function, packed_metadata = "function", "metadata"

    def __init__(self, calls):
        self.calls = calls

    def run(self, grid_x, grid_y, grid_z, stream, function, metadata, launch_metadata, enter, exit, *args):
        self.calls.append(("direct", (grid_x,), args, {"stream": stream, "hooks": (enter, exit)}))


class _FakeTmaKernel:
    """Stands in for the jitted TMA kernel: kernel[grid](*args) records the call, returns the compiled kernel."""

    def __init__(self, calls):
        self.calls = calls

    def __getitem__(self, grid):
        def launch(*args, **options):
            self.calls.append(("triton", grid, args, options))
            return _FakeCompiledKernel(self.calls)

        return launch


@pytest.fixture
def fake_gpu_launch(monkeypatch):
    """The GPU launch path of the TMA kernel, with the kernel and the CUDA queries stubbed (runs on a CPU)."""
    from rl_engine.kernels.ops.triton.linear import matmul as module

    calls = []
    monkeypatch.setattr(module, "_matmul_tma_kernel", _FakeTmaKernel(calls))
    monkeypatch.setattr(module, "ensure_cuda_context", lambda device: None)
    monkeypatch.setattr(module, "_current_stream", lambda: lambda device: 1234)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    plan = dataclasses.replace(module._make_plan(torch.bfloat16, 40, 48, -1, TMA), interpreting=False)
    return module, plan, calls


def _check_direct_launch(launch_tma, plan, calls):
    """Launch a plan twice, at M = 33 then M = 1: the first goes through Triton (compiles, binds), the
    second reuses its compiled kernel with the very same arguments, on the current stream, no hooks."""
    descriptors = ("a_desc", "b_desc", "c_desc")
    for m in (33, 1):
        launch_tma(plan, 3, descriptors, m, 40, 48, False, True)
    (via_triton, _, triton_args, options), (via_run, grid, direct_args, extra) = calls
    assert (via_triton, via_run) == ("triton", "direct")
    expected = (*descriptors, 1, 40, 48, None, None, None, None, False, True, *plan.constexprs,
                False, False, False, False, False)
    assert direct_args == expected, f"direct launch passed {direct_args}"
    assert grid == (3,) and extra == {"stream": 1234, "hooks": (None, None)}
    assert triton_args[3:] == (33, *expected[4:]), "both paths bind the kernel's parameters in one order"
    assert options == {"num_warps": TMA.num_warps, "num_stages": TMA.num_stages, "launch_pdl": False}


def test_a_decode_plan_launches_with_pdl_and_hands_the_weight(fake_gpu_launch):
    """A small-M tier's plan (pdl): the stored weight goes to w_ptr, PDL is on, and the launch asks for programmatic
    dependent launch; a continuation (init=) of the same plan does not."""
    module, plan, calls = fake_gpu_launch
    plan = dataclasses.replace(plan, pdl=True, tma_kernels={})
    weight = torch.empty(48, 40, dtype=torch.bfloat16).t()
    for m in (33, 1):
        module._launch_tma(plan, 3, ("a", "b", "c"), m, 40, 48, False, True, weight=weight)
    (_, _, triton_args, options), (_, _, direct_args, _) = calls
    assert direct_args[8] is weight and direct_args[-3] is True and options["launch_pdl"] is True
    assert triton_args[8] is weight and triton_args[-3] is True
    init = torch.zeros(1, 40)
    module._launch_tma(plan, 3, ("a", "b", "c"), 1, 40, 48, False, True, init, weight=weight)
    assert calls[-1][2][8] is None and calls[-1][2][-3] is False and calls[-1][3]["launch_pdl"] is False


def test_direct_launch_passes_what_triton_would(fake_gpu_launch):
    module, plan, calls = fake_gpu_launch
    _check_direct_launch(module._launch_tma, plan, calls)
    module._launch_tma(plan, 3, ("a", "b", "c"), 5, 40, 48, True, True)  # another A_TRANS: another kernel
    assert calls[-1][0] == "triton"


def test_direct_launch_check_catches_swapped_arguments(fake_gpu_launch):
    """Planted bug: a direct launch that passes K before N."""
    module, plan, calls = fake_gpu_launch

    def swapped_launch(plan, grid, descriptors, m, n, k, a_trans, b_trans):
        kernel = plan.tma_kernels.get((0, a_trans, b_trans, False, False, False, False))
        if kernel is None:
            return module._launch_tma(plan, grid, descriptors, m, n, k, a_trans, b_trans)
        args = (*descriptors, m, k, n, None, None, None, None, a_trans, b_trans, *plan.constexprs, False, False, False,
                False, False)
        kernel.run(grid, 1, 1, 1234, kernel.function, kernel.packed_metadata, None, None, None, *args)

    with pytest.raises(AssertionError, match="direct launch passed"):
        _check_direct_launch(swapped_launch, plan, calls)


def test_profiler_hooks_send_every_launch_through_triton(fake_gpu_launch):
    import triton

    module, plan, calls = fake_gpu_launch
    hook = lambda metadata: None  # noqa: E731
    triton.knobs.runtime.launch_enter_hook.add(hook)
    try:
        for m in (33, 1):
            module._launch_tma(plan, 3, ("a", "b", "c"), m, 40, 48, False, True)
    finally:
        triton.knobs.runtime.launch_enter_hook.remove(hook)
    assert [c[0] for c in calls] == ["triton", "triton"]
    module._launch_tma(plan, 3, ("a", "b", "c"), 1, 40, 48, False, True)
    assert calls[-1][0] == "direct"


def test_plan_is_built_once_per_shape_and_not_per_batch_size():
    from rl_engine.kernels.ops.triton.linear import matmul as module

    w = _randn(40, 48, dtype=torch.float32, seed=28)
    module._plans.clear()
    for m in (1, 7, 64):
        batch_invariant_mm(_randn(m, 48, dtype=torch.float32, seed=m), w.t())
    assert len(module._plans) == 1, list(module._plans)
    (dtype, n, k, _, config), plan = next(iter(module._plans.items()))
    assert (dtype, n, k, config) == (torch.float32, 40, 48, None) and plan.config == matmul_config(dtype, n, k)


# --- on the H200 -------------------------------------------------------------------------------------

# Qwen3-8B projections (hidden 4096): (N, K) of q/o, k/v, gate/up, down.
QWEN3_8B_SHAPES = [(4096, 4096), (1024, 4096), (12288, 4096), (4096, 12288)]


@pytest.mark.gpu
@pytest.mark.parametrize("n,k", QWEN3_8B_SHAPES, ids=lambda v: str(v))
@pytest.mark.parametrize("tma", [True, False], ids=["tma", "pointer"])
def test_gpu_rows_bitwise_invariant_at_qwen3_shapes(n, k, tma):
    a = torch.randn(4096, k, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) / k**0.5
    config = dataclasses.replace(matmul_config(torch.bfloat16, n, k), tma=tma)
    full = batch_invariant_mm(a, w.t(), config=config)
    for start, m in [(0, 1), (0, 7), (0, 64), (1000, 7), (4095, 1)]:
        part = batch_invariant_mm(a[start : start + m].clone(), w.t(), config=config)
        assert_bitwise(part, full[start : start + m], f"N={n} K={k} rows {start}+{m}")
    ref = NativeMatmulOp()(a=a[None, :256], b=w.t())[0]
    base = NativeMatmulOp().baseline(a=a[None, :256], b=w.t())[0]
    assert_close_to_reference(full[:256], ref, base, what=f"N={n} K={k}")


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=str)
def test_gpu_other_dtypes(dtype):
    a = torch.randn(512, 4096, device="cuda", dtype=dtype)
    w = torch.randn(1024, 4096, device="cuda", dtype=dtype) / 64
    full = batch_invariant_mm(a, w.t())
    assert_bitwise(batch_invariant_mm(a[3:4].clone(), w.t()), full[3:4], f"{dtype} row 3 alone")
    ref = NativeMatmulOp()(a=a[None], b=w.t())[0]
    if dtype == torch.float32:
        torch.testing.assert_close(full, ref, atol=1e-4, rtol=1e-4)  # ieee: no TF32
    else:
        assert_close_to_reference(full, ref, NativeMatmulOp().baseline(a=a[None], b=w.t())[0], what=str(dtype))


@pytest.mark.gpu
def test_gpu_lm_head_qwen3_vocab():
    hidden = torch.randn(1, 64, 4096, device="cuda", dtype=torch.bfloat16)
    weight = torch.randn(151936, 4096, device="cuda", dtype=torch.bfloat16) / 64
    logits = TritonLmHeadOp()(hidden=hidden, weight=weight)
    assert_bitwise(TritonLmHeadOp()(hidden=hidden[:, 5:6], weight=weight), logits[:, 5:6], "token 5 alone")
    ref = NativeLmHeadOp()(hidden=hidden, weight=weight)
    assert_close_to_reference(logits, ref, NativeLmHeadOp().baseline(hidden=hidden, weight=weight), what="lm_head")


@pytest.mark.gpu
def test_gpu_gradients_and_determinism():
    a = torch.randn(2, 300, 1024, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(1024, 768, device="cuda", dtype=torch.bfloat16) / 32
    g = torch.randn(2, 300, 768, device="cuda")
    out, (ga, gb) = _grads(lambda a, b: TritonMatmulOp()(a=a, b=b), a, b, grad_out=g)
    out2, (ga2, gb2) = _grads(lambda a, b: TritonMatmulOp()(a=a, b=b), a, b, grad_out=g)
    for name, x, y in [("out", out, out2), ("grad a", ga, ga2), ("grad b", gb, gb2)]:
        assert_bitwise(x, y, f"rerun {name}")
    ref, (ra, rb) = _grads(lambda a, b: NativeMatmulOp()(a=a, b=b), a.float(), b.float(), grad_out=g)
    base, (ba, bb) = _grads(lambda a, b: NativeMatmulOp().baseline(a=a, b=b), a, b, grad_out=g)
    assert_close_to_reference(out, ref, base, what="out")
    assert_close_to_reference(ga, ra, ba, what="grad a")
    assert_close_to_reference(gb, rb, bb, what="grad b")


@pytest.mark.gpu
def test_gpu_direct_launch_and_cuda_graph_give_triton_launch_bits():
    """The cached direct launch, and the same call captured in a CUDA graph, reproduce the bits of
    the launch Triton binds itself (forward layout, and the transposed a of the weight gradient)."""
    from rl_engine.kernels.ops.triton.linear import matmul as module

    a = torch.randn(320, 1024, device="cuda", dtype=torch.bfloat16)  # 320 tokens: 16-byte rows of a.t()
    w = torch.randn(768, 1024, device="cuda", dtype=torch.bfloat16) / 32
    g = torch.randn(320, 768, device="cuda", dtype=torch.bfloat16)
    for x, y, what in [(a, w.t(), "a @ w.t()"), (a.t(), g, "a.t() @ g")]:
        module._plans.clear()
        first = batch_invariant_mm(x, y)  # through Triton's launch
        again = batch_invariant_mm(x, y)  # direct launch of the compiled kernel
        assert any(plan.tma_kernels for plan in module._plans.values()), f"{what}: the TMA kernel ran"
        assert_bitwise(again, first, f"{what}: direct launch")
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            captured = batch_invariant_mm(x, y)
        graph.replay()
        torch.cuda.synchronize()
        assert_bitwise(captured, first, f"{what}: CUDA graph replay")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("parts", [2, 4])
def test_a_product_continued_over_k_slices_has_the_bits_of_one_launch(dtype, parts):
    """init= / out_fp32= split one product's K loop over launches (a tensor-parallel rank per slice)."""
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(37, 128, generator=gen).to(dtype)
    w = (torch.randn(48, 128, generator=gen) / 8).to(dtype)
    step = 128 // parts
    acc = None
    for i in range(parts):
        s = slice(i * step, (i + 1) * step)
        acc = batch_invariant_mm(x[:, s].contiguous(), w[:, s].contiguous().t(), init=acc, out_fp32=i < parts - 1)
    assert acc.dtype == dtype and torch.equal(acc, batch_invariant_mm(x, w.t()))


def test_the_continuation_check_catches_partials_summed_afterwards():
    # Planted: each slice from zero, then added: fp32 shows the different order (bf16 may round it away).
    gen = torch.Generator().manual_seed(0)
    x, w = torch.randn(37, 128, generator=gen), torch.randn(48, 128, generator=gen) / 8
    halves = [batch_invariant_mm(x[:, s].contiguous(), w[:, s].contiguous().t(), out_fp32=True)
              for s in (slice(0, 64), slice(64, 128))]
    assert not torch.equal(halves[0] + halves[1], batch_invariant_mm(x, w.t()))


def test_a_continuation_refuses_an_init_of_the_wrong_kind():
    x, w = torch.randn(4, 32), torch.randn(8, 32)
    with pytest.raises(ValueError, match="init: expected float32"):
        batch_invariant_mm(x, w.t(), init=torch.zeros(4, 8, dtype=torch.bfloat16))


# --- the residual epilogue (a decoder layer's h + o_proj(a), h + down_proj(m)) ---------------------


def _residual_case(dtype, m=9, k=48, n=40):
    a, w = _randn(m, k, dtype=dtype, seed=11), _randn(n, k, dtype=dtype, seed=12)
    return a, w, _randn(m, n, dtype=dtype, seed=13) * 64  # large beside the product: the add rounds


@CONFIGS
@DTYPES
def test_a_fused_residual_has_the_bits_of_the_separate_add(config, dtype):
    a, w, h = _residual_case(dtype)
    fused = batch_invariant_mm(a, w.t(), config=config, residual=h)
    assert_bitwise(fused, h + batch_invariant_mm(a, w.t(), config=config), f"{dtype} residual")


def test_the_residual_check_catches_an_add_before_rounding():
    # Planted: the residual added to the fp32 accumulator, rounded once; the case must tell it from the kernel's.
    a, w, h = _residual_case(torch.float16)
    fused = batch_invariant_mm(a, w.t(), config=TMA, residual=h)
    planted = (h.float() + batch_invariant_mm(a, w.t(), config=TMA, out_fp32=True)).to(torch.float16)
    with pytest.raises(AssertionError, match="elements differ"):
        assert_bitwise(planted, fused, "add before rounding")


def test_the_matmul_op_adds_its_residual_and_refuses_a_wrong_one():
    a, w, h = _residual_case(torch.bfloat16)
    op = TritonMatmulOp()
    assert_bitwise(op(a=a[None], b=w.t(), residual=h[None]), h[None] + op(a=a[None], b=w.t()), "op residual")
    assert_bitwise(NativeMatmulOp().baseline(a=a[None], b=w.t(), residual=h[None]),
                   h[None] + a[None] @ w.t(), "torch residual")
    with pytest.raises(ValueError, match="residual: expected shape"):
        op(a=a[None], b=w.t(), residual=h[None, :, :-1])
    with pytest.raises(ValueError, match="residual: expected a's dtype"):
        op(a=a[None], b=w.t(), residual=h[None].float())


def test_a_differentiable_residual_call_gives_the_residual_its_gradient():
    a, w, h = (t.float().requires_grad_() for t in _residual_case(torch.float32))
    TritonMatmulOp()(a=a[None], b=w.t(), residual=h[None]).sum().backward()
    assert torch.equal(h.grad, torch.ones_like(h)) and a.grad is not None and w.grad is not None


@pytest.mark.gpu
@pytest.mark.parametrize("m", [1, 16, 64, 300])
def test_gpu_fused_residual_has_the_bits_of_the_separate_add(m):
    # Qwen3-8B's o_proj and down_proj at decode and prefill M (each M's own tier), with their L2 prefetch and PDL.
    for n, k in ((4096, 4096), (4096, 12288)):
        a = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) / k**0.5
        h = torch.randn(m, n, device="cuda", dtype=torch.bfloat16) * 8
        assert_bitwise(batch_invariant_mm(a, w.t(), residual=h), h + batch_invariant_mm(a, w.t()), f"{m}x{n}x{k}")
