"""The attention, grouped-GEMM and linear_logp kernels compile for the H200 (sm_90a) here, on the CPU.

See rl_engine/kernels/ops/triton/sm90.py: the interpreter hides compile failures, ptxas does not.
One subprocess (the interpreter off) compiles every case; the tests read its report.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from rl_engine.kernels.ops.triton.sm90 import (
    ATTENTION_KERNELS,
    DECODE_KERNELS,
    H200_SHARED_BYTES,
    LINEAR_LOGP_BF16_ONLY,
    LINEAR_LOGP_KERNELS,
    MATMUL_VARIANTS,
    MOE_KERNELS,
    PAGED_HEAD_DIMS,
    PAGED_KERNELS,
)

# One case per tile class of attention_config: small heads, the flat split loop (64), a padded head (80),
# the main bf16 tiles, 256-lane heads, and fp32's two classes.
CASES = ["bf16/8", "bf16/64", "bf16/80", "bf16/128", "bf16/256", "fp32/128", "fp32/256"]


def run_sm90(*args: str) -> dict:
    env = dict(os.environ, TRITON_INTERPRET="0")
    proc = subprocess.run([sys.executable, "-m", "rl_engine.kernels.ops.triton.sm90", *args],
                          capture_output=True, text=True, env=env, timeout=1200)
    assert proc.returncode == 0, proc.stderr[-2000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def report():
    return run_sm90("--cases", ",".join(CASES))


@pytest.mark.parametrize("kind", ATTENTION_KERNELS)
@pytest.mark.parametrize("case", CASES)
def test_attention_compiles_for_the_h200(report, kind, case):
    result = report[f"{kind}/{case}"]
    assert "error" not in result, result["error"]
    assert result["cubin"] > 0, "ptxas produced no machine code"
    assert result["shared"] <= H200_SHARED_BYTES, result
    if case.startswith("bf16") and int(case.split("/")[1]) >= 64 and kind != "combine" and _mma_rows(kind, case) >= 64:
        assert result["wgmma"] > 0, "bf16 tiles of 64 rows should reach Hopper's asynchronous tensor-core MMA"
    if case.startswith("bf16") and kind in ("forward", "forward_partial"):
        assert result["single_bf16_cvt"] == 0, "p rounded to bf16 one element at a time (F2F)"


@pytest.mark.parametrize("kind", PAGED_KERNELS)
@pytest.mark.parametrize("head_dim", PAGED_HEAD_DIMS)
def test_the_paged_forward_compiles_for_the_h200(report, kind, head_dim):
    # The forward reading a paged KV cache through its block table (the rollout's decode and chunked prefill).
    result = report[f"{kind}/bf16/{head_dim}"]
    assert "error" not in result, result["error"]
    assert result["cubin"] > 0 and result["shared"] <= H200_SHARED_BYTES and result["wgmma"] > 0, result


_PLANTED_SOFTMAX_BLOCK = """
import triton
import triton.language as tl


@triton.jit
def planted(q, k, v, m, l, acc, visible, qk_scale, kv_base: tl.constexpr, MASKED: tl.constexpr,
            DOT_FP32: tl.constexpr, DOT_PRECISION: tl.constexpr):
    s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION)
    if MASKED:
        s = tl.where(visible, s, float("-inf"))
    m_new = tl.maximum(m, tl.max(s, 1) * qk_scale)
    alpha = tl.math.exp2(m - m_new)
    p_v = tl.math.exp2(tl.fma(s, qk_scale, -m_new[:, None])).to(kv_base)
    l = l * alpha[:, None] + tl.sum(p_v.to(tl.float32), 1)[:, None]  # the [BLOCK_M, 16] tile flash.py carries
    return m_new, l, tl.dot(p_v, v, acc * alpha[:, None], input_precision=DOT_PRECISION)
