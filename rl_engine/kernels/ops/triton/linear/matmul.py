"""Batch-invariant persistent GEMM: c[M,N] = a[M,K] @ b[K,N], and the matmul op built on it.

Why a row's bits never depend on M (DESIGN.md rule 1): the reduction order is fixed by (dtype, N, K)
only, there is no split-K, and every output element is one fp32 accumulator that walks K in
BLOCK_K steps from 0 upwards with the same `tl.dot` instruction family. M only changes how
many tiles exist and which program runs which tile, never the arithmetic of a tile. Rows past M
are padding that is computed and thrown away. `M` is excluded from Triton's argument
specialisation so M = 1 (or M % 16 == 0) compiles the same kernel as any other M.

Small M (decode: M = 1..256 rows) reads the weight once and is bound by memory, but the large
config's 128x256 tiles give only N/256 programs (16 at N = 4096): far too few to stream the weight
at the device's bandwidth. So a second config, chosen by M, runs small M with narrow N tiles
(many programs) and deep pipelining. That choice is allowed to depend on M only because it keeps
every output element's reduction order: K walked from 0 upwards into one fp32 accumulator by the
same `tl.dot` instruction family (BLOCK_M >= 64 in warpgroups of 4 warps: Hopper's wgmma, as the large
config; rows past M are padding), in steps of the large config's BLOCK_K or a multiple of it (the same
chain of k16 wgmmas, fewer and longer loads: weight rows are read in longer contiguous runs; not yet
used by the table, see `check_same_reduction_order`), no
split-K. Only the tile's N width, the step length, the pipeline depth and the grid change, none of
which touches an element's arithmetic. Building the
plan refuses a pair that breaks this (`check_same_reduction_order`); `benchmarks/matmul_small_m.py`
proves the bits equal on the GPU.
A fixed split-K at every M was the other option; it would slow the large-M path (partials).

The kernel is persistent: grid = min(#SMs, #tiles) programs, each looping over tiles with a
stride of #SMs (grouped ordering for L2 reuse). Two variants share that structure:
- `_matmul_tma_kernel` loads tiles through host-built TMA tensor descriptors (Hopper; the fast
  path), with either operand allowed to be stored transposed (weight.t(), a.t() in backward);
- `_matmul_pointer_kernel` loads through arbitrary strides (any layout or alignment).
Which one runs is fixed by the config table and by (dtype, N, K, b's layout): never by M. A
non-persistent config (`persistent=False`, a small-M candidate) runs the same kernel with one tile per
program: its stride between tiles is larger than any tile count.

Host cost: at small M launching can take longer than the GPU's work, so the launch is kept short.
What depends only on (dtype, N, K, device, config) is worked out once (`_Plan`); the TMA kernel is
launched through Triton once per plan and layout, then its compiled kernel is launched directly
(no argument binding or cache-key hashing per call); descriptors skip checks already made.
Device-side descriptors (`tl.make_tensor_descriptor`) would also drop the three host encodings,
but need a scratch allocator that Triton keeps in a context variable (unset on autograd's backward
thread, like the CUDA context below) and change the kernel, so the host descriptors stay.

Under the CPU interpreter bf16/fp16 `tl.dot` is wrong, so `DOT_FP32` upcasts the operands first
(runtime.dot_fp32); the interpreter also gets its own small fixed configs (a large-M and a small-M
one that differ in tile shape, grouping and grid but not BLOCK_K, so CPU tests exercise the dispatch). fp32 operands use
input_precision="ieee" (no TF32).
"""

from __future__ import annotations

import dataclasses
import functools

import torch
import triton
import triton.language as tl
from triton._utils import validate_block_shape
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from rl_engine.kernels.ops.pytorch.linear.matmul import NativeMatmulOp
from rl_engine.kernels.ops.triton.runtime import (
    check_devices,
    dot_fp32,
    dot_precision,
    ensure_cuda_context,
    host_descriptor,
    interpreting,
    needs_autograd,
    register_autograd,
    sm_count,
)


@dataclasses.dataclass(frozen=True)
class MatmulConfig:
    """One fixed tile configuration. `tma` asks for the descriptor kernel where layouts allow it."""

    block_m: int
    block_n: int
    block_k: int
    group_m: int = 8
    num_warps: int = 8
    num_stages: int = 3
    tma: bool = True
    persistent: bool = True  # False: one tile per program (grid = #tiles), for configs of many small tiles
    # True: each tile is computed as its transpose, weight tile × activation tileᵀ (`_matmul_tma_kernel`'s SWAP_AB):
    # the weight rows fill the tensor core's 64-row side and the few activation rows its narrow N side, instead of
    # padding M = 1 to 64 rows. Small-M tiers only, 16-bit on the GPU (check_same_reduction_order).
    swap_ab: bool = False


@dataclasses.dataclass(frozen=True)
class SmallMConfig:
    """The config used for M <= max_m instead of the (dtype, N, K) table's: same reduction order, see
    `check_same_reduction_order`; it changes speed, never bits. A table entry may be a tuple of tiers (ascending
    max_m): an M runs the first tier whose max_m it does not pass."""

    max_m: int
    config: MatmulConfig


# The fixed configurations, as data. Key: dtype name, then optional (N, K) overrides for a dtype.
# Chosen for the H200 (sm90, 227 KB shared memory per block); `benchmarks/matmul.py --sweep`
# measures candidates at M = 8192 so the table can be revised from evidence. Never keyed by M.
GPU_CONFIGS: dict[str, MatmulConfig] = {
    "bfloat16": MatmulConfig(block_m=128, block_n=256, block_k=64, group_m=8, num_warps=8, num_stages=3),
    "float16": MatmulConfig(block_m=128, block_n=256, block_k=64, group_m=8, num_warps=8, num_stages=3),
    # ieee fp32 runs on FMA units, not tensor cores: smaller N tile, pointer loads.
    "float32": MatmulConfig(block_m=128, block_n=128, block_k=32, group_m=8, num_warps=8, num_stages=3, tma=False),
}
GPU_CONFIG_OVERRIDES: dict[tuple[str, int, int], MatmulConfig] = {}

