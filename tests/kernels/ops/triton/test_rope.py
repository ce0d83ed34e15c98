"""Triton RoPE against the gold: forward, backward, batch invariance, determinism, large angles."""

import pytest
import torch

from rl_engine.kernels.ops.pytorch.position.rope import NativeRopeOp, rope_cos_sin
from rl_engine.kernels.ops.triton.attention.paged_write import KvPages, write_kv_pages
from rl_engine.kernels.ops.triton.position import rope as triton_rope
from rl_engine.kernels.ops.triton.position.rope import TritonRopeOp, cached_inv_freq, rope_inv_freq
from rl_engine.rollout.paged_cache import padded_block_table, pool_slots

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
# fp32: cos/sin of large angles may differ by an ulp between libraries (numpy under the interpreter
# vs torch CPU; libdevice vs torch CUDA), so a few fp32 ulps of |x|; bf16: one bf16 rounding.
TOL = {torch.float32: dict(rtol=1e-5, atol=2e-6), torch.bfloat16: dict(rtol=2**-7, atol=1e-5)}


def _inputs(shape, dtype, first_position=0, seed=0):
    gen = torch.Generator().manual_seed(seed)
    b, s = shape[:2]
    x = torch.randn(shape, generator=gen).to(dtype).to(DEVICE)
    positions = (first_position + torch.randperm(b * s, generator=gen).reshape(b, s)).to(DEVICE)
    dy = torch.randn(shape, generator=gen).to(dtype).to(DEVICE)
    return x, positions, dy


def _run(op, x, positions, dy):
    x = x.clone().requires_grad_()
    y = op(x=x, positions=positions)
    y.backward(dy.to(y.dtype))
    return y.detach(), x.grad


def _assert_close(actual, expected, dtype):
    torch.testing.assert_close(actual.float(), expected.float(), **TOL[dtype])

def _assert_rounds_to_nearest(actual, reference):
    """bf16 outputs are the fp32 reference rounded to nearest even, but for a few near-ties.

    A truncating cast (what Triton's interpreter does without runtime.cast_rne) misses about half."""
    misses = int((actual != reference.to(actual.dtype)).sum())
    assert misses <= max(1, actual.numel() // 100), f"{misses} of {actual.numel()} not rounded to nearest"



def test_inv_freq_table_is_the_golds():
    # The kernel's fp32 factors are bit-identical to the ones the gold's cos/sin are built from.
    positions = torch.ones(1, 1, dtype=torch.int64)
    cos, sin = rope_cos_sin(positions, 16, 1e6)
    assert torch.equal(torch.cos(rope_inv_freq(16, 1e6, "cpu")), cos[0, 0, :8])


def test_cached_inv_freq_is_built_once_per_key_and_equals_the_fresh_table(monkeypatch):
    built = []
    monkeypatch.setattr(triton_rope, "_inv_freq_tables", {})
    monkeypatch.setattr(triton_rope, "rope_inv_freq", lambda *a: built.append(a) or rope_inv_freq(*a))
    cpu = torch.device("cpu")
    first = cached_inv_freq(16, 1e6, cpu)
    assert cached_inv_freq(16, 1e6, cpu) is first and len(built) == 1
    assert torch.equal(first, rope_inv_freq(16, 1e6, cpu))
    # Another theta or head dim is another table (a cache keyed on D alone would return `first`).
    assert not torch.equal(cached_inv_freq(16, 1e4, cpu), first) and len(built) == 2
    assert cached_inv_freq(8, 1e6, cpu).shape == (4,) and len(built) == 3


def test_one_kernel_launch_forward_one_backward_no_table_rebuild(monkeypatch):
    x, positions, dy = _inputs((1, 3, 2, 8), torch.float32)
    TritonRopeOp()(x=x, positions=positions)  # warm the table cache
    launches, tables = [], []
    apply, build = triton_rope.rope_apply, triton_rope.rope_inv_freq
    monkeypatch.setattr(triton_rope, "rope_apply", lambda *a, **k: launches.append(k) or apply(*a, **k))
    monkeypatch.setattr(triton_rope, "rope_inv_freq", lambda *a: tables.append(a) or build(*a))
    y, dx = _run(TritonRopeOp(), x, positions, dy)
    assert [k.get("transpose", False) for k in launches] == [False, True] and tables == []


def test_no_grad_path_equals_autograd_path_bitwise():
    x, positions, dy = _inputs((2, 3, 2, 8), torch.bfloat16, first_position=9)
    y, _ = _run(TritonRopeOp(), x, positions, dy)
    with torch.no_grad():
        assert torch.equal(TritonRopeOp()(x=x, positions=positions), y)
    assert torch.equal(TritonRopeOp()(x=x, positions=positions), y)  # x without requires_grad


def test_non_contiguous_input_is_rotated_and_gets_its_gradient():
    x, positions, dy = _inputs((2, 3, 4, 8), torch.float32, first_position=2)
    strided = x.transpose(0, 1).contiguous().transpose(0, 1)  # same values, not contiguous
    assert not strided.is_contiguous()
    y, dx = _run(TritonRopeOp(), strided, positions, dy)
    y_ref, dx_ref = _run(TritonRopeOp(), x, positions, dy)
    assert torch.equal(y, y_ref) and torch.equal(dx, dx_ref)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    "shape, first_position", [((2, 5, 3, 16), 17), ((1, 4, 1, 8), 0), ((2, 3, 4, 6), 40000)]
)
def test_forward_and_backward_match_gold(shape, first_position, dtype):
    x, positions, dy = _inputs(shape, dtype, first_position)
    y, dx = _run(TritonRopeOp(), x, positions, dy)
    y_ref, dx_ref = _run(NativeRopeOp(), x.float(), positions, dy.float())
    assert y.dtype == dx.dtype == dtype
    _assert_close(y, y_ref, dtype)
    _assert_close(dx, dx_ref, dtype)
    if dtype == torch.bfloat16:
        _assert_rounds_to_nearest(y, y_ref)


