"""The Triton ops as torch custom ops: torch.library's own checks, and torch.compile(fullgraph=True)
tracing a tiny model built from them with the eager bits, forward and backward."""

from __future__ import annotations

import pytest
import torch

from rl_engine.kernels.ops.triton.activation.silu import _silu_fake, silu, silu_backward_op, silu_op
from rl_engine.kernels.ops.triton.activation.swiglu import swiglu, swiglu_backward_op, swiglu_op
from rl_engine.kernels.ops.triton.attention.attention import triton_attention
from rl_engine.kernels.ops.triton.attention.contract import sequence_table
from rl_engine.kernels.ops.triton.attention.dispatch import (
    flash_attention,
    flash_attention_backward_op,
    flash_attention_op,
)
from rl_engine.kernels.ops.triton.embedding.embedding import embedding, embedding_backward_op, embedding_op
from rl_engine.kernels.ops.triton.linear.lm_head import lm_head_op
from rl_engine.kernels.ops.triton.linear.matmul import batch_invariant_mm_op, triton_matmul
from rl_engine.kernels.ops.triton.loss.linear_logp import linear_logp, linear_logp_backward_op, linear_logp_op
from rl_engine.kernels.ops.triton.loss.logp import logp, logp_backward_op, logp_op
from rl_engine.kernels.ops.triton.norm.rms_norm import rms_norm, rms_norm_backward_op, rms_norm_op
from rl_engine.kernels.ops.triton.position.rope import rope, rope_op

# Every opcheck test_util runs here: under the interpreter the ops run real kernels on CPU tensors, and
# the aot_dispatch checks trace through the fake implementations. None is excluded.
CHECKS = ("test_schema", "test_autograd_registration", "test_faketensor", "test_aot_dispatch_static",
          "test_aot_dispatch_dynamic")


# Without CUDA the kernels run under the interpreter on CPU tensors; with it, on the GPU.
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _on_device(arg):
    """arg on DEVICE with its strides and requires_grad (cases are built on the CPU)."""
    if not isinstance(arg, torch.Tensor):
        return arg
    return arg.detach().to(DEVICE).requires_grad_(arg.requires_grad)


def _randn(*shape, seed, grad=True, dtype=torch.float32):
    t = torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(dtype)
    return t.requires_grad_(grad)


def _ints(high, *shape, seed):
    return torch.randint(0, high, shape, generator=torch.Generator().manual_seed(seed))


def _table(batch, seq):
    """The padded form's table: one sequence per row, every row covered (no uninitialised output)."""
    row0 = torch.arange(batch, dtype=torch.int32) * seq
    length = torch.full((batch,), seq, dtype=torch.int32)
    return sequence_table(row0, length, torch.zeros_like(length), row0, length, max_q_count=seq, max_kv_len=seq)


def _cases():
    """(name, op, args): each op with small inputs; forwards with inputs that need a gradient."""
    x, d = (2, 5, 8), dict(grad=False)
    return [
        ("silu", silu_op, (_randn(*x, seed=1),)),
        ("silu_backward", silu_backward_op, (_randn(*x, seed=2, **d), _randn(*x, seed=3, **d))),
        ("swiglu", swiglu_op, (_randn(*x, seed=4), _randn(*x, seed=5))),
        ("swiglu_backward", swiglu_backward_op, tuple(_randn(*x, seed=s, **d) for s in (6, 7, 8))),
        ("rms_norm", rms_norm_op, (_randn(*x, seed=9), _randn(8, seed=10), 1e-6)),
        ("rms_norm_backward", rms_norm_backward_op, (_randn(*x, seed=11, **d), _randn(*x, seed=12, **d),
                                                     _randn(8, seed=13, **d), torch.rand(10) + 0.5)),
        ("rope", rope_op, (_randn(2, 5, 2, 8, seed=14), _ints(100, 2, 5, seed=15), None, 1e4, False)),
        ("rope_inv_freq_transpose", rope_op, (_randn(2, 5, 2, 8, seed=16), _ints(100, 2, 5, seed=17),
                                              torch.rand(4), 1e4, True)),
        ("embedding", embedding_op, (_ints(11, 2, 5, seed=18), _randn(11, 8, seed=19))),
        ("embedding_backward", embedding_backward_op, (_randn(*x, seed=20, **d), _ints(11, 2, 5, seed=21), 11,
                                                       torch.bfloat16)),
        ("batch_invariant_mm", batch_invariant_mm_op, (_randn(7, 16, seed=22), _randn(16, 16, seed=23))),
        ("lm_head", lm_head_op, (_randn(7, 16, seed=24), _randn(20, 16, seed=25))),
        ("logp", logp_op, (_randn(2, 5, 40, seed=26), _ints(40, 2, 5, seed=27))),
        ("logp_backward", logp_backward_op, (_randn(2, 5, seed=28, **d), _randn(2, 5, 40, seed=29, **d),
                                             _ints(40, 2, 5, seed=30), torch.rand(10) + 4)),
        ("linear_logp", linear_logp_op, (_randn(2, 5, 16, seed=31), _randn(40, 16, seed=32),
                                         _ints(40, 2, 5, seed=33), _randn(40, seed=34))),
        ("linear_logp_no_bias", linear_logp_op, (_randn(2, 5, 16, seed=35), _randn(40, 16, seed=36),
                                                 _ints(40, 2, 5, seed=37), None)),
        # A transposed weight: the fake must give the gradient the strides the kernel path gives it.
        ("linear_logp_backward", linear_logp_backward_op, (
            _randn(2, 5, seed=38, **d), _randn(2, 5, 16, seed=39, **d), _randn(16, 40, seed=40, **d).t(),
            _ints(40, 2, 5, seed=41), _randn(40, seed=42, **d), torch.rand(10) + 4, True, True, True)),
        ("linear_logp_backward_hidden_only", linear_logp_backward_op, (
            _randn(2, 5, seed=43, **d), _randn(2, 5, 16, seed=44, **d), _randn(40, 16, seed=45, **d),
            _ints(40, 2, 5, seed=46), None, torch.rand(10) + 4, True, False, False)),
        ("flash_attention", flash_attention_op, (
            _randn(10, 4, 16, seed=47), _randn(10, 2, 16, seed=48), _randn(10, 2, 16, seed=49),
            _table(2, 5).info, 5, 5, True, 0.25, 1)),
        # kv-cache decode: two query heads per tile, forward only.
        ("flash_attention_heads_per_tile", flash_attention_op, (
            _randn(2, 4, 16, seed=50, **d), _randn(10, 2, 16, seed=51, **d), _randn(10, 2, 16, seed=52, **d),
            sequence_table(torch.arange(2, dtype=torch.int32), torch.ones(2, dtype=torch.int32),
                           torch.tensor([2, 4], dtype=torch.int32), torch.arange(2, dtype=torch.int32) * 5,
                           torch.tensor([3, 5], dtype=torch.int32), max_q_count=1, max_kv_len=5).info,
            1, 5, True, 0.25, 2)),
        ("flash_attention_backward", flash_attention_backward_op, (
            *(_randn(10, h, 16, seed=53 + i, **d) for i, h in enumerate((4, 4, 2, 2, 4))),
            torch.rand(10, 4) + 1, _table(2, 5).info, 5, 5, True, 0.25)),
    ]


