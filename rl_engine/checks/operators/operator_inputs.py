"""Deterministic inputs for every operator, in the ops' semantic shapes ([B,S,...], never flattened).

Two modes:
- `random`: each tensor draws from its own generator, seeded from (seed, op, tensor name), so a
  tensor's values do not change when another tensor is added or resized. Values are drawn in fp32
  on the target device (a Qwen3-8B LM head weight is 622M values: seconds on a CPU, milliseconds on
  a GPU), then cast to the case dtype. The same seed gives the same inputs on the same device type;
  a CPU and a GPU draw different values.
- `constant`: every floating tensor holds `constant_value`, every id `token_value % vocab`.

Dims default to sizes a CPU checks in milliseconds; `QWEN3_8B` holds the production geometry.
"""

from __future__ import annotations

import dataclasses
import hashlib
import math
from dataclasses import dataclass

import torch

from rl_engine.kernels.records import OPS

INPUT_MODES = ("random", "constant")


@dataclass(frozen=True)
class OperatorDims:
    batch: int = 2
    seq: int = 4
    vocab: int = 32
    normalized_dim: int = 16  # hidden size H: rms_norm, lm_head, linear_logp, embedding
    intermediate: int = 32  # I: silu, swiglu
    n_heads: int = 4  # query heads Hq: attention, kv_cache_attention, rope
    n_kv_heads: int = 2
    head_dim: int = 8
    k_dim: int = 16  # matmul a [B,S,K] @ b [K,N]
    n_dim: int = 12
    experts: int = 4  # grouped_matmul weight [E,N,K] with N = n_dim, K = k_dim
    theta: float = 1e6
    eps: float = 1e-6

    @property
    def cache_len(self) -> int:
        """Smax of the KV cache: room for earlier tokens before the `seq` new ones, even when seq = 1."""
        return max(4 * self.seq, 16)

    def validate(self) -> None:
        for field in dataclasses.fields(self):
            value = getattr(self, field.name)
            if field.type == "int" and (not isinstance(value, int) or value <= 0):
                raise ValueError(f"{field.name}: expected a positive integer, got {value!r}")
        if self.n_heads % self.n_kv_heads:
            raise ValueError(f"n_kv_heads: {self.n_kv_heads} must divide n_heads={self.n_heads}")
        if self.head_dim % 2:
            raise ValueError(f"head_dim: rope needs an even head dim, got {self.head_dim}")
        if not 0 < self.theta < float("inf"):
            raise ValueError(f"theta: expected a positive finite number, got {self.theta!r}")
        if not 0 <= self.eps < float("inf"):
            raise ValueError(f"eps: expected a non-negative finite number, got {self.eps!r}")


# Qwen3-8B: hidden 4096, 32 query / 8 KV heads of 128, MLP 12288, vocab 151936. matmul takes the
# shape of the MLP up projection.
QWEN3_8B = dict(
    normalized_dim=4096, n_heads=32, n_kv_heads=8, head_dim=128, intermediate=12288, vocab=151936,
    k_dim=4096, n_dim=12288,
)


class _Draw:
    """Builds one op's tensors: each named tensor from its own seeded stream, or constants."""

    def __init__(self, op: str, dtype, device, mode: str, seed: int, constant_value: float, token_value: int,
                 layout: str):
        if mode not in INPUT_MODES:
            raise ValueError(f"input_mode: expected one of {INPUT_MODES}, got {mode!r}")
        self.op, self.dtype, self.device, self.mode, self.layout = op, dtype, torch.device(device), mode, layout
        self.seed, self.constant_value, self.token_value = seed, constant_value, token_value

    def _generator(self, name: str) -> torch.Generator:
        digest = hashlib.sha256(f"{self.seed}:{self.op}:{name}".encode()).digest()
        seed = int.from_bytes(digest[:8], "little") & (2**63 - 1)
        return torch.Generator(device=self.device).manual_seed(seed)

    def normal(self, name: str, shape, scale: float = 1.0, shift: float = 0.0) -> torch.Tensor:
        if self.mode == "constant":
            values = torch.full(shape, float(self.constant_value), device=self.device)
        else:
            values = torch.randn(shape, generator=self._generator(name), device=self.device) * scale + shift
        return values.to(self.dtype)

    def ints(self, name: str, shape, low: int, high: int, dtype=torch.int64) -> torch.Tensor:
        """Integers in [low, high); constant mode gives low + token_value % (high - low)."""
        if self.mode == "constant":
            values = torch.full(shape, low + self.token_value % (high - low), dtype=torch.int64, device=self.device)
        else:
            values = torch.randint(low, high, shape, generator=self._generator(name), device=self.device)
        return values.to(dtype)


