"""The experimental Gluon attention forward (attention/gluon_forward.py): its input checks, its sm_90a
compile on the CPU, and on the H200 the bits (outputs and LSE) of flash.py's forward on the same sequence
tables: a batch, left padding, packed sequences across a KV split, causal and not. Gluon's API moves
between Triton releases; the kernels compile under those of gluon_compat.SUPPORTED (CI compiles them under each)."""

from __future__ import annotations

import pytest
import torch
import triton
from one_compile_process import case_result, compile_selected

from rl_engine.kernels.ops.triton.attention import gluon_compat

pytestmark = pytest.mark.skipif(not gluon_compat.supported(),
                                reason=f"Gluon kernels written for Triton {gluon_compat.SUPPORTED}, this is "
                                       f"{triton.__version__}")

COMPILE = """
import re
from rl_engine.kernels.ops.triton.attention.gluon_forward import compile_for_sm90
from rl_engine.kernels.ops.triton.sm90 import _summary
def compile_case(mask, head_dim):
    k = compile_for_sm90(causal=mask == "causal", head_dim=head_dim)
    return dict(_summary(k), warps=k.metadata.num_warps,
                target=re.findall(r"^\\.target (\\S+)", k.asm["ptx"], re.M))
"""


@pytest.fixture(scope="module")
def forward_compiles(request):
    """Every selected case of test_compiles_for_the_h200, compiled in one process."""
    return compile_selected(request, "test_compiles_for_the_h200", COMPILE, lambda p: (p["mask"], p["head_dim"]))


def _bf16(*shape, seed=0, device="cpu"):
    g = torch.Generator(device=device).manual_seed(seed)
    return torch.randn(*shape, generator=g, device=device).to(torch.bfloat16)


@pytest.mark.parametrize("bad, message", [
    (dict(dtype=torch.float16), "contiguous bf16"),
    (dict(d=96), r"expected head_dim \(64, 128, 256\)"),
    (dict(hkv=3), "multiple of Hkv"),
    (dict(dims=4), "rows"),
])
def test_inputs_it_does_not_cover_are_refused(bad, message):
    from rl_engine.kernels.ops.triton.attention.gluon_forward import check_rows

    d, hkv = bad.get("d", 128), bad.get("hkv", 2)
    q = torch.zeros(192, 4, d, dtype=bad.get("dtype", torch.bfloat16))
    k = torch.zeros(192, hkv, d, dtype=q.dtype)
    if bad.get("dims") == 4:
        q = q.unsqueeze(0)
    with pytest.raises(ValueError, match=message):
        check_rows(q, k, k.clone())


def test_flash_forward_routes_only_what_the_kernel_is_written_for():
    from rl_engine.kernels.ops.triton.attention.gluon_forward import routes

    assert [d for d in (32, 64, 96, 128, 256) if routes(torch.bfloat16, d, (9, 0), "3.6.0")] == [64, 128, 256]
    for dtype, head_dim, capability, version in [(torch.float16, 128, (9, 0), "3.6.0"),
                                                (torch.bfloat16, 96, (9, 0), "3.6.0"),
                                                (torch.bfloat16, 128, (10, 0), "3.6.0"),
                                                (torch.bfloat16, 128, (9, 0), "3.5.1"),
                                                (torch.bfloat16, 128, (9, 0), "3.10.0")]:
        assert not routes(dtype, head_dim, capability, version)


@pytest.mark.parametrize("version, supported", [("3.6.0", True), ("3.7.1", True), ("3.8.0", True), ("3.9.0", True),
                                                ("3.9.0+git1a2b3c4", True), ("3.5.1", False), ("3.10.0", False),
                                                ("3.60.0", False), ("4.0.0", False)])
def test_routes_the_triton_releases_it_compiles_under(version, supported):
    from rl_engine.kernels.ops.triton.attention.gluon_forward import routes

    assert gluon_compat.supported(version) == supported
    assert routes(torch.bfloat16, 128, (9, 0), version) == supported