# Small M (decode): the table's config for M <= max_m. Same BLOCK_K and instruction family as the
# large config (checked); narrower N tiles and a deeper pipeline so that many programs stream the
# weight. Keyed like the large table: dtype name, then optional (N, K) overrides (None: no small-M
# config for that shape). `benchmarks/matmul_small_m.py` sweeps candidates and prints the lines.
# Tiers: at M = 256 a weight panel streams fastest through 128-wide N tiles, from M = 17 to 128 through 64-wide ones
# with 128-long K steps (more programs, each reusing its loads over more rows).
_DECODE = MatmulConfig(64, 128, 64, group_m=8, num_warps=4, num_stages=8, persistent=True)
_DECODE_NARROW = dataclasses.replace(_DECODE, block_n=32)  # N = 1024: 32 programs instead of 8
_DECODE_WIDE_K = MatmulConfig(64, 64, 128, num_warps=4, num_stages=6)
# M <= 16 (H100 sweeps, every candidate bit-equal to M = 4096): swapped tiles, 16 activation rows against 128 (64 for
# down and gate_up) weight rows; docs/kernels.md gives the rates.
_SWAP_DECODE = MatmulConfig(16, 128, 128, num_warps=4, num_stages=6, swap_ab=True)
_SWAP_DECODE_NARROW = MatmulConfig(16, 64, 128, num_warps=4, num_stages=8, swap_ab=True)
# 128 < M <= 256 where N is wide enough: two warpgroups of 64 rows (the large config's wgmma) on 128-wide N tiles (H100
# sweep: q/k/v 17%, gate_up 12% faster than their configs before at M = 256; slower below M = 256 for q/k/v).
_DECODE_WIDE_M = MatmulConfig(128, 128, 64, num_warps=8, num_stages=6)
_QO_TIERS = (SmallMConfig(16, _SWAP_DECODE), SmallMConfig(128, _DECODE_WIDE_K), SmallMConfig(256, _DECODE))
_DOWN_TIERS = (SmallMConfig(16, _SWAP_DECODE_NARROW), SmallMConfig(128, _DECODE_WIDE_K), SmallMConfig(256, _DECODE))
SMALL_M_CONFIGS: dict[str, SmallMConfig | tuple[SmallMConfig, ...] | None] = {
    "bfloat16": SmallMConfig(256, _DECODE),
    "float16": SmallMConfig(256, _DECODE),
    "float32": None,  # ieee fp32 runs on FMA units: compute-bound well below M = 256
}
SMALL_M_OVERRIDES: dict[tuple[str, int, int], SmallMConfig | tuple[SmallMConfig, ...] | None] = {
    ("bfloat16", 1024, 4096): SmallMConfig(256, _DECODE_NARROW),  # Qwen3-8B k/v
    # Wide N already gives every SM tiles; from M = 256 the large tiles' operand reuse wins there.
    ("bfloat16", 12288, 4096): SmallMConfig(128, _DECODE),  # gate/up
    ("bfloat16", 24576, 4096): (SmallMConfig(16, _SWAP_DECODE_NARROW), SmallMConfig(128, _DECODE),
                                SmallMConfig(256, _DECODE_WIDE_M)),  # gate and up
    ("bfloat16", 151936, 4096): SmallMConfig(128, MatmulConfig(64, 128, 128, num_warps=4, num_stages=4)),  # lm_head
    ("bfloat16", 4096, 4096): _QO_TIERS,  # q/o
    ("bfloat16", 4096, 12288): _DOWN_TIERS,  # down
    ("bfloat16", 6144, 4096): (SmallMConfig(16, _SWAP_DECODE), SmallMConfig(128, _DECODE),
                               SmallMConfig(256, _DECODE_WIDE_M)),  # q, k, v stacked
}

# The interpreter runs every program in Python: small tiles keep CPU tests fast. Still fixed.
INTERPRETER_CONFIG = MatmulConfig(block_m=16, block_n=16, block_k=16, group_m=2, num_warps=4, num_stages=1, tma=False)
INTERPRETER_PROGRAMS = 4  # stands in for the SM count: several tiles per program, as on the GPU
# Differs from INTERPRETER_CONFIG in everything the GPU's small-M config may change: tile shape,
# grouping, grid (one tile per program). BLOCK_K is the same: the reduction order is.
INTERPRETER_SMALL_M = SmallMConfig(24, MatmulConfig(block_m=32, block_n=8, block_k=16, group_m=1, num_warps=4,
                                                    num_stages=1, tma=False, persistent=False))
ONE_TILE_PER_PROGRAM = 1 << 30  # the stride between a non-persistent program's tiles: past any tile count

SUPPORTED_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
CONTINUATION_STAGES = 1  # TMA launches that start from or hand on an fp32 partial (see _launch_tma)
PREFETCH_ROW_BYTES = 1024  # a decode launch's L2 prefetch per weight row (a multiple of 16)
_PREFETCH_ASM = tl.constexpr("{ .reg .pred p; setp.ne.b32 p, $2, 0; "
                             f"@p cp.async.bulk.prefetch.L2.global [$1], {PREFETCH_ROW_BYTES}; mov.u32 $0, 0; }}")


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def matmul_config(dtype: torch.dtype, n: int, k: int) -> MatmulConfig:
    """The fixed configuration for a product with N output columns and reduction length K."""
    return INTERPRETER_CONFIG if interpreting() else table_config(dtype, n, k)


