"""Selected-token log-probability in Triton: logp[b, s] = logits[b, s, t] - logsumexp(logits[b, s, :]).

Forward: one program per row streams the vocabulary once in chunks of BLOCK_V and keeps a running
max and sum of exponentials in fp32. Three ways to keep them (`ALGO`, a constexpr fixed per
(dtype, V) in FORWARD_CONFIGS; `benchmarks/logp.py --sweep` times them on the H200):
  "lane"   each lane has its own max; one exp per element as exp(-|x - m|) plus a select to decide
           which side it rescales (about 15 instructions per element on sm_90: issue-bound).
  "block"  one row max per chunk (a cross-warp tl.max), lane sums rescaled once per chunk:
           s = s * 2^((m_old - m) log2e) + 2^(x log2e - m log2e) - an FFMA, an ex2 and an FFMA per
           element.
  "group"  a [BLOCK_V / G, G] view where each group of G contiguous elements is one thread's vector
           load: per-group max and sum with no cross-thread traffic inside the loop; the groups are
           folded once at the end.
"block" and "group" use ex2.approx.ftz (one MUFU op; the non-ftz form Triton emits for tl.exp
costs three more instructions for a denormal range that cannot change a sum that is >= 1).
Only the per-row logsumexp (fp32) is saved.
Backward: grad_logits[v] = g * (1[v == t] - exp(logit[v] - lse)), written in one pass in the
logits' dtype.

Batch invariance and determinism: a row is reduced by exactly one program with a loop and a final
fold that depend only on (dtype, V) - never on the number of rows - and there are no atomics.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from rl_engine.kernels.ops.pytorch.base import expect_rank, expect_shape
from rl_engine.kernels.ops.pytorch.loss.logp import NativeLogpOp
from rl_engine.kernels.ops.triton.runtime import cast_rne, check_devices, interpreting, register_autograd

LOG2E = tl.constexpr(1.4426950408889634)  # exp(x) = 2^(x log2e)

if interpreting():

    @triton.jit
    def exp2_ftz(x):
        """2^x (the interpreter has no inline PTX)."""
        return tl.exp2(x)

else:

    @triton.jit
    def exp2_ftz(x):
        """2^x as one MUFU.EX2 (ftz: results below 2^-126 flush to 0, inputs -inf give 0)."""
        return tl.inline_asm_elementwise(
            "ex2.approx.ftz.f32 $0, $1;", "=r,r", [x], dtype=tl.float32, is_pure=True, pack=1
        )


@triton.jit
def _maximum_nan(a, b):
    # NaN-propagating max (PTX max.NaN.f32: the cost of max). tl.maximum and tl.max drop NaN on the
    # GPU; the running maxima below keep it, so that a NaN logit makes the row's lse NaN.
    return tl.maximum(a, b, propagate_nan=tl.PropagateNan.ALL)


@triton.jit
def max_nan(x, axis: tl.constexpr):
    """tl.max(x, axis), except that a NaN anywhere along the axis gives NaN."""
    return tl.reduce(x, axis, _maximum_nan)


@triton.jit
def _lane_update(m, s, x):
    # Lane-wise online logsumexp with one exp per element: if x raises the lane's max, rescale the
    # old sum by exp(m - x) and add 1; otherwise add exp(x - m). Both are exp(-|x - m|).
    # x = -inf (masked tail, or a masked-out vocabulary entry) adds 0, even on a lane still at -inf.
    e = tl.where(x == float("-inf"), 0.0, tl.exp(-tl.abs(x - m)))
    # x = NaN makes s NaN; m keeps the NaN too, so that fold_lse can tell it from a +inf lane.
    grows = x > m
    s = tl.where(grows, s * e + 1.0, s + e)
    m = _maximum_nan(m, x)
    return m, s


@triton.jit
def _block_update(m, s, x):
    # m: the row's running max (a scalar); s: lane sums relative to m. One cross-warp max per chunk.
    m_new = _maximum_nan(m, max_nan(x, 0))  # NaN once any logit was NaN: then so is the lse
    # While the row is all -inf so far, shift by 0 (not -inf) so that -inf - shift stays -inf, not NaN.
    shift = tl.where(m_new == float("-inf"), 0.0, m_new) * LOG2E
    s = s * exp2_ftz(m * LOG2E - shift) + exp2_ftz(x * LOG2E - shift)
    return m_new, s


@triton.jit
def _group_update(m, s, x):
    # x: [groups, G], each group one thread's contiguous vector; m, s: [groups] per-group state.
    m_new = _maximum_nan(m, max_nan(x, 1))
    shift = tl.where(m_new == float("-inf"), 0.0, m_new) * LOG2E
    s = s * exp2_ftz(m * LOG2E - shift) + tl.sum(exp2_ftz(x * LOG2E - shift[:, None]), axis=1)
    return m_new, s


@triton.jit
def fold_lse(m, s):
    # Lanes (or groups) -> the row's logsumexp, in an order fixed by the layout (not by the batch).
    # Lanes that saw only -inf (s == 0) add 0, not 0 * exp(-inf - -inf) = NaN. A NaN lane (m and s
    # NaN; tl.max skips it) adds NaN. A +inf lane adds 1: its s may be NaN from inf - inf, while the
    # row's lse is +inf, as torch.logsumexp gives.
    row_max = tl.max(m, axis=0)
    part = tl.where(s == 0, 0.0, s * tl.exp(m - row_max))
    total = tl.sum(tl.where(m == float("inf"), 1.0, part), axis=0)
    return row_max + tl.log(total)


@triton.jit
def _logp_forward_kernel(
    logits_ptr, target_ptr, logp_ptr, lse_ptr,
    row_stride, V,
    BLOCK_V: tl.constexpr, ALGO: tl.constexpr, G: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    row_ptr = logits_ptr + row * row_stride
    full_end = (V // BLOCK_V) * BLOCK_V
    if ALGO == "group":
        offs = tl.arange(0, BLOCK_V // G)[:, None] * G + tl.arange(0, G)[None, :]
        m = tl.full([BLOCK_V // G], float("-inf"), tl.float32)
        s = tl.zeros([BLOCK_V // G], tl.float32)
    elif ALGO == "block":
        offs = tl.arange(0, BLOCK_V)
        m = tl.full([], float("-inf"), tl.float32)
        s = tl.zeros([BLOCK_V], tl.float32)
    else:
        offs = tl.arange(0, BLOCK_V)
        m = tl.full([BLOCK_V], float("-inf"), tl.float32)
        s = tl.zeros([BLOCK_V], tl.float32)
    for start in range(0, full_end, BLOCK_V):
        x = tl.load(row_ptr + start + offs).to(tl.float32)
        if ALGO == "group":
            m, s = _group_update(m, s, x)
        elif ALGO == "block":
            m, s = _block_update(m, s, x)
        else:
            m, s = _lane_update(m, s, x)
    if full_end < V:
        x = tl.load(row_ptr + full_end + offs, mask=full_end + offs < V, other=float("-inf")).to(tl.float32)
        if ALGO == "group":
            m, s = _group_update(m, s, x)
        elif ALGO == "block":
            m, s = _block_update(m, s, x)
        else:
            m, s = _lane_update(m, s, x)
    if ALGO == "block":
        # m = +inf: every lane is NaN (inf - inf) but lse is +inf; m = NaN: lse is NaN.
        lse = tl.where(m == float("inf"), m, m + tl.log(tl.sum(s, axis=0)))
    else:
        lse = fold_lse(m, s)
    # Ids are not range-checked on the host (that would synchronize); an id outside [0, V) gives NaN.
    target = tl.load(target_ptr + row).to(tl.int64)
    valid = (target >= 0) & (target < V)
    picked = tl.load(row_ptr + target, mask=valid, other=float("nan")).to(tl.float32)
    tl.store(logp_ptr + row, picked - lse)
    tl.store(lse_ptr + row, lse)


@triton.jit
def _logp_backward_kernel(
    logits_ptr, target_ptr, lse_ptr, grad_out_ptr, grad_logits_ptr,
    row_stride, grad_row_stride, V,
    BLOCK_V: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    row_ptr = logits_ptr + row * row_stride
    grad_row_ptr = grad_logits_ptr + row * grad_row_stride
    lse = tl.load(lse_ptr + row)
    g = tl.load(grad_out_ptr + row)
    target = tl.load(target_ptr + row).to(tl.int64)
    offs = tl.arange(0, BLOCK_V)
    for start in range(0, V, BLOCK_V):
        cols = start + offs
        mask = cols < V
        x = tl.load(row_ptr + cols, mask=mask, other=0.0).to(tl.float32)
        grad = g * (tl.where(cols == target, 1.0, 0.0) - tl.exp(x - lse))
        tl.store(grad_row_ptr + cols, cast_rne(grad, grad_logits_ptr.dtype.element_ty), mask=mask)


# The forward's one fixed configuration per dtype class - never keyed on the number of rows.
# BLOCK_V is capped at next_power_of_2(V). `benchmarks/logp.py --sweep` times the alternatives.
FORWARD_CONFIGS = {
    "16bit": dict(ALGO="group", BLOCK_V=8192, num_warps=8),
    "fp32": dict(ALGO="lane", BLOCK_V=2048, num_warps=8),
}
ALGOS = ("lane", "block", "group")


def _forward_config(dtype: torch.dtype, vocab: int) -> dict:
    """ALGO, BLOCK_V, G (elements per 16-byte load) and num_warps, fixed per (dtype, V)."""
    cfg = dict(FORWARD_CONFIGS["fp32" if dtype.itemsize > 2 else "16bit"])
    if interpreting():
        # Small chunks so that CPU tests at V ~ 100 exercise the multi-chunk and tail paths.
        cfg.update(BLOCK_V=32, num_warps=1)
    block_v = min(cfg["BLOCK_V"], triton.next_power_of_2(vocab))
    return dict(cfg, BLOCK_V=block_v, G=min(16 // dtype.itemsize, block_v))


def _backward_config(dtype: torch.dtype, vocab: int) -> tuple[int, int]:
    """(BLOCK_V, num_warps), fixed per (dtype, V). Never depends on the number of rows."""
    if interpreting():
        return min(32, triton.next_power_of_2(vocab)), 1
    cap = 4096 if dtype.itemsize <= 2 else 2048
    return min(cap, triton.next_power_of_2(vocab)), 8


def _validate(logits: torch.Tensor, target_ids: torch.Tensor) -> None:
    expect_rank("logits", logits, 3, "[B,S,V]")
    if not logits.is_floating_point():
        raise ValueError(f"logits: expected a floating dtype [B,S,V], got {logits.dtype}")
    expect_shape("target_ids", target_ids, tuple(logits.shape[:2]), "[B,S]")
    if target_ids.dtype.is_floating_point or target_ids.dtype == torch.bool:
        raise ValueError(f"target_ids: expected integer ids [B,S], got dtype {target_ids.dtype}")


def _rows(logits: torch.Tensor) -> torch.Tensor:
    rows = logits.reshape(-1, logits.shape[-1])
    return rows if rows.stride(-1) == 1 else rows.contiguous()


# Forward and backward are torch custom ops (fake + autograd registered), so torch.compile traces them.
@torch.library.custom_op("rl_engine::logp", mutates_args=())
def logp_op(logits: torch.Tensor, target_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(fp32 logp [B,S], fp32 logsumexp [B*S]) (torch.ops.rl_engine.logp); differentiable in logp."""
    batch_shape, vocab = logits.shape[:-1], logits.shape[-1]
    rows = _rows(logits)
    targets = target_ids.reshape(-1).contiguous()
    n = rows.shape[0]
    logp = torch.empty(n, dtype=torch.float32, device=logits.device)
    lse = torch.empty(n, dtype=torch.float32, device=logits.device)
    cfg = _forward_config(logits.dtype, vocab)
    if n:
        _logp_forward_kernel[(n,)](rows, targets, logp, lse, rows.stride(0), vocab, **cfg)
    return logp.reshape(batch_shape), lse


