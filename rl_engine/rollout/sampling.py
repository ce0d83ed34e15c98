"""Token sampling with per-sequence counter-based randomness: a sequence's draws never see its neighbours.

Filters, in vLLM v1's order (vllm/v1/sample/sampler.py: temperature, then the argmax-invariant min-p
processor, then top-k and top-p together), on z = logits / T in fp32:
  1. temperature: z = float32(logits) / T; T = 0 is greedy (argmax of the raw logits, first index on ties);
  2. min-p: drop v where p_v < min_p · max_u p_u, p = softmax(z) (the ratio is computed as exp(z_v − max z));
  3. top-k: drop v where z_v < the k-th largest z (ties with the k-th value are kept, as HF and vLLM);
  4. top-p: over the survivors, sorted by z descending (stable: lower id first on ties), keep the
     shortest prefix whose probability reaches p: v is kept iff the mass strictly before it is < top_p
     (the top token is always kept). Probabilities are renormalised over the survivors first.
Hugging Face's `generate` applies top-k, top-p, then min-p (min-p on the already truncated
distribution); the two orders agree whenever min-p removes nothing that top-k/top-p keep.

The draw: Gumbel-max over the survivors, token = argmax_v (z_v + g_v), g_v = −log(−log u_v), which samples
softmax(z) restricted to the survivors exactly. u_v comes from a counter-based hash of
(seed, sequence id, position of the new token, v): 32-bit integer mixing in int64 torch ops (every
product stays below 2^63, so no overflow), u = (bits + 0.5) / 2^32 in fp64 (exact), then g in fp64.
No torch.Generator, no state: the same (seed, sequence, position) gives the same draw in any batch.

Invalid rows get no token: `sample` returns -1 for a row with any NaN logit (greedy or sampled), a
sampled row whose tempered z reaches +inf (a +inf logit, or logit / T overflowing fp32: softmax is
undefined there), or a row with no logit above -inf. -inf logits are otherwise ordinary: probability 0,
never drawn, never the greedy argmax unless nothing else is left (then -1). A greedy row with +inf
logits takes the first of them. `check_tokens` turns a -1 into one error naming the request (the
engine's step reads the tokens on the host anyway, so the check costs no extra sync).

Two implementations of this one rule:
  * on CUDA, `sample` launches rl_engine.kernels.ops.triton.sampling.sampler: one Triton program per row,
    no sort (top-k and top-p thresholds by bisection over order-preserving int32 keys of z, then the
    ties at the top-p cut in id order), the same uint32 hash, fp64 Gumbel transform and first-index
    argmax; parameters travel as device tensors (`sampling_tensors`), so it never syncs and can be
    captured in a CUDA graph;
  * elsewhere (the CPU, and the reference `sample_reference` anywhere), the torch code below: sort,
    softmax and cumsum per row. Under Triton's CPU interpreter the kernel costs seconds per row with
    top-k/top-p (each bisection step is a pass over the row), so CPU runs keep the torch path; tests run
    the kernel there at tiny V.
The two agree token for token except where rounding decides: the fp64 log (libm vs libdevice/numpy) can
differ by an ulp, so two scores within a few ulps may swap; and a token at a min-p or top-p boundary
(its ratio or its mass before equal to the threshold within fp32 rounding: the sums run in different
orders) may fall on the other side. Each path alone is deterministic and batch invariant.

Batch invariance of the torch arithmetic: every row is processed alone, at the fixed shape [V]. Torch picks
code paths by tensor shape (on a CPU: vectorised body vs scalar tail of elementwise exp/log, a two-pass
parallel reduction when a reduction has a single output), so the same row inside [B,V] could round
differently from the row alone. Greedy rows are the exception: an argmax rounds nothing, so all of them
take one batched argmax. The kernel is invariant by construction: a program reads its row alone, with a
BLOCK fixed per V and loops in a fixed order.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

_MASK32 = 0xFFFFFFFF
# Odd multipliers below 2^31: a 32-bit value times one stays below 2^63 (exact in int64).
_M1, _M2 = 0x7FEB352D, 0x2C1B3C6D
_STREAM = 0x9E3779B9  # separates the key words


@dataclass(frozen=True)
class SamplingParams:
    """How one sequence is sampled. top_k 0 and top_p 1 and min_p 0 switch a filter off; temperature 0 is greedy."""

    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    max_new_tokens: int = 16
    stop_token_ids: tuple[int, ...] = ()
    seed: int = 0

    def __post_init__(self):
        def number(x):  # bool is an int to Python, never a sampling parameter
            return isinstance(x, (int, float)) and not isinstance(x, bool)

        def integer(x):
            return isinstance(x, int) and not isinstance(x, bool)

        if not (number(self.temperature) and math.isfinite(self.temperature) and self.temperature >= 0):
            raise ValueError(f"temperature: expected a finite number >= 0, got {self.temperature!r}")
        if not integer(self.top_k) or self.top_k < 0:
            raise ValueError(f"top_k: expected an integer >= 0 (0: off), got {self.top_k!r}")
        if not (number(self.top_p) and 0 < self.top_p <= 1):
            raise ValueError(f"top_p: expected 0 < top_p <= 1, got {self.top_p!r}")
        if not (number(self.min_p) and 0 <= self.min_p <= 1):
            raise ValueError(f"min_p: expected 0 <= min_p <= 1, got {self.min_p!r}")
        if not integer(self.max_new_tokens) or self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens: expected a positive integer, got {self.max_new_tokens!r}")
        if not integer(self.seed) or not 0 <= self.seed < 2**63:
            raise ValueError(f"seed: expected an integer in [0, 2^63), got {self.seed!r}")
        stops = self.stop_token_ids
        if not isinstance(stops, (tuple, list)) or not all(integer(t) and t >= 0 for t in stops):
            raise TypeError(f"stop_token_ids: expected a tuple of token ids (integers >= 0), got {stops!r}")
        object.__setattr__(self, "stop_token_ids", tuple(stops))  # hashable, and `in` on a tuple

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


def _mix32(x: torch.Tensor) -> torch.Tensor:
    """A 32-bit integer finaliser (xorshift-multiply, two rounds) on int64 values in [0, 2^32)."""
    x = x ^ (x >> 16)
    x = (x * _M1) & _MASK32
    x = x ^ (x >> 15)
    x = (x * _M2) & _MASK32
    return x ^ (x >> 16)


def _key(seed: int, sequence_id: int, position: int, device) -> torch.Tensor:
    """One 32-bit key per (seed, sequence, position), folded word by word."""
    words = (seed & _MASK32, seed >> 32, sequence_id & _MASK32, (sequence_id >> 32) & _MASK32, position & _MASK32)
    k = torch.tensor(0, dtype=torch.int64, device=device)
    for w in words:
        k = _mix32(((k + _STREAM) & _MASK32) ^ w)
    return k


def uniforms(seed: int, sequence_id: int, position: int, vocab_size: int, device="cpu") -> torch.Tensor:
    """u_v in (0, 1), fp64 [V]: a pure function of (seed, sequence id, position, v)."""
    key = _key(seed, sequence_id, position, device)
    v = torch.arange(vocab_size, dtype=torch.int64, device=device)
    bits = _mix32(key ^ _mix32((v * 2 + 1) & _MASK32))
    return (bits.to(torch.float64) + 0.5) * 2.0**-32


def keep_mask(z: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """bool [V]: the tokens that survive min-p, top-k, top-p (in that order) on tempered logits z [V] (fp32)."""
    keep = z > -math.inf  # drops -inf and NaN logits
    v = z.shape[0]
    if params.min_p > 0:
        ratio = torch.exp(z - z.max())  # p_v / p_max
        keep &= ratio >= params.min_p
    if 0 < params.top_k < v:
        kth = torch.topk(torch.where(keep, z, -math.inf), params.top_k).values[-1]
        keep &= z >= kth
    if params.top_p < 1:
        masked = torch.where(keep, z, -math.inf)
        order = torch.sort(masked, descending=True, stable=True).indices
        probs = torch.softmax(masked[order], dim=0)
        before = torch.cumsum(probs, dim=0) - probs  # mass strictly before each sorted token
        kept_sorted = before < params.top_p
        kept_sorted[0] = True
        top = torch.zeros_like(keep)
        top[order] = kept_sorted
        keep &= top
    return keep


def _invalid(z: torch.Tensor, greedy: bool) -> torch.Tensor:
    """bool (any leading shape): the rows of z [..., V] that get no token (module docstring)."""
    bad = torch.isnan(z).any(-1) | ~(z > -math.inf).any(-1)
    return bad if greedy else bad | torch.isposinf(z).any(-1)


def sample_row(logits: torch.Tensor, params: SamplingParams, sequence_id: int, position: int) -> torch.Tensor:
    """The token (0-dim int64; -1: no token) drawn for `sequence_id` at `position` from its logits row [V]."""
    z = logits.float()
    if params.greedy:
        return torch.where(_invalid(z, True), -1, torch.argmax(z))
    z = z / params.temperature
    keep = keep_mask(z, params)
    g = -torch.log(-torch.log(uniforms(params.seed, sequence_id, position, z.shape[0], z.device)))
    score = torch.where(keep, z.double() + g, -math.inf)
    return torch.where(_invalid(z, False), -1, torch.argmax(score))


def _check_batch(logits: torch.Tensor, params: list, sequence_ids: list, positions: list) -> None:
    if logits.dim() != 2 or not len(params) == len(sequence_ids) == len(positions) == logits.shape[0]:
        raise ValueError(f"sample: expected logits [B,V] and B params, ids, positions; got {tuple(logits.shape)}, "
                         f"{len(params)}, {len(sequence_ids)}, {len(positions)}")
    for name, values in (("sequence_ids", sequence_ids), ("positions", positions)):
        if not all(isinstance(x, int) and -(2**63) <= x < 2**63 for x in values):
            raise ValueError(f"{name}: expected int64 integers, got {values!r}")


def sample_reference(logits: torch.Tensor, params: list[SamplingParams], sequence_ids: list[int],
                     positions: list[int]) -> torch.Tensor:
    """int64 [B]: the torch path (module docstring), row by row; on any device."""
    _check_batch(logits, params, sequence_ids, positions)
    out = torch.empty(len(params), dtype=torch.int64, device=logits.device)
    greedy = [b for b, p in enumerate(params) if p.greedy]
    if greedy:  # an argmax is exact (no rounding; first index on ties) in any batch: one launch for all
        index = torch.tensor(greedy, device=logits.device)
        rows = logits[index].float()
        out[index] = torch.where(_invalid(rows, True), -1, torch.argmax(rows, dim=1))
    for b, (p, s, pos) in enumerate(zip(params, sequence_ids, positions)):
        if not p.greedy:
            out[b] = sample_row(logits[b], p, s, pos)
    return out


def sampling_tensors(params: list[SamplingParams], sequence_ids: list[int], positions: list[int],
                     device) -> tuple[torch.Tensor, ...]:
    """The kernel's per-row inputs on `device`: fp32 temperature, int64 top_k, fp32 top_p, fp32 min_p, int64
    seed, sequence_ids, positions, each [B]. Two host-to-device copies, asynchronous on CUDA (pinned)."""
    floats = torch.tensor([[p.temperature for p in params], [p.top_p for p in params], [p.min_p for p in params]],
                          dtype=torch.float32).reshape(3, len(params))
    ints = torch.tensor([[p.top_k for p in params], [p.seed for p in params], list(sequence_ids), list(positions)],
                        dtype=torch.int64).reshape(4, len(params))
    device = torch.device(device)
    if device.type == "cuda":
        floats = floats.pin_memory().to(device, non_blocking=True)
        ints = ints.pin_memory().to(device, non_blocking=True)
    else:
        floats, ints = floats.to(device), ints.to(device)
    return floats[0], ints[0], floats[1], floats[2], ints[1], ints[2], ints[3]


def sample(logits: torch.Tensor, params: list[SamplingParams], sequence_ids: list[int],
           positions: list[int]) -> torch.Tensor:
    """int64 [B]: one token per row of logits [B,V] (-1: no token, see `check_tokens`); row b is sampled
    alone. On CUDA the Triton sampler kernel, elsewhere the torch path (module docstring)."""
    _check_batch(logits, params, sequence_ids, positions)
    if not logits.is_cuda:
        return sample_reference(logits, params, sequence_ids, positions)
    from rl_engine.kernels.ops.triton.sampling.sampler import sample_tokens

    return sample_tokens(logits, *sampling_tensors(params, sequence_ids, positions, logits.device))


def check_tokens(tokens: list[int], sequence_ids: list[int]) -> None:
    """ValueError naming the first request whose row got no token (-1 from `sample`)."""
    for token, sequence_id in zip(tokens, sequence_ids):
        if token < 0:
            raise ValueError(f"request {sequence_id}: its logits hold NaN or +inf (after temperature), or nothing "
                             f"above -inf: no token can be sampled")