def _logp(d: OperatorDims, draw: _Draw) -> dict:
    b, s, v = d.batch, d.seq, d.vocab
    return {"logits": draw.normal("logits", (b, s, v), scale=2.0), "target_ids": draw.ints("target_ids", (b, s), 0, v)}


def _linear_logp(d: OperatorDims, draw: _Draw) -> dict:
    b, s, v, h = d.batch, d.seq, d.vocab, d.normalized_dim
    return {
        "hidden": draw.normal("hidden", (b, s, h)),
        "lm_head_weight": draw.normal("lm_head_weight", (v, h), scale=2.0 / math.sqrt(h)),
        "target_ids": draw.ints("target_ids", (b, s), 0, v),
    }


def _rms_norm(d: OperatorDims, draw: _Draw) -> dict:
    h = d.normalized_dim
    return {"x": draw.normal("x", (d.batch, d.seq, h)), "weight": draw.normal("weight", (h,), 0.1, 1.0)}


def _matmul(d: OperatorDims, draw: _Draw) -> dict:
    return {
        "a": draw.normal("a", (d.batch, d.seq, d.k_dim)),
        "b": draw.normal("b", (d.k_dim, d.n_dim), scale=1.0 / math.sqrt(d.k_dim)),
    }


def _grouped_matmul(d: OperatorDims, draw: _Draw) -> dict:
    return {
        "x": draw.normal("x", (d.batch, d.seq, d.k_dim)),
        "weight": draw.normal("weight", (d.experts, d.n_dim, d.k_dim), scale=1.0 / math.sqrt(d.k_dim)),
        "expert_ids": draw.ints("expert_ids", (d.batch, d.seq), 0, d.experts),
    }


def _lm_head(d: OperatorDims, draw: _Draw) -> dict:
    h = d.normalized_dim
    return {
        "hidden": draw.normal("hidden", (d.batch, d.seq, h)),
        "weight": draw.normal("weight", (d.vocab, h), scale=1.0 / math.sqrt(h)),
    }


def _attention(d: OperatorDims, draw: _Draw) -> dict:
    """padded [B,S,H,D]; left_padded adds seq_starts [B] (row 0 unpadded, the others up to S-1 pad tokens);
    packed is B sequences of 1..2S tokens in one [1,T,H,D] row with cu_seqlens [B+1]."""
    b, s = d.batch, d.seq
    extra = {}
    if draw.layout == "left_padded":
        starts = draw.ints("seq_starts", (b,), 0, s, dtype=torch.int32)
        extra["seq_starts"] = torch.cat([starts.new_zeros(1), starts[1:]]) if b else starts
    elif draw.layout == "packed":
        lengths = draw.ints("seq_lengths", (b,), 1, 2 * s + 1)
        if draw.mode == "constant":
            lengths = torch.full((b,), s, dtype=torch.int64, device=draw.device)
        cu = torch.cat([lengths.new_zeros(1), lengths.cumsum(0)]).to(torch.int32)
        b, s = 1, int(cu[-1])
        extra["cu_seqlens"] = cu
    return {
        "q": draw.normal("q", (b, s, d.n_heads, d.head_dim)),
        "k": draw.normal("k", (b, s, d.n_kv_heads, d.head_dim)),
        "v": draw.normal("v", (b, s, d.n_kv_heads, d.head_dim)),
        **extra,
    }


def _kv_cache_attention(d: OperatorDims, draw: _Draw) -> dict:
    b, s, smax = d.batch, d.seq, d.cache_len
    if draw.mode == "constant":
        seqlens = torch.full((b,), smax, dtype=torch.int32, device=draw.device)
    else:
        seqlens = draw.ints("cache_seqlens", (b,), s, smax + 1, dtype=torch.int32)
    return {
        "q": draw.normal("q", (b, s, d.n_heads, d.head_dim)),
        "k_cache": draw.normal("k_cache", (b, smax, d.n_kv_heads, d.head_dim)),
        "v_cache": draw.normal("v_cache", (b, smax, d.n_kv_heads, d.head_dim)),
        "cache_seqlens": seqlens,
    }