@pytest.mark.parametrize("name, op, args", _cases(), ids=[c[0] for c in _cases()])
def test_opcheck(name, op, args):
    torch.library.opcheck(op, tuple(map(_on_device, args)), test_utils=CHECKS)


def test_eager_attention_is_the_custom_op_without_its_dispatch():
    """Eager autograd runs the op's implementation and backward without its dispatch (runtime.register_autograd):
    the same outputs and gradients, bit for bit, as the op with its registered autograd."""
    q, k, v = (_on_device(_randn(10, h, 16, seed=60 + i)) for i, h in enumerate((4, 2, 2)))
    info = _table(2, 5).info.to(DEVICE)
    grad = _on_device(_randn(10, 4, 16, seed=70, grad=False))
    results = []
    for fn in (lambda *a: flash_attention(*a, 1), lambda *a: flash_attention_op(*a, 1)):
        out, lse = fn(q, k, v, info, 5, 5, True, 0.25)
        results.append((out, lse, *torch.autograd.grad(out, (q, k, v), grad)))
    for name, a, b in zip(("out", "lse", "dq", "dk", "dv"), *results, strict=True):
        assert torch.equal(a, b), name


@pytest.mark.parametrize("mode", ["fake", "meta"])
def test_attention_on_fake_and_meta_tensors_takes_the_custom_op(mode):
    """Shapes without data (memory planning, meta-device init) go through the op's fake: the eager path would
    launch kernels on tensors that have no storage."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    q, k, v = (torch.empty(2, 5, h, 16, device="meta") for h in (4, 2, 2))
    if mode == "fake":
        with FakeTensorMode() as fake:
            q, k, v = (fake.from_tensor(torch.empty(2, 5, h, 16)).requires_grad_() for h in (4, 2, 2))
            out = triton_attention(q, k, v)
    else:
        out = triton_attention(q, k, v)
    assert out.shape == q.shape and out.dtype == q.dtype


def test_opcheck_catches_a_wrong_fake():
    """A fake that disagrees with the kernel (here: dtype) fails the fake-tensor check."""
    args = (_on_device(_randn(2, 5, 8, seed=1)),)

    def wrong_fake(x):
        return torch.empty_like(x, dtype=torch.float64)

    silu_op.register_fake(wrong_fake)
    try:
        with pytest.raises(Exception, match="Dtypes"):
            torch.library.opcheck(silu_op, args, test_utils=("test_faketensor",))
    finally:
        silu_op.register_fake(_silu_fake)
    torch.library.opcheck(silu_op, args, test_utils=("test_faketensor",))


def _tiny_model(ids, positions, emb, norm_w, w_qk, w_gate, w_up, w_down):
    """Embedding -> RMSNorm -> projection + RoPE -> causal GQA attention -> SwiGLU / SiLU MLP -> log-probabilities
    of the next ids (fused and from logits): every converted op with a backward."""
    h = embedding(ids, emb)
    x = rms_norm(h, norm_w)
    q = rope(triton_matmul(x, w_qk).reshape(*ids.shape, 2, 8), positions, theta=1e4)
    h = h + triton_attention(q, q[:, :, :1], x.reshape(*ids.shape, 1, 16)[..., :8]).reshape(h.shape)
    x = rms_norm(h, norm_w)
    y = swiglu(triton_matmul(x, w_gate), triton_matmul(x, w_up))
    h = h + triton_matmul(silu(y), w_down)
    targets = ids.roll(-1, dims=1)
    return linear_logp(h, emb, targets) + logp(triton_matmul(h, emb.t()), targets)


def _model_inputs(device="cpu", dtype=torch.float32):
    ids, positions = _ints(11, 2, 5, seed=30).to(device), _ints(64, 2, 5, seed=31).to(device)
    weights = [_randn(*shape, seed=32 + i, grad=False, dtype=dtype).to(device).requires_grad_(True)
               for i, shape in enumerate([(11, 16), (16,), (16, 16), (16, 32), (16, 32), (32, 16)])]
    return ids, positions, weights


def _forward_backward(fn, ids, positions, weights):
    out = fn(ids, positions, *weights)
    grads = torch.autograd.grad(out, weights, grad_outputs=torch.ones_like(out))
    return out.detach(), grads


def _assert_compiled_gives_the_eager_bits(backend, device, dtype):
    ids, positions, weights = _model_inputs(device, dtype)
    compiled = torch.compile(_tiny_model, backend=backend, fullgraph=True)  # raises on a graph break
    out, grads = _forward_backward(compiled, ids, positions, weights)
    ref, ref_grads = _forward_backward(_tiny_model, ids, positions, weights)
    assert torch.equal(out, ref), "forward: compiled vs eager"
    for i, (g, r) in enumerate(zip(grads, ref_grads, strict=True)):
        assert torch.equal(g, r), f"grad of weight {i}: compiled vs eager"
    with torch.no_grad():  # without autograd eager skips the custom ops; the compiled graph still holds them
        assert torch.equal(compiled(ids, positions, *weights), _tiny_model(ids, positions, *weights))


def test_tiny_model_compiles_fullgraph_with_the_eager_bits():
    torch._dynamo.reset()
    _assert_compiled_gives_the_eager_bits("aot_eager", DEVICE, torch.float32)


def _packed_attention(x, cu, w_q, w_kv):
    """Packed causal GQA attention over one row [T,H] of several sequences (cu_seqlens).

    Our ops' outputs only: a torch reduction after them is inductor's to fuse, and its fp32 bits
    differ from eager's (seen on the H200: a trailing `.sum(-1)` differed in 14 of 26 values while the
    attention output was equal)."""
    q = triton_matmul(x, w_q).reshape(x.shape[0], 2, 8)
    kv = triton_matmul(x, w_kv).reshape(x.shape[0], 2, 8)
    return triton_attention(q, kv[:, :1], kv[:, 1:], cu_seqlens=cu)


def _assert_packed_compiles_with_the_eager_bits(backend, device, dtype):
    # Traced, the packed table cannot read the longest sequence back: the grid is bounded by T instead.
    x = _randn(13, 16, seed=40, grad=False, dtype=dtype).to(device).requires_grad_(True)
    w = [_randn(16, 16, seed=41 + i, grad=False, dtype=dtype).to(device) for i in range(2)]
    cu = torch.tensor([0, 6, 7, 13], dtype=torch.int32, device=device)
    compiled = torch.compile(_packed_attention, backend=backend, fullgraph=True)  # raises on a graph break
    out, ref = compiled(x, cu, *w), _packed_attention(x, cu, *w)
    assert torch.equal(out, ref), "forward: compiled vs eager"
    grad_out = _randn(*out.shape, seed=42, grad=False, dtype=dtype).to(device)
    g, = torch.autograd.grad(out, x, grad_out)
    r, = torch.autograd.grad(ref, x, grad_out)
    assert torch.equal(g, r), "dx: compiled vs eager"


def test_packed_attention_compiles_fullgraph_with_the_eager_bits():
    torch._dynamo.reset()
    _assert_packed_compiles_with_the_eager_bits("aot_eager", DEVICE, torch.float32)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_packed_attention_compiles_with_inductor_with_the_eager_bits(dtype):
    torch._dynamo.reset()
    with torch._inductor.config.patch(emulate_precision_casts=True):
        _assert_packed_compiles_with_the_eager_bits("inductor", "cuda", dtype)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_tiny_model_compiles_with_inductor_with_the_eager_bits(dtype):
    torch._dynamo.reset()
    # The glue between the ops (residual adds, gradient accumulation) is inductor's: fused bf16 adds
    # would skip eager's intermediate roundings. The ops' own bits need no such help.
    with torch._inductor.config.patch(emulate_precision_casts=True):
        _assert_compiled_gives_the_eager_bits("inductor", "cuda", dtype)
