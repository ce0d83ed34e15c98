"""Token sampling in Triton: one program per row of logits [B,V] draws that row's token.

The rule is rl_engine.rollout.sampling's (its docstring is the meaning): z = fp32(logit) / T (rounded
division), then min-p, top-k, top-p, and the Gumbel-max draw over the survivors with the same 32-bit
counter hash of (seed, sequence id, position, v) and the same fp64 Gumbel transform. Here without a
sort: top-k and top-p thresholds are found by a search over order-preserving int32 keys of z
(key(a) < key(b) iff a < b; -0.0 and +0.0 share key 0); each step is one pass over the row that counts
(or sums) at SPLIT = 16 thresholds at once, so at most 8 passes cover the 2^32 keys:
  top-k: the largest key t with #(survivors with key >= t) >= k, i.e. the k-th largest z (ties kept);
  top-p: the largest key t with mass(survivors with key >= t) >= top_p * total (the cut value); every
         survivor above the cut is kept, and those tied at the cut in id order while the mass strictly
         before them (all above the cut, then lower ids at the cut) is < top_p * total.
Masses are fp32 sums of exp(z - max z) in block order, compared unnormalised with top_p * total.

Invalid rows give token -1: any NaN logit; for a sampled row also a tempered z of +inf (a +inf logit or
an overflow of logit / T) or no z above -inf; for a greedy row (T = 0) no logit above -inf.

Batch invariance: a program reads only its row and its row's parameters; BLOCK is fixed per V (never
per batch), every loop runs over the row's blocks in order, and the searches' trip counts depend on the
row's values alone. No host sync: parameters are device tensors, so the launch can be captured in a CUDA
graph.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from rl_engine.kernels.ops.triton.runtime import interpreting

INT32_MAX = tl.constexpr(2147483647)
SPLIT = tl.constexpr(16)  # thresholds tried per pass of a search: each pass shrinks the key range 16-fold


def _device_function(fn):
    """@triton.jit on the GPU. Under the interpreter a plain call: its re-patching of triton.language on every
    nested call (about 1.5 ms) was most of a tiny-V program's time; the code run is the same."""
    return fn if interpreting() else triton.jit(fn)


@_device_function
def _mix32(x):
    """The 32-bit finaliser of the torch path (uint32 products wrap mod 2^32, as its `& MASK`)."""
    x = x ^ (x >> 16)
    x = x * tl.full([], 0x7FEB352D, tl.uint32)
    x = x ^ (x >> 15)
    x = x * tl.full([], 0x2C1B3C6D, tl.uint32)
    return x ^ (x >> 16)


@_device_function
def _fold(k, word):
    return _mix32((k + tl.full([], 0x9E3779B9, tl.uint32)) ^ word)


@_device_function
def _key32(z):
    """Order-preserving int32 key of fp32 z (NaN aside); -0.0 maps to +0.0's key."""
    bits = z.to(tl.int32, bitcast=True)
    key = tl.where(bits < 0, bits ^ 0x7FFFFFFF, bits)
    return tl.where(z == 0.0, 0, key)


@_device_function
def _tempered(row_ptr, start, offs, V, t):
    cols = start + offs
    x = tl.load(row_ptr + cols, mask=cols < V, other=float("-inf")).to(tl.float32)
    z = tl.math.div_rn(x, tl.full(x.shape, 0, tl.float32) + t)
    return cols, z, _key32(z)


@_device_function
def _alive(z, key, zmax, min_p, k_floor):
    # Survivors of min-p (p_v / p_max = exp(z - max z) >= min_p) and of a top-k floor key.
    return (z > float("-inf")) & (tl.exp(z - zmax) >= min_p) & (key >= k_floor)