def _silu(d: OperatorDims, draw: _Draw) -> dict:
    return {"x": draw.normal("x", (d.batch, d.seq, d.intermediate), scale=3.0)}


def _swiglu(d: OperatorDims, draw: _Draw) -> dict:
    shape = (d.batch, d.seq, d.intermediate)
    return {"gate": draw.normal("gate", shape, scale=3.0), "up": draw.normal("up", shape)}


def _rope(d: OperatorDims, draw: _Draw) -> dict:
    # Positions up to a few times the sequence: what prefill and packed batches see.
    positions = draw.ints("positions", (d.batch, d.seq), 0, max(4 * d.seq, 16))
    return {"x": draw.normal("x", (d.batch, d.seq, d.n_heads, d.head_dim)), "positions": positions}


def _embedding(d: OperatorDims, draw: _Draw) -> dict:
    return {
        "token_ids": draw.ints("token_ids", (d.batch, d.seq), 0, d.vocab),
        "weight": draw.normal("weight", (d.vocab, d.normalized_dim)),
    }


def _linear_policy_loss(d: OperatorDims, draw: _Draw) -> dict:
    inputs = _linear_logp(d, draw)
    b, s = d.batch, d.seq
    # Old and reference logprobs near the current policy's, so ratios straddle the clip bounds.
    logits = inputs["hidden"].float() @ inputs["lm_head_weight"].float().t()
    logp = torch.log_softmax(logits, -1).gather(-1, inputs["target_ids"].unsqueeze(-1)).squeeze(-1)
    if draw.mode == "constant":
        mask = torch.ones((b, s), device=draw.device)
    else:
        mask = (draw.ints("mask", (b, s), 0, 5) != 0).float()  # about one token in five inactive
    return {
        **inputs,
        "advantages": draw.normal("advantages", (b, s)),
        "old_logprobs": (logp + draw.normal("old_logprobs", (b, s), scale=0.3).float()).to(draw.dtype),
        "ref_logprobs": (logp + draw.normal("ref_logprobs", (b, s), scale=0.3).float()).to(draw.dtype),
        "mask": mask.to(draw.dtype),
    }


INPUT_BUILDERS = {
    "logp": _logp,
    "linear_logp": _linear_logp,
    "rms_norm": _rms_norm,
    "matmul": _matmul,
    "lm_head": _lm_head,
    "grouped_matmul": _grouped_matmul,
    "attention": _attention,
    "kv_cache_attention": _kv_cache_attention,
    "silu": _silu,
    "swiglu": _swiglu,
    "rope": _rope,
    "embedding": _embedding,
    "linear_policy_loss": _linear_policy_loss,
}


def make_operator_inputs(
    op: str,
    dims: OperatorDims | None = None,
    *,
    dtype=torch.float32,
    device="cpu",
    input_mode: str = "random",
    constant_value: float = 1.0,
    token_value: int = 0,
    seed: int = 0,
    layout: str | None = None,
) -> dict[str, torch.Tensor]:
    """The named inputs of `op` (keyword arguments of its gold op), floating tensors in `dtype`, in one of
    the op's layouts (default: its first)."""
    if op not in INPUT_BUILDERS:
        raise ValueError(f"op: unknown operator {op!r}; known: {', '.join(INPUT_BUILDERS)}")
    layouts = OPS[op].layouts
    layout = layouts[0] if layout is None else layout
    if layout not in layouts:
        raise ValueError(f"layout: {op} takes {', '.join(layouts)}; got {layout!r}")
    dims = dims or OperatorDims()
    dims.validate()
    draw = _Draw(op, dtype, device, input_mode, seed, constant_value, token_value, layout)
    return INPUT_BUILDERS[op](dims, draw)


def shape_name(inputs: dict[str, torch.Tensor]) -> str:
    """A short case label from the first input's shape, e.g. '2x4x32'."""
    first = next(iter(inputs.values()))
    return "x".join(str(n) for n in first.shape)
