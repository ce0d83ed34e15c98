"""Compile the attention, matmul, grouped-GEMM and linear_logp kernels for the H200 (sm_90a) without a GPU.

    TRITON_INTERPRET=0 python -m rl_engine.kernels.ops.triton.sm90 [--tile M,N,WARPS,STAGES]

Triton's CPU interpreter runs code that the GPU compiler rejects (head_dim 8 attention once failed
only on the H200). `triton.compile` with a CUDA target runs the whole GPU pipeline, down to PTX and
ptxas's machine code, with no GPU present, so CI can see a kernel that will not compile, or whose
tiles overflow the H200's shared memory, before a device session does. It must run with the
interpreter off (the interpreter replaces kernels by Python functions); tests start it in a
subprocess. Prints one JSON object: {"<kind>/<dtype>/<head_dim>" (attention) or "grouped_<kind>/<dtype>":
{"shared": bytes, "cubin": bytes, "wgmma": count[, "registers", "spill_bytes", "serialised_wgmma" with --registers]} or
{"error": "..."}}.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import re
import sys

import torch

from rl_engine.kernels.ops.triton.runtime import dot_precision

H200_SHARED_BYTES = 227 * 1024
ATTENTION_KERNELS = ("forward", "forward_partial", "combine", "dq", "dkdv")
# The forward reading a paged KV cache through its block table (16-key pages), compiled for the bf16 head dims a
# rollout decodes at: whole tiles (chunked prefill) and split programs (decode).
PAGED_KERNELS = ("forward_paged", "forward_partial_paged")
PAGED_HEAD_DIMS = (64, 128)
PAGED_PAGE_SIZE = 16
CASES = [(torch.bfloat16, d) for d in (8, 64, 80, 128, 256)] + [(torch.float32, d) for d in (8, 128, 256)]
# Launches specialise pointers and integer arguments that are multiples of 16 as 16-byte aligned (what
# makes loads vectorised and pipelined); these are, at every shape a model runs.
_ALIGNED = {"Q", "K", "V", "O", "LSE", "PM", "PL", "PACC", "SEQ_INFO", "DO", "DELTA", "DQ", "DK", "DV",
            "hidden_ptr", "weight_ptr", "target_ptr", "part_max_ptr", "part_sum_ptr", "target_logit_ptr",
            "lse_ptr", "grad_out_ptr", "dlogits_ptr", "b_ptr", "logp_ptr", "H", "stride_hn", "stride_wv",
            "stride_dn", "stride_ak", "stride_bk", "M",
            "stride_qr", "stride_qh", "stride_kr", "stride_kh", "stride_or", "stride_oh", "stride_lr",
            "a_ptr", "w_ptr", "c_ptr", "g_ptr", "dw_ptr", "tiles_ptr", "starts_ptr", "N",  # "K" is above
            "stride_am", "stride_we", "stride_wn", "stride_wk", "stride_cm", "stride_gm", "stride_de",
            "e_ptr", "mean_z_ptr", "part_ptr", "stride_en"}
# Launches also specialise integer arguments equal to 1 as constants: the unit strides of row-major operands.
_UNIT_STRIDES = {"stride_ak", "stride_wk", "stride_cn", "stride_gn", "stride_dk"}


def _compile(fn, constants: dict, types, num_warps: int, num_stages: int):
    """triton.compile of fn for sm_90a; types(name) gives each runtime argument's Triton type."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    names = fn.arg_names
    signature = {n: "constexpr" if n in constants else types(n) for n in names}
    source = ASTSource(fn=fn, signature=signature,
                       constexprs={(names.index(k),): v for k, v in constants.items()},
                       attrs={(names.index(n),): [["tt.divisibility", 16]] for n in names
                              if n in _ALIGNED and n not in constants})
    return triton.compile(source, target=GPUTarget("cuda", 90, 32),
                          options={"num_warps": num_warps, "num_stages": num_stages})