def test_theta_and_int32_positions():
    x, positions, dy = _inputs((1, 3, 2, 8), torch.float32, first_position=5)
    y, _ = _run(TritonRopeOp(theta=1e4), x, positions.to(torch.int32), dy)
    y_ref, _ = _run(NativeRopeOp(theta=1e4), x, positions, dy)
    _assert_close(y, y_ref, torch.float32)
    y_default, _ = _run(TritonRopeOp(), x, positions, dy)
    assert not torch.allclose(y_default, y_ref)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_batch_invariance_bitwise(dtype):
    x, positions, dy = _inputs((3, 6, 3, 16), dtype, first_position=100, seed=1)
    y, dx = _run(TritonRopeOp(), x, positions, dy)
    for b, s in [(0, 0), (2, 5), (1, 3)]:
        y1, dx1 = _run(TritonRopeOp(), x[b:b + 1, s:s + 1], positions[b:b + 1, s:s + 1], dy[b:b + 1, s:s + 1])
        assert torch.equal(y1[0, 0], y[b, s]) and torch.equal(dx1[0, 0], dx[b, s])


def test_deterministic():
    x, positions, dy = _inputs((2, 5, 3, 16), torch.bfloat16, first_position=3, seed=2)
    first, second = _run(TritonRopeOp(), x, positions, dy), _run(TritonRopeOp(), x, positions, dy)
    assert all(torch.equal(a, b) for a, b in zip(first, second))


def test_bad_inputs_raise_value_error_naming_the_input():
    with pytest.raises(ValueError, match="positions"):
        TritonRopeOp()(x=torch.zeros(1, 2, 1, 8), positions=torch.zeros(1, 3, dtype=torch.int64))
    with pytest.raises(ValueError, match="x"):
        TritonRopeOp()(x=torch.zeros(1, 2, 1, 7), positions=torch.zeros(1, 2, dtype=torch.int64))


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_qwen3_8b_shape_on_gpu(dtype):
    x, positions, dy = _inputs((2, 2048, 32, 128), dtype, first_position=30000, seed=3)
    y, dx = _run(TritonRopeOp(), x, positions, dy)
    y_ref, dx_ref = _run(NativeRopeOp(), x.float(), positions, dy.float())
    # Recorded for the docs: how far libdevice cos/sin + no-FMA land from torch's CUDA gold.
    print(f"\nrope {dtype}: max|y - ref| = {(y.float() - y_ref).abs().max().item():.3e}, "
          f"elements differing from ref.to(dtype): {(y != y_ref.to(dtype)).sum().item()} of {y.numel()}")
    _assert_close(y, y_ref, dtype)
    _assert_close(dx, dx_ref, dtype)
    y1, dx1 = _run(TritonRopeOp(), x[1:2, 7:8], positions[1:2, 7:8], dy[1:2, 7:8])
    assert torch.equal(y1[0, 0], y[1, 7]) and torch.equal(dx1[0, 0], dx[1, 7])
    again = _run(TritonRopeOp(), x, positions, dy)
    assert torch.equal(again[0], y) and torch.equal(again[1], dx)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_q_of_a_stacked_product_is_rotated_in_place_with_the_bits_of_a_copy(dtype, monkeypatch):
    """q as a view of one [B, S, (Hq + 2 Hkv) D] q/k/v product (models without q/k norms rotate it directly): read
    at its token stride with the bits of the contiguous copy; a planted token stride is caught."""
    from rl_engine.kernels.ops.triton.position import rope as module

    g = torch.Generator().manual_seed(0)
    qkv = torch.randn(2, 3, (4 + 2 * 2) * 16, generator=g).to(dtype).to(DEVICE)
    q = qkv[..., : 4 * 16].view(2, 3, 4, 16)
    positions = torch.tensor([[0, 1, 2], [7, 8, 9]], device=DEVICE)
    assert not q.is_contiguous() and module._token_rows(q)[1] == qkv.stride(1)
    want = module.rope(q.contiguous(), positions)
    assert torch.equal(module.rope(q, positions), want)
    monkeypatch.setattr(module, "_token_rows", lambda x: (x, x.shape[-2] * x.shape[-1]))
    assert not torch.equal(module.rope(q, positions), want)


