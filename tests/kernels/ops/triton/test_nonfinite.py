"""NaN and ±inf propagate through every Triton op (attention aside) to the same places as in the gold.

For each op, a NaN, +inf or -inf is planted in one entry of one floating input, or of the upstream
gradient, and the NaN, +inf and -inf positions of the output and of every input gradient must be
the gold op's (the gold propagates them itself: the comparison fails if either side hides one), and
the finite entries must still agree. fp32 throughout (the interpreter's bf16 `tl.dot` is wrong).

Under the CPU interpreter an elementwise max (`tl.maximum`) keeps NaN (numpy's maximum) where the
GPU's drops it (maxnum); the autouse fixture makes the interpreter drop it too, so that a kernel
relying on a NaN-keeping max fails here, not only on the H200.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

import rl_engine.kernels.ops.triton.loss.logp as logp_module
from rl_engine.kernels.ops.pytorch.activation.silu import NativeSiluOp
from rl_engine.kernels.ops.pytorch.activation.swiglu import NativeSwigluOp
from rl_engine.kernels.ops.pytorch.embedding.embedding import NativeEmbeddingOp
from rl_engine.kernels.ops.pytorch.linear.lm_head import NativeLmHeadOp
from rl_engine.kernels.ops.pytorch.linear.matmul import NativeMatmulOp
from rl_engine.kernels.ops.pytorch.loss.linear_logp import NativeLinearLogpOp
from rl_engine.kernels.ops.pytorch.loss.logp import NativeLogpOp
from rl_engine.kernels.ops.pytorch.norm.rms_norm import NativeRmsNormOp
from rl_engine.kernels.ops.pytorch.position.rope import NativeRopeOp
from rl_engine.kernels.ops.triton.activation.silu import TritonSiluOp
from rl_engine.kernels.ops.triton.activation.swiglu import TritonSwigluOp
from rl_engine.kernels.ops.triton.embedding.embedding import TritonEmbeddingOp
from rl_engine.kernels.ops.triton.linear.lm_head import TritonLmHeadOp
from rl_engine.kernels.ops.triton.linear.matmul import TritonMatmulOp
from rl_engine.kernels.ops.triton.loss.linear_logp import TritonLinearLogpOp
from rl_engine.kernels.ops.triton.loss.logp import TritonLogpOp
from rl_engine.kernels.ops.triton.norm.rms_norm import TritonRmsNormOp
from rl_engine.kernels.ops.triton.position.rope import TritonRopeOp
from rl_engine.kernels.ops.triton.runtime import interpreting

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
NAN, INF = float("nan"), float("inf")


@pytest.fixture(autouse=True)
def gpu_max_semantics(monkeypatch):
    """Under the interpreter, maxnum/minnum return the non-NaN operand, as on the GPU."""
    if interpreting():
        from triton.runtime.interpreter import InterpreterBuilder

        monkeypatch.setattr(InterpreterBuilder, "create_maxnumf", lambda self, a, b: self.binary_op(a, b, np.fmax))
        monkeypatch.setattr(InterpreterBuilder, "create_minnumf", lambda self, a, b: self.binary_op(a, b, np.fmin))


def _logp_inputs(g):
    return dict(logits=torch.randn(2, 3, 37, generator=g) * 3, target_ids=torch.randint(0, 37, (2, 3), generator=g))


def _linear_logp_inputs(g):
    return dict(hidden=torch.randn(1, 3, 16, generator=g), lm_head_weight=torch.randn(37, 16, generator=g),
                target_ids=torch.randint(0, 37, (1, 3), generator=g), bias=torch.randn(37, generator=g))


# name -> (candidate, gold, inputs from a generator). Shapes cross the interpreter's borders: logp
# chunks of 32 (V = 37: a tail, lanes that see two entries), linear_logp tiles of 16, GEMM K tiles of 16.
OPS = {
    "logp": (TritonLogpOp, NativeLogpOp, _logp_inputs),
    "linear_logp": (TritonLinearLogpOp, NativeLinearLogpOp, _linear_logp_inputs),
    "rms_norm": (TritonRmsNormOp, NativeRmsNormOp,
                 lambda g: dict(x=torch.randn(1, 3, 8, generator=g), weight=torch.randn(8, generator=g))),
    "silu": (TritonSiluOp, NativeSiluOp, lambda g: dict(x=torch.randn(1, 2, 8, generator=g) * 4)),
    "swiglu": (TritonSwigluOp, NativeSwigluOp,
               lambda g: dict(gate=torch.randn(1, 2, 8, generator=g) * 4, up=torch.randn(1, 2, 8, generator=g))),
    "rope": (TritonRopeOp, NativeRopeOp,
             lambda g: dict(x=torch.randn(1, 2, 2, 8, generator=g), positions=torch.tensor([[0, 5]]))),
    "embedding": (TritonEmbeddingOp, NativeEmbeddingOp,
                  lambda g: dict(token_ids=torch.tensor([[1, 3, 1, 0]]), weight=torch.randn(5, 8, generator=g))),
    "matmul": (TritonMatmulOp, NativeMatmulOp,
               lambda g: dict(a=torch.randn(1, 3, 20, generator=g), b=torch.randn(20, 8, generator=g))),
    "lm_head": (TritonLmHeadOp, NativeLmHeadOp,
                lambda g: dict(hidden=torch.randn(1, 3, 20, generator=g), weight=torch.randn(8, 20, generator=g))),
}
GRAD_OUT = "grad_out"


def _cases():
    for name, (_, _, make) in OPS.items():
        floats = [k for k, v in make(torch.Generator().manual_seed(0)).items() if v.is_floating_point()]
        for where in [*floats, GRAD_OUT]:
            for value in (NAN, INF, -INF):
                yield pytest.param(name, where, value, id=f"{name}-{where}-{value}")


def _plant(t, value):
    t = t.clone()
    t.view(-1)[t.numel() // 3] = value  # an entry every op reads (embedding: a looked-up row)
    return t


def _run(op, inputs, where, value):
    leaves = {k: v.clone().requires_grad_() if v.is_floating_point() else v for k, v in inputs.items()}
    out = op(**leaves)
    grad_out = torch.randn(out.shape, generator=torch.Generator().manual_seed(1)).to(DEVICE)
    if where == GRAD_OUT:
        grad_out = _plant(grad_out, value)
    floats = [k for k, v in leaves.items() if v.is_floating_point()]
    grads = torch.autograd.grad(out, [leaves[k] for k in floats], grad_out)
    return {"out": out.detach(), **{f"d{k}": g for k, g in zip(floats, grads)}}


def _positions(t):
    return t.isnan(), t.isposinf(), t.isneginf()


@pytest.mark.parametrize("name, where, value", list(_cases()))
def test_nan_and_inf_land_where_the_gold_puts_them(name, where, value):
    candidate, gold, make = OPS[name]
    inputs = {k: v.to(DEVICE) for k, v in make(torch.Generator().manual_seed(0)).items()}
    if where != GRAD_OUT:
        inputs[where] = _plant(inputs[where], value)
    got, ref = _run(candidate(), inputs, where, value), _run(gold(), inputs, where, value)
    for key in ref:
        a, b = got[key].float(), ref[key]
        nan_a, nan_b = a.isnan(), b.isnan()
        # ±inf upstream gradient on a logprob: the gold's backward adds the gather's g to logsumexp's
        # -g·p, inf - inf = NaN at the target, where the fused g·(1 - p) is ±inf (IEEE for the
        # derivative 1 - p). Allowed there only; every other position must match exactly.
        fused = name in ("logp", "linear_logp") and where == GRAD_OUT and abs(value) == INF
        allowed = nan_b & a.isinf() if fused else torch.zeros_like(nan_b)
        assert torch.equal(nan_a, nan_b & ~allowed), f"{key}: NaN at {(nan_a ^ nan_b).nonzero().tolist()[:8]}"
        assert torch.equal(a.isposinf(), b.isposinf() | (allowed & a.isposinf())), f"{key}: +inf positions"
        assert torch.equal(a.isneginf(), b.isneginf() | (allowed & a.isneginf())), f"{key}: -inf positions"
        finite = b.isfinite()
        torch.testing.assert_close(a[finite], b[finite], rtol=1e-4, atol=1e-5, msg=key)


# Rows of a [cases, 2, 37] logits tensor (targets 3 and 5): vocabulary entry -> planted value. With
# chunks of 32 entries 3 and 35 share a lane ("one lane"); 36 is in the tail chunk.
LOGP_ROWS = {
    "nan": {3: NAN}, "+inf": {3: INF}, "-inf": {3: -INF}, "nan in the tail": {36: NAN}, "+inf in the tail": {36: INF},
    "two +inf, one lane": {3: INF, 35: INF}, "+inf then nan, one lane": {3: INF, 35: NAN},
    "nan then +inf, one lane": {3: NAN, 35: INF}, "+inf and nan": {3: INF, 20: NAN}, "+inf and -inf": {3: INF, 4: -INF},
    "all -inf": dict.fromkeys(range(37), -INF), "all +inf": dict.fromkeys(range(37), INF),
    "all nan": dict.fromkeys(range(37), NAN),
}


@pytest.fixture(params=logp_module.ALGOS)
def algo(request, monkeypatch):
    """Every forward algorithm of logp, not only the shipped one, for every dtype."""
    configs = {k: dict(v, ALGO=request.param) for k, v in logp_module.FORWARD_CONFIGS.items()}
    monkeypatch.setattr(logp_module, "FORWARD_CONFIGS", configs)
    return request.param


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_logp_rows_with_nan_and_inf_in_every_algorithm(algo, dtype):
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(len(LOGP_ROWS), 2, 37, generator=gen) * 3
    for row, planted in enumerate(LOGP_ROWS.values()):
        for entry, value in planted.items():
            logits[row, :, entry] = value
    logits = logits.to(dtype).to(DEVICE)
    targets = torch.tensor([[3, 5]] * len(LOGP_ROWS), device=DEVICE)
    inputs = dict(logits=logits, target_ids=targets)
    got, ref = _run(TritonLogpOp(), inputs, None, None), _run(NativeLogpOp(), inputs, None, None)
    for key in ("out", "dlogits"):
        for row, case in enumerate(LOGP_ROWS):
            a, b = got[key][row].float(), ref[key][row].float()
            where = f"{case}, {key}"
            for kind, pa, pb in zip(("NaN", "+inf", "-inf"), _positions(a), _positions(b)):
                assert torch.equal(pa, pb), f"{where}: {kind} at {pa.nonzero().tolist()}, gold {pb.nonzero().tolist()}"
            finite = b.isfinite()
            torch.testing.assert_close(a[finite], b[finite], rtol=2**-7, atol=1e-5, msg=where)


def test_logp_issue_repro_nan_in_a_long_row():
    logits = torch.randn(1, 1, 5000, generator=torch.Generator().manual_seed(0)).to(DEVICE)
    logits[0, 0, 4000] = NAN
    targets = torch.tensor([[7]], device=DEVICE)
    assert TritonLogpOp()(logits=logits, target_ids=targets).isnan().all()


def test_linear_logp_a_tile_of_minus_inf_logits_is_neutral():
    # A -inf bias over a whole vocabulary tile (16 under the interpreter) masks those tokens; the
    # tile's max is -inf and its sum must be 0, not exp(-inf - -inf) = NaN. A row whose every
    # logit is -inf gives NaN, as the gold does.
    inputs = {k: v.to(DEVICE) for k, v in _linear_logp_inputs(torch.Generator().manual_seed(3)).items()}
    inputs["bias"][:32] = -INF
    inputs["target_ids"][0, 1] = 33
    got, ref = _run(TritonLinearLogpOp(), inputs, None, None), _run(NativeLinearLogpOp(), inputs, None, None)
    assert got["out"][0, 1].isfinite()
    for key in ref:
        assert all(torch.equal(p, q) for p, q in zip(_positions(got[key]), _positions(ref[key]))), key
        torch.testing.assert_close(got[key], ref[key], rtol=1e-4, atol=1e-5, equal_nan=True)
    inputs["bias"][:] = -INF
    assert TritonLinearLogpOp()(**inputs).isnan().all() and NativeLinearLogpOp()(**inputs).isnan().all()


def test_linear_logp_nan_next_to_plus_inf_in_one_tile_gives_nan():
    # The tile's max must keep the NaN: a max that dropped it would give +inf, and the lse +inf.
    inputs = {k: v.to(DEVICE) for k, v in _linear_logp_inputs(torch.Generator().manual_seed(4)).items()}
    inputs["bias"][33], inputs["bias"][34] = INF, NAN
    assert NativeLinearLogpOp()(**inputs).isnan().all()
    assert TritonLinearLogpOp()(**inputs).isnan().all()