def compile_attention(kind: str, dtype: torch.dtype, head_dim: int, tile=None):
    """The compiled kernel (triton.compile's result) of one attention kernel at its configured tiles; also
    "combine_after_pdl", the combine as gluon_decode launches it (waiting for the decode grid)."""
    from rl_engine.kernels.ops.triton.attention import contract, flash

    config = contract.attention_config(dtype, head_dim)
    padded = contract.block_d(head_dim)
    element = "*bf16" if dtype == torch.bfloat16 else "*fp32"
    if kind in ("combine", "combine_after_pdl"):
        constants = dict(BLOCK_R=contract.COMBINE_BLOCK_R, BLOCK_D=padded, AFTER_PDL=kind == "combine_after_pdl")
        return _compile(flash._split_combine_kernel, constants,
                        lambda n: element if n == "O" else "*fp32" if n.isupper() else "i32", 4, 1)
    paged = kind.endswith("_paged")
    kind = kind.removesuffix("_paged")
    fn, field = {"forward": (flash._flash_forward_kernel, "forward"),
                 "forward_partial": (flash._flash_forward_kernel, "forward"),
                 "dq": (flash._flash_backward_dq_kernel, "backward_dq"),
                 "dkdv": (flash._flash_backward_dkdv_kernel, "backward_dkdv")}[kind]
    tile = tile or getattr(config, field)
    constants = dict(CAUSAL=True, BLOCK_M=tile.block_m, BLOCK_N=tile.block_n, BLOCK_D=padded,
                     EVEN_D=padded == head_dim, MASK_SPLIT=dtype != torch.float32, DOT_FP32=False,
                     DOT_PRECISION=dot_precision(dtype))
    if fn is flash._flash_forward_kernel:
        constants.update(KV_SPLIT=config.kv_split, PARTIAL=kind == "forward_partial", FLAT=config.flat_splits,
                         PAGE_SIZE=PAGED_PAGE_SIZE if paged else 1, PAGED=paged)
        if not paged:
            constants["BLOCK_TABLE"] = None  # what flash_forward passes for a contiguous cache
    # what dispatch.row_descriptors decides for contiguous rows (a paged cache has none)
    tma = dtype != torch.float32 and padded == head_dim and not paged
    constants["TMA"] = tma
    block_rows = {"KD": tile.block_n, "VD": tile.block_n, "QD": tile.block_m, "DOD": tile.block_m}

    def types(name: str) -> str:
        if name in block_rows:
            return f"tensordesc<{element[1:]}[{block_rows[name]}, {head_dim}]>" if tma else element
        if name in ("SEQ_INFO", "BLOCK_TABLE"):
            return "*i32"
        if name in ("LSE", "DELTA", "PM", "PL", "PACC"):
            return "*fp32"
        if name.isupper():
            return element
        return "fp32" if name in ("qk_scale", "scale") else "i32"

    return _compile(fn, constants, types, tile.num_warps, tile.num_stages)


def compile_grouped_matmul(kind: str, dtype: torch.dtype):
    """The grouped GEMM's forward/input-gradient kernel ("matmul") or weight-gradient kernel ("weight_grad")
    at the tiles its wrapper launches for Qwen3-30B-A3B expert shapes (N = 768, K = 2048)."""
    from rl_engine.kernels.ops.triton.linear import grouped_matmul as gm
    from rl_engine.kernels.ops.triton.linear.matmul import matmul_config

    cfg = matmul_config(dtype, 768, 2048)
    precision = dot_precision(dtype)  # the interpreter is off here: the GPU's choice
    element = "*bf16" if dtype == torch.bfloat16 else "*fp32"
    if kind in ("matmul", "matmul_w_along_n"):  # forward; input gradient (w read along its unit-stride n)
        fn = gm._grouped_matmul_kernel
        transpose_w = kind == "matmul_w_along_n"
        constants = dict(BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, DOT_FP32=False,
                         INPUT_PRECISION=precision, TMA=cfg.tma, TRANSPOSE_W=transpose_w)
        blocks = {"a_desc": [cfg.block_m, cfg.block_k],
                  "w_desc": [cfg.block_k, cfg.block_n] if transpose_w else [cfg.block_n, cfg.block_k]}
    else:
        fn = gm._grouped_weight_grad_kernel
        blocks = {}
        constants = dict(BLOCK_N=min(cfg.block_m, 128), BLOCK_K=min(cfg.block_n, 128), BLOCK_R=cfg.block_k,
                         E_PAD=128, DOT_FP32=False, INPUT_PRECISION=precision)
    unit = _UNIT_STRIDES ^ {"stride_wk", "stride_wn"} if kind == "matmul_w_along_n" else _UNIT_STRIDES
    constants.update({name: 1 for name in fn.arg_names if name in unit})

    def types(name: str) -> str:
        if name in ("a_desc", "w_desc"):
            return f"tensordesc<{element[1:]}[{blocks[name][0]}, {blocks[name][1]}]>" if cfg.tma else element
        if name == "tiles_ptr":
            return "*i32"
        if name == "counts_ptr":
            return "*i64"
        return element if name.endswith("_ptr") else "i32"

    return _compile(fn, constants, types, cfg.num_warps, cfg.num_stages)


