"""triton_attention / TritonAttentionOp against the fp32 gold NativeAttentionOp, forward and backward.

Without CUDA these run under the Triton CPU interpreter at head_dim 16 with 16×16 tiles, so S = 37
covers full blocks and a tail; bf16 operands take the fp32-upcast `tl.dot` path there
(`dot_fp32`), fp32 operands the IEEE fp32 path. The gpu tests run Qwen3-8B head geometry on the H200
with bf16 tensor-core dots.
"""

from __future__ import annotations

import warnings

import pytest
import torch

from rl_engine.checks.testing import assert_never_quieter
from rl_engine.kernels.ops.pytorch.attention.attention import NativeAttentionOp
from rl_engine.kernels.ops.triton.attention import TritonAttentionOp, triton_attention
from rl_engine.kernels.ops.triton.runtime import dot_fp32

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
TOL = {torch.float32: 2e-5, torch.bfloat16: 3e-2}
# Every head size the kernels promise (BLOCK_D pads them to a power of two >= 16 inside the kernel).
HEAD_DIMS = [8, 16, 32, 64, 80, 96, 128, 192, 256]


def dot_path(dtype) -> str:
    return "fp32-upcast dot (interpreter)" if dot_fp32(dtype) else f"native {dtype} dot"


def _qkv(b, s, hq, hkv, d, dtype, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(b, s, h, d, generator=gen).to(dtype).to(DEVICE) for h in (hq, hkv, hkv)]


def _grads(fn, tensors, grad_out):
    leaves = [t.detach().clone().requires_grad_() for t in tensors]
    out = fn(*leaves)
    return (out.detach(), *torch.autograd.grad(out, leaves, grad_out))


def _close(name, got, ref, dtype):
    err = (got.float() - ref.float()).abs().max().item()
    assert torch.isfinite(got).all(), f"{name}: non-finite values"
    assert err <= TOL[dtype] * max(1.0, ref.abs().max().item()), f"{name}: max error {err} ({dot_path(dtype)})"


def test_dot_path_matches_the_machine():
    # On the CPU the interpreter must take the fp32-upcast path for bf16; on the GPU the native one.
    assert dot_fp32(torch.bfloat16) == (DEVICE == "cpu")
    assert not dot_fp32(torch.float32)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("heads", [(4, 4), (4, 2), (4, 1)], ids=["gqa1", "gqa2", "gqa4"])
def test_forward_and_backward_match_gold(dtype, heads):
    q, k, v = _qkv(1, 37, *heads, 16, dtype)
    grad_out = torch.randn(q.shape, generator=torch.Generator().manual_seed(1)).to(dtype).to(DEVICE)
    out, dq, dk, dv = _grads(TritonAttentionOp(), (q, k, v), grad_out)
    ref, rq, rk, rv = _grads(lambda q, k, v: NativeAttentionOp()(q=q, k=k, v=v), (q, k, v), grad_out.float())
    assert out.dtype == dtype and out.shape == q.shape
    for name, got, want in (("out", out, ref), ("dq", dq, rq), ("dk", dk, rk), ("dv", dv, rv)):
        _close(name, got, want, dtype)


@pytest.mark.parametrize("head_dim, dtype", [(8, torch.bfloat16), (80, torch.float32), (96, torch.bfloat16),
                                             (192, torch.float32)])
def test_head_sizes_below_16_and_not_powers_of_two(head_dim, dtype):
    # Padded lanes (8 -> 16, 80/96 -> 128, 192 -> 256) must contribute exact zeros, forward and backward.
    q, k, v = _qkv(1, 19, 2, 1, head_dim, dtype, seed=head_dim)
    grad_out = torch.randn(q.shape, generator=torch.Generator().manual_seed(2)).to(dtype).to(DEVICE)
    got = _grads(TritonAttentionOp(), (q, k, v), grad_out)
    ref = _grads(lambda q, k, v: NativeAttentionOp()(q=q, k=k, v=v), (q, k, v), grad_out.float())
    for name, a, b in zip(("out", "dq", "dk", "dv"), got, ref):
        _close(f"{name} (head_dim {head_dim})", a, b, dtype)


