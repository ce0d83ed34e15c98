"""Rotary position embedding in Triton, Qwen3 / Hugging Face rotate-half convention.

With x = [x1 | x2] split at D/2, angle[j] = float(position) · inv_freq[j] (fp32), c = cos(angle),
s = sin(angle):  out1 = x1·c - x2·s,  out2 = x2·c + x1·s  (= x·cos + rotate_half(x)·sin).
Backward is the transpose rotation (the same kernel with s negated):
dx1 = g1·c + g2·s,  dx2 = g2·c - g1·s.

Matching the gold bit for bit where the hardware allows:
- inv_freq is computed by the gold's own expression, on x's device, and handed to the kernel as an
  fp32 table, so the kernel multiplies exactly the gold's fp32 factors; the table is built once per
  (device, D, theta) and cached (building it is five small torch kernels: on the H200 that host
  work cost more than the rotation itself, benchmarks/results/rope.json);
- on the GPU cos and sin are libdevice's correctly range-reduced `cosf`/`sinf` (what torch's CUDA
  `cos`/`sin` call), not the approximate hardware instructions that lose accuracy on large angles;
  under the CPU interpreter they are numpy's (torch CPU uses its own vectorised routines, so the
  two can differ by an ulp there);
- the kernel launches with `enable_fp_fusion=False`, so x1·c - x2·s is two rounded products and a
  rounded difference, as in the gold's separate elementwise kernels (no FMA).
Measured under the CPU interpreter (x ~ N(0,1) [1, 4096, 1, 128], positions 0..40950, theta 1e6):
fp32 max |out - gold| = 4.8e-7, 12.5% of elements differ in the last bits (numpy vs torch trig);
bf16: 3 of 524,288 outputs differ from the fp32 gold rounded to bf16. On the H200 the gpu test in
tests/kernels/ops/triton/test_rope.py prints the same two figures.
All math in fp32, one cast to x's dtype. One program per token (all heads of that token): a token's
bits never depend on the batch or the grid.
Per-call host work is kept small (it is what the op costs at small shapes): contiguous inputs are not
copied, the launch configuration is cached per (heads, D), and without autograd (no_grad, or no input
needing a gradient) the kernel is launched directly, without the custom op. The backward is
exactly one kernel launch.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl
from triton.language.extra import libdevice
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from rl_engine.kernels.ops.pytorch.base import expect_float
from rl_engine.kernels.ops.pytorch.position.rope import NativeRopeOp
from rl_engine.kernels.ops.triton.attention.paged_write import KvPages, write_kv_pages
from rl_engine.kernels.ops.triton.runtime import (
    cast_rne,
    check_devices,
    interpreting,
    needs_autograd,
    pdl_launch,
    register_autograd,
    unit_column_rows,
)


@triton.jit
def _rope_kernel(
    x_ptr, positions_ptr, inv_freq_ptr, out_ptr,
    n_heads, half, stride_token,
    k_pool_ptr, v_pool_ptr, slots_ptr, v_ptr, v_stride, first_k_head,
    TRANSPOSE: tl.constexpr, LIBDEVICE_TRIG: tl.constexpr,
    BLOCK_HEADS: tl.constexpr, BLOCK_HALF: tl.constexpr, KV: tl.constexpr, BLOCK_V: tl.constexpr, PDL: tl.constexpr,
):
    if PDL:  # launched as a programmatic dependent (runtime.pdl_launch)
        gdc_launch_dependents()
        gdc_wait()
    token = tl.program_id(0).to(tl.int64)
    freq = tl.arange(0, BLOCK_HALF)
    freq_mask = freq < half
    inv_freq = tl.load(inv_freq_ptr + freq, mask=freq_mask, other=0.0)
    angle = tl.load(positions_ptr + token).to(tl.float32) * inv_freq
    if LIBDEVICE_TRIG:
        cos = libdevice.cos(angle)
        sin = libdevice.sin(angle)
    else:
        cos = tl.cos(angle)
        sin = tl.sin(angle)
    if TRANSPOSE:
        sin = -sin
    heads = tl.arange(0, BLOCK_HEADS)
    in_head = heads[:, None] * 2 * half + freq[None, :]
    offs = token * n_heads * 2 * half + in_head  # out is contiguous; x's tokens lie stride_token apart
    src = token * stride_token + in_head
    mask = (heads[:, None] < n_heads) & freq_mask[None, :]
    x1 = tl.load(x_ptr + src, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(x_ptr + src + half, mask=mask, other=0.0).to(tl.float32)
    out1 = cast_rne(x1 * cos[None, :] - x2 * sin[None, :], out_ptr.dtype.element_ty)
    out2 = cast_rne(x2 * cos[None, :] + x1 * sin[None, :], out_ptr.dtype.element_ty)
    tl.store(out_ptr + offs, out1, mask=mask)
    tl.store(out_ptr + offs + half, out2, mask=mask)
    if KV:  # the heads from first_k_head on are the keys: into the pool row of this token, its values beside them
        slot = tl.load(slots_ptr + token).to(tl.int64)
        row = (n_heads - first_k_head) * 2 * half
        in_row = slot * row + (heads[:, None] - first_k_head) * 2 * half + freq[None, :]
        is_key = mask & (heads[:, None] >= first_k_head)
        tl.store(k_pool_ptr + in_row, out1, mask=is_key)
        tl.store(k_pool_ptr + in_row + half, out2, mask=is_key)
        cols = tl.arange(0, BLOCK_V)
        in_v = cols < row
        tl.store(v_pool_ptr + slot * row + cols, tl.load(v_ptr + token * v_stride + cols, mask=in_v), mask=in_v)


def rope_inv_freq(head_dim: int, theta: float, device) -> torch.Tensor:
    """fp32 inv_freq [D/2], by the gold's expression (rl_engine/kernels/ops/pytorch/position/rope.py)."""
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64, device=device).float() / head_dim
    return 1.0 / (theta ** exponents)