@_device_function
def _candidates(lo, hi):
    """SPLIT increasing thresholds in (lo, hi], the last one hi: lo + ceil((hi - lo) (j + 1) / SPLIT)."""
    span = hi.to(tl.int64) - lo
    j = tl.arange(0, SPLIT).to(tl.int64)
    return (lo + (span * (j + 1) + SPLIT - 1) // SPLIT).to(tl.int32)


@_device_function
def _narrow(lo, hi, candidates, ok):
    """The range left after one pass: ok is true on a prefix of the candidates (the predicate is monotone)."""
    return (tl.max(tl.where(ok, candidates, lo), axis=0), tl.min(tl.where(ok, hi, candidates - 1), axis=0))


@_device_function
def _count_at_least(row_ptr, V, t, zmax, min_p, k_floor, thresholds, BLOCK: tl.constexpr):
    """[SPLIT] int32: survivors with key >= each threshold (lane sums, folded once at the end). The
    thresholds run along dim 0 so that the row's elements stay along the contiguous dim (one thread holds
    all SPLIT counts of its elements: no element is loaded or tempered twice)."""
    offs = tl.arange(0, BLOCK)
    n = tl.zeros([SPLIT, BLOCK], tl.int32)
    for start in range(0, V, BLOCK):
        cols, z, key = _tempered(row_ptr, start, offs, V, t)
        alive = _alive(z, key, zmax, min_p, k_floor)
        n += (alive[None, :] & (key[None, :] >= thresholds[:, None])).to(tl.int32)
    return tl.sum(n, axis=1)


@_device_function
def _mass_at_least(row_ptr, V, t, zmax, min_p, k_floor, thresholds, BLOCK: tl.constexpr):
    """[SPLIT] fp32: mass exp(z - max z) of the survivors with key >= each threshold, in a fixed order."""
    offs = tl.arange(0, BLOCK)
    mass = tl.zeros([SPLIT, BLOCK], tl.float32)
    for start in range(0, V, BLOCK):
        cols, z, key = _tempered(row_ptr, start, offs, V, t)
        e = tl.where(_alive(z, key, zmax, min_p, k_floor), tl.exp(z - zmax), 0.0)
        mass += tl.where(key[None, :] >= thresholds[:, None], e[None, :], 0.0)
    return tl.sum(mass, axis=1)


@triton.jit
def _sample_kernel(
    logits_ptr, temperature_ptr, top_k_ptr, top_p_ptr, min_p_ptr, seed_ptr, sequence_id_ptr, position_ptr,
    token_ptr, keep_ptr,
    row_stride, V,
    BLOCK: tl.constexpr, WRITE_KEEP: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    row_ptr = logits_ptr + row * row_stride
    offs = tl.arange(0, BLOCK)
    t = tl.load(temperature_ptr + row)
    token = tl.full([], -1, tl.int64)
    if t == 0.0:
        # Greedy: argmax of the raw logits, first index on ties (strict > across blocks).
        best = tl.full([], float("-inf"), tl.float32)
        bad = tl.zeros([], tl.int32)
        for start in range(0, V, BLOCK):
            cols = start + offs
            x = tl.load(row_ptr + cols, mask=cols < V, other=float("-inf")).to(tl.float32)
            bad = tl.maximum(bad, tl.max((x != x).to(tl.int32), axis=0))
            m, i = tl.max(x, axis=0, return_indices=True, return_indices_tie_break_left=True)
            token = tl.where(m > best, start + i.to(tl.int64), token)
            best = tl.maximum(best, m)
        token = tl.where(bad != 0, -1, token)  # no NaN ever becomes a token; all -inf left token at -1
        if WRITE_KEEP:
            for start in range(0, V, BLOCK):
                cols = start + offs
                tl.store(keep_ptr + row * V + cols, (cols == token).to(tl.int8), mask=cols < V)
    else:
        min_p = tl.load(min_p_ptr + row)
        top_p = tl.load(top_p_ptr + row)
        top_k = tl.load(top_k_ptr + row)
        # Pass 1: max z, the smallest finite key, and whether the row is valid.
        zmax = tl.full([], float("-inf"), tl.float32)
        kmin = tl.full([], INT32_MAX, tl.int32)
        bad = tl.zeros([], tl.int32)
        for start in range(0, V, BLOCK):
            cols, z, key = _tempered(row_ptr, start, offs, V, t)
            bad = tl.maximum(bad, tl.max(((z != z) | (z == float("inf"))).to(tl.int32), axis=0))
            zmax = tl.maximum(zmax, tl.max(z, axis=0))
            kmin = tl.minimum(kmin, tl.min(tl.where(z > float("-inf"), key, INT32_MAX), axis=0))
        if (bad == 0) & (zmax > float("-inf")):
            kmax = _key32(zmax)
            # top-k: the largest key t with at least k survivors at or above it (fewer survivors: t = kmin).
            k_floor = kmin
            if (top_k > 0) & (top_k < V):
                lo = kmin
                hi = kmax
                while lo < hi:
                    candidates = _candidates(lo, hi)
                    n = _count_at_least(row_ptr, V, t, zmax, min_p, kmin, candidates, BLOCK)
                    lo, hi = _narrow(lo, hi, candidates, n >= top_k)
                k_floor = lo
            # top-p: the cut key, the mass strictly above it, and the target top_p * total.
            cut = kmin - 1  # off: every survivor is above the cut
            above = tl.zeros([], tl.float32)
            target = tl.zeros([], tl.float32)
            if top_p < 1.0:
                floor = tl.zeros([SPLIT], tl.int32) + k_floor
                total = tl.max(_mass_at_least(row_ptr, V, t, zmax, min_p, k_floor, floor, BLOCK), axis=0)
                target = top_p * total
                lo = k_floor
                hi = kmax
                while lo < hi:
                    candidates = _candidates(lo, hi)
                    mass = _mass_at_least(row_ptr, V, t, zmax, min_p, k_floor, candidates, BLOCK)
                    lo, hi = _narrow(lo, hi, candidates, mass >= target)
                cut = lo
                above = tl.max(_mass_at_least(row_ptr, V, t, zmax, min_p, k_floor,
                                              tl.zeros([SPLIT], tl.int32) + cut + 1, BLOCK), axis=0)
            # The draw: Gumbel-max over the survivors, u from the (seed, sequence, position, v) hash.
            seed = tl.load(seed_ptr + row)
            sequence_id = tl.load(sequence_id_ptr + row)
            position = tl.load(position_ptr + row)
            k = tl.zeros([], tl.uint32)
            k = _fold(k, seed.to(tl.uint32))
            k = _fold(k, (seed >> 32).to(tl.uint32))
            k = _fold(k, sequence_id.to(tl.uint32))
            k = _fold(k, (sequence_id >> 32).to(tl.uint32))
            k = _fold(k, position.to(tl.uint32))
            best = tl.full([], float("-inf"), tl.float64)
            carry = above  # mass strictly before the next token tied at the cut
            for start in range(0, V, BLOCK):
                cols, z, key = _tempered(row_ptr, start, offs, V, t)
                e = tl.exp(z - zmax)
                alive = _alive(z, key, zmax, min_p, k_floor)
                tied = alive & (key == cut)
                e_tied = tl.where(tied, e, 0.0)
                before = carry + (tl.cumsum(e_tied, axis=0) - e_tied)
                carry += tl.sum(e_tied, axis=0)
                keep = alive & ((key > cut) | (tied & (before < target)))
                bits = _mix32(k ^ _mix32((cols * 2 + 1).to(tl.uint32)))
                u = (bits.to(tl.float64) + 0.5) * 2.3283064365386963e-10  # (bits + 1/2) / 2^32, exact
                score = tl.where(keep, z.to(tl.float64) - tl.log(-tl.log(u)), float("-inf"))
                m, i = tl.max(score, axis=0, return_indices=True, return_indices_tie_break_left=True)
                token = tl.where(m > best, start + i.to(tl.int64), token)
                best = tl.maximum(best, m)
                if WRITE_KEEP:
                    tl.store(keep_ptr + row * V + cols, keep.to(tl.int8), mask=cols < V)
    tl.store(token_ptr + row, token)


def _block(vocab: int) -> tuple[int, int]:
    """(BLOCK, num_warps): fixed per V, never per batch (`benchmarks/sampler.py --sweep` times others). Small
    under the interpreter, so that CPU tests at V ~ 40 cross blocks and a tail."""
    if interpreting():
        return min(32, triton.next_power_of_2(vocab)), 1
    return min(2048, triton.next_power_of_2(vocab)), 16


_PARAMS = (("temperature", torch.float32), ("top_k", torch.int64), ("top_p", torch.float32),
           ("min_p", torch.float32), ("seed", torch.int64), ("sequence_ids", torch.int64),
           ("positions", torch.int64))


def _validate(logits: torch.Tensor, tensors: tuple) -> None:
    if logits.dim() != 2 or not logits.is_floating_point():
        raise ValueError(f"logits: expected floating logits [B,V], got {logits.dtype} {tuple(logits.shape)}")
    for (name, dtype), tensor in zip(_PARAMS, tensors):
        if tensor.shape != (logits.shape[0],) or tensor.dtype != dtype or tensor.device != logits.device:
            raise ValueError(f"{name}: expected {dtype} [{logits.shape[0]}] on {logits.device}, got {tensor.dtype} "
                             f"{tuple(tensor.shape)} on {tensor.device}")


def _launch(logits: torch.Tensor, params: tuple, keep: torch.Tensor | None) -> torch.Tensor:
    if logits.stride(-1) != 1:
        logits = logits.contiguous()
    n, vocab = logits.shape
    tokens = torch.empty(n, dtype=torch.int64, device=logits.device)
    block, num_warps = _block(vocab)
    if n:
        _sample_kernel[(n,)](logits, *params, tokens, keep if keep is not None else tokens, logits.stride(0), vocab,
                             BLOCK=block, WRITE_KEEP=keep is not None, num_warps=num_warps)
    return tokens


@torch.library.custom_op("rl_engine::sample_tokens", mutates_args=())
def sample_tokens_op(logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor,
                     min_p: torch.Tensor, seed: torch.Tensor, sequence_ids: torch.Tensor,
                     positions: torch.Tensor) -> torch.Tensor:
    """torch.ops.rl_engine.sample_tokens: `sample_tokens` without `keep`, for torch.compile to trace."""
    return _launch(logits, (temperature, top_k, top_p, min_p, seed, sequence_ids, positions), None)


@sample_tokens_op.register_fake
def _(logits, temperature, top_k, top_p, min_p, seed, sequence_ids, positions) -> torch.Tensor:
    return logits.new_empty(logits.shape[0], dtype=torch.int64)


def sample_tokens(logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor,
                  min_p: torch.Tensor, seed: torch.Tensor, sequence_ids: torch.Tensor, positions: torch.Tensor,
                  keep: torch.Tensor | None = None) -> torch.Tensor:
    """int64 [B]: row b's token (-1: an invalid row). Parameters are [B] tensors on the logits' device
    (fp32 temperature, top_p, min_p; int64 top_k, seed, sequence_ids, positions), so that the call reads
    nothing on the host. keep: optional int8 [B,V] that receives each row's survivors (the greedy token)."""
    params = (temperature, top_k, top_p, min_p, seed, sequence_ids, positions)
    _validate(logits, params)
    if keep is not None and (keep.shape != logits.shape or keep.dtype != torch.int8 or not keep.is_contiguous()):
        raise ValueError(f"keep: expected contiguous int8 {tuple(logits.shape)}, got {keep.dtype} {tuple(keep.shape)}")
    if torch.compiler.is_compiling() and keep is None:
        return sample_tokens_op(logits, *params)
    return _launch(logits, params, keep)  # the custom op's dispatch would cost ~10 us of host time per call