MATMUL_VARIANTS = ("plain", "init", "out_fp32", "init_out_fp32", "small_m", "small_m_narrow", "small_m_residual",
                   "swap_ab")
# A swapped decode tile (MatmulConfig.swap_ab): 16 activation rows on the tensor core's N side, 64 weight rows.
SWAP_AB_PROBE = dict(block_m=16, block_n=64, block_k=128, num_warps=4, num_stages=6, swap_ab=True)


def compile_matmul(variant: str):
    """The bf16 TMA matmul kernel at its GPU tiles, activations times a weight stored [N, K] (B_TRANS):
    as one product ("plain"), or as a K-slice continuing another launch's fp32 partial ("init"),
    handing its own on ("out_fp32"), or both (a tensor-parallel rank in the middle of the chain); or
    the small-M (decode) tiers at the same shape ("small_m": the widest, "small_m_narrow": the narrowest,
    "small_m_residual": the narrowest adding the residual stream in its epilogue, as o_proj does at batch 1),
    launched as decode launches are (PDL: the weight's L2 prefetch, the trigger of the kernel after, then the wait
    for the kernel before)."""
    from rl_engine.kernels.ops.triton.linear import matmul as mm

    cfg = mm.matmul_config(torch.bfloat16, 4096, 4096)
    tiers = mm.small_m_tiers(torch.bfloat16, 4096, 4096)
    if variant.startswith("small_m"):
        cfg = (tiers[0] if variant in ("small_m_narrow", "small_m_residual") else tiers[-1]).config
    if variant == "swap_ab":
        cfg = mm.MatmulConfig(**SWAP_AB_PROBE)
    has_init, out_fp32 = variant in ("init", "init_out_fp32"), variant in ("out_fp32", "init_out_fp32")
    blocks = {"a_desc": [cfg.block_m, cfg.block_k], "b_desc": [cfg.block_n, cfg.block_k],
              "c_desc": [cfg.block_m, cfg.block_n]}
    constants = dict(A_TRANS=False, B_TRANS=True, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k,
                     GROUP_M=cfg.group_m, NUM_PROGRAMS=132 if cfg.persistent else mm.ONE_TILE_PER_PROGRAM,
                     DOT_FP32=False,
                     INPUT_PRECISION=dot_precision(torch.bfloat16), HAS_INIT=has_init, OUT_FP32=out_fp32,
                     PDL=variant.startswith("small_m") or variant == "swap_ab", SWAP_AB=cfg.swap_ab,
                     RESIDUAL=variant == "small_m_residual")
    if not constants["PDL"]:
        constants["w_ptr"] = None
    if not has_init:
        constants["init_ptr"] = None
    if not out_fp32:
        constants["out32_ptr"] = None
    if not constants["RESIDUAL"]:
        constants["res_ptr"] = None

    def types(name: str) -> str:
        if name in blocks:
            return f"tensordesc<bf16[{blocks[name][0]}, {blocks[name][1]}]>"
        return "*bf16" if name in ("w_ptr", "res_ptr") else "*fp32" if name.endswith("_ptr") else "i32"

    stages = mm.CONTINUATION_STAGES if has_init or out_fp32 else cfg.num_stages
    return _compile(mm._matmul_tma_kernel, constants, types, cfg.num_warps, stages)


# The small kernels of a decode step, as the step launches them: programmatic dependents (runtime.pdl_launch), bf16,
# Qwen3-8B's widths (hidden 4096, intermediate 12288, 32 heads of 128, 8 KV heads).
DECODE_KERNELS = ("rms_norm", "rms_norm_heads", "swiglu", "rope", "rope_kv_pages", "paged_write")