def test_flash_backward_routes_its_own_head_dims():
    from rl_engine.kernels.ops.triton.attention.gluon_backward import HEAD_DIMS
    from rl_engine.kernels.ops.triton.attention.gluon_forward import check_rows, routes

    assert HEAD_DIMS == (64, 128, 256)
    routed = [d for d in (32, 64, 96, 128, 192, 256) if routes(torch.bfloat16, d, (9, 0), "3.6.0", HEAD_DIMS)]
    assert routed == [64, 128, 256]
    q, k = torch.zeros(192, 4, 96, dtype=torch.bfloat16), torch.zeros(192, 2, 96, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match=r"expected head_dim \(64, 128, 256\)"):
        check_rows(q, k, k.clone(), HEAD_DIMS)


@pytest.mark.parametrize("mask, head_dim", [("causal", 64), ("causal", 128), ("full", 128), ("causal", 256)])
def test_compiles_for_the_h200(forward_compiles, mask, head_dim):
    from rl_engine.kernels.ops.triton.sm90 import H200_SHARED_BYTES

    result = case_result(forward_compiles, (mask, head_dim))
    assert result["target"] == ["sm_90a"] and result["cubin"] > 0
    assert result["wgmma"] > 0 and result["shared"] <= H200_SHARED_BYTES
    from rl_engine.kernels.ops.triton.attention.gluon_forward import SHAPES

    consumers, wait_apart = SHAPES[head_dim][0], SHAPES[head_dim][-1]
    assert result["warps"] == 4 * (consumers + 1), "the consumer warpgroups and a producer warp rounded to a warpgroup"
    if wait_apart:  # the softmax of block j overlaps block j-1's p·v: all of a 64 x 64 block's 32 exp2s a thread
        # precede the wait for p·v in every loop (with the wait inline, as at bf81220, ptxas hoisted it: 0 of 32)
        loops = result["exp2_before_pv_wait"]
        assert len(loops) >= 2 and all(n == 32 for n in loops), loops


# (name, layout, lengths or starts, S, Hq, Hkv, causal, head_dim): each compared with flash.py on the same
# table. Causal lengths that are not multiples of 192 leave a sequence's first CTA with rows before it.
GPU_CASES = [
    ("batch", "padded", None, 1536, 32, 8, True, 128),
    ("batch_full", "padded", None, 576, 8, 2, False, 128),
    ("batch_4096", "padded", None, 4096, 8, 2, True, 128),
    ("left_padded", "padded", [0, 300, 1000], 1100, 8, 8, True, 128),
    ("packed_splits", "packed", [2600, 900, 333, 1, 64, 191], None, 32, 8, True, 128),
    ("packed_full", "packed", [700, 129, 64], None, 8, 2, False, 128),
    # three KV splits: a fold that reads and rewrites the running fold (in shared memory or the workspace)
    ("packed_three_splits", "packed", [5000, 77], None, 8, 2, True, 128),
    ("hd64_packed_three_splits", "packed", [5000, 77], None, 8, 2, True, 64),
    ("hd256_packed_splits", "packed", [2600, 900, 333, 1, 64, 191], None, 8, 2, True, 256),
    ("hd256_batch_full", "padded", None, 576, 8, 2, False, 256),
    ("hd64_packed_splits", "packed", [2600, 900, 333, 1, 64, 191], None, 32, 8, True, 64),
    ("hd64_batch_full", "padded", None, 576, 8, 2, False, 64),
]