def _paged_case(dtype, seed=0):
    """q and k's heads side by side in a stacked q/k/v product (after their norms), v its strided view, and pools with
    scattered pages (the rollout's paged cache)."""
    g = torch.Generator().manual_seed(seed)
    hq, hkv, d, page = 4, 2, 16, 4
    qkv = torch.randn(3, 2, (hq + 2 * hkv) * d, generator=g).to(dtype).to(DEVICE)
    qk = qkv[..., : (hq + hkv) * d].view(3, 2, hq + hkv, d)
    v = qkv[..., (hq + hkv) * d:].view(3, 2, hkv, d)
    positions = torch.tensor([[5, 6], [2, 3], [9, 10]], device=DEVICE)
    table = padded_block_table([[3, 7], [1], [8, 2, 5]], 3).to(DEVICE)
    pools = [torch.full((9, page, hkv, d), -1.0, dtype=dtype, device=DEVICE) for _ in range(2)]
    return qk, v, positions, pools, pool_slots(table, positions, page)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_rope_writes_keys_and_values_into_pages_with_the_bits_of_a_separate_write(dtype):
    """kv_pages: the launch that rotates q's and k's heads also writes the rotated keys and the values into the paged
    pools, with the bits of rotating, then `write_kv_pages`; the rotation's own output is unchanged."""
    qk, v, positions, (k_pool, v_pool), slots = _paged_case(dtype)
    want_k, want_v = k_pool.clone(), v_pool.clone()
    want = triton_rope.rope(qk, positions)
    write_kv_pages(want_k, want_v, slots, want[..., 4:, :], v)
    got = triton_rope.rope(qk, positions, kv_pages=KvPages(k_pool, v_pool, slots, v))
    assert torch.equal(got, want) and torch.equal(k_pool, want_k) and torch.equal(v_pool, want_v)
    # What the check tells apart: unrotated keys, or a write one pool row off
    unrotated_k = k_pool.clone()
    write_kv_pages(unrotated_k, v_pool.clone(), slots, qk[..., 4:, :], v)
    assert not torch.equal(unrotated_k, want_k)
    k_off, v_off = torch.full_like(k_pool, -1.0), torch.full_like(v_pool, -1.0)
    triton_rope.rope(qk, positions, kv_pages=KvPages(k_off, v_off, slots + 1, v))  # planted: the next row
    assert not torch.equal(k_off, want_k) and not torch.equal(v_off, want_v)


def test_rope_kv_pages_under_autograd_write_the_same_bits():
    qk, v, positions, (k_pool, v_pool), slots = _paged_case(torch.float32, seed=1)
    want_k, want_v = k_pool.clone(), v_pool.clone()
    triton_rope.rope(qk, positions, kv_pages=KvPages(want_k, want_v, slots, v))
    x = qk.detach().clone().requires_grad_()
    triton_rope.rope(x, positions, kv_pages=KvPages(k_pool, v_pool, slots, v))
    assert torch.equal(k_pool, want_k) and torch.equal(v_pool, want_v)


def test_rope_kv_pages_of_another_shape_is_one_line():
    qk, v, positions, (k_pool, v_pool), slots = _paged_case(torch.float32)
    with pytest.raises(ValueError, match="kv_pages: expected"):
        triton_rope.rope(qk, positions, kv_pages=KvPages(k_pool, v_pool, slots[:, :1], v))
    with pytest.raises(ValueError, match="kv_pages: expected"):
        triton_rope.rope(qk, positions, kv_pages=KvPages(k_pool.bfloat16(), v_pool, slots, v))


@pytest.mark.gpu
def test_gpu_rope_writes_keys_and_values_into_pages_with_the_bits_of_a_separate_write():
    assert DEVICE == "cuda"
    test_rope_writes_keys_and_values_into_pages_with_the_bits_of_a_separate_write(torch.bfloat16)