def table_config(dtype: torch.dtype, n: int, k: int) -> MatmulConfig:
    """The GPU table's config at (dtype, N, K), also off a GPU (what --apply compares against)."""
    name = _dtype_name(dtype)
    return GPU_CONFIG_OVERRIDES.get((name, n, k), GPU_CONFIGS[name])


def _as_tiers(rule: SmallMConfig | tuple[SmallMConfig, ...] | None) -> tuple[SmallMConfig, ...]:
    tiers = () if rule is None else (rule,) if isinstance(rule, SmallMConfig) else tuple(rule)
    return tuple(sorted(tiers, key=lambda t: t.max_m))


def table_tiers(dtype: torch.dtype, n: int, k: int) -> tuple[SmallMConfig, ...]:
    """The GPU table's small-M tiers at (dtype, N, K), ascending max_m, also off a GPU (what --apply rewrites)."""
    name = _dtype_name(dtype)
    return _as_tiers(SMALL_M_OVERRIDES.get((name, n, k), SMALL_M_CONFIGS[name]))


def small_m_tiers(dtype: torch.dtype, n: int, k: int) -> tuple[SmallMConfig, ...]:
    """The small-M tiers at (dtype, N, K), ascending max_m; none: every M runs `matmul_config`'s."""
    return _as_tiers(INTERPRETER_SMALL_M) if interpreting() else table_tiers(dtype, n, k)


def small_m_config(dtype: torch.dtype, n: int, k: int) -> SmallMConfig | None:
    """The widest small-M tier at (dtype, N, K) (the largest max_m), or None."""
    tiers = small_m_tiers(dtype, n, k)
    return tiers[-1] if tiers else None


def config_at(dtype: torch.dtype, n: int, k: int, m: int) -> MatmulConfig:
    """The config a product of M rows runs: the first small-M tier whose max_m M does not pass, else the table's."""
    return next((t.config for t in small_m_tiers(dtype, n, k) if m <= t.max_m), matmul_config(dtype, n, k))


def check_same_reduction_order(large: MatmulConfig, small: MatmulConfig, dtype: torch.dtype, gpu: bool = True) -> None:
    """ValueError unless a row computed with `small` has the bits of the same row computed with `large`.

    Each output element is one fp32 accumulator walking K from 0 in BLOCK_K steps with `tl.dot`; the
    kernel (TMA or pointer loads) and the tensor-core instruction family fix the instructions. On Hopper,
    Triton emits wgmma for tiles of >= 64 rows in warpgroups of 4 warps (smaller tiles may take another
    MMA), and a 16-bit `tl.dot` of BLOCK_K is BLOCK_K / 16 k16 wgmmas chained through the accumulator in
    K order, so a BLOCK_K that is a multiple of the large config's walks the same chain in longer steps.
    Tile N width, pipelining and grid change no bit (shown on the GPU by benchmarks/matmul_small_m.py and
    the gate's row tests); no table entry uses a longer step until that sweep's bit check (run before its
    timing; --apply writes only bit-equal winners) and the gate have shown it too. gpu=False (the
    interpreter, whose dot is one numpy product per block) and fp32 (FMA): the same BLOCK_K only.
    swap_ab (a 16-bit GPU small-M tier): each element is still one accumulator over the same exact products in
    the same k16 steps, only the operands' roles are swapped; the gate's row tests must show it before a table
    entry uses it (benchmarks/matmul_small_m.py --swap-ab sweeps such configs, bit check first).
    """
    chain = gpu and dtype in (torch.bfloat16, torch.float16)  # wgmma: a tl.dot is a chain of k16 instructions
    same_walk = small.block_k == large.block_k or (chain and small.block_k % large.block_k == 0)
    if not same_walk or small.tma != large.tma:
        rule = "a multiple of" if chain else "equal to"
        raise ValueError(f"small-M config: BLOCK_K {small.block_k} / tma {small.tma} must be {rule} the large "
                         f"config's ({large.block_k} / {large.tma}): they fix each element's reduction order")
    if small.swap_ab and not (chain and small.tma and not large.swap_ab):
        raise ValueError("small-M config: swap_ab runs only as a 16-bit small-M tier on the GPU (wgmma)")
    # The side of the tile that the tensor core's 64-row operand covers: the weight's rows when swapped.
    rows = lambda c: c.block_n if c.swap_ab else c.block_m  # noqa: E731
    wgmma = all(rows(c) % 64 == 0 and c.num_warps % 4 == 0 for c in (large, small)) and (
        not small.swap_ab or small.block_m % 8 == 0)
    if chain and not wgmma:
        side = "BLOCK_N (swapped)" if small.swap_ab else "BLOCK_M"
        raise ValueError(f"small-M config: {side} {rows(small)} (multiple of 64), num_warps {small.num_warps} "
                         "(multiple of 4) and a swapped BLOCK_M of 8s keep the large config's wgmma instructions")


def fused_keeps_bits(dtype: torch.dtype, parts: list[int], k: int) -> bool:
    """Whether one product over weights stacked by rows ([N1; N2; ...], K) gives each part's columns the bits of
    that part's own product, at every M: every config either may run (large and small-M, fused and parts) walks K
    in the same order through the same kernel (TMA or pointer loads), so an element's arithmetic is the same;
    only tile widths, step lengths and the grid differ (`check_same_reduction_order`)."""
    size = dtype.itemsize
    configs = []
    for n in [*parts, sum(parts)]:
        configs += [(c, c.tma and (k * size) % 16 == 0 and (n * size) % 16 == 0)
                    for c in (matmul_config(dtype, n, k), *(t.config for t in small_m_tiers(dtype, n, k)))]
    if len({tma for _, tma in configs}) != 1:
        return False
    base = min(configs, key=lambda ct: ct[0].block_k)[0]
    try:
        for c, _ in configs:
            check_same_reduction_order(base, c, dtype, gpu=not interpreting())
    except ValueError:
        return False
    return True