@pytest.mark.gpu
@pytest.mark.parametrize("name, layout, spec, s, hq, hkv, causal, d", GPU_CASES, ids=[c[0] for c in GPU_CASES])
def test_gpu_gives_the_bits_of_the_triton_forward(monkeypatch, name, layout, spec, s, hq, hkv, causal, d):
    if torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("the Gluon kernel is written for Hopper (sm_90a)")
    from rl_engine.kernels.ops.triton.attention import dispatch
    from rl_engine.kernels.ops.triton.attention import gluon_forward as gluon_forward_module
    from rl_engine.kernels.ops.triton.attention.attention import _packed_table, _padded_table
    from rl_engine.kernels.ops.triton.attention.gluon_forward import gluon_forward

    if layout == "padded":
        b = 3 if spec else 2
        q4 = _bf16(b, s, hq, d, seed=1, device="cuda")
        table = _padded_table(q4, None if spec is None else torch.tensor(spec))
        rows = b * s
    else:
        rows = sum(spec)
        cu = torch.tensor([0] + spec).cumsum(0)
        table = _packed_table(rows, cu, "cuda")
    q, k, v = (_bf16(rows, h, d, seed=i, device="cuda") for i, h in enumerate((hq, hkv, hkv)))
    monkeypatch.setattr(gluon_forward_module, "covers", lambda *args: False)  # flash.py's own kernel
    want, want_lse = dispatch.flash_forward(q, k, v, table, causal=causal, scale=d ** -0.5)
    monkeypatch.undo()
    got, got_lse = gluon_forward(q, k, v, table, causal=causal)
    info = table.info.cpu().tolist()
    for z, (q_row0, q_count, *_rest) in enumerate(info):
        sl = slice(q_row0, q_row0 + q_count)
        assert torch.equal(got[sl], want[sl]), f"sequence {z}: {(got[sl] != want[sl]).float().mean().item():.2e} differ"
        assert torch.equal(got_lse[sl], want_lse[sl]), f"sequence {z}: the LSE differs"


@pytest.mark.gpu
@pytest.mark.parametrize("d", [64, 128, 256])
def test_gpu_rows_whose_max_jumps_mid_walk_keep_the_bits(monkeypatch, d):
    """Keys 12x longer every 300 rows raise some rows' running max by more than the lazy max's threshold well
    after a split's first block (and leave the other rows of the same threads alone): the Gluon forward then
    rescales only where flash.py's alpha is not 1, and must still give flash.py's bits (a thread that skipped
    its rows' rescale wrongly would not: the random data of the cases above hardly ever moves a max that far)."""
    if torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("the Gluon kernel is written for Hopper (sm_90a)")
    from rl_engine.kernels.ops.triton.attention import dispatch
    from rl_engine.kernels.ops.triton.attention import gluon_forward as gluon_forward_module
    from rl_engine.kernels.ops.triton.attention.attention import _packed_table
    from rl_engine.kernels.ops.triton.attention.gluon_forward import gluon_forward

    spec = [2600, 900, 333]
    table = _packed_table(sum(spec), torch.tensor([0] + spec).cumsum(0), "cuda")
    q, k, v = (_bf16(sum(spec), h, d, seed=i, device="cuda") for i, h in enumerate((8, 2, 2)))
    k[150::300] *= 12  # a sequence's first long key is in its third block (64-key blocks; 32 at head_dim 256)
    monkeypatch.setattr(gluon_forward_module, "covers", lambda *args: False)  # flash.py's own kernel
    want, want_lse = dispatch.flash_forward(q, k, v, table, causal=True, scale=d ** -0.5)
    monkeypatch.undo()
    got, got_lse = gluon_forward(q, k, v, table, causal=True)
    smooth = k.clone()
    smooth[150::300] /= 12
    _, smooth_lse = gluon_forward(q, smooth, v, table, causal=True)
    assert (want_lse - smooth_lse).max().item() > 8, "the long keys must raise some rows' max past the threshold"
    for z, (q_row0, q_count, *_rest) in enumerate(table.info.cpu().tolist()):
        sl = slice(q_row0, q_row0 + q_count)
        assert torch.equal(got[sl], want[sl]), f"sequence {z}: {(got[sl] != want[sl]).float().mean().item():.2e} differ"
        assert torch.equal(got_lse[sl], want_lse[sl]), f"sequence {z}: the LSE differs"


COMPILE_BACKWARD = """
from rl_engine.kernels.ops.triton.attention.gluon_backward import compile_for_sm90
def compile_case(mask, kernel, head_dim):
    k = compile_for_sm90(causal=mask == "causal", kernel=kernel, head_dim=head_dim)
    return {"shared": k.metadata.shared, "warps": k.metadata.num_warps, "wgmma": k.asm["ptx"].count("wgmma.mma_async")}
"""


