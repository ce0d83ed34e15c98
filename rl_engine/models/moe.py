"""The sparse MLP block (Qwen3-MoE's): a router picks k experts per token; each is a SwiGLU MLP.

    logits = x @ router^T                (the `matmul` op, activation dtype)
    probs  = softmax(logits) in fp32;    top-k by probability, ties to the lowest expert index
    w      = probs[top-k] (/ their sum when norm_topk_prob), cast to the activation dtype
    out[t] = sum over slots s = 0..k-1, in slot order, in fp32, of w[t,s] * expert_{e[t,s]}(x[t]);
             one cast to the activation dtype

which is transformers' Qwen3MoeSparseMoeBlock (softmax in fp32, weights cast to the logits' dtype),
except that transformers sums the k weighted outputs in the activation dtype, in expert order.

Why a token's bits never depend on the other tokens (DESIGN.md, MoE rule):
- routing is per token: the fp32 softmax uses a max (exact) and a fixed pairwise tree sum; the expert
  axis is padded with -inf to a multiple of 64 so torch's CPU `exp` never reaches its scalar tail (which
  may round differently from the vector body, so an element's bits could depend on its position); the
  top-k is a stable descending sort, so equal probabilities go to the lowest expert index;
- permute: the rows routed to expert e are gathered in token order (experts in index order); the
  experts run as `grouped_matmul` (gate, up) -> `swiglu` -> `grouped_matmul` (down), each row through
  its own expert's weight. The triton profile's grouped GEMM gives a row the bits of the `matmul` op on
  that row (fixed tiles per (dtype, N, K), no split-K, tiles never shared between experts), so a row's
  result does not depend on which or how many rows its expert serves;
- unpermute and combine: the k outputs of a token are summed in slot order in fp32.
Backward is written out (no reduction whose order torch picks, no atomics): the gradient of a token's
input sums its k slot gradients in slot order in fp32; the weights' gradient reduces over the hidden
axis with the same fixed tree; the router's is the softmax/top-k derivative with tree sums over k.
Expert weight gradients come from the `grouped_matmul` op's backward (a fixed-order sum over the
expert's tokens, in token order; zeros for an expert no token chose).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from rl_engine.kernels.ops.pytorch.reduction import tree_sum
from rl_engine.kernels.ops.triton import moe as moe_kernels
from rl_engine.kernels.ops.triton.moe import router_width


def _acc(t: torch.Tensor) -> torch.dtype:
    """The accumulation dtype: fp32, or float64 for float64 inputs (the gradient checks run in it)."""
    return torch.float64 if t.dtype == torch.float64 else torch.float32


def router_softmax(logits: torch.Tensor) -> torch.Tensor:
    """fp32 softmax over the last axis of [T,E] logits, with the fixed tree sum (float64 stays float64)."""
    t, e = logits.shape
    width = router_width(e)
    padded = logits.new_full((t, width), float("-inf"), dtype=_acc(logits))
    padded[:, :e] = logits
    ex = torch.exp(padded - padded.max(dim=-1, keepdim=True).values)  # the max is exact in any order
    return (ex / tree_sum(ex)[:, None])[:, :e]


def route_torch(logits: torch.Tensor, top_k: int, norm_topk_prob: bool):
    """(weights [T,k] in the logits' dtype, experts [T,k], probs [T,E], picked [T,k]): the routing as torch
    ops (CPU, float64); probs and picked in fp32 (float64 for float64 logits)."""
    probs = router_softmax(logits)
    # Stable: among equal probabilities the lower expert index comes first.
    experts = torch.sort(probs, dim=-1, descending=True, stable=True).indices[:, :top_k].contiguous()
    picked = probs.gather(-1, experts)
    weights = picked / tree_sum(picked)[:, None] if norm_topk_prob else picked
    return weights.to(logits.dtype), experts, probs, picked


def route_backward_torch(grad_weights, probs, experts, picked, norm_topk_prob: bool, dtype: torch.dtype):
    g = grad_weights.to(probs.dtype)
    if norm_topk_prob:  # w = p / S, S = sum of p: dp = (g - sum(g * w)) / S
        total = tree_sum(picked)[:, None]
        g = (g - tree_sum(g * (picked / total))[:, None]) / total
    # p = softmax(l): dl = p * (dp - sum(p * dp)); dp is zero off the chosen experts.
    dp = torch.zeros_like(probs).scatter(-1, experts, g)
    dl = probs * (dp - tree_sum(picked * g)[:, None])
    return dl.to(dtype)


class _Route(torch.autograd.Function):
    """logits [T,E] -> (weights [T,k] in the logits' dtype, expert ids [T,k]), with a hand-written backward;
    on CUDA one Triton kernel each way (rl_engine.kernels.ops.triton.moe.route), with these bits."""

    @staticmethod
    def forward(ctx, logits, top_k, norm_topk_prob):
        routing = moe_kernels.route if _on_triton(logits) else route_torch
        weights, experts, probs, picked = routing(logits, top_k, norm_topk_prob)
        ctx.save_for_backward(probs, experts, picked)
        ctx.norm_topk_prob, ctx.logits_dtype = norm_topk_prob, logits.dtype
        ctx.mark_non_differentiable(experts)
        return weights, experts

    @staticmethod
    def backward(ctx, grad_weights, _grad_experts):
        probs, experts, picked = ctx.saved_tensors
        backward = moe_kernels.route_backward if _on_triton(probs) else route_backward_torch
        return backward(grad_weights, probs, experts, picked, ctx.norm_topk_prob, ctx.logits_dtype), None, None


def route(logits: torch.Tensor, top_k: int, norm_topk_prob: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(weights [T,k] in the logits' dtype, as transformers casts them; expert ids [T,k] int64)."""
    return _Route.apply(logits, top_k, norm_topk_prob)


def expert_counts(sorted_ids: torch.Tensor, num_experts: int) -> torch.Tensor:
    """Rows per expert [E] from the sorted expert ids, by where each expert starts: no atomics and no
    read-back (CUDA's bincount reads max() back to size its output)."""
    experts = torch.arange(num_experts + 1, device=sorted_ids.device, dtype=sorted_ids.dtype)
    return torch.searchsorted(sorted_ids, experts).diff()


class Dispatch:
    """Where each (token, slot) goes: rows sorted by expert (index order), tokens in order within one.

    token_of_row [N = T*k]: the token of each permuted row; row_of_slot [T,k]: the permuted row of
    each slot; counts [E]: rows per expert, on the device (never read back here).
    """

    def __init__(self, experts: torch.Tensor, num_experts: int):
        t, k = experts.shape
        flat = experts.reshape(-1)
        ids, order = torch.sort(flat, stable=True)  # stable: token order within an expert
        self.token_of_row = order // k
        row_of_flat = torch.empty_like(order)
        row_of_flat[order] = torch.arange(order.numel(), device=order.device)
        self.row_of_slot = row_of_flat.view(t, k)
        self.counts = expert_counts(ids, num_experts)


# The slot loops below gather one slot ([T,H]) at a time and let each fp32 operation read the bf16 rows
# (an exact upcast inside the op): the same fp32 operations, in the same order, as on a [T,k,H] fp32
# copy of the gathered rows, without that copy or a per-slot one. On CUDA the same operations run as
# one Triton kernel each (rl_engine.kernels.ops.triton.moe), with these bits: about 140 fewer launches
# per layer.


def combine_torch(rows, weights, row_of_slot):
    w = weights.to(_acc(rows))
    acc = w[:, 0, None] * rows[row_of_slot[:, 0]]
    for s in range(1, row_of_slot.shape[1]):
        acc = acc + w[:, s, None] * rows[row_of_slot[:, s]]
    return acc.to(rows.dtype)


def combine_backward_torch(grad_out, rows, weights, row_of_slot):
    g = grad_out.to(_acc(rows))
    w = weights.to(g.dtype)
    grad_rows = torch.empty_like(rows)
    grad_weights = torch.empty_like(w)
    for s in range(row_of_slot.shape[1]):
        grad_rows[row_of_slot[:, s]] = (w[:, s, None] * g).to(rows.dtype)  # each row once: a copy
        grad_weights[:, s] = tree_sum(g * rows[row_of_slot[:, s]])
    return grad_rows, grad_weights


def permute_backward_torch(grad_rows, row_of_slot):
    acc = grad_rows[row_of_slot[:, 0]].to(_acc(grad_rows))
    for s in range(1, row_of_slot.shape[1]):
        acc = acc + grad_rows[row_of_slot[:, s]]
    return acc.to(grad_rows.dtype)


def _on_triton(t: torch.Tensor) -> bool:
    return t.is_cuda and t.dtype != torch.float64


class _Permute(torch.autograd.Function):
    """x [T,H] -> rows [N,H]; backward sums each token's k row gradients in slot order in fp32."""

    @staticmethod
    def forward(ctx, x, token_of_row, row_of_slot):
        ctx.save_for_backward(row_of_slot)
        return x[token_of_row]

    @staticmethod
    def backward(ctx, grad_rows):
        (row_of_slot,) = ctx.saved_tensors
        backward = moe_kernels.permute_backward if _on_triton(grad_rows) else permute_backward_torch
        return backward(grad_rows, row_of_slot), None, None


class _Combine(torch.autograd.Function):
    """rows [N,H] (expert outputs), weights [T,k] -> out [T,H] = sum_s w[t,s] * rows[row_of_slot[t,s]]."""

    @staticmethod
    def forward(ctx, rows, weights, row_of_slot):
        ctx.save_for_backward(rows, weights, row_of_slot)
        return (moe_kernels.combine if _on_triton(rows) else combine_torch)(rows, weights, row_of_slot)

    @staticmethod
    def backward(ctx, grad_out):
        rows, weights, row_of_slot = ctx.saved_tensors
        backward = moe_kernels.combine_backward if _on_triton(rows) else combine_backward_torch
        grad_rows, grad_weights = backward(grad_out, rows, weights, row_of_slot)
        return grad_rows, grad_weights.to(weights.dtype), None


def local_experts(ops, node: str, gate: torch.Tensor, up: torch.Tensor, down: torch.Tensor):
    """The experts computed here, as one `grouped_matmul` dispatch per projection (gate, up, down) over
    all of them, each row through its own expert's weight, and one `swiglu`.

    gate, up [E,I,H] and down [E,H,I]: the experts' weights stacked, as the model holds them (read in
    place, their gradients land there). Returns run(rows [N,H] grouped by expert, counts [E] on the
    device) -> [N,H]; nothing is read back to the host.
    """

    def run(rows: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        x = rows[None]
        g = ops("grouped_matmul", f"{node}.experts.gate_proj", x=x, weight=gate, counts=counts)
        u = ops("grouped_matmul", f"{node}.experts.up_proj", x=x, weight=up, counts=counts)
        m = ops("swiglu", f"{node}.experts.swiglu", gate=g, up=u)
        return ops("grouped_matmul", f"{node}.experts.down_proj", x=m, weight=down, counts=counts)[0]

    return run


def moe_block(ops, node: str, x: torch.Tensor, router: torch.Tensor, moe, experts: Callable) -> torch.Tensor:
    """The sparse MLP block on x [..., H]; `moe` is a MoeConfig, `experts(rows, counts)` the expert step
    (local_experts, or expert_parallel's exchange around it)."""
    shape = x.shape
    flat = x.reshape(-1, shape[-1])
    logits = ops("matmul", f"{node}.gate", a=flat[None], b=router.t())[0]
    weights, chosen = route(logits, moe.top_k, moe.norm_topk_prob)
    plan = Dispatch(chosen, moe.num_experts)
    rows = _Permute.apply(flat, plan.token_of_row, plan.row_of_slot)
    out = _Combine.apply(experts(rows, plan.counts), weights, plan.row_of_slot)
    return out.view(shape)
