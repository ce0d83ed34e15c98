"""The small-M (decode) config of the batch-invariant GEMM: a row computed in a product of M rows has the
bits of the same row in a large batch, for every M; configs that change the reduction order are refused,
and the bitwise check catches them when planted. Under the interpreter the small-M and large-M configs
differ in tile shape, grouping and grid (INTERPRETER_SMALL_M vs INTERPRETER_CONFIG), as on the GPU.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from rl_engine.kernels.ops.triton.linear import matmul as module
from rl_engine.kernels.ops.triton.linear.matmul import (
    GPU_CONFIGS,
    INTERPRETER_CONFIG,
    INTERPRETER_SMALL_M,
    SMALL_M_CONFIGS,
    SMALL_M_OVERRIDES,
    MatmulConfig,
    SmallMConfig,
    batch_invariant_mm,
    check_same_reduction_order,
    config_at,
    fused_keeps_bits,
    small_m_config,
    table_config,
)

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
N, K, FULL_M = 24, 48, 48  # K: three BLOCK_K steps, so the reduction order shows in fp32's bits
interpreter_only = pytest.mark.skipif(DEVICE != "cpu", reason="the interpreter's configs")


def _randn(*shape, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=g).to(dtype=dtype, device=DEVICE)


def rows_differing(mm, a: torch.Tensor, b: torch.Tensor, ms) -> dict[int, int]:
    """{M: elements of rows 0..M-1 computed alone that differ in bits from the same rows of mm(a, b)}."""
    full = mm(a, b)
    bits = {2: torch.int16, 4: torch.int32}[a.element_size()]
    out = {}
    for m in ms:
        part = mm(a[:m].clone(), b)
        out[m] = int((part.view(bits) != full[:m].view(bits)).sum().item())
    return {m: d for m, d in out.items() if d}


@interpreter_only
def test_the_interpreter_runs_two_different_configs_by_m():
    small, large = config_at(torch.float32, N, K, INTERPRETER_SMALL_M.max_m), config_at(torch.float32, N, K, FULL_M)
    assert large == INTERPRETER_CONFIG and small == INTERPRETER_SMALL_M.config
    differing = {f.name for f in dataclasses.fields(MatmulConfig) if getattr(small, f.name) != getattr(large, f.name)}
    assert differing == {"block_m", "block_n", "group_m", "persistent"}, differing
    module._plans.clear()
    batch_invariant_mm(_randn(1, K, dtype=torch.float32, seed=0), _randn(K, N, dtype=torch.float32, seed=1))
    (plan,) = module._plans.values()
    assert plan.small.config == small and plan.small_max_m == INTERPRETER_SMALL_M.max_m


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_small_m_rows_have_the_bits_of_a_large_batch(dtype):
    # fp32 at every M through the small-M range and past it; bf16 (upcast dot on the CPU) at its edges.
    max_m = small_m_config(dtype, N, K).max_m
    ms = range(1, max_m + 4) if dtype == torch.float32 else [1, 5, max_m, max_m + 1]
    a = _randn(FULL_M, K, dtype=dtype, seed=2)
    w = _randn(N, K, dtype=dtype, seed=3)
    assert rows_differing(batch_invariant_mm, a, w.t(), ms) == {}


def test_the_check_catches_a_small_m_config_with_another_block_k():
    """Planted: M <= 24 runs BLOCK_K = 32 (two dots per row instead of three)."""
    bad = dataclasses.replace(small_m_config(torch.float32, N, K).config, block_k=32)

    def mm(x, y):
        return batch_invariant_mm(x, y, config=bad if x.shape[0] <= 24 else None)

    a, w = _randn(FULL_M, K, dtype=torch.float32, seed=4), _randn(N, K, dtype=torch.float32, seed=5)
    assert set(rows_differing(mm, a, w.t(), [1, 7, 24, 25])) == {1, 7, 24}


def test_the_check_catches_split_k_by_m():
    """Planted: M <= 24 splits K in two launches and adds the fp32 halves afterwards."""

    def mm(x, y):
        if x.shape[0] > 24:
            return batch_invariant_mm(x, y)
        halves = [batch_invariant_mm(x[:, s].contiguous(), y[s], out_fp32=True) for s in (slice(0, 16), slice(16, K))]
        return halves[0] + halves[1]

    a, w = _randn(FULL_M, K, dtype=torch.float32, seed=6), _randn(N, K, dtype=torch.float32, seed=7)
    assert set(rows_differing(mm, a, w.t(), [1, 24])) == {1, 24}


# Two tiers under the interpreter: the narrowest differs from the wider one in tile shape and grid.
NARROW_TIER = SmallMConfig(3, dataclasses.replace(INTERPRETER_SMALL_M.config, block_m=16, block_n=16, persistent=True))


@interpreter_only
def test_tiers_run_by_m_and_keep_a_large_batch_s_bits(monkeypatch):
    monkeypatch.setattr(module, "INTERPRETER_SMALL_M", (INTERPRETER_SMALL_M, NARROW_TIER))  # any order
    module._plans.clear()
    assert [config_at(torch.float32, N, K, m) for m in (1, 3, 4, INTERPRETER_SMALL_M.max_m, FULL_M)] == [
        NARROW_TIER.config, NARROW_TIER.config, INTERPRETER_SMALL_M.config, INTERPRETER_SMALL_M.config,
        INTERPRETER_CONFIG]
    a = _randn(FULL_M, K, dtype=torch.float32, seed=12)
    w = _randn(N, K, dtype=torch.float32, seed=13)
    assert rows_differing(batch_invariant_mm, a, w.t(), [1, 2, 3, 4, 5, INTERPRETER_SMALL_M.max_m]) == {}
    (plan,) = module._plans.values()
    assert (plan.small.config, plan.small_max_m) == (INTERPRETER_SMALL_M.config, INTERPRETER_SMALL_M.max_m)
    assert (plan.small.small.config, plan.small.small_max_m) == (NARROW_TIER.config, NARROW_TIER.max_m)
    assert plan.small.small.small is None and plan.small.small.small_max_m == 0
    module._plans.clear()


@interpreter_only
def test_a_narrower_tier_with_another_block_k_is_refused(monkeypatch):
    bad = SmallMConfig(3, dataclasses.replace(NARROW_TIER.config, block_k=8))
    monkeypatch.setattr(module, "INTERPRETER_SMALL_M", (INTERPRETER_SMALL_M, bad))
    module._plans.clear()
    with pytest.raises(ValueError, match="BLOCK_K 8"):
        batch_invariant_mm(_randn(1, K, dtype=torch.float32, seed=14), _randn(K, N, dtype=torch.float32, seed=15))
    module._plans.clear()


@interpreter_only
def test_a_small_m_config_with_another_block_k_is_refused(monkeypatch):
    bad = dataclasses.replace(INTERPRETER_SMALL_M, config=dataclasses.replace(INTERPRETER_SMALL_M.config, block_k=32))
    monkeypatch.setattr(module, "INTERPRETER_SMALL_M", bad)
    module._plans.clear()
    with pytest.raises(ValueError, match="BLOCK_K 32"):
        batch_invariant_mm(_randn(1, K, dtype=torch.float32, seed=8), _randn(K, N, dtype=torch.float32, seed=9))
    module._plans.clear()


def test_an_explicit_config_runs_at_every_m():
    """config= (sweeps, tests, continuations) is never swapped for the small-M one."""
    module._plans.clear()
    batch_invariant_mm(_randn(1, K, dtype=torch.float32, seed=10), _randn(K, N, dtype=torch.float32, seed=11),
                       config=INTERPRETER_CONFIG)
    (plan,) = module._plans.values()
    assert plan.small is None and plan.small_max_m == 0


# --- the H200 table, checked on the CPU -------------------------------------------------------------------

def _tiers(rule):
    return [] if rule is None else [rule] if isinstance(rule, SmallMConfig) else list(rule)


SMALL_TABLE = [(name, None, None, t) for name, rule in SMALL_M_CONFIGS.items() for t in _tiers(rule)] + [
    (name, n, k, t) for (name, n, k), rule in SMALL_M_OVERRIDES.items() for t in _tiers(rule)
]


@pytest.mark.parametrize("name,n,k,rule", SMALL_TABLE, ids=[f"{t[0]}-{t[1]}-{t[2]}" for t in SMALL_TABLE])
def test_gpu_small_m_table_keeps_the_reduction_order_and_fits(name, n, k, rule):
    large = table_config(getattr(torch, name), n, k)
    check_same_reduction_order(large, rule.config, getattr(torch, name), gpu=True)
    cfg, elem = rule.config, getattr(torch, name).itemsize
    for size in (cfg.block_m, cfg.block_n, cfg.block_k, cfg.num_warps):
        assert size & (size - 1) == 0, f"{name}: {size} is not a power of two"
    smem = (cfg.block_m + cfg.block_n) * cfg.block_k * elem * cfg.num_stages + cfg.block_m * cfg.block_n * elem
    assert smem <= 227 * 1024, f"{name}: {smem} bytes of shared memory"
    assert 1 <= rule.max_m <= 4096


@pytest.mark.parametrize("change,match", [
    ({"block_k": 32}, "BLOCK_K"),
    ({"block_k": 96}, "BLOCK_K"),  # not a multiple: a different chain of steps
    ({"tma": False}, "tma"),
    ({"block_m": 32}, "wgmma"),
    ({"num_warps": 2}, "wgmma"),
])  # fmt: skip
def test_order_changing_gpu_configs_are_refused(change, match):
    large = GPU_CONFIGS["bfloat16"]
    small = dataclasses.replace(MatmulConfig(64, 64, large.block_k, num_warps=4, persistent=False), **change)
    with pytest.raises(ValueError, match=match):
        check_same_reduction_order(large, small, torch.bfloat16, gpu=True)


# --- on the H200 ----------------------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.parametrize("n,k", [(4096, 4096), (1024, 4096), (6144, 4096), (12288, 4096), (24576, 4096), (4096, 12288)],
                         ids=str)
def test_gpu_small_m_rows_have_the_bits_of_m_4096(n, k):
    a = torch.randn(4096, k, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) / k**0.5
    assert config_at(torch.bfloat16, n, k, 1) != config_at(torch.bfloat16, n, k, 4096), "two configs ran"
    assert rows_differing(batch_invariant_mm, a, w.t(), [1, 2, 3, 8, 17, 64, 100, 128, 255, 256, 257]) == {}


@pytest.mark.gpu
@pytest.mark.parametrize("parts", [[4096, 1024, 1024], [12288, 12288]], ids=str)
def test_gpu_a_stacked_product_gives_each_part_its_own_bits(parts):
    """Qwen3-8B's q/k/v and gate/up as one product (DecoderModel._projections): each part's columns equal that
    part's own product at every M the decode and prefill run (their configs differ: fused_keeps_bits says so)."""
    k = 4096
    assert fused_keeps_bits(torch.bfloat16, parts, k)
    a = torch.randn(4096, k, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(sum(parts), k, device="cuda", dtype=torch.bfloat16) / k**0.5
    starts = [sum(parts[:i]) for i in range(len(parts))]
    for m in (1, 3, 64, 128, 255, 256, 4096):
        fused = batch_invariant_mm(a[:m], w.t())
        for r, n in zip(starts, parts):
            alone = batch_invariant_mm(a[:m], w[r : r + n].t())
            assert torch.equal(fused[:, r : r + n].view(torch.int16), alone.view(torch.int16)), (m, r, n)


@pytest.mark.parametrize("block_k", [128, 256])
def test_a_multiple_of_block_k_keeps_the_wgmma_chain_and_nothing_else_does(block_k):
    """16-bit on the GPU: a longer step of the same k16 wgmma chain is allowed; the interpreter (a numpy product per
    block) and fp32 (FMA) keep the same BLOCK_K only."""
    large = GPU_CONFIGS["bfloat16"]
    small = MatmulConfig(64, 64, block_k, num_warps=4, num_stages=3)
    check_same_reduction_order(large, small, torch.bfloat16, gpu=True)
    for dtype, gpu in ((torch.bfloat16, False), (torch.float32, True)):
        with pytest.raises(ValueError, match="equal to"):
            check_same_reduction_order(large, small, dtype, gpu=gpu)


# --- swapped tiles (MatmulConfig.swap_ab): the kernel under the interpreter, the rule, the dispatch -----------------
# The interpreter's dot is a numpy product per block, whose summation order may follow the operands' roles: values
# are compared here (to fp32 rounding), bits on the GPU (the gate's row tests, once a table entry swaps).
SWAP = dataclasses.replace(INTERPRETER_CONFIG, block_m=8, block_n=16, tma=True, swap_ab=True)


@interpreter_only
@pytest.mark.parametrize("m", [1, 5, 8, 13])
def test_a_swapped_tile_computes_the_product(m):
    a = _randn(m, K, dtype=torch.float32, seed=20)
    w = _randn(N, K, dtype=torch.float32, seed=21)
    got = batch_invariant_mm(a, w.t(), config=SWAP)
    torch.testing.assert_close(got, a @ w.t(), rtol=1e-5, atol=1e-5)
    # a K-split over two launches (the tensor-parallel chain: init, then the fp32 hand-over) gives the same values
    half = K // 2
    part = batch_invariant_mm(a[:, :half], w[:, :half].t(), config=SWAP, out_fp32=True)
    whole = batch_invariant_mm(a[:, half:], w[:, half:].t(), config=SWAP, init=part)
    torch.testing.assert_close(whole, got, rtol=1e-5, atol=1e-5)


def test_the_rule_admits_a_swapped_tier_only_as_a_16_bit_gpu_wgmma_tile():
    large = GPU_CONFIGS["bfloat16"]
    swap = MatmulConfig(16, 64, 64, num_warps=4, num_stages=6, swap_ab=True)
    check_same_reduction_order(large, swap, torch.bfloat16, gpu=True)
    for dtype, gpu, cfg, match in (
        (torch.bfloat16, False, swap, "swap_ab"),  # the interpreter
        (torch.float32, True, swap, "swap_ab"),  # FMA
        (torch.bfloat16, True, dataclasses.replace(swap, tma=False), "tma"),
        (torch.bfloat16, True, dataclasses.replace(swap, block_n=32), "BLOCK_N"),  # the 64-row side is the weight's
        (torch.bfloat16, True, dataclasses.replace(swap, block_m=12), "BLOCK_N"),  # wgmma N: multiples of 8
    ):
        with pytest.raises(ValueError, match=match):
            check_same_reduction_order(large, cfg, dtype, gpu=gpu)


@interpreter_only
def test_a_swapped_tier_runs_only_on_a_stored_weight(monkeypatch):
    """Dispatch: a swap tier reads b as a stored [N, K] weight; any other b runs the next wider tier."""
    monkeypatch.setattr(module, "INTERPRETER_SMALL_M", (INTERPRETER_SMALL_M, SmallMConfig(3, SWAP)))
    monkeypatch.setattr(module, "check_same_reduction_order", lambda *args, **kw: None)  # the GPU's rule
    module._plans.clear()
    a = _randn(2, K, dtype=torch.float32, seed=22)
    w = _randn(N, K, dtype=torch.float32, seed=23)
    ran = []
    real = module._launch_tma
    monkeypatch.setattr(module, "_launch_tma", lambda plan, *args, **kw: (ran.append(plan.config), real(plan, *args,
                                                                                                          **kw))[1])
    torch.testing.assert_close(batch_invariant_mm(a, w.t()), a @ w.t(), rtol=1e-5, atol=1e-5)
    assert ran[-1] == SWAP
    got = batch_invariant_mm(a, w.t().contiguous())  # [K, N] row-major: not a stored weight
    torch.testing.assert_close(got, a @ w.t(), rtol=1e-5, atol=1e-5)
    assert ran == [SWAP], "the wider tier (pointer loads here) ran instead"
    module._plans.clear()