def compile_decode(kind: str):
    from rl_engine.kernels.ops.triton.activation.swiglu import BLOCK, NUM_WARPS, _swiglu_forward_kernel
    from rl_engine.kernels.ops.triton.attention.paged_write import _write_kv_kernel
    from rl_engine.kernels.ops.triton.norm.rms_norm import _rms_norm_forward_kernel, launch_config
    from rl_engine.kernels.ops.triton.position.rope import _rope_kernel

    def types(ints: dict[str, str], default: str = "*bf16"):
        return lambda n: ints.get(n, default if n.endswith("_ptr") else "i32")

    if kind in ("rms_norm", "rms_norm_heads"):  # the hidden rows; q's and k's heads in one launch (weight rows)
        heads = kind == "rms_norm_heads"
        block, warps = launch_config(128 if heads else 4096)
        return _compile(_rms_norm_forward_kernel, dict(BLOCK_H=block, SPLIT_WEIGHT=heads, PDL=True),
                        types({"rstd_ptr": "*fp32", "eps": "fp32"}), warps, 1)
    if kind == "swiglu":
        return _compile(_swiglu_forward_kernel, dict(BLOCK=BLOCK, PDL=True), types({}), NUM_WARPS, 1)
    if kind in ("rope", "rope_kv_pages"):  # q's heads; q's and k's heads in one launch, writing the paged cache
        kv = kind == "rope_kv_pages"
        return _compile(_rope_kernel, dict(TRANSPOSE=False, LIBDEVICE_TRIG=True, BLOCK_HEADS=64 if kv else 32,
                                           BLOCK_HALF=64, KV=kv, BLOCK_V=1024 if kv else 1, PDL=True),
                        types({"positions_ptr": "*i64", "inv_freq_ptr": "*fp32", "slots_ptr": "*i64"}), 2, 1)
    return _compile(_write_kv_kernel, dict(ROW=1024, BLOCK=1024, PDL=True), types({"slots_ptr": "*i64"}), 4, 1)


LINEAR_LOGP_KERNELS = ("partials", "partials_logits", "combine", "dlogits", "dh", "dw", "policy_stats",
                       "policy_dlogits", "policy_stats_e", "policy_dlogits_e", "policy_dx_split", "policy_dx_sum")
# Elementwise kernels whose fp32 build differs from the bf16 one only in pointer types: compiled in bf16 alone.
LINEAR_LOGP_BF16_ONLY = ("policy_dlogits_e", "policy_dx_sum")