@triton.jit
def _tile_coords(tile_id, num_pid_m, num_pid_n, GROUP_M: tl.constexpr):
    """Grouped tile order: GROUP_M row-tiles share each column sweep, so b tiles stay in L2."""
    tiles_per_group = GROUP_M * num_pid_n
    first_m = (tile_id // tiles_per_group) * GROUP_M
    rows_in_group = min(num_pid_m - first_m, GROUP_M)
    pid_m = first_m + (tile_id % tiles_per_group) % rows_in_group
    pid_n = (tile_id % tiles_per_group) // rows_in_group
    return pid_m, pid_n


@triton.jit(do_not_specialize=["M"])
def _matmul_pointer_kernel(
    a_ptr, b_ptr, c_ptr, M, N, K, init_ptr, res_ptr,
    stride_am, stride_ak, stride_bk, stride_bn, stride_cm, stride_cn,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
    NUM_PROGRAMS: tl.constexpr, DOT_FP32: tl.constexpr, INPUT_PRECISION: tl.constexpr,
    HAS_INIT: tl.constexpr = False, RESIDUAL: tl.constexpr = False,
):  # fmt: skip
    # HAS_INIT: the accumulator starts from init_ptr's fp32 [M, N] (contiguous) instead of zero: the
    # K loop continued from an earlier launch's fp32 partial (a tensor-parallel rank continuing the
    # previous rank's reduction), the same adds in the same order as one launch over the whole K.
    # RESIDUAL: c = res + c, res_ptr [M, N] contiguous in c's dtype (`_add_residual`).
    start = tl.program_id(0)
    num_pid_m = tl.cdiv(M, BLOCK_M)
    num_pid_n = tl.cdiv(N, BLOCK_N)
    num_tiles = num_pid_m * num_pid_n
    k_tiles = tl.cdiv(K, BLOCK_K)
    offs_k0 = tl.arange(0, BLOCK_K)
    # The epilogue recomputes its tile from a second counter: the flattened-loop pipeliner
    # mishandles a value used both before and after the K loop (Triton tutorial 09).
    tile_id_c = start - NUM_PROGRAMS
    for tile_id in tl.range(start, num_tiles, NUM_PROGRAMS, flatten=True):
        pid_m, pid_n = _tile_coords(tile_id, num_pid_m, num_pid_n, GROUP_M)
        offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        # Rows/columns past the edge re-read row/column 0 (never stored), so loads need no M/N mask.
        offs_m = tl.max_contiguous(tl.multiple_of(tl.where(offs_m < M, offs_m, 0), BLOCK_M), BLOCK_M)
        offs_n = tl.max_contiguous(tl.multiple_of(tl.where(offs_n < N, offs_n, 0), BLOCK_N), BLOCK_N)
        # 64-bit pointers advanced by BLOCK_K each step: offsets times strides can pass 2^31
        # (e.g. d_weight of the lm_head reads logits' gradient transposed, stride V = 151936).
        a_ptrs = a_ptr + offs_m.to(tl.int64)[:, None] * stride_am + offs_k0[None, :] * stride_ak
        b_ptrs = b_ptr + offs_n.to(tl.int64)[None, :] * stride_bn + offs_k0[:, None] * stride_bk
        if HAS_INIT:
            acc = tl.load(init_ptr + offs_m.to(tl.int64)[:, None] * N + offs_n[None, :])
        else:
            acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for ki in range(k_tiles):
            k_left = K - ki * BLOCK_K
            a = tl.load(a_ptrs, mask=offs_k0[None, :] < k_left, other=0.0)
            b = tl.load(b_ptrs, mask=offs_k0[:, None] < k_left, other=0.0)
            if DOT_FP32:
                a = a.to(tl.float32)
                b = b.to(tl.float32)
            acc = tl.dot(a, b, acc, input_precision=INPUT_PRECISION)
            a_ptrs += BLOCK_K * stride_ak
            b_ptrs += BLOCK_K * stride_bk

        tile_id_c += NUM_PROGRAMS
        pid_m, pid_n = _tile_coords(tile_id_c, num_pid_m, num_pid_n, GROUP_M)
        offs_cm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        offs_cn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        c_ptrs = c_ptr + offs_cm.to(tl.int64)[:, None] * stride_cm + offs_cn[None, :] * stride_cn
        c_mask = (offs_cm[:, None] < M) & (offs_cn[None, :] < N)
        c = acc.to(c_ptr.dtype.element_ty)
        if RESIDUAL:
            c = _add_residual(c, res_ptr, offs_cm, offs_cn, M, N)
        tl.store(c_ptrs, c, mask=c_mask)


@triton.jit
def _add_residual(c, res_ptr, rows, cols, M, N):
    """res + c for the tile at (rows, cols), rounded once to c's dtype: the bits of torch's `res + c` on the rounded
    product (a 16-bit add computes in fp32 and rounds), so a fused residual changes no bit."""
    res = tl.load(res_ptr + rows.to(tl.int64)[:, None] * N + cols[None, :],
                  mask=(rows[:, None] < M) & (cols[None, :] < N), other=0.0)
    return (res.to(tl.float32) + c.to(tl.float32)).to(c.dtype)


@triton.jit
def _prefetch_rows_l2(ptrs, mask):
    """cp.async.bulk.prefetch.L2 of PREFETCH_ROW_BYTES from each pointer (16-byte aligned) where mask holds."""
    tl.inline_asm_elementwise(_PREFETCH_ASM, "=r,l,r", [ptrs, mask.to(tl.int32)], dtype=tl.int32, is_pure=False,
                              pack=1)


@triton.jit(do_not_specialize=["M"])
def _matmul_tma_kernel(
    a_desc, b_desc, c_desc, M, N, K, init_ptr, out32_ptr, w_ptr, res_ptr,
    A_TRANS: tl.constexpr, B_TRANS: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
    NUM_PROGRAMS: tl.constexpr, DOT_FP32: tl.constexpr, INPUT_PRECISION: tl.constexpr,
    HAS_INIT: tl.constexpr, OUT_FP32: tl.constexpr, PDL: tl.constexpr, SWAP_AB: tl.constexpr,
    RESIDUAL: tl.constexpr,
):  # fmt: skip
    # HAS_INIT, RESIDUAL: see _matmul_pointer_kernel. OUT_FP32: the unrounded accumulator goes to out32_ptr
    # (fp32 [M, N], contiguous) through plain stores: an fp32 TMA store tile would not fit beside the
    # pipeline's buffers in shared memory. Both off: the kernel as it always was.
    # A_TRANS: a_desc describes the stored [K,M] tensor whose transpose is a; B_TRANS: b_desc
    # describes the stored [N,K] tensor (a weight) whose transpose is b. TMA zero-fills outside.
    # SWAP_AB (B_TRANS, not A_TRANS): the accumulator holds the tile's transpose, [BLOCK_N, BLOCK_M] = w · aᵀ, each
    # element the same products walked in the same K order with the operands' roles swapped.
    start = tl.program_id(0)
    num_pid_m = tl.cdiv(M, BLOCK_M)
    num_pid_n = tl.cdiv(N, BLOCK_N)
    num_tiles = num_pid_m * num_pid_n
    k_tiles = tl.cdiv(K, BLOCK_K)
    tile_id_c = start - NUM_PROGRAMS  # see _matmul_pointer_kernel
    if PDL:
        # Launched while the kernel before it still runs (programmatic dependent launch): the weight, which no
        # kernel of the step writes, starts streaming into L2 (the head of each of the first tile's rows; w_ptr
        # is the stored [N, K] weight), lets the kernel after it launch in turn (its programs wait for this one's
        # end the same way), then waits for the kernel before to end before touching a or c.
        rows = _tile_coords(start, num_pid_m, num_pid_n, GROUP_M)[1] * BLOCK_N + tl.arange(0, BLOCK_N)
        _prefetch_rows_l2(w_ptr + rows.to(tl.int64) * K, rows < N)
        gdc_launch_dependents()
        gdc_wait()
    for tile_id in tl.range(start, num_tiles, NUM_PROGRAMS, flatten=True):
        pid_m, pid_n = _tile_coords(tile_id, num_pid_m, num_pid_n, GROUP_M)
        off_m = pid_m * BLOCK_M
        off_n = pid_n * BLOCK_N
        if HAS_INIT:
            rows = off_m + tl.arange(0, BLOCK_M)
            cols = off_n + tl.arange(0, BLOCK_N)
            acc = tl.load(init_ptr + rows.to(tl.int64)[:, None] * N + cols[None, :],
                          mask=(rows[:, None] < M) & (cols[None, :] < N), other=0.0)
            if SWAP_AB:
                acc = tl.trans(acc)
        elif SWAP_AB:
            acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
        else:
            acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for ki in range(k_tiles):
            off_k = ki * BLOCK_K
            if SWAP_AB:
                a = a_desc.load([off_m, off_k])
                w = b_desc.load([off_n, off_k])
                if DOT_FP32:
                    a = a.to(tl.float32)
                    w = w.to(tl.float32)
                acc = tl.dot(w, a.T, acc, input_precision=INPUT_PRECISION)
            else:
                if A_TRANS:
                    a = a_desc.load([off_k, off_m]).T
                else:
                    a = a_desc.load([off_m, off_k])
                if B_TRANS:
                    b = b_desc.load([off_n, off_k]).T
                else:
                    b = b_desc.load([off_k, off_n])
                if DOT_FP32:
                    a = a.to(tl.float32)
                    b = b.to(tl.float32)
                acc = tl.dot(a, b, acc, input_precision=INPUT_PRECISION)
        if SWAP_AB:
            acc = tl.trans(acc)

        tile_id_c += NUM_PROGRAMS
        pid_m, pid_n = _tile_coords(tile_id_c, num_pid_m, num_pid_n, GROUP_M)
        if OUT_FP32:
            rows_c = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
            cols_c = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
            tl.store(out32_ptr + rows_c.to(tl.int64)[:, None] * N + cols_c[None, :], acc,
                     mask=(rows_c[:, None] < M) & (cols_c[None, :] < N))
        else:
            c = acc.to(c_desc.dtype)
            if RESIDUAL:
                c = _add_residual(c, res_ptr, pid_m * BLOCK_M + tl.arange(0, BLOCK_M),
                                  pid_n * BLOCK_N + tl.arange(0, BLOCK_N), M, N)
            c_desc.store([pid_m * BLOCK_M, pid_n * BLOCK_N], c)


def _stored_rows(b: torch.Tensor) -> bool:
    """Whether b [K, N] is the transpose of a row-major [N, K] tensor (a weight as stored): what SWAP_AB reads."""
    layout = _row_major_layout(b)
    return layout is not None and layout[2] and _tma_compatible(b, layout[1])


def _row_major_layout(t: torch.Tensor) -> tuple[list[int], list[int], bool] | None:
    """(shape, strides, transposed): t read as a row-major tensor s with t == (s.t() if transposed else s).

    s has the same data pointer as t, so a TMA descriptor built from (t, shape, strides) reads s.
    Size-1 dimensions get their canonical stride so that M = 1 views land on the same path as any
    other M. None when t is neither row- nor column-major, or its rows overlap (broadcast): the
    caller then copies it or uses the pointer kernel.
    """
    rows, cols = t.shape
    row_stride, col_stride = t.stride()
    # Unit stride along one dimension and rows that do not overlap (no broadcast stride 0).
    if (col_stride == 1 or cols == 1) and (rows == 1 or row_stride >= cols):
        return [rows, cols], [row_stride if rows > 1 else cols, 1], False
    if (row_stride == 1 or rows == 1) and (cols == 1 or col_stride >= rows):
        return [cols, rows], [col_stride if cols > 1 else rows, 1], True
    return None


def _tma_compatible(t: torch.Tensor, strides: list[int]) -> bool:
    """TMA wants a 16-byte aligned base and 16-byte aligned row stride."""
    return t.data_ptr() % 16 == 0 and (strides[0] * t.element_size()) % 16 == 0


def _check_operands(a: torch.Tensor, b: torch.Tensor) -> None:
    if not isinstance(a, torch.Tensor) or a.dim() != 2:
        raise ValueError(f"a: expected a tensor of shape [M,K], got {getattr(a, 'shape', type(a).__name__)}")
    if not isinstance(b, torch.Tensor) or b.dim() != 2 or b.shape[0] != a.shape[1]:
        got = tuple(b.shape) if isinstance(b, torch.Tensor) else type(b).__name__
        raise ValueError(f"b: expected shape [K,N] with K={a.shape[1]} (from a), got {got}")
    if a.dtype not in SUPPORTED_DTYPES or b.dtype != a.dtype:
        raise ValueError(f"a, b: expected one dtype among bf16/fp16/fp32, got {a.dtype} and {b.dtype}")
    if a.device != b.device:
        raise ValueError(f"a, b: expected one device, got {a.device} and {b.device}")


@dataclasses.dataclass
class _Plan:
    """Everything a launch needs that depends only on (dtype, N, K, device, config): built once.

    Per call only the operands' layouts, M and the grid size remain to be worked out: at small M
    the host's launch cost can exceed the GPU time of the product.
    """

    config: MatmulConfig
    interpreting: bool
    num_programs: int
    tma: bool  # the config asks for TMA and rows of K and N elements are 16-byte aligned
    round_on_host: bool
    constexprs: tuple  # BLOCK_M, BLOCK_N, BLOCK_K, GROUP_M, NUM_PROGRAMS, DOT_FP32, INPUT_PRECISION
    a_block: dict[bool, list[int]]  # TMA block shape of the stored a, by A_TRANS
    b_block: dict[bool, list[int]]  # ... of the stored b, by B_TRANS
    c_block: list[int]
    # Compiled TMA kernels by (current device, A_TRANS, B_TRANS, HAS_INIT, OUT_FP32, PDL, RESIDUAL), launched without
    # Triton's argument binding. Their specialisation is fixed by this plan: descriptors specialise on
    # dtype and block shape only, N and K are the plan's, and M is never specialised.
    tma_kernels: dict = dataclasses.field(default_factory=dict)
    # The plan for M <= small_max_m (a small-M tier: same bits, other tiles), for plans of the table only; its own
    # `small` is the next narrower tier.
    small: _Plan | None = None
    small_max_m: int = 0
    # A small-M tier's launches (decode): programmatic dependent launch with an L2 prefetch of the weight
    # (_matmul_tma_kernel's PDL), where each stored weight row holds PREFETCH_ROW_BYTES. Scheduling only: no bit.
    pdl: bool = False


_plans: dict[tuple, _Plan] = {}


def _make_plan(dtype: torch.dtype, n: int, k: int, device_index: int, config: MatmulConfig | None) -> _Plan:
    cfg = config or matmul_config(dtype, n, k)
    interp = interpreting()
    upcast = dot_fp32(dtype)
    size = dtype.itemsize
    if cfg.tma:
        for block in ([cfg.block_m, cfg.block_k], [cfg.block_k, cfg.block_n], [cfg.block_m, cfg.block_n]):
            validate_block_shape(block)  # what TensorDescriptor checks, once instead of per call
    if not cfg.persistent:
        programs = ONE_TILE_PER_PROGRAM
    else:
        programs = INTERPRETER_PROGRAMS if interp else sm_count(device_index)
    precision = dot_precision(dtype)
    return _Plan(
        config=cfg,
        interpreting=interp,
        num_programs=programs,
        tma=cfg.tma and (k * size) % 16 == 0 and (n * size) % 16 == 0,
        # The interpreter casts fp32 -> bf16 by truncation; the GPU rounds to nearest even. Under the
        # interpreter the kernel stores fp32 and torch rounds, so both paths round the same way.
        round_on_host=interp and dtype == torch.bfloat16,
        constexprs=(cfg.block_m, cfg.block_n, cfg.block_k, cfg.group_m, programs, upcast, precision),
        a_block={False: [cfg.block_m, cfg.block_k], True: [cfg.block_k, cfg.block_m]},
        b_block={False: [cfg.block_k, cfg.block_n], True: [cfg.block_n, cfg.block_k]},
        c_block=[cfg.block_m, cfg.block_n],
    )


def _plan(dtype: torch.dtype, n: int, k: int, device_index: int, config: MatmulConfig | None) -> _Plan:
    key = (dtype, n, k, device_index, config)
    plan = _plans.get(key)
    if plan is None:
        plan = _make_plan(*key)
        tiers = small_m_tiers(dtype, n, k) if config is None else ()  # an explicit config runs at every M
        outer = plan
        for rule in reversed(tiers):  # widest first: each tier's plan hands the smaller M to the next
            if rule.config == outer.config:
                continue
            check_same_reduction_order(plan.config, rule.config, dtype, gpu=not plan.interpreting)
            outer.small, outer.small_max_m = _make_plan(dtype, n, k, device_index, rule.config), rule.max_m
            outer = outer.small
            outer.pdl = outer.tma and not outer.interpreting and k * dtype.itemsize >= PREFETCH_ROW_BYTES
        _plans[key] = plan
    return plan


@functools.cache
def _current_stream():
    """Triton's own getter of the current raw CUDA stream (the one its launches use)."""
    return triton.runtime.driver.active.get_current_stream


def _launch_hooks_set() -> bool:
    """Whether a profiler (proton, ...) hooks Triton launches: then every launch goes through Triton."""
    hooks = (triton.knobs.runtime.launch_enter_hook, triton.knobs.runtime.launch_exit_hook)
    return any(h is not None and getattr(h, "calls", True) for h in hooks)


def _launch_tma(plan: _Plan, grid: int, descriptors: tuple, m: int, n: int, k: int, a_trans: bool, b_trans: bool,
                init: torch.Tensor | None = None, out32: torch.Tensor | None = None,
                weight: torch.Tensor | None = None, residual: torch.Tensor | None = None):
    cfg = plan.config
    # Every kernel parameter, positionally and in order, constexprs included (the launcher skips them).
    pdl = plan.pdl and b_trans and init is None and out32 is None
    args = (*descriptors, m, n, k, init, out32, weight if pdl else None, residual, a_trans, b_trans, *plan.constexprs,
            init is not None, out32 is not None, pdl, cfg.swap_ab, residual is not None)
    # A continuation moves an fp32 tile through shared memory (sm90 check: 131 KB at one stage, over the
    # H200's 227 KB at two). Pipelining depth changes no bit: the same dots in the same order.
    stages = cfg.num_stages if init is None and out32 is None else CONTINUATION_STAGES
    if plan.interpreting:
        _matmul_tma_kernel[(grid,)](*args, num_warps=cfg.num_warps, num_stages=stages)
        return
    device = torch.cuda.current_device()
    ensure_cuda_context(device)
    key = (device, a_trans, b_trans, init is not None, out32 is not None, pdl, residual is not None)
    kernel = plan.tma_kernels.get(key)
    if kernel is None or _launch_hooks_set():
        # First call for this plan (compiles or loads from Triton's cache), or a profiler is listening.
        plan.tma_kernels[key] = _matmul_tma_kernel[(grid,)](*args, num_warps=cfg.num_warps, num_stages=stages,
                                                            launch_pdl=pdl)
        return
    # The same compiled kernel Triton's launch would pick, launched directly: skips binding and
    # specialising 15 arguments and building the cache key on every call (the TMA descriptors are
    # still encoded per call, by the launcher).
    kernel.run(grid, 1, 1, _current_stream()(device), kernel.function, kernel.packed_metadata, None, None, None, *args)


def writable_rows(out: torch.Tensor) -> bool:
    """Whether `out=` can take this 2-D tensor: rows of stride N (unit columns), 16-byte aligned (a TMA store)."""
    m, n = out.shape
    return (n <= 1 or out.stride(1) == 1) and (m <= 1 or out.stride(0) == n) and out.data_ptr() % 16 == 0


def batch_invariant_mm(a: torch.Tensor, b: torch.Tensor, *, config: MatmulConfig | None = None,
                       init: torch.Tensor | None = None, out_fp32: bool = False,
                       out: torch.Tensor | None = None, residual: torch.Tensor | None = None) -> torch.Tensor:
    """c = a @ b in a's dtype, fp32 accumulation; row i of c depends only on a[i] and b.

    a: [M,K], b: [K,N], any strides (b is typically weight.t(): no copy is made).
    `config` overrides the fixed table at every M (no small-M dispatch; its BLOCK_K fixes the bits):
    for sweeps, tests, and a K-slice that must run the whole product's tiles (see `continue_mm`).
    init (fp32 [M,N]): the accumulator's start instead of zero. out_fp32: return the unrounded fp32
    accumulator. Together they split one product's K loop over launches without changing a bit.
    out: c is written there (a's dtype, [M,N] rows of stride N: e.g. a weight gradient's vocabulary rows).
    residual ([M,N], a's dtype): c = residual + a @ b, added in the epilogue to the rounded product: the bits of the
    separate add, one launch fewer (a decode layer's residual stream).
    """
    _check_operands(a, b)
    (m, k), n = a.shape, b.shape[1]
    out_dtype = torch.float32 if out_fp32 else a.dtype
    if residual is not None:
        if residual.dtype != a.dtype or residual.shape != (m, n) or init is not None or out_fp32:
            raise ValueError(f"residual: expected {a.dtype} {(m, n)} and neither init nor out_fp32; got "
                             f"{residual.dtype} {tuple(residual.shape)}")
        residual = residual.contiguous()
    if out is not None and (out.dtype != out_dtype or out.shape != (m, n) or not writable_rows(out)):
        raise ValueError(f"out: expected {out_dtype} {(m, n)}, row stride {n}, 16-byte aligned; got {out.dtype} "
                         f"{tuple(out.shape)} strides {out.stride()}")
    if init is not None:
        if init.dtype != torch.float32 or init.shape != (m, n):
            raise ValueError(f"init: expected float32 {(m, n)}, got {init.dtype} {tuple(init.shape)}")
        init = init.contiguous()
    if m == 0 or n == 0 or k == 0:
        c = (init if init is not None else torch.zeros((m, n), dtype=torch.float32, device=a.device)).to(out_dtype)
        if residual is not None:
            c = residual + c
        return c if out is None else out.copy_(c)
    top = plan = _plan(a.dtype, n, k, a.get_device(), config)
    while m <= plan.small_max_m and (not plan.small.config.swap_ab or _stored_rows(b)):
        plan = plan.small  # narrower tiles, more programs: the same reduction order (checked in _plan)
    cfg = plan.config
    # The residual goes into the epilogue of the small-M tiers (decode) and the interpreter's tiles. Elsewhere it is
    # added apart, with the same bits: the large tiles leave no shared memory for its tile (H100: 245 KB of 227 KB),
    # and the interpreter's bf16 is rounded on the host, the residual after it.
    fuse = (plan is not top or plan.interpreting) and not plan.round_on_host
    fused_residual, residual = (residual, None) if fuse else (None, residual)
    if out is not None and not plan.round_on_host:
        c = out
    else:
        c = a.new_empty((m, n), dtype=torch.float32 if (plan.round_on_host or out_fp32) else a.dtype)
    tiles = -(-m // cfg.block_m) * -(-n // cfg.block_n)  # host ceil-div (triton.cdiv is a slow jit call here)
    grid = min(plan.num_programs, tiles)

    # Which kernel runs is decided by the plan and b's layout (a weight's: fixed), never by M: both
    # plans of a shape have the same `tma` (checked) and the same 16-byte alignment test.
    b_layout = _row_major_layout(b) if plan.tma else None
    if b_layout is not None and _tma_compatible(b, b_layout[1]):
        a_layout = _row_major_layout(a)
        if a_layout is None or not _tma_compatible(a, a_layout[1]) or (cfg.swap_ab and a_layout[2]):
            # An activation is cheap to copy, and which kernel runs must not depend on where it lives.
            a = a.new_empty((m, k)).copy_(a)
            a_layout = [m, k], [k, 1], False
        (a_shape, a_strides, a_trans), (b_shape, b_strides, b_trans) = a_layout, b_layout
        # OUT_FP32 stores through pointers; c's descriptor is then passed but unused.
        descriptors = (
            host_descriptor(a, a_shape, a_strides, plan.a_block[a_trans]),
            host_descriptor(b, b_shape, b_strides, plan.b_block[b_trans]),
            host_descriptor(c, [m, n], [n, 1], plan.c_block),
        )
        _launch_tma(plan, grid, descriptors, m, n, k, a_trans, b_trans, init, c if out_fp32 else None, b,
                    fused_residual)
    else:
        _matmul_pointer_kernel[(grid,)](
            a, b, c, m, n, k, init, fused_residual,
            a.stride(0), a.stride(1), b.stride(0), b.stride(1), c.stride(0), c.stride(1),
            *plan.constexprs, init is not None, fused_residual is not None, num_warps=cfg.num_warps,
            num_stages=cfg.num_stages,
        )  # fmt: skip
    if plan.round_on_host:
        c = c.to(out_dtype) if residual is None else residual + c.to(out_dtype)
        return c if out is None else out.copy_(c)
    return c if residual is None else torch.add(residual, c, out=c)


# Registered as a torch custom op so torch.compile traces models that use it without a graph break.
@torch.library.custom_op("rl_engine::batch_invariant_mm", mutates_args=())
def batch_invariant_mm_op(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Differentiable `batch_invariant_mm` with the fixed config (torch.ops.rl_engine.batch_invariant_mm)."""
    return batch_invariant_mm(a, b)


@batch_invariant_mm_op.register_fake
def _(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    _check_operands(a, b)
    return a.new_empty((a.shape[0], b.shape[1]))


def _mm_setup_context(ctx, inputs, output) -> None:
    ctx.save_for_backward(*inputs)


def _mm_backward(ctx, grad_c: torch.Tensor):
    """dA = dC @ b^T (its rows are batch-invariant); dB = a^T @ dC (reduces over M: deterministic)."""
    a, b = ctx.saved_tensors
    grad_a = batch_invariant_mm_op(grad_c, b.t()) if ctx.needs_input_grad[0] else None
    grad_b = batch_invariant_mm_op(a.t(), grad_c) if ctx.needs_input_grad[1] else None
    return grad_a, grad_b


batch_invariant_mm_autograd = register_autograd(batch_invariant_mm_op, _mm_backward, _mm_setup_context)


def triton_matmul(a: torch.Tensor, b: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor:
    """out[..., :] = a[..., :] @ b (+ residual[..., :]) for a of any leading shape [..., K] and b [K,N];
    differentiable (a differentiable call adds the residual apart: its gradient is the output's)."""
    lead = a.shape[:-1]
    a2 = a.reshape(lead.numel(), a.shape[-1])  # not -1, ambiguous when K = 0
    if needs_autograd(a, b) or (residual is not None and needs_autograd(residual)):
        out = batch_invariant_mm_autograd(a2, b).reshape(*lead, b.shape[1])
        return out if residual is None else residual + out
    res = None if residual is None else residual.reshape(lead.numel(), b.shape[1])
    return batch_invariant_mm(a2, b, residual=res).reshape(*lead, b.shape[1])


class TritonMatmulOp:
    """Triton candidate for NativeMatmulOp: a [B,S,K] @ b [K,N] (+ residual [B,S,N]) -> [B,S,N] in the inputs'
    dtype; the residual is added in the product's epilogue."""

    input_names = NativeMatmulOp.input_names

    def __call__(self, *, a: torch.Tensor, b: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor:
        check_devices("TritonMatmulOp", a=a, b=b, residual=residual)
        NativeMatmulOp().validate(a=a, b=b, residual=residual)
        return triton_matmul(a, b, residual)