_inv_freq_tables: dict[tuple, torch.Tensor] = {}


def cached_inv_freq(head_dim: int, theta: float, device: torch.device) -> torch.Tensor:
    """rope_inv_freq, built once per (device, D, theta); callers must not modify it."""
    key = (device, head_dim, theta)
    table = _inv_freq_tables.get(key)
    if table is None:
        table = rope_inv_freq(head_dim, theta, device)
        # A table built inside a CUDA graph capture holds its values only once the graph replays.
        if not (device.type == "cuda" and torch.cuda.is_current_stream_capturing()):
            _inv_freq_tables[key] = table
    return table


@functools.cache
def launch_config(n_heads: int, head_dim: int) -> tuple[int, int, int]:
    """(BLOCK_HEADS, BLOCK_HALF, num_warps): fixed per (heads, D), never per number of tokens."""
    block_heads, block_half = triton.next_power_of_2(n_heads), triton.next_power_of_2(head_dim // 2)
    tile = block_heads * block_half
    # H200, [32768 tokens, 32, 128] bf16 forward: 2 warps 87.7% of copy bandwidth, 4: 83.3%, 8: 63.8%
    # (benchmarks/results/rope.json, 2026-11-29). Small tiles with many programs in flight win here.
    return block_heads, block_half, 2 if tile >= 512 else 1


def _token_rows(x: torch.Tensor) -> tuple[torch.Tensor, int]:
    """(x or a copy, the token stride) with each token's heads contiguous: q or k of a stacked q/k/v product read in
    place."""
    n_heads, head_dim = x.shape[-2], x.shape[-1]
    try:
        v = x.view(-1, n_heads, head_dim)
    except RuntimeError:
        v = None
    if v is not None and (v.numel() == 0 or (v.stride(2) == 1 and (n_heads == 1 or v.stride(1) == head_dim))):
        return v, v.stride(0) if v.shape[0] > 1 else n_heads * head_dim
    return x.contiguous(), n_heads * head_dim


def rope_apply(x: torch.Tensor, positions: torch.Tensor, inv_freq: torch.Tensor, *, transpose: bool = False,
               num_warps: int | None = None, kv_pages: KvPages | None = None) -> torch.Tensor:
    """Rotate x [..., Hh, D] (each token's heads contiguous; tokens at any stride) by positions [...] (the transpose
    rotation when `transpose`); the result is contiguous. With `kv_pages`, the same launch also writes the last Hkv
    heads of the result (the keys) and kv_pages.v into the pools: the bits of `write_kv_pages` after it."""
    n_heads, head_dim = x.shape[-2], x.shape[-1]
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    x, stride_token = _token_rows(x)
    n_tokens = positions.numel()
    block_heads, block_half, warps = launch_config(n_heads, head_dim)
    if kv_pages is None:  # unread: the pointers only need to be valid
        kv, block_v = (out, out, positions, out, 0, n_heads), 1
    else:
        k_pool, v_pool, slots, v = kv_pages
        v = unit_column_rows(v, kv_pages.row)
        kv, block_v = (k_pool, v_pool, slots.reshape(-1), v, v.stride(0), n_heads - k_pool.shape[-2]), kv_pages.row
    if n_tokens:
        _rope_kernel[(n_tokens,)](
            x, positions, inv_freq, out, n_heads, head_dim // 2, stride_token, *kv,
            TRANSPOSE=transpose, LIBDEVICE_TRIG=not interpreting(),
            BLOCK_HEADS=block_heads, BLOCK_HALF=block_half,
            KV=kv_pages is not None, BLOCK_V=triton.next_power_of_2(block_v),
            num_warps=num_warps or warps, enable_fp_fusion=False, **pdl_launch(),
        )
    return out


# A torch custom op (fake + autograd registered), so torch.compile traces it. theta's table is looked
# up inside the op: traced, the cache would be a side effect, and a recomputed table could round differently.
@torch.library.custom_op("rl_engine::rope", mutates_args=())
def rope_op(x: torch.Tensor, positions: torch.Tensor, inv_freq: torch.Tensor | None, theta: float,
            transpose: bool) -> torch.Tensor:
    """rope_apply (torch.ops.rl_engine.rope); inv_freq None means theta's table. Differentiable in x."""
    x, positions = x.contiguous(), positions.contiguous()
    inv_freq = cached_inv_freq(x.shape[-1], theta, x.device) if inv_freq is None else inv_freq.contiguous()
    return rope_apply(x, positions, inv_freq, transpose=transpose)


@rope_op.register_fake
def _(x, positions, inv_freq, theta, transpose) -> torch.Tensor:
    return torch.empty_like(x, memory_format=torch.contiguous_format)


def _rope_setup_context(ctx, inputs, output) -> None:
    _, positions, inv_freq, ctx.theta, ctx.transpose = inputs
    ctx.save_for_backward(positions, inv_freq)


def _rope_backward(ctx, grad_out: torch.Tensor):
    """The rotation is orthogonal: its gradient is the transpose rotation."""
    positions, inv_freq = ctx.saved_tensors
    return rope_op(grad_out, positions, inv_freq, ctx.theta, not ctx.transpose), None, None, None, None


rope_autograd = register_autograd(rope_op, _rope_backward, _rope_setup_context)


def _check_kv_pages(x: torch.Tensor, positions: torch.Tensor, kv_pages: KvPages) -> None:
    k_pool, v_pool, slots, v = kv_pages
    hkv, d = k_pool.shape[-2], k_pool.shape[-1]
    if (k_pool.dim() != 4 or v_pool.shape != k_pool.shape or not (k_pool.is_contiguous() and v_pool.is_contiguous())
            or d != x.shape[-1] or hkv > x.shape[-2] or tuple(v.shape) != (*x.shape[:-2], hkv, d)
            or slots.numel() != positions.numel() or slots.dtype != torch.int64
            or not x.dtype == v.dtype == k_pool.dtype == v_pool.dtype):
        raise ValueError(
            f"kv_pages: expected contiguous pools [pages, page, Hkv, D] of x's dtype and D ({x.dtype}, {x.shape[-1]}), "
            f"values [..., Hkv, D] and one int64 slot per token; got pools {tuple(k_pool.shape)} {k_pool.dtype}, "
            f"values {tuple(v.shape)}, {slots.numel()} {slots.dtype} slots for {positions.numel()} tokens")


def rope(x: torch.Tensor, positions: torch.Tensor, theta: float = 1e6,
         inv_freq: torch.Tensor | None = None, kv_pages: KvPages | None = None) -> torch.Tensor:
    """Rotate x [B,S,Hh,D] by integer positions [B,S]; returns x's dtype. `inv_freq` (fp32 [D/2] on x's
    device, checked by NativeRopeOp) replaces theta's table for a scaled RoPE. `kv_pages`: the last Hkv heads of
    the result (the keys) and its values also go into the paged pools (rope_apply; a second launch under autograd)."""
    if x.dim() < 2 or x.shape[-1] % 2 or tuple(positions.shape) != tuple(x.shape[:-2]):
        raise ValueError(
            f"x, positions: expected x [..., Hh, D] with even D and positions of shape x.shape[:-2]; "
            f"got x {tuple(x.shape)}, positions {tuple(positions.shape)}"
        )
    if positions.is_floating_point():
        raise ValueError(f"positions: expected integer positions, got dtype {positions.dtype}")
    expect_float("x", x, "[..., Hh, D]")
    if kv_pages is not None:
        _check_kv_pages(x, positions, kv_pages)
    if needs_autograd(x):
        out = rope_autograd(x, positions, inv_freq, theta, False)
        if kv_pages is not None:
            write_kv_pages(kv_pages.k_pool, kv_pages.v_pool, kv_pages.slots,
                           out[..., -kv_pages.k_pool.shape[-2]:, :].detach(), kv_pages.v.detach())
        return out
    positions = positions.contiguous()  # x is read in place (rope_apply)
    inv_freq = cached_inv_freq(x.shape[-1], theta, x.device) if inv_freq is None else inv_freq.contiguous()
    return rope_apply(x, positions, inv_freq, kv_pages=kv_pages)


class TritonRopeOp:
    """Triton candidate for NativeRopeOp: op(x=[B,S,Hh,D], positions=[B,S] int) -> x's shape and dtype."""

    input_names = NativeRopeOp.input_names

    def __init__(self, theta: float = 1e6, inv_freq: torch.Tensor | None = None, kv_pages: KvPages | None = None):
        self.theta = theta
        self.inv_freq = inv_freq
        self.kv_pages = kv_pages  # the decoder's paged cache, written by the same launch (rope_apply)

    def __call__(self, *, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        check_devices("TritonRopeOp", x=x, positions=positions)
        NativeRopeOp(self.theta, self.inv_freq).validate(x=x, positions=positions)
        return rope(x, positions, self.theta, self.inv_freq, self.kv_pages)