@logp_op.register_fake
def _(logits: torch.Tensor, target_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    n = logits.shape[:-1].numel()
    return logits.new_empty(logits.shape[:-1], dtype=torch.float32), logits.new_empty(n, dtype=torch.float32)


@torch.library.custom_op("rl_engine::logp_backward", mutates_args=())
def logp_backward_op(grad_logp: torch.Tensor, logits: torch.Tensor, target_ids: torch.Tensor,
                     lse: torch.Tensor) -> torch.Tensor:
    rows = _rows(logits)
    targets = target_ids.reshape(-1).contiguous()
    n, vocab = rows.shape
    grad_out = grad_logp.reshape(-1).to(torch.float32).contiguous()
    grad_rows = torch.empty_like(rows)
    block_v, num_warps = _backward_config(rows.dtype, vocab)
    if n:
        _logp_backward_kernel[(n,)](
            rows, targets, lse, grad_out, grad_rows,
            rows.stride(0), grad_rows.stride(0), vocab,
            BLOCK_V=block_v, num_warps=num_warps,
        )
    return grad_rows.reshape(logits.shape)


@logp_backward_op.register_fake
def _(grad_logp, logits, target_ids, lse) -> torch.Tensor:
    return torch.empty_like(_rows(logits)).reshape(logits.shape)


def _logp_setup_context(ctx, inputs, output) -> None:
    logits, target_ids = inputs
    ctx.save_for_backward(logits, target_ids, output[1])


def _logp_backward(ctx, grad_logp: torch.Tensor, _grad_lse):
    logits, target_ids, lse = ctx.saved_tensors
    return logp_backward_op(grad_logp, logits, target_ids, lse), None


logp_autograd = register_autograd(logp_op, _logp_backward, _logp_setup_context)


def row_logsumexp(rows: torch.Tensor) -> torch.Tensor:
    """fp32 logsumexp of each row of `rows` [N,V]: the forward kernel's own lse (batch invariant)."""
    rows = _rows(rows)
    n, vocab = rows.shape
    lse = torch.empty(n, dtype=torch.float32, device=rows.device)
    if n:
        targets = torch.zeros(n, dtype=torch.int64, device=rows.device)
        picked = torch.empty(n, dtype=torch.float32, device=rows.device)
        cfg = _forward_config(rows.dtype, vocab)
        _logp_forward_kernel[(n,)](rows, targets, picked, lse, rows.stride(0), vocab, **cfg)
    return lse


def logp(logits: torch.Tensor, target_ids: torch.Tensor) -> torch.Tensor:
    """fp32 log-probabilities [B,S] of `target_ids` [B,S] under `logits` [B,S,V] (any float dtype)."""
    _validate(logits, target_ids)
    return logp_autograd(logits, target_ids)[0]


class TritonLogpOp:
    """Triton candidate for NativeLogpOp: called as op(logits=..., target_ids=...) -> fp32 [B,S]."""

    input_names = NativeLogpOp.input_names

    def __call__(self, *, logits: torch.Tensor, target_ids: torch.Tensor) -> torch.Tensor:
        check_devices("TritonLogpOp", logits=logits, target_ids=target_ids)
        return logp(logits, target_ids)