"""


def test_the_single_cvt_count_sees_p_rounded_one_at_a_time(tmp_path):
    # Planted: the forward's softmax block with l summed from p converted back to fp32 (flash.py's form before
    # l became a product): Triton 3.6 then rounds p to bf16 one element at a time (F2F, on the MUFU pipe).
    (tmp_path / "planted_block.py").write_text(_PLANTED_SOFTMAX_BLOCK)
    code = (
        "import json, sys, unittest.mock as m, torch\n"
        f"sys.path.insert(0, {str(tmp_path)!r})\n"
        "from planted_block import planted\n"
        "from rl_engine.kernels.ops.triton import sm90\n"
        "from rl_engine.kernels.ops.triton.attention import flash\n"
        "with m.patch.object(flash, '_online_softmax_block', planted):\n"
        "    print(json.dumps(sm90._summary(sm90.compile_attention('forward', torch.bfloat16, 64))))\n"
    )
    env = dict(os.environ, TRITON_INTERPRET="0")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert json.loads(proc.stdout.strip().splitlines()[-1])["single_bf16_cvt"] > 0


def _mma_rows(kind: str, case: str) -> int:
    """Rows of the kernel's products (a warpgroup's wgmma takes 64): query rows, or key rows for dK/dV.
    Smaller tiles can win (head_dim 256's 32x32 dK/dV tiles, measured on the H200) and use mma.sync."""
    import torch

    from rl_engine.kernels.ops.triton.attention import contract

    config = contract.attention_config(torch.bfloat16, int(case.split("/")[1]))
    return config.backward_dkdv.block_n if kind == "dkdv" else getattr(
        config, "backward_dq" if kind == "dq" else "forward").block_m


@pytest.mark.parametrize("key", ["grouped_matmul/bf16", "grouped_matmul_w_along_n/bf16", "grouped_weight_grad/bf16",
                                 "grouped_matmul/fp32", "grouped_matmul_w_along_n/fp32", "grouped_weight_grad/fp32"])
def test_grouped_matmul_compiles_for_the_h200(report, key):
    result = report[key]
    assert "error" not in result, result["error"]
    assert result["cubin"] > 0 and result["shared"] <= H200_SHARED_BYTES, result
    if key.endswith("bf16"):
        assert result["wgmma"] > 0
        # Forward and input gradient read w along its unit stride in 16-byte copies. The input
        # gradient once redirected columns with tl.where, and each bf16 came alone (64 scalar loads).
        assert result["scalar_loads"] == 0, result


@pytest.mark.parametrize(("kind", "dtype"), [(k, d) for k in LINEAR_LOGP_KERNELS for d in ("bf16", "fp32")
                                             if d == "bf16" or k not in LINEAR_LOGP_BF16_ONLY])
def test_linear_logp_compiles_for_the_h200(report, kind, dtype):
    result = report[f"linear_logp_{kind}/{dtype}"]
    assert "error" not in result, result["error"]
    assert result["cubin"] > 0 and result["shared"] <= H200_SHARED_BYTES, result
    if dtype == "bf16" and kind in ("policy_stats_e", "policy_dx_split"):  # the main-grad mode's GEMMs
        assert result["wgmma"] > 0 and result["scalar_loads"] == 0, result
    if kind == "policy_dlogits_e":  # e and dlogits rows at 16-byte aligned strides: vector loads
        assert result["scalar_loads"] == 0, result


@pytest.mark.parametrize("kind", MOE_KERNELS)
def test_moe_kernels_compile_without_fma_contraction(report, kind):
    # Their bits equal torch's only while every product and sum is rounded on its own (no fma). The
    # router's fmas are libdevice's expf's own (torch's CUDA exp runs the same ones), in the form
    # without flush-to-zero, as torch is built.
    result = report[f"moe_{kind}/bf16"]
    assert "error" not in result, result["error"]
    assert result["cubin"] > 0 and result["ftz_fma"] == 0, result
    if kind != "route":
        assert result["fma"] == 0, result


def _planted_moe_summary(attribute: str, value: str, kind: str) -> dict:
    """sm90._summary of the MoE kernel `kind` compiled (in a fresh process) with moe.<attribute> = value."""
    code = (
        "import json, unittest.mock as m\n"
        "from rl_engine.kernels.ops.triton import moe, sm90\n"
        f"with m.patch.object(moe, {attribute!r}, {value}):\n"
        f"    print(json.dumps(sm90._summary(sm90.compile_moe({kind!r}))))\n"
    )
    env = dict(os.environ, TRITON_INTERPRET="0")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_the_ftz_count_sees_libdevice_flushing_denormals():
    # Planted: the router compiled with libdevice's flush-to-zero form (Triton's default).
    planted = "dict(moe._ROUTER_OPTIONS, enable_reflect_ftz=True)"
    assert _planted_moe_summary("_ROUTER_OPTIONS", planted, "route")["ftz_fma"] > 0


def test_the_fma_count_sees_a_contraction():
    # Planted: the combine compiled with fp fusion on contracts its multiply-adds.
    assert _planted_moe_summary("_NO_FMA", "{}", "combine")["fma"] > 0


@pytest.mark.parametrize("variant", MATMUL_VARIANTS)
def test_matmul_and_its_continuations_compile_for_the_h200(report, variant):
    # The continuations (an fp32 partial in or out) are what a tensor-parallel rank launches.
    result = report[f"matmul_{variant}/bf16"]
    assert "error" not in result, result["error"]
    assert result["cubin"] > 0 and result["shared"] <= H200_SHARED_BYTES and result["wgmma"] > 0, result


@pytest.mark.parametrize("kind", DECODE_KERNELS)
def test_the_decode_step_s_small_kernels_compile_as_programmatic_dependents(report, kind):
    result = report[f"decode_{kind}/bf16"]
    assert "error" not in result, result["error"]
    assert result["cubin"] > 0 and result["griddep"] >= 2, result  # launch_dependents, then wait


@pytest.mark.parametrize("variant", ["small_m", "small_m_narrow", "small_m_residual", "swap_ab"])
def test_a_decode_matmul_prefetches_triggers_its_dependents_then_waits(report, variant):
    assert report[f"matmul_{variant}/bf16"]["griddep"] >= 2


def test_a_tile_that_overflows_shared_memory_is_caught():
    # Planted: 128x128 forward tiles with 5 stages at head_dim 256 need far more than 227 KiB.
    result = run_sm90("--tile", "128,128,8,5", "--cases", "bf16/256")["forward/bf16/256"]
    assert "error" in result or result["shared"] > H200_SHARED_BYTES, result


def test_it_refuses_to_run_under_the_interpreter():
    env = dict(os.environ, TRITON_INTERPRET="1")
    proc = subprocess.run([sys.executable, "-m", "rl_engine.kernels.ops.triton.sm90"], capture_output=True,
                          text=True, env=env, timeout=300)
    assert proc.returncode == 2 and "TRITON_INTERPRET=0" in proc.stderr


@pytest.fixture(scope="module")
def ptxas_report():
    """One run with `ptxas -v` on the bf16/64 attention kernels (one run serves both tests). Its --tile is the
    configured forward tile of bf16/64, so forward and forward_partial compile exactly as `report` compiles them;
    --tile only skips the GEMMs, whose `ptxas -v` these tests do not read."""
    import torch

    from rl_engine.kernels.ops.triton.attention import contract

    tile = contract.attention_config(torch.bfloat16, 64).forward
    return run_sm90("--registers", "--tile", f"{tile.block_m},{tile.block_n},{tile.num_warps},{tile.num_stages}",
                    "--cases", "bf16/64")


def test_serialised_wgmma_is_read_from_ptxas(ptxas_report):
    # ptxas serialises every wgmma of flash.py's whole-tile forward at head_dim 64 (C7515: an accumulator defined by
    # other instructions while its MMA is in flight; the Gluon forward runs that prefill on the H200), not of its split
    # programs (decode): the check sees one and not the other.
    whole, split = ptxas_report["forward/bf16/64"], ptxas_report["forward_partial/bf16/64"]
    assert "accumulator registers" in (whole["serialised_wgmma"] or ""), whole
    assert split["serialised_wgmma"] is None, split


def test_registers_and_spills_are_read_from_ptxas(ptxas_report):
    result = ptxas_report["forward/bf16/64"]
    assert 0 < result["registers"] <= 255 and result["spill_bytes"] >= 0, result
