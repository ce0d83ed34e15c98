"""The MoE block's router, combine and permute backward in Triton, with the bits of their torch form.

`rl_engine.models.moe` writes the combine (out[t] = sum over slots s, in slot order, in fp32, of
w[t,s] * rows[row_of_slot[t,s]]), its backward (grad_rows, and grad_weights[t,s] = tree_sum over H of
g[t] * rows[...]) and the permute's backward (a token's k row gradients summed in slot order in fp32)
as torch ops: about 140 launches per layer, forward and backward, at k = 8 (the tree alone is 11
levels per slot). Here each is one kernel, one program per token, doing the same IEEE operations in
the same order: products and sums are separate roundings (`enable_fp_fusion=False`: no fma
contraction), the tree adds the upper half of the (zero-padded, power-of-two) row to the lower half
level by level as `tree_sum` does, and bf16 results are rounded to nearest even once. So the torch
and Triton forms give the same bits on the same device (tests/models/test_moe_kernels.py, the
interpreter on the CPU and CUDA on the H200); the model uses this form on CUDA.

The router (softmax over the experts, top-k, renormalisation, and its backward) was about 45 small
torch launches per layer, forward and backward: at 4096 tokens the layer waited on the host.
Here it is one kernel each way, one program per
token. Its exp is libdevice's `expf` on the GPU, the function torch's CUDA `exp` calls, and its
divisions are correctly rounded (`div_rn`), as torch's are; under the interpreter the exp is numpy's,
which differs from torch's CPU exp in the last bit, so the CPU test swaps numpy's exp into the torch
form too.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.language.extra import libdevice

from rl_engine.kernels.ops.triton.runtime import cast_rne, interpreting

_NO_FMA = {"enable_fp_fusion": False}  # torch's mul and add are two roundings; so must ours be
# The router also calls libdevice's expf: in its non-flush-to-zero form, as torch's CUDA exp (built
# without -ftz) runs it, so a probability that underflows to a subnormal stays one.
_ROUTER_OPTIONS = dict(_NO_FMA, enable_reflect_ftz=False, num_warps=4)


@triton.jit
def _slot_sum_kernel(rows_ptr, w_ptr, slot_ptr, out_ptr, H, stride_r, stride_o,
                     WEIGHTED: tl.constexpr, TOP_K: tl.constexpr, BLOCK_H: tl.constexpr):
    # out[t] = sum over slots s, in slot order, in fp32, of (w[t,s] *) rows[slot[t,s]]: the combine
    # (WEIGHTED) and the permute's backward.
    t = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK_H)
    ok = offs < H
    acc = tl.zeros([BLOCK_H], tl.float32)
    for s in tl.static_range(TOP_K):
        row = tl.load(slot_ptr + t * TOP_K + s).to(tl.int64)
        term = tl.load(rows_ptr + row * stride_r + offs, mask=ok, other=0.0).to(tl.float32)
        if WEIGHTED:
            term = tl.load(w_ptr + t * TOP_K + s).to(tl.float32) * term
        if s == 0:
            acc = term
        else:
            acc = acc + term
    tl.store(out_ptr + t * stride_o + offs, cast_rne(acc, out_ptr.dtype.element_ty), mask=ok)


@triton.jit
def _tree_sum(x, BLOCK_H: tl.constexpr, LOG_H: tl.constexpr):
    # tree_sum's order: the upper half added to the lower half until one element is left.
    for level in tl.static_range(LOG_H):
        x = tl.sum(tl.reshape(x, (2, BLOCK_H >> (level + 1))), axis=0)  # row 0 + row 1, lane by lane
    return tl.sum(x, axis=0)  # one element


@triton.jit
def _combine_backward_kernel(grad_ptr, rows_ptr, w_ptr, slot_ptr, grad_rows_ptr, grad_w_ptr, H,
                             stride_g, stride_r, TOP_K: tl.constexpr, BLOCK_H: tl.constexpr, LOG_H: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK_H)
    ok = offs < H
    g = tl.load(grad_ptr + t * stride_g + offs, mask=ok, other=0.0).to(tl.float32)
    for s in tl.static_range(TOP_K):
        row = tl.load(slot_ptr + t * TOP_K + s).to(tl.int64)
        w = tl.load(w_ptr + t * TOP_K + s).to(tl.float32)
        tl.store(grad_rows_ptr + row * stride_r + offs, cast_rne(w * g, grad_rows_ptr.dtype.element_ty), mask=ok)
        x = tl.load(rows_ptr + row * stride_r + offs, mask=ok, other=0.0).to(tl.float32)
        tl.store(grad_w_ptr + t * TOP_K + s, _tree_sum(g * x, BLOCK_H, LOG_H))


@triton.jit
def _route_kernel(logits_ptr, probs_ptr, weights_ptr, experts_ptr, picked_ptr, E, stride_l,
                  TOP_K: tl.constexpr, NORM: tl.constexpr, LIBDEVICE_EXP: tl.constexpr,
                  BLOCK_E: tl.constexpr, LOG_E: tl.constexpr, BLOCK_K: tl.constexpr, LOG_K: tl.constexpr):
    # router_softmax (the expert axis padded with -inf to BLOCK_E lanes, the max, exp, the tree sum, one
    # division), then the top-k as a stable descending sort picks it (ties to the lower expert), then
    # the renormalisation by the tree sum of the k picked probabilities.
    t = tl.program_id(0).to(tl.int64)
    lanes = tl.arange(0, BLOCK_E)
    ok = lanes < E
    x = tl.load(logits_ptr + t * stride_l + lanes, mask=ok, other=float("-inf")).to(tl.float32)
    x = x - tl.max(x, axis=0)
    if LIBDEVICE_EXP:
        ex = libdevice.exp(x)
    else:
        ex = tl.exp(x)
    probs = tl.math.div_rn(ex, _tree_sum(ex, BLOCK_E, LOG_E))
    tl.store(probs_ptr + t * E + lanes, probs, mask=ok)
    left = tl.where(ok, probs, -1.0)  # probabilities are >= 0: -1 marks a lane taken or padding
    slots = tl.arange(0, BLOCK_K)
    picked = tl.zeros([BLOCK_K], tl.float32)
    chosen = tl.zeros([BLOCK_K], tl.int64)
    for s in tl.static_range(TOP_K):
        best = tl.max(left, axis=0)
        expert = tl.min(tl.where(left == best, lanes, BLOCK_E), axis=0)
        picked = tl.where(slots == s, best, picked)
        chosen = tl.where(slots == s, expert.to(tl.int64), chosen)
        left = tl.where(lanes == expert, -1.0, left)
    weights = picked
    if NORM:
        weights = tl.math.div_rn(picked, _tree_sum(picked, BLOCK_K, LOG_K))
    out = t * TOP_K + slots
    used = slots < TOP_K
    tl.store(picked_ptr + out, picked, mask=used)
    tl.store(weights_ptr + out, cast_rne(weights, weights_ptr.dtype.element_ty), mask=used)
    tl.store(experts_ptr + out, chosen, mask=used)


@triton.jit
def _route_backward_kernel(grad_ptr, probs_ptr, picked_ptr, experts_ptr, dlogits_ptr, E, stride_d,
                           TOP_K: tl.constexpr, NORM: tl.constexpr, BLOCK_E: tl.constexpr,
                           BLOCK_K: tl.constexpr, LOG_K: tl.constexpr):
    # With w = p / S (NORM): dp = (g - sum(g * (p / S))) / S; then dl = p * (dp - sum(picked * dp)),
    # dp zero off the chosen experts; each sum the tree over the k slots.
    t = tl.program_id(0).to(tl.int64)
    slots = tl.arange(0, BLOCK_K)
    used = slots < TOP_K
    g = tl.load(grad_ptr + t * TOP_K + slots, mask=used, other=0.0).to(tl.float32)
    picked = tl.load(picked_ptr + t * TOP_K + slots, mask=used, other=0.0)
    if NORM:
        total = _tree_sum(picked, BLOCK_K, LOG_K)
        g = tl.math.div_rn(g - _tree_sum(g * tl.math.div_rn(picked, total), BLOCK_K, LOG_K), total)
        g = tl.where(used, g, 0.0)  # the tree below pads with +0.0, as tree_sum does
    centre = _tree_sum(picked * g, BLOCK_K, LOG_K)
    lanes = tl.arange(0, BLOCK_E)
    ok = lanes < E
    # The scatter of the k slot gradients: a lane takes its slot's value as is (a select, not a sum,
    # so a -0.0 stays -0.0 as in torch's scatter); other lanes hold +0.0.
    dp = tl.zeros([BLOCK_E], tl.float32)
    for s in tl.static_range(TOP_K):
        expert = tl.load(experts_ptr + t * TOP_K + s)
        g_s = tl.max(tl.where(slots == s, g, float("-inf")), axis=0)  # slot s's value, bit for bit
        dp = tl.where(lanes == expert, g_s, dp)
    probs = tl.load(probs_ptr + t * E + lanes, mask=ok, other=0.0)
    dl = probs * (dp - centre)
    tl.store(dlogits_ptr + t * stride_d + lanes, cast_rne(dl, dlogits_ptr.dtype.element_ty), mask=ok)


def _launch_options(h: int) -> dict:
    block = triton.next_power_of_2(max(h, 1))
    return dict(BLOCK_H=block, num_warps=4 if block <= 2048 else 8, **_NO_FMA)


def _log2(block: int) -> int:
    return block.bit_length() - 1


def combine(rows: torch.Tensor, weights: torch.Tensor, row_of_slot: torch.Tensor) -> torch.Tensor:
    """out [T,H] in rows' dtype: sum_s (fp32, slot order) of weights[t,s] * rows[row_of_slot[t,s]]."""
    rows, slots = rows.contiguous(), row_of_slot.contiguous()
    t, k = slots.shape
    out = rows.new_empty((t, rows.shape[1]))
    if t:
        _slot_sum_kernel[(t,)](rows, weights.contiguous(), slots, out, rows.shape[1], rows.stride(0), out.stride(0),
                               WEIGHTED=True, TOP_K=k, **_launch_options(rows.shape[1]))
    return out