def compile_linear_logp(kind: str, dtype: torch.dtype):
    """linear_logp's kernels at its GPU configuration (Qwen3-8B: V = 151936, H = 4096): the forward's
    logits partials and combine, the backward's logits recompute and its two gradient GEMMs; and the
    fused policy loss's statistics and gradient-logits kernels (with the entropy terms: their largest),
    and its fp32 main-grad mode's: the statistics storing e, dlogits from e, the split dhidden GEMM and its sum."""
    from rl_engine.kernels.ops.triton.loss import linear_logp as ll
    from rl_engine.kernels.ops.triton.loss import linear_policy_loss as pl

    # the rollout's sampler reads the lm_head on its own tiles; every other kernel runs the trainer's
    cfg = ll.sampling_config(dtype) if kind == "partials_logits" else dict(
        ll._GPU_CONFIGS["fp32" if dtype == torch.float32 else "16bit"])
    element = "*bf16" if dtype == torch.bfloat16 else "*fp32"
    precision = dot_precision(dtype)  # the interpreter is off here: the GPU's choice
    tiles = dict(BLOCK_T=cfg["BLOCK_T"], BLOCK_V=cfg["BLOCK_V"], BLOCK_H=cfg["BLOCK_H"], GROUP=cfg["GROUP"],
                 NUM_PROGRAMS=132, DOT_FP32=False, INPUT_PRECISION=precision)
    fp32_ptrs = {"part_max_ptr", "part_sum_ptr", "target_logit_ptr", "logits_ptr", "logp_ptr", "lse_ptr",
                 "grad_out_ptr"}
    blocks = {"h_desc": [cfg["BLOCK_T"], cfg["BLOCK_H"]], "w_desc": [cfg["BLOCK_V"], cfg["BLOCK_H"]]}

    def types(name: str) -> str:
        if name in blocks:
            return f"tensordesc<{element[1:]}[{blocks[name][0]}, {blocks[name][1]}]>"
        if name == "target_ptr":
            return "*i64"
        if name == "inv_temp":
            return "fp32"
        if name == "e_ptr":  # e is bf16 beside 16-bit inputs, fp32 beside fp32 ones
            return element
        if kind.startswith("policy") and name not in ("dlogits_ptr", "out_ptr") and name.endswith("_ptr"):
            return "*fp32"
        if name in fp32_ptrs:
            return "*fp32"
        return element if name.endswith("_ptr") else "i32"

    warps, stages = cfg["num_warps"], cfg["num_stages"]
    if kind in ("policy_stats", "policy_stats_e"):
        return _compile(pl._stats_partials_kernel, dict(tiles, ENTROPY=True, STORE_E=kind == "policy_stats_e"),
                        types, warps, stages)
    if kind == "policy_dlogits":
        return _compile(pl._policy_dlogits_kernel, dict(tiles, ENTROPY_BONUS=True), types, warps, stages)
    main_grad = pl.config(dtype, "gpu")
    if kind == "policy_dlogits_e":
        return _compile(pl._dlogits_from_e_kernel, dict(ENTROPY_BONUS=True, BLOCK_R=main_grad["E_BLOCK_R"],
                                                         BLOCK_V=cfg["BLOCK_V"]), types, 4, 1)
    if kind == "policy_dx_sum":
        return _compile(pl._split_k_sum_kernel, dict(SPLITS=main_grad["SPLIT_K"], BLOCK=1024), types, 4, 1)
    if kind == "policy_dx_split":
        dx = main_grad["DX"]
        tma = dtype != torch.float32  # what gemm_descriptors decides for the row-major dlogits and weight
        dx_blocks = {"a_desc": [dx["BLOCK_M"], dx["BLOCK_K"]], "b_desc": [dx["BLOCK_K"], dx["BLOCK_N"]]}
        constants = dict(BLOCK_M=dx["BLOCK_M"], BLOCK_N=dx["BLOCK_N"], BLOCK_K=dx["BLOCK_K"], GROUP=dx["GROUP"],
                         DOT_FP32=False, INPUT_PRECISION=precision, TMA=tma, stride_ak=1, stride_bn=1)

        def dx_types(name: str) -> str:
            if name in dx_blocks:
                return f"tensordesc<{element[1:]}[{dx_blocks[name][0]}, {dx_blocks[name][1]}]>" if tma else element
            return "*fp32" if name == "part_ptr" else element if name.endswith("_ptr") else "i32"

        return _compile(pl._split_k_kernel, constants, dx_types, dx["num_warps"], dx["num_stages"])
    if kind == "combine":
        return _compile(ll._combine_kernel, {"BLOCK": 2048}, types, 4, 1)
    if kind in ("partials", "partials_logits"):  # the trainer's forward; the rollout's, storing the logits too
        return _compile(ll._partials_kernel, dict(tiles, HAS_BIAS=False, STORE_LOGITS=kind == "partials_logits"),
                        types, cfg["num_warps"], cfg["num_stages"])
    if kind == "dlogits":
        return _compile(ll._dlogits_kernel, dict(tiles, HAS_BIAS=False), types, cfg["num_warps"], cfg["num_stages"])
    gemm = cfg["DH" if kind == "dh" else "DW"]
    constants = dict(BLOCK_M=gemm["BLOCK_M"], BLOCK_N=gemm["BLOCK_N"], BLOCK_K=gemm["BLOCK_K"], GROUP=gemm["GROUP"],
                     ROW_SUM=False, EVEN_K=True, DOT_FP32=False, INPUT_PRECISION=precision,
                     stride_bn=1, stride_cn=1)
    # dH += dlogits @ W[chunk] into the fp32 accumulator; dW[chunk] = dlogits^T @ hidden (A read transposed).
    constants.update(ACCUMULATE=True, stride_ak=1) if kind == "dh" else constants.update(ACCUMULATE=False, stride_am=1)
    tma = dtype != torch.float32  # what gemm_descriptors decides for these row-major layouts
    constants.update(TMA=tma, A_TRANS=tma and kind == "dw")
    bm, bn, bk = gemm["BLOCK_M"], gemm["BLOCK_N"], gemm["BLOCK_K"]
    gemm_blocks = {"a_desc": [bk, bm] if kind == "dw" else [bm, bk], "b_desc": [bk, bn]}

    def gemm_types(name: str) -> str:
        if name in gemm_blocks:
            return f"tensordesc<{element[1:]}[{gemm_blocks[name][0]}, {gemm_blocks[name][1]}]>" if tma else element
        if kind == "dh" and name == "c_ptr":
            return "*fp32"
        return types(name)

    return _compile(ll._matmul_kernel, constants, gemm_types, gemm["num_warps"], gemm["num_stages"])


