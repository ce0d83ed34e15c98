"""The grouped GEMM of the MoE experts: the bits of the loop of `matmul` calls it replaces, a row's bits
independent of the other experts' rows, deterministic gradients, one-line errors. Under the interpreter
without CUDA; the `gpu` tests run Qwen3-30B-A3B expert shapes on the H200."""

from __future__ import annotations

import pytest
import torch

from rl_engine.kernels.ops.triton.linear.grouped_matmul import grouped_matmul
from rl_engine.kernels.ops.triton.linear.matmul import triton_matmul

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
DTYPES = pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)


def problem(counts, n, k, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    rows = torch.randn(sum(counts), k, generator=g).to(dtype=dtype, device=DEVICE)
    weight = (torch.randn(len(counts), n, k, generator=g) / k**0.5).to(dtype=dtype, device=DEVICE)
    return rows, weight


def loop(rows, weight, counts):
    """The reference: one batch-invariant `matmul` per expert, on its rows only."""
    parts = [triton_matmul(part, weight[e].t()) for e, part in enumerate(rows.split(counts)) if part.shape[0]]
    return torch.cat(parts) if parts else rows.new_empty(0, weight.shape[1])


# Odd counts cross the interpreter's 16-row tiles; expert 2 has no rows; N and K cross 16-wide tiles.
COUNTS = [5, 17, 0, 33, 1]


@DTYPES
def test_forward_has_the_bits_of_the_matmul_loop(dtype):
    rows, weight = problem(COUNTS, 24, 40, dtype)
    assert torch.equal(grouped_matmul(rows, weight, COUNTS), loop(rows, weight, COUNTS))


def test_forward_matches_float64():
    rows, weight = problem(COUNTS, 24, 40, torch.float32)
    ref = torch.cat([p.double() @ weight[e].double().t() for e, p in enumerate(rows.split(COUNTS))])
    assert (grouped_matmul(rows, weight, COUNTS).double() - ref).abs().max() < 1e-5


@DTYPES
def test_a_rows_bits_do_not_depend_on_the_other_rows(dtype):
    rows, weight = problem(COUNTS, 24, 40, dtype)
    full = grouped_matmul(rows, weight, COUNTS)
    # Expert 3's rows alone (every other expert empty), and expert 3 with only its last 4 rows.
    start = sum(COUNTS[:3])
    alone = [0, 0, 0, COUNTS[3], 0]
    assert torch.equal(grouped_matmul(rows[start:start + COUNTS[3]], weight, alone), full[start:start + COUNTS[3]])
    few = [0, 0, 0, 4, 0]
    end = start + COUNTS[3]
    assert torch.equal(grouped_matmul(rows[end - 4:end], weight, few), full[end - 4:end])


def test_the_comparison_catches_a_row_that_reads_the_wrong_expert():
    # Planted: expert 3's rows run with expert 1's weight: the loop comparison must see it.
    rows, weight = problem(COUNTS, 24, 40, torch.float32)
    wrong = weight.clone()
    wrong[3] = weight[1]
    assert not torch.equal(grouped_matmul(rows, wrong, COUNTS), loop(rows, weight, COUNTS))


@DTYPES
def test_gradients_match_the_loop_and_are_deterministic(dtype):
    rows, weight = problem(COUNTS, 24, 40, dtype)
    grad_out = problem(COUNTS, 24, 24, dtype, seed=1)[0]

    def grads(fn):
        r, w = rows.clone().requires_grad_(), weight.clone().requires_grad_()
        fn(r, w, COUNTS).backward(grad_out)
        return r.grad, w.grad

    d_rows, d_weight = grads(grouped_matmul)
    ref_rows, ref_weight = grads(loop)
    assert torch.equal(d_rows, ref_rows)  # the same kernel shapes and K order as the matmul backward
    assert torch.equal(d_weight[2], torch.zeros_like(d_weight[2]))  # an expert without rows
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    assert (d_weight.float() - ref_weight.float()).abs().max() <= tol * ref_weight.float().abs().max()
    again_rows, again_weight = grads(grouped_matmul)
    assert torch.equal(again_rows, d_rows) and torch.equal(again_weight, d_weight)


def test_weight_gradient_matches_float64():
    rows, weight = problem(COUNTS, 24, 40, torch.float32)
    grad_out = problem(COUNTS, 24, 24, torch.float32, seed=1)[0]
    w = weight.clone().requires_grad_()
    grouped_matmul(rows, w, COUNTS).backward(grad_out)
    ref = torch.stack([g.double().t() @ r.double() for g, r in zip(grad_out.split(COUNTS), rows.split(COUNTS))])
    assert (w.grad.double() - ref).abs().max() < 1e-5


@pytest.fixture
def tma_on_the_interpreter(monkeypatch):
    """The interpreter's matmul config asks for pointer loads; this turns on the grouped kernel's TMA path."""
    import dataclasses

    from rl_engine.kernels.ops.triton.linear import grouped_matmul as gm

    config = gm.matmul_config
    monkeypatch.setattr(gm, "matmul_config", lambda dtype, n, k: dataclasses.replace(config(dtype, n, k), tma=True))
    return gm


@DTYPES
@pytest.mark.parametrize("n, k", [(24, 40), (32, 48)], ids=["tails", "whole"])
def test_tma_loads_give_the_bits_of_pointer_loads(tma_on_the_interpreter, dtype, n, k):
    # (24, 40): forward K and N tails (zero-filled columns, next expert's weight rows never stored), the
    # backward's reduction over 24 weight rows has a tail: pointer path. (32, 48): TMA both ways.
    gm = tma_on_the_interpreter
    rows, weight = problem(COUNTS, n, k, dtype)
    grad_out = problem(COUNTS, n, n, dtype, seed=1)[0]
    cfg = gm.matmul_config(dtype, n, k)
    assert gm._descriptors(rows, weight, cfg, False, k) is not None
    assert (gm._descriptors(grad_out, weight, cfg, True, n) is None) == (n % cfg.block_k != 0)

    def run():
        r = rows.clone().requires_grad_()
        out = grouped_matmul(r, weight, COUNTS)
        out.backward(grad_out)
        return out.detach(), r.grad

    with_tma = run()
    assert torch.equal(with_tma[0], loop(rows, weight, COUNTS))
    descriptors = gm._descriptors
    gm._descriptors = lambda *args: None
    try:
        pointers = run()
    finally:
        gm._descriptors = descriptors
    assert torch.equal(with_tma[0], pointers[0]) and torch.equal(with_tma[1], pointers[1])


def test_tma_comparison_catches_a_descriptor_of_the_wrong_expert(tma_on_the_interpreter, monkeypatch):
    # Planted: the weight descriptor over the experts in reverse order.
    gm = tma_on_the_interpreter
    rows, weight = problem(COUNTS, 32, 48, torch.float32)
    want = loop(rows, weight, COUNTS)
    descriptors = gm._descriptors
    monkeypatch.setattr(gm, "_descriptors", lambda a, w, *rest: descriptors(a, w.flip(0).contiguous(), *rest))
    assert not torch.equal(grouped_matmul(rows, weight, COUNTS), want)


def test_bad_inputs_get_one_clear_line():
    rows, weight = problem(COUNTS, 24, 40, torch.float32)
    with pytest.raises(ValueError, match="counts: expected 5 non-negative counts summing to 56"):
        grouped_matmul(rows, weight, [5, 17, 0, 33])
    with pytest.raises(ValueError, match="weight: expected K = 40"):
        grouped_matmul(rows, weight[:, :, :8], COUNTS)
    with pytest.raises(ValueError, match="dtype"):
        grouped_matmul(rows, weight.double(), COUNTS)


@pytest.mark.gpu
@pytest.mark.parametrize("n,k", [(768, 2048), (2048, 768)], ids=["gate_up", "down"])
def test_gpu_qwen3_30b_a3b_experts_bitwise_to_the_loop(n, k):
    # 128 experts, 4096 routed rows (512 tokens x 8), uneven counts and empty experts.
    g = torch.Generator().manual_seed(0)
    counts = torch.multinomial(torch.rand(128, generator=g) ** 3, 4096, replacement=True, generator=g)
    counts = torch.bincount(counts, minlength=128).tolist()
    rows, weight = problem(counts, n, k, torch.bfloat16)
    out = grouped_matmul(rows, weight, counts)
    assert torch.equal(out, loop(rows, weight, counts))
    grad_out = torch.randn_like(out)
    r, w = rows.clone().requires_grad_(), weight.clone().requires_grad_()
    grouped_matmul(r, w, counts).backward(grad_out)
    r2, w2 = rows.clone().requires_grad_(), weight.clone().requires_grad_()
    loop(r2, w2, counts).backward(grad_out)
    assert torch.equal(r.grad, r2.grad)
    ref = torch.stack([gg.float().t() @ rr.float() for gg, rr in zip(grad_out.split(counts), rows.split(counts))])
    assert (w.grad.float() - ref).abs().max() <= 1e-2 * ref.abs().max()


@pytest.mark.parametrize("counts", [COUNTS, [0, 0, 0], [16, 16], [0, 40, 0, 0, 7], [3] * 40, [17] * 50], ids=str)
def test_the_tile_table_is_built_on_the_device_without_the_counts_on_the_host(counts):
    """Each expert's rows cut into 16-row tiles, experts in order, then empty tiles up to the bound
    cdiv(rows, 16) + E that the host knows without reading the counts ([17] * 50: 150 tiles, located by
    three programs)."""
    from rl_engine.kernels.ops.triton.linear.grouped_matmul import _tile_table

    table, row = [], 0
    for expert, count in enumerate(counts):
        table += [(expert, first, min(first + 16, row + count)) for first in range(row, row + count, 16)]
        row += count
    table += [(0, 0, 0)] * (-(-row // 16) + len(counts) - len(table))
    got = _tile_table(torch.tensor(counts, device=DEVICE), 16, row)
    assert got.tolist() == [list(t) for t in table]


def test_device_counts_give_the_bits_of_host_counts_and_of_expert_ids():
    """The MoE layer's call (counts [E] on the device, rows grouped) against the list and against the
    registry op given the expert of every row."""
    from rl_engine.kernels.ops.triton.linear.grouped_matmul import TritonGroupedMatmulOp

    rows, weight = problem(COUNTS, 24, 40, torch.bfloat16)
    counts = torch.tensor(COUNTS, device=DEVICE)
    out = grouped_matmul(rows, weight, counts)
    assert torch.equal(out, grouped_matmul(rows, weight, COUNTS))
    ids = torch.repeat_interleave(torch.arange(len(COUNTS), device=DEVICE), counts)
    op = TritonGroupedMatmulOp()
    assert torch.equal(op(x=rows[None], weight=weight, counts=counts)[0], out)
    assert torch.equal(op(x=rows[None], weight=weight, expert_ids=ids[None])[0], out)
    with pytest.raises(ValueError, match="exactly one of them"):
        op(x=rows[None], weight=weight, expert_ids=ids[None], counts=counts)