def combine_backward(grad_out: torch.Tensor, rows: torch.Tensor, weights: torch.Tensor,
                     row_of_slot: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(grad_rows [N,H] in rows' dtype, fp32 grad_weights [T,k]): every permuted row is one slot's."""
    # Contiguous: grad_rows is written with rows' row stride.
    grad_out, rows, slots = grad_out.contiguous(), rows.contiguous(), row_of_slot.contiguous()
    t, k = slots.shape
    grad_rows = torch.empty_like(rows)
    grad_w = torch.empty((t, k), dtype=torch.float32, device=rows.device)
    if t:
        options = _launch_options(rows.shape[1])
        _combine_backward_kernel[(t,)](grad_out, rows, weights.contiguous(), slots, grad_rows, grad_w, rows.shape[1],
                                       grad_out.stride(0), rows.stride(0), TOP_K=k, LOG_H=_log2(options["BLOCK_H"]),
                                       **options)
    return grad_rows, grad_w


def permute_backward(grad_rows: torch.Tensor, row_of_slot: torch.Tensor) -> torch.Tensor:
    """grad_x [T,H] in grad_rows' dtype: a token's k row gradients summed in slot order in fp32."""
    grad_rows, slots = grad_rows.contiguous(), row_of_slot.contiguous()
    t, k = slots.shape
    out = grad_rows.new_empty((t, grad_rows.shape[1]))
    if t:
        _slot_sum_kernel[(t,)](grad_rows, grad_rows, slots, out, grad_rows.shape[1], grad_rows.stride(0),
                               out.stride(0), WEIGHTED=False, TOP_K=k, **_launch_options(grad_rows.shape[1]))
    return out


# The router's expert axis is padded to a multiple of this (and to a power of two, for the tree).
ROUTER_PAD = 64


def _pow2_at_least(n: int) -> int:
    return 1 << max(n - 1, 0).bit_length()


def router_width(experts: int) -> int:
    """The router's padded expert axis: a power of two, at least ROUTER_PAD (the Triton router's lanes too)."""
    return max(ROUTER_PAD, _pow2_at_least(experts))


def route(logits: torch.Tensor, top_k: int, norm_topk_prob: bool):
    """(weights [T,k] in the logits' dtype, int64 experts [T,k], fp32 probs [T,E], fp32 picked [T,k]) from
    logits [T,E]: rl_engine.models.moe's routing (route_torch) in one kernel."""
    logits = logits.contiguous()
    t, e = logits.shape
    f32 = dict(dtype=torch.float32, device=logits.device)
    probs = torch.empty(t, e, **f32)
    weights, picked = torch.empty(t, top_k, dtype=logits.dtype, device=logits.device), torch.empty(t, top_k, **f32)
    experts = torch.empty(t, top_k, dtype=torch.int64, device=logits.device)
    if t:
        lanes, slots = router_width(e), triton.next_power_of_2(top_k)
        _route_kernel[(t,)](logits, probs, weights, experts, picked, e, logits.stride(0), TOP_K=top_k,
                            NORM=norm_topk_prob, LIBDEVICE_EXP=not interpreting(), BLOCK_E=lanes,
                            LOG_E=_log2(lanes), BLOCK_K=slots, LOG_K=_log2(slots), **_ROUTER_OPTIONS)
    return weights, experts, probs, picked


def route_backward(grad_weights: torch.Tensor, probs: torch.Tensor, experts: torch.Tensor, picked: torch.Tensor,
                   norm_topk_prob: bool, dtype: torch.dtype) -> torch.Tensor:
    """The logits' gradient [T,E] in `dtype` from the weights' gradient [T,k] (route's outputs saved)."""
    t, e = probs.shape
    k = experts.shape[1]
    dlogits = torch.empty(t, e, dtype=dtype, device=probs.device)
    if t:
        slots = triton.next_power_of_2(k)
        _route_backward_kernel[(t,)](grad_weights.contiguous(), probs, picked, experts, dlogits, e, dlogits.stride(0),
                                     TOP_K=k, NORM=norm_topk_prob, BLOCK_E=router_width(e), BLOCK_K=slots,
                                     LOG_K=_log2(slots), **_ROUTER_OPTIONS)
    return dlogits