def _planted(which, position, value, dtype, seq=37):
    q, k, v = _qkv(1, seq, 4, 2, 16, dtype, seed=4)
    (q, k, v)[which][0, position, 1, 3] = value
    return q, k, v


NON_FINITE = [(which, value) for which in range(3) for value in (float("nan"), float("inf"))] + [(0, float("-inf"))]


@pytest.mark.parametrize("which, value", NON_FINITE, ids=[f"{'qkv'[w]}={v}" for w, v in NON_FINITE])
def test_non_finite_inputs_reach_exactly_the_rows_the_gold_says(which, value):
    # The rows that see the planted value (and the gradients they touch) turn non-finite as IEEE says; a q
    # value reaches exactly its row's output. Key 20 sits inside a 16-key block whose earlier rows do not see
    # it: there the tile products may spread NaN (louder than the gold: flash.py says why), never hide it.
    # A -inf in q makes a row whose visible scores are all -inf: 0/0 = NaN.
    dtype = torch.float32
    q, k, v = _planted(which, 20, value, dtype)
    grad_out = torch.randn(q.shape, generator=torch.Generator().manual_seed(1)).to(DEVICE)
    got = _grads(TritonAttentionOp(), (q, k, v), grad_out)
    ref = _grads(lambda q, k, v: NativeAttentionOp()(q=q, k=k, v=v), (q, k, v), grad_out)
    assert torch.isnan(ref[0]).any() or torch.isinf(ref[0]).any() or which != 0
    for name, a, b in zip(("out", "dq", "dk", "dv"), got, ref):
        assert_never_quieter(name, a, b)
        both = torch.isfinite(a) & torch.isfinite(b)
        assert both.any() and (a[both] - b[both]).abs().max() <= TOL[dtype] * max(1.0, b[both].abs().max())
    if which == 0:  # q's row: exactly the gold's non-finite positions in the forward
        assert torch.equal(torch.isfinite(got[0]), torch.isfinite(ref[0]))


def test_a_nan_hiding_candidate_is_caught():
    # Planted bug: the old gold (softmax, then nan_to_num, then a plain product) hides q's NaN (its row
    # comes out 0): the check above must reject it.
    def old_gold(q, k, v):
        k, v = k.repeat_interleave(2, dim=2), v.repeat_interleave(2, dim=2)
        s = torch.einsum("bqhd,bkhd->bhqk", q, k) / 4
        s = s.masked_fill(~torch.ones(s.shape[-2:], dtype=torch.bool).tril(), float("-inf"))
        return torch.einsum("bhqk,bkhd->bqhd", torch.nan_to_num(torch.softmax(s, -1), nan=0.0), v)

    q, k, v = _planted(0, 20, float("nan"), torch.float32)
    with pytest.raises(AssertionError, match="turned finite"):
        assert_never_quieter("out", old_gold(q, k, v), NativeAttentionOp()(q=q, k=k, v=v))


def test_non_causal_and_explicit_scale():
    q, k, v = _qkv(1, 21, 2, 1, 16, torch.float32)
    grad_out = torch.randn(q.shape).to(DEVICE)
    got = _grads(lambda q, k, v: triton_attention(q, k, v, causal=False, scale=0.3), (q, k, v), grad_out)
    ref = _grads(lambda q, k, v: NativeAttentionOp(causal=False, scale=0.3)(q=q, k=k, v=v), (q, k, v), grad_out)
    for name, a, b in zip(("out", "dq", "dk", "dv"), got, ref):
        _close(name, a, b, torch.float32)


def test_wrong_scale_is_caught():
    # Planted bug: the comparison above must fail when the candidate uses another scale.
    q, k, v = _qkv(1, 21, 2, 1, 16, torch.float32)
    out = triton_attention(q, k, v, scale=0.3)
    with pytest.raises(AssertionError):
        _close("out", out, NativeAttentionOp()(q=q, k=k, v=v), torch.float32)


