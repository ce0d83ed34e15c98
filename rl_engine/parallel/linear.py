"""Column- and row-parallel linear layers, bitwise equal for TP = 1, 2 and 4.

y = x @ W^T (+ b), W [N_out, K], computed in fp32 with TF32 off, fp32 output.

- column-parallel: W's output rows are cut into the 4 canonical shards; each shard's columns of y
  are computed alone, so the forward is exact under any TP (gathering the output is a copy). The
  input gradient sums every shard's dy_i @ W_i: all-gathered, then the fixed tree.
- row-parallel: the contraction K is cut into the 4 canonical shards (x and W split along K); each
  shard's partial product x_i @ W_i^T is all-gathered and summed in the fixed tree
  ((p0 + p1) + (p2 + p3)), then the (replicated) bias is added. Never all_reduce: its order is the
  backend's. Weight and input gradients are local to each shard.

Weight gradients sum over tokens inside one matmul; with data parallelism on top, reduce them across
data ranks the same way (gather_shards + tree_sum), not with all_reduce.
"""

from __future__ import annotations

import torch

from rl_engine.kernels.ops.pytorch.base import expect_shape, tf32_off
from rl_engine.parallel.canonical import ShardLayout, gather_shards, local_shard, sum_shards


def _flat(x: torch.Tensor, name: str, meaning: str) -> torch.Tensor:
    if not isinstance(x, torch.Tensor) or x.dim() < 1:
        raise ValueError(f"{name}: expected a tensor of shape {meaning}, got {getattr(x, 'shape', type(x))}")
    return x.reshape(-1, x.shape[-1])


class _ColumnParallelLinear(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, layout, gather_output):
        size = layout.local_size("weight", weight.shape[0], "output features N_local")
        h = x.float().contiguous()
        with tf32_off():
            shards = []
            for j in range(layout.shards_per_rank):
                y = h @ local_shard(weight, 0, j, size).float().t()
                if bias is not None:
                    y = y + local_shard(bias, 0, j, size).float()
                shards.append(y)
        stacked = torch.stack(shards)  # [S, T, size]
        if gather_output:
            stacked = gather_shards(stacked, layout)
        ctx.save_for_backward(x, weight, bias)
        ctx.layout, ctx.size, ctx.gather_output = layout, size, gather_output
        return stacked.permute(1, 0, 2).reshape(h.shape[0], -1)  # shards side by side: a copy

    @staticmethod
    def backward(ctx, grad_y):
        x, weight, bias = ctx.saved_tensors
        layout, size = ctx.layout, ctx.size
        h = x.float().contiguous()
        grad_y = grad_y.float()
        if ctx.gather_output:  # the full output's gradient is replicated: keep this rank's columns
            width = size * layout.shards_per_rank
            grad_y = grad_y.narrow(1, layout.rank * width, width)
        grad_x, grad_w, grad_b = [], [], []
        with tf32_off():
            for j in range(layout.shards_per_rank):
                g = local_shard(grad_y, 1, j, size)
                grad_x.append(g @ local_shard(weight, 0, j, size).float())
                grad_w.append(g.t() @ h)
                grad_b.append(g.sum(dim=0))
            grad_input = sum_shards(torch.stack(grad_x), layout)
        grad_bias = torch.cat(grad_b).to(bias.dtype) if bias is not None else None
        return grad_input.to(x.dtype), torch.cat(grad_w).to(weight.dtype), grad_bias, None, None


def column_parallel_linear(x, weight, bias=None, group=None, gather_output: bool = False) -> torch.Tensor:
    """x [..., K] (replicated) @ W^T, W = this rank's output rows [N_local, K], bias [N_local] or None.

    Returns fp32 [..., N_local] (this rank's columns), or [..., N] on every rank if `gather_output`.
    """
    layout = ShardLayout.from_group(group)
    x2 = _flat(x, "x", "[...,K]")
    k = x2.shape[1]
    if not isinstance(weight, torch.Tensor) or weight.dim() != 2:
        got = getattr(weight, "shape", weight)
        raise ValueError(f"weight: expected shape [N_local,K] with K={k}, got {got}")
    expect_shape("weight", weight, (weight.shape[0], k), f"[N_local,K] with K={k}")
    layout.local_size("weight", weight.shape[0], "output features N_local")
    if bias is not None:
        expect_shape("bias", bias, (weight.shape[0],), "[N_local]")
    y = _ColumnParallelLinear.apply(x2, weight, bias, layout, gather_output)
    return y.reshape(*x.shape[:-1], y.shape[-1])


class _RowParallelLinear(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, layout):
        size = layout.local_size("weight", weight.shape[1], "input features K_local")
        h = x.float()
        with tf32_off():
            partial = [
                local_shard(h, 1, j, size) @ local_shard(weight, 1, j, size).float().t()
                for j in range(layout.shards_per_rank)
            ]
            y = sum_shards(torch.stack(partial), layout)
            if bias is not None:
                y = y + bias.float()
        ctx.save_for_backward(x, weight, bias)
        ctx.layout, ctx.size = layout, size
        return y

    @staticmethod
    def backward(ctx, grad_y):
        x, weight, bias = ctx.saved_tensors
        layout, size = ctx.layout, ctx.size
        h, g = x.float(), grad_y.float().contiguous()
        with tf32_off():
            grad_x = [g @ local_shard(weight, 1, j, size).float() for j in range(layout.shards_per_rank)]
            grad_w = [g.t() @ local_shard(h, 1, j, size) for j in range(layout.shards_per_rank)]
        grad_bias = g.sum(dim=0).to(bias.dtype) if bias is not None else None
        return torch.cat(grad_x, 1).to(x.dtype), torch.cat(grad_w, 1).to(weight.dtype), grad_bias, None


def row_parallel_linear(x, weight, bias=None, group=None) -> torch.Tensor:
    """x [..., K_local] (this rank's K slice) @ W^T, W = this rank's columns [N, K_local]; bias [N] replicated.

    Returns fp32 [..., N], identical on every rank and for every TP in (1, 2, 4).
    """
    layout = ShardLayout.from_group(group)
    x2 = _flat(x, "x", "[...,K_local]")
    k_local = x2.shape[1]
    if not isinstance(weight, torch.Tensor) or weight.dim() != 2:
        got = getattr(weight, "shape", weight)
        raise ValueError(f"weight: expected shape [N,K_local] with K_local={k_local}, got {got}")
    expect_shape("weight", weight, (weight.shape[0], k_local), f"[N,K_local] with K_local={k_local}")
    layout.local_size("weight", k_local, "input features K_local")
    if bias is not None:
        expect_shape("bias", bias, (weight.shape[0],), "[N]")
    y = _RowParallelLinear.apply(x2, weight, bias, layout)
    return y.reshape(*x.shape[:-1], y.shape[-1])
