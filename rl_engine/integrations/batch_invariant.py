"""A batch-invariant mode for code nobody patched: inside `batch_invariant_mode()`, the aten ops whose
results depend on the batch in plain PyTorch run on batch-invariant kernels.

    with batch_invariant_mode():
        logp = torch.log_softmax(model(x), -1)     # any nn.Module: a row's bits no longer depend on the batch

Routed (fp32, bf16, fp16; anything else runs as before):
- `mm`, `addmm`, `bmm` (so `nn.Linear`, `F.linear`, `@`, `matmul`): the Triton matmul, one tile
  configuration per (dtype, N, K), no split-K; `addmm` adds the bias to the rounded product;
- `_log_softmax` and its backward: the row's logsumexp from the Triton logp kernel, then
  elementwise; the backward's row sum by a fixed pairwise tree;
- `sum` / `mean` over the last dim: a fixed pairwise tree of elementwise adds (fp32 accumulation).

It is a `TorchDispatchMode`, so autograd runs above it (backward ops are routed too) and every op it
does not route runs exactly as before. It changes which kernels run, never the math: results differ
from plain PyTorch by rounding only. Inspired by Thinking Machines' batch_invariant_ops (aten
overrides through torch.library); a dispatch mode lets unsupported dtypes fall through to PyTorch.
On CPU tensors the Triton kernels need Triton's interpreter (TRITON_INTERPRET=1 before the import).
"""

from __future__ import annotations

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from rl_engine.kernels.ops.pytorch.reduction import tree_sum

aten = torch.ops.aten
_FLOATS = (torch.float32, torch.bfloat16, torch.float16)


def _routable(*tensors) -> bool:
    first = tensors[0]
    if not all(isinstance(t, torch.Tensor) and t.dtype == first.dtype and t.device == first.device for t in tensors):
        return False
    if first.dtype not in _FLOATS:
        return False
    from rl_engine.kernels.ops.triton.runtime import interpreting

    if first.device.type == "cpu" and not interpreting():
        raise RuntimeError("batch_invariant_mode: CPU tensors need Triton's interpreter (TRITON_INTERPRET=1 "
                           "before rl_engine is imported); on a GPU it is not needed")
    return first.device.type in ("cpu", "cuda")


def _mm(a, b):
    from rl_engine.kernels.ops.triton.linear.matmul import batch_invariant_mm

    return batch_invariant_mm(a, b) if _routable(a, b) else NotImplemented


def _addmm(bias, a, b, *, beta=1, alpha=1):
    if not _routable(bias, a, b):
        return NotImplemented
    product = _mm(a, b)
    if alpha != 1:
        product = product * alpha
    return product + (bias if beta == 1 else bias * beta)


def _bmm(a, b):
    if not _routable(a, b):
        return NotImplemented
    return torch.stack([_mm(a[i], b[i]) for i in range(a.shape[0])]) if a.shape[0] else a.new_empty(
        (0, a.shape[1], b.shape[2]))


def _last(x, dim) -> bool:
    return dim in (-1, x.dim() - 1)


def _log_softmax(x, dim, half_to_float):
    if not (_routable(x) and _last(x, dim)) or x.dim() == 0:
        return NotImplemented
    from rl_engine.kernels.ops.triton.loss.logp import row_logsumexp

    rows = x.reshape(-1, x.shape[-1])
    out = rows.float() - row_logsumexp(rows)[:, None]
    return out.reshape(x.shape).to(torch.float32 if half_to_float else x.dtype)


def _log_softmax_backward(grad, output, dim, input_dtype):
    if not (_routable(grad, output) and _last(grad, dim)):
        return NotImplemented
    g = grad.float()
    return (g - torch.exp(output.float()) * tree_sum(g)[..., None]).to(input_dtype)  # g is fp32


def _dims(x, dim):
    return list(dim) if dim is not None else list(range(x.dim()))


def _sum(x, dim=None, keepdim=False, *, dtype=None):
    dims = _dims(x, dim)
    if not (_routable(x) and len(dims) == 1 and _last(x, dims[0])) or x.dim() == 0:
        return NotImplemented
    out = tree_sum(x.float()).to(dtype or x.dtype)
    return out.unsqueeze(-1) if keepdim else out


def _mean(x, dim=None, keepdim=False, *, dtype=None):
    dims = _dims(x, dim)
    if not (_routable(x) and len(dims) == 1 and _last(x, dims[0])) or x.dim() == 0:
        return NotImplemented
    out = (tree_sum(x.float()) / x.shape[-1]).to(dtype or x.dtype)
    return out.unsqueeze(-1) if keepdim else out


_ROUTES = {
    aten.mm.default: _mm,
    aten.addmm.default: _addmm,
    aten.bmm.default: _bmm,
    aten._log_softmax.default: _log_softmax,
    aten._log_softmax_backward_data.default: _log_softmax_backward,
    aten.sum.dim_IntList: _sum,
    aten.mean.dim: _mean,
}


class batch_invariant_mode(TorchDispatchMode):  # noqa: N801 - used as a context manager, like torch's modes
    """Context manager: the routed aten ops run on batch-invariant kernels (see the module docstring)."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        route = _ROUTES.get(func)
        if route is not None:
            out = route(*args, **kwargs)
            if out is not NotImplemented:
                return out
        return func(*args, **kwargs)
