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

Batch invariance of the arithmetic: every row is processed alone, at the fixed shape [V]. Torch picks
code paths by tensor shape (on a CPU: vectorised body vs scalar tail of elementwise exp/log, a two-pass
parallel reduction when a reduction has a single output), so the same row inside [B,V] could round
differently from the row alone. Cost: B small launches per op per step on a GPU (a one-program-per-row
sampler kernel would remove it). Greedy rows are the exception: an argmax rounds nothing, so all of them
take one batched argmax.
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
        if not (isinstance(self.temperature, (int, float)) and math.isfinite(self.temperature)
                and self.temperature >= 0):
            raise ValueError(f"temperature: expected a finite number >= 0, got {self.temperature!r}")
        if not isinstance(self.top_k, int) or self.top_k < 0:
            raise ValueError(f"top_k: expected an integer >= 0 (0: off), got {self.top_k!r}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p: expected 0 < top_p <= 1, got {self.top_p!r}")
        if not 0 <= self.min_p <= 1:
            raise ValueError(f"min_p: expected 0 <= min_p <= 1, got {self.min_p!r}")
        if not isinstance(self.max_new_tokens, int) or self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens: expected a positive integer, got {self.max_new_tokens!r}")
        if not isinstance(self.seed, int) or not 0 <= self.seed < 2**63:
            raise ValueError(f"seed: expected an integer in [0, 2^63), got {self.seed!r}")

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


def sample_row(logits: torch.Tensor, params: SamplingParams, sequence_id: int, position: int) -> torch.Tensor:
    """The token (0-dim int64) drawn for `sequence_id` at `position` from its logits row [V] (any float dtype)."""
    z = logits.float()
    if params.greedy:
        return torch.argmax(z)
    z = z / params.temperature
    keep = keep_mask(z, params)
    g = -torch.log(-torch.log(uniforms(params.seed, sequence_id, position, z.shape[0], z.device)))
    score = torch.where(keep, z.double() + g, -math.inf)
    return torch.argmax(score)


def sample(logits: torch.Tensor, params: list[SamplingParams], sequence_ids: list[int],
           positions: list[int]) -> torch.Tensor:
    """int64 [B]: one token per row of logits [B,V]; row b is sampled alone (module docstring)."""
    if logits.dim() != 2 or not len(params) == len(sequence_ids) == len(positions) == logits.shape[0]:
        raise ValueError(f"sample: expected logits [B,V] and B params, ids, positions; got {tuple(logits.shape)}, "
                         f"{len(params)}, {len(sequence_ids)}, {len(positions)}")
    out = torch.empty(len(params), dtype=torch.int64, device=logits.device)
    greedy = [b for b, p in enumerate(params) if p.greedy]
    if greedy:  # an argmax is exact (no rounding; first index on ties) in any batch: one launch for all
        index = torch.tensor(greedy, device=logits.device)
        out[index] = torch.argmax(logits[index].float(), dim=1)
    for b, (p, s, pos) in enumerate(zip(params, sequence_ids, positions)):
        if not p.greedy:
            out[b] = sample_row(logits[b], p, s, pos)
    return out