@pytest.fixture(scope="module")
def backward_compiles(request):
    """Every selected case of test_the_backward_kernels_compile_for_the_h200, compiled in one process."""
    return compile_selected(request, "test_the_backward_kernels_compile_for_the_h200", COMPILE_BACKWARD,
                            lambda p: (p["mask"], p["kernel"], p["head_dim"]))


@pytest.mark.parametrize("head_dim", [64, 128, 256])
@pytest.mark.parametrize("mask, kernel", [("causal", "dq"), ("full", "dq"), ("causal", "dkdv"), ("full", "dkdv")])
def test_the_backward_kernels_compile_for_the_h200(backward_compiles, mask, kernel, head_dim):
    from rl_engine.kernels.ops.triton.attention.gluon_backward import DQ_SHAPES
    from rl_engine.kernels.ops.triton.sm90 import H200_SHARED_BYTES

    result = case_result(backward_compiles, (mask, kernel, head_dim))
    assert result["wgmma"] > 0 and result["shared"] <= H200_SHARED_BYTES
    consumers = DQ_SHAPES[head_dim][0] if kernel == "dq" else 2
    assert result["warps"] == 4 * consumers + 4, "the consumer warpgroups and a producer warp rounded up to a warpgroup"


def _first_wrong_box(t, x, n):
    """Where the dK/dV producer's box (row k·Hq + h, columns [r - k, r - k + n), k = r % 4) of `t` is not rows
    [r, r + n) of head h of `x` (inside x), or None."""
    rows, heads = x.shape
    for r in range(rows):
        k = r % 4
        assert (r - k) * t.element_size() % 16 == 0, "the box's innermost coordinate must be 16-byte aligned"
        for h in range(heads):
            got = t[k * heads + h, r - k: r - k + n][: min(n, rows - r)]
            if not torch.equal(got, x[r: r + n, h]):
                return r, h
    return None