def _jumps(q, k, scale, block, threshold=8.0):
    """How many (row, block) pairs raise a causal row's running max by more than `threshold` log2 units after
    the row's first block: where the kernels' lazy max (contract.RESCALE_ABOVE) must move and rescale."""
    s = torch.einsum("bqhd,bkhd->bhqk", q.float(), k.float().repeat_interleave(q.shape[2] // k.shape[2], 2))
    s = (s * scale * 1.4426950408889634).masked_fill(torch.ones_like(s, dtype=torch.bool).triu(1), float("-inf"))
    s = torch.nn.functional.pad(s, (0, -s.shape[-1] % block), value=float("-inf"))
    block_max = s.unflatten(-1, (-1, block)).amax(-1)
    running = block_max.cummax(-1).values
    return int(((running[..., 1:] - running[..., :-1]) > threshold).sum())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_scores_that_jump_mid_walk_match_gold(dtype):
    # A few keys 12x longer raise some rows' max by far more than the lazy max's threshold after their first
    # key block (and lower others'): those rows must move their max and rescale acc and l, the rest must not.
    q, k, v = _qkv(1, 37, 4, 2, 16, dtype)
    k[:, 20] *= 12
    k[:, 33] *= 12
    assert _jumps(q, k, 16 ** -0.5, 16) > 0
    grad_out = torch.randn(q.shape, generator=torch.Generator().manual_seed(1)).to(dtype).to(DEVICE)
    got = _grads(TritonAttentionOp(), (q, k, v), grad_out)
    ref = _grads(lambda q, k, v: NativeAttentionOp()(q=q, k=k, v=v), (q, k, v), grad_out.float())
    for name, a, b in zip(("out", "dq", "dk", "dv"), got, ref):
        _close(name, a, b, dtype)


def test_left_padding_with_seq_starts():
    dtype = torch.float32
    q, k, v = _qkv(2, 29, 4, 2, 16, dtype)
    starts = torch.tensor([0, 11])
    grad_out = torch.randn(q.shape).to(DEVICE)
    out, dq, dk, dv = _grads(lambda q, k, v: triton_attention(q, k, v, seq_starts=starts), (q, k, v), grad_out)
    for b, st in enumerate(starts.tolist()):
        part = [t[b : b + 1, st:] for t in (q, k, v)]
        ref, rq, rk, rv = _grads(lambda q, k, v: NativeAttentionOp()(q=q, k=k, v=v), part, grad_out[b : b + 1, st:])
        for name, got, want in (("out", out, ref), ("dq", dq, rq), ("dk", dk, rk), ("dv", dv, rv)):
            _close(f"{name}[{b}]", got[b : b + 1, st:], want, dtype)
        # A padding query sees only its own key (the registry's reference): its output is its v, exactly.
        group = q.shape[2] // k.shape[2]
        assert torch.equal(out[b, :st], v[b, :st].repeat_interleave(group, dim=1))


def test_packed_varlen_matches_gold_per_sequence():
    dtype = torch.bfloat16
    lengths = [9, 0, 23, 17]
    cu = torch.tensor([0, 9, 9, 32, 49], dtype=torch.int32)
    q, k, v = (t[0] for t in _qkv(1, 49, 4, 2, 16, dtype))
    grad_out = torch.randn(q.shape).to(dtype).to(DEVICE)
    out, dq, dk, dv = _grads(lambda q, k, v: triton_attention(q, k, v, cu_seqlens=cu), (q, k, v), grad_out)
    assert out.shape == q.shape
    # The [1,T,H,D] spelling of the same batch gives the same bits.
    assert torch.equal(triton_attention(q[None], k[None], v[None], cu_seqlens=cu)[0], out)
    flat = [t.reshape(49, *t.shape[-2:]) for t in (q, k, v, grad_out, out, dq, dk, dv)]
    for i, n in enumerate(lengths):
        if n == 0:
            continue
        a, b = int(cu[i]), int(cu[i + 1])
        part = [t[a:b][None] for t in flat[:3]]
        ref, rq, rk, rv = _grads(lambda q, k, v: NativeAttentionOp()(q=q, k=k, v=v), part, flat[3][a:b][None].float())
        for name, got, want in zip(("out", "dq", "dk", "dv"), flat[4:], (ref, rq, rk, rv)):
            _close(f"{name}[seq {i}]", got[a:b][None], want, dtype)


def test_forward_and_backward_are_deterministic():
    q, k, v = _qkv(1, 37, 4, 1, 16, torch.bfloat16)
    grad_out = torch.randn(q.shape).to(torch.bfloat16).to(DEVICE)
    first = _grads(TritonAttentionOp(), (q, k, v), grad_out)
    second = _grads(TritonAttentionOp(), (q, k, v), grad_out)
    for a, b in zip(first, second):
        assert torch.equal(a, b)


def test_bad_inputs_name_the_input():
    q, k, v = _qkv(1, 8, 4, 2, 16, torch.float32)
    with pytest.raises(ValueError, match="k"):
        triton_attention(q, k[:, :5], v)
    with pytest.raises(ValueError, match="Hkv"):
        triton_attention(q, *_qkv(1, 8, 4, 3, 16, torch.float32)[1:])
    with pytest.raises(ValueError, match="seq_starts"):
        triton_attention(q, k, v, seq_starts=torch.tensor([9]))
    with pytest.raises(ValueError, match="cu_seqlens"):
        triton_attention(q, k, v, cu_seqlens=torch.tensor([0, 3, 7], dtype=torch.int32))
    with pytest.raises(ValueError, match="v"):
        triton_attention(q, k, v.to(torch.bfloat16))


@pytest.mark.parametrize("offsets", [[1, 3, 8], [0, 3, 7], [0, 5, 3, 8], [0, 9]],
                         ids=["start", "end", "decreasing", "past-end"])
def test_packed_offsets_are_checked(offsets):
    q, k, v = (t[0] for t in _qkv(1, 8, 4, 2, 16, torch.float32))
    with pytest.raises(ValueError, match=r"cu_seqlens: expected non-decreasing offsets from 0 to T=8"):
        triton_attention(q, k, v, cu_seqlens=torch.tensor(offsets, dtype=torch.int32))


def test_packed_empty_batch_and_empty_sequences():
    q, k, v = (t[0] for t in _qkv(1, 0, 4, 2, 16, torch.float32))
    assert triton_attention(q, k, v, cu_seqlens=torch.tensor([0], dtype=torch.int32)).shape == q.shape
    assert triton_attention(q, k, v, cu_seqlens=torch.tensor([0, 0, 0], dtype=torch.int32)).shape == q.shape


@pytest.mark.gpu
def test_gpu_packed_call_reads_back_once():
    # The offsets' checks and the grid's bound come back to the host in one read: each extra read is a
    # device sync that stalls the host ahead of the kernels (measured 4 before).
    q, k, v = (t[0] for t in _qkv(1, 300, 4, 2, 64, torch.bfloat16))
    cu = torch.tensor([0, 100, 120, 300], dtype=torch.int32, device=DEVICE)
    triton_attention(q, k, v, cu_seqlens=cu)  # compiled and warm
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("warn")
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            triton_attention(q, k, v, cu_seqlens=cu)
    finally:
        torch.cuda.set_sync_debug_mode(0)
    syncs = [w for w in caught if "synchroniz" in str(w.message)]
    assert len(syncs) == 1, [str(w.message) for w in syncs]


@pytest.mark.gpu
@pytest.mark.parametrize("seq_len", [1000, 2048])
def test_gpu_qwen3_8b_geometry_bf16(seq_len):
    dtype = torch.bfloat16
    q, k, v = _qkv(2, seq_len, 32, 8, 128, dtype)
    grad_out = torch.randn(q.shape, device=DEVICE, dtype=dtype)
    got = _grads(TritonAttentionOp(), (q, k, v), grad_out)
    ref = _grads(lambda q, k, v: NativeAttentionOp()(q=q, k=k, v=v), (q, k, v), grad_out.float())
    base = _grads(lambda q, k, v: NativeAttentionOp().baseline(q=q, k=k, v=v), (q, k, v), grad_out)
    for name, a, r, bl in zip(("out", "dq", "dk", "dv"), got, ref, base):
        err = (a.float() - r).abs().max().item()
        base_err = (bl.float() - r).abs().max().item()
        # FlashAttention's rule: within a few times plain bf16 PyTorch's own error.
        assert err <= 3 * base_err + 1e-3, f"{name}: error {err} vs bf16 baseline {base_err}"
    again = _grads(TritonAttentionOp(), (q, k, v), grad_out)
    assert all(torch.equal(a, b) for a, b in zip(got, again))


@pytest.mark.gpu
@pytest.mark.parametrize("head_dim", HEAD_DIMS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=["fp32", "bf16", "fp16"])
def test_gpu_every_head_size_and_dtype(dtype, head_dim):
    # Compiles and runs every kernel (forward, delta, dQ, dK/dV) at every head size; short sequences.
    q, k, v = _qkv(2, 77, 4, 2, head_dim, dtype, seed=head_dim)
    grad_out = torch.randn(q.shape, device=DEVICE, dtype=dtype)
    got = _grads(TritonAttentionOp(), (q, k, v), grad_out)
    ref = _grads(lambda q, k, v: NativeAttentionOp()(q=q, k=k, v=v), (q, k, v), grad_out.float())
    base = _grads(lambda q, k, v: NativeAttentionOp().baseline(q=q, k=k, v=v), (q, k, v), grad_out)
    for name, a, r, bl in zip(("out", "dq", "dk", "dv"), got, ref, base):
        assert torch.isfinite(a).all(), f"{name}: non-finite values"
        err, base_err = (a.float() - r).abs().max().item(), (bl.float() - r).abs().max().item()
        assert err <= 3 * base_err + 1e-3, f"{name}: error {err} vs {dtype} baseline {base_err}"


@pytest.mark.gpu
def test_gpu_backward_on_two_streams_keeps_the_bits_and_joins(monkeypatch):
    # The dQ kernel runs on a side stream beside the dK/dV kernel, and the caller's stream waits for it.
    # The gradients must be the serial launch's bits (the side stream replaced by the caller's own), also
    # when the side stream is busy for ~50 ms first (a missing join would hand back dq before it is
    # written), and when the whole step is captured in a CUDA graph and replayed.
    from rl_engine.kernels.ops.triton import runtime

    q, k, v = _qkv(2, 1000, 32, 8, 128, torch.bfloat16, seed=9)
    grad_out = torch.randn(q.shape, device=DEVICE, dtype=torch.bfloat16)
    used = []
    side = runtime._side_stream
    monkeypatch.setattr(runtime, "_side_stream", lambda i: used.append(i) or side(i))
    concurrent = _grads(TritonAttentionOp(), (q, k, v), grad_out)
    assert used, "the backward did not use the side stream"

    def busy_side(i):
        stream = side(i)
        with torch.cuda.stream(stream):
            torch.cuda._sleep(100_000_000)  # ~50 ms of cycles queued ahead of the dQ kernel
        return stream

    monkeypatch.setattr(runtime, "_side_stream", busy_side)
    late = _grads(TritonAttentionOp(), (q, k, v), grad_out)
    monkeypatch.setattr(runtime, "_side_stream", lambda i: torch.cuda.current_stream())
    serial = _grads(TritonAttentionOp(), (q, k, v), grad_out)
    for name, a, b, c in zip(("out", "dq", "dk", "dv"), concurrent, serial, late):
        assert torch.equal(a, b) and torch.equal(c, b), name

    monkeypatch.setattr(runtime, "_side_stream", side)
    leaves = [t.detach().clone().requires_grad_() for t in (q, k, v)]
    warm = torch.cuda.Stream()
    warm.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(warm):  # capture needs the kernels compiled and the allocator warm
        torch.autograd.grad(TritonAttentionOp()(*leaves), leaves, grad_out)
    torch.cuda.current_stream().wait_stream(warm)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = torch.autograd.grad(TritonAttentionOp()(*leaves), leaves, grad_out)
    graph.replay()
    torch.cuda.synchronize()
    for name, a, b in zip(("dq", "dk", "dv"), captured, serial[1:]):
        assert torch.equal(a, b), f"{name} replayed from a CUDA graph"