MOE_KERNELS = ("combine", "combine_backward", "permute_backward", "route", "route_backward")


def compile_moe(kind: str):
    """The MoE combine / permute-backward kernels at Qwen3-30B-A3B's hidden 2048, k = 8, and the router's
    at 128 experts, bf16, with the launch options the model uses (which must forbid fma contraction:
    torch rounds mul and add apart)."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from rl_engine.kernels.ops.triton import moe

    fn = {"combine_backward": moe._combine_backward_kernel, "route": moe._route_kernel,
          "route_backward": moe._route_backward_kernel}.get(kind, moe._slot_sum_kernel)
    launch = moe._launch_options(2048)
    constants = {"TOP_K": 8, "BLOCK_H": launch["BLOCK_H"], "LOG_H": moe._log2(launch["BLOCK_H"]),
                 "WEIGHTED": kind == "combine", "NORM": True, "LIBDEVICE_EXP": True, "BLOCK_E": 128, "LOG_E": 7,
                 "BLOCK_K": 8, "LOG_K": 3}
    names = fn.arg_names
    constants = {k: v for k, v in constants.items() if k in names}
    fp32 = {"grad_w_ptr", "probs_ptr", "picked_ptr"}
    signature = {n: "constexpr" if n in constants else
                 "*i64" if n in ("slot_ptr", "experts_ptr") else "*fp32" if n in fp32 else
                 "*bf16" if n.endswith("_ptr") else "i32" for n in names}
    source = ASTSource(fn=fn, signature=signature, constexprs={(names.index(k),): v for k, v in constants.items()},
                       attrs={(names.index(n),): [["tt.divisibility", 16]] for n in names
                              if n.endswith("_ptr") or n in ("H", "stride_r", "stride_o", "stride_g")})
    options = {k: v for k, v in launch.items() if k not in constants}
    if kind.startswith("route"):
        options = moe._ROUTER_OPTIONS
    return triton.compile(source, target=GPUTarget("cuda", 90, 32), options=dict(options, num_stages=1))


def _summary(kernel, registers: bool = False) -> dict:
    ptx = kernel.asm["ptx"]
    # scalar_loads: 16-bit global loads one element at a time, where a contiguous tile should come in
    # 16-byte async copies (a grouped GEMM whose operand lost its contiguity was 5x slower on the H200).
    summary = {"shared": kernel.metadata.shared, "cubin": len(kernel.asm.get("cubin", b"")),
               "wgmma": ptx.count("wgmma.mma_async"), "scalar_loads": len(re.findall(r"ld\.global\.[bu]16", ptx)),
               "fma": len(re.findall(r"\bfma\.rn\.f32", ptx)), "griddep": ptx.count("griddepcontrol."),
               "ftz_fma": len(re.findall(r"\bfma\.r[nmzp]\.ftz\.f32", ptx))}
    if registers:
        summary.update(ptxas_registers(ptx))
    if summary["cubin"]:
        text = sass(kernel.asm["cubin"])
        # single_bf16_cvt: fp32 -> bf16 conversions one element at a time in the machine code (F2F, on the MUFU
        # pipe beside attention's exp2s), where the paired F2FP (cvt.rn.bf16x2.f32) rounds the same.
        summary["single_bf16_cvt"] = len(re.findall(r"\bF2F\.BF16\.F32\b", text))
        summary["exp2_before_pv_wait"] = _exp2_before_pv_wait(text)
    return summary


def _exp2_before_pv_wait(text: str) -> list[int]:
    """Per loop of the Gluon forward's machine code, the exp2s issued between the wait for q·kᵀ (p·v still in
    flight: `gsb0, 0x2`) and the wait for p·v (`0x0`): how much of a block's softmax overlaps the previous p·v."""
    loops, exp2 = [], None
    for line in text.splitlines():
        if "WARPGROUP.DEPBAR.LE gsb0, 0x2" in line:
            exp2 = 0
        elif exp2 is not None and "MUFU.EX2" in line:
            exp2 += 1
        elif exp2 is not None and "WARPGROUP.DEPBAR.LE gsb0, 0x0" in line:
            loops, exp2 = loops + [exp2], None
    return loops