@pytest.mark.parametrize("rows", [1, 3, 4, 5, 63, 893])
def test_the_dkdv_producer_reads_every_block_start_from_an_aligned_box(rows):
    from rl_engine.kernels.ops.triton.attention.gluon_backward import DKDV_BLOCK_Q, shifted_rows

    x = torch.randn(rows, 3)
    t = shifted_rows(x)
    assert t.shape == (12, -(-rows // 4) * 4) and t.stride(0) * t.element_size() % 16 == 0
    assert _first_wrong_box(t, x, DKDV_BLOCK_Q) is None
    if rows > 1:  # planted: the four copies not shifted (the box read at the aligned row, not the block's)
        unshifted = torch.cat([x.t()] * 4)
        unshifted = torch.nn.functional.pad(unshifted, (0, t.shape[1] - rows))
        assert _first_wrong_box(unshifted, x, DKDV_BLOCK_Q) is not None


BACKWARD_CASES = GPU_CASES + [
    ("hd64_left_padded", "padded", [0, 300, 1000], 1100, 8, 8, True, 64),
    ("hd256_left_padded", "padded", [0, 300, 1000], 1100, 8, 8, True, 256),
]


@pytest.mark.gpu
@pytest.mark.parametrize("name, layout, spec, s, hq, hkv, causal, d", BACKWARD_CASES,
                         ids=[c[0] for c in BACKWARD_CASES])
def test_gpu_backward_gives_the_bits_of_the_triton_backward(monkeypatch, name, layout, spec, s, hq, hkv, causal, d):
    """flash_backward with the Gluon dQ and dK/dV kernels (routed) against the same call with flash.py's own:
    the same tiles, blocks and group order, so the same bits are expected."""
    if torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("the Gluon kernel is written for Hopper (sm_90a)")
    from rl_engine.kernels.ops.triton.attention import dispatch, gluon_backward
    from rl_engine.kernels.ops.triton.attention.attention import _packed_table, _padded_table

    if layout == "padded":
        b = 3 if spec else 2
        table = _padded_table(_bf16(b, s, hq, d, seed=1, device="cuda"), None if spec is None else torch.tensor(spec))
        rows = b * s
    else:
        rows = sum(spec)
        table = _packed_table(rows, torch.tensor([0] + spec).cumsum(0), "cuda")
    q, k, v, do = (_bf16(rows, h, d, seed=i, device="cuda") for i, h in enumerate((hq, hkv, hkv, hq)))
    out, lse = dispatch.flash_forward(q, k, v, table, causal=causal, scale=d ** -0.5)
    got = dispatch.flash_backward(do, q, k, v, out, lse, table, causal=causal, scale=d ** -0.5)
    assert dispatch._gluon_covers(q, k, v, backward=True), "the Gluon backward is routed for these rows"
    monkeypatch.setattr(gluon_backward, "covers", lambda *args: False)  # flash.py's own kernels
    want = dispatch.flash_backward(do, q, k, v, out, lse, table, causal=causal, scale=d ** -0.5)
    for z, (q_row0, q_count, _q_pos0, k_row0, kv_len, _window) in enumerate(table.info.cpu().tolist()):
        for name, i, sl in (("dq", 0, slice(q_row0, q_row0 + q_count)), ("dk", 1, slice(k_row0, k_row0 + kv_len)),
                            ("dv", 2, slice(k_row0, k_row0 + kv_len))):
            assert torch.equal(got[i][sl], want[i][sl]), \
                f"sequence {z}: {(got[i][sl] != want[i][sl]).float().mean().item():.2e} of {name} differ"


@pytest.mark.gpu
@pytest.mark.parametrize("d", [64, 128, 256])
def test_gpu_a_neighbours_nan_does_not_reach_a_sequence(d):
    """Packed [70, 130] with the second sequence's q, k, v and dO all NaN: the first sequence's last blocks read
    rows 70..127 of it (its dQ tile's last K/V block, its dK/dV consumers' last Q/dO block), which the kernels zero
    before their products (0·NaN is NaN). Its output and gradients must equal those of the sequence alone.
    Planted: the same call with the NaNs in the first sequence's own rows makes its gradients NaN."""
    if torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("the Gluon kernel is written for Hopper (sm_90a)")
    from rl_engine.kernels.ops.triton.attention import dispatch
    from rl_engine.kernels.ops.triton.attention.attention import _packed_table

    def grads(q, k, v, do, lengths):
        table = _packed_table(sum(lengths), torch.tensor([0] + lengths).cumsum(0), "cuda")
        out, lse = dispatch.flash_forward(q, k, v, table, causal=True, scale=d ** -0.5)
        return (out, *dispatch.flash_backward(do, q, k, v, out, lse, table, causal=True, scale=d ** -0.5))

    q, k, v, do = (_bf16(200, h, d, seed=i, device="cuda") for i, h in enumerate((8, 2, 2, 8)))
    assert dispatch._gluon_covers(q, k, v, backward=True)
    alone = grads(q[:70], k[:70], v[:70], do[:70], [70])
    for t in (q, k, v, do):
        t[70:] = float("nan")
    packed = grads(q, k, v, do, [70, 130])
    for name, got, want in zip(("out", "dq", "dk", "dv"), packed, alone):
        assert torch.isfinite(want).all() and torch.equal(got[:70], want), f"{name}: the neighbour's NaN leaked in"
    for t in (q, k, v, do):
        t[60:70] = float("nan")
    planted = grads(q, k, v, do, [70, 130])
    assert not torch.isfinite(planted[2][:70]).all(), "NaN in the sequence's own rows must reach its dk"


def test_row_descriptor_views_the_rows_in_boxes_of_one_head():
    from triton.experimental.gluon import language as gl

    from rl_engine.kernels.ops.triton.attention.gluon_forward import row_descriptor

    x = torch.zeros(192, 4, 128, dtype=torch.bfloat16)
    d = row_descriptor(x, 64)
    assert d.base.data_ptr() == x.data_ptr() and d.shape == [192, 512] and d.strides == [512, 1]
    assert d.block_shape == [64, 128] and d.layout == gl.NVMMASharedLayout.get_default_for([64, 128], gl.bfloat16)
    assert row_descriptor(x[:100], 64).layout is d.layout, "the layout is built once per box"