def sass(cubin: bytes) -> str:
    """The machine code of a cubin, as text (nvdisasm beside Triton's ptxas)."""
    import subprocess
    import tempfile

    from triton.backends.nvidia.compiler import get_ptxas

    nvdisasm = os.path.join(os.path.dirname(get_ptxas(90).path), "nvdisasm")
    with tempfile.NamedTemporaryFile("wb", suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        return subprocess.run([nvdisasm, "-c", f.name], capture_output=True, text=True, check=True).stdout


def ptxas_registers(ptx: str) -> dict:
    """{"registers": per thread, "spill_bytes": spill stores, "serialised_wgmma": ptxas's reason or None} from
    `ptxas -v` on the kernel's PTX: a kernel that spills pays local-memory traffic in its inner loop, and one whose
    wgmma ptxas serialises (C7514/C7515: an accumulator touched by other instructions while its MMA is in flight)
    waits for every MMA, so tiles can be screened here (a Gluon decode lost 1.37x to it)."""
    import re
    import subprocess
    import tempfile

    from triton.backends.nvidia.compiler import get_ptxas

    with tempfile.NamedTemporaryFile("w", suffix=".ptx") as f:
        f.write(ptx)
        f.flush()
        out = subprocess.run([get_ptxas(90).path, "-v", "--gpu-name=sm_90a", f.name, "-o", "/dev/null"],
                             capture_output=True, text=True, check=True).stderr
    registers = re.search(r"Used (\d+) registers", out)
    spills = re.search(r"(\d+) bytes spill stores", out)
    serialised = re.search(r"wgmma\.mma_async instructions are serialized due to ([^']*?) in the function", out)
    return {"registers": int(registers.group(1)) if registers else None,
            "spill_bytes": int(spills.group(1)) if spills else 0,
            "serialised_wgmma": " ".join(serialised.group(1).split()) if serialised else None}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tile", help="force one attention tile M,N,WARPS,STAGES (to test the check; skips the GEMMs)")
    parser.add_argument("--cases", help="dtype/head_dim list, e.g. bf16/128,fp32/256 (default: all)")
    parser.add_argument("--registers", action="store_true", help="also registers and spill bytes (ptxas -v)")
    args = parser.parse_args(argv)
    from rl_engine.kernels.ops.triton.runtime import interpreting

    if interpreting():
        parser.exit(2, "sm90: set TRITON_INTERPRET=0 (the interpreter replaces kernels by Python functions)\n")
    from rl_engine.kernels.ops.triton.attention.contract import TileConfig

    tile = TileConfig(*map(int, args.tile.split(","))) if args.tile else None
    cases = CASES
    if args.cases:
        dtypes = {"bf16": torch.bfloat16, "fp32": torch.float32}
        cases = [(dtypes[c.split("/")[0]], int(c.split("/")[1])) for c in args.cases.split(",")]
    results = {}

    def record(key, build):
        try:
            results[key] = _summary(build(), args.registers)
        except Exception as exc:  # noqa: BLE001 - a kernel that fails to compile is the finding
            results[key] = {"error": f"{type(exc).__name__}: {str(exc).strip().splitlines()[-1][:300]}"}
        print(f"sm90 {key}: {results[key]}", file=sys.stderr, flush=True)

    if not args.tile:
        for dtype, name in ((torch.bfloat16, "bf16"), (torch.float32, "fp32")):
            for kind in ("matmul", "matmul_w_along_n", "weight_grad"):
                record(f"grouped_{kind}/{name}", functools.partial(compile_grouped_matmul, kind, dtype))
            for kind in LINEAR_LOGP_KERNELS:
                if name == "bf16" or kind not in LINEAR_LOGP_BF16_ONLY:
                    record(f"linear_logp_{kind}/{name}", functools.partial(compile_linear_logp, kind, dtype))
        for kind in MOE_KERNELS:
            record(f"moe_{kind}/bf16", functools.partial(compile_moe, kind))
        for variant in MATMUL_VARIANTS:
            record(f"matmul_{variant}/bf16", functools.partial(compile_matmul, variant))
        for kind in DECODE_KERNELS:
            record(f"decode_{kind}/bf16", functools.partial(compile_decode, kind))
    for dtype, head_dim in cases:
        paged = PAGED_KERNELS if dtype == torch.bfloat16 and head_dim in PAGED_HEAD_DIMS else ()
        for kind in ATTENTION_KERNELS + paged:
            key = f"{kind}/{'bf16' if dtype == torch.bfloat16 else 'fp32'}/{head_dim}"
            record(key, functools.partial(compile_attention, kind, dtype, head_dim, tile))
    print(json.dumps(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
