"""One record per op: everything rl_engine knows about an operator, declared once (the OpInfo idea).

An op is its record here, its gold op (`ops/pytorch/<module>.py`, class `Native<Stem>Op`, which owns
the op's whole meaning and its `baseline`), its Triton kernel (`ops/triton/<module>.py`, class
`Triton<Stem>Op`) and its sample builder (`checks/operators/operator_inputs.py`). Everything else is
derived from the records: the registry's backends (`registry.py`), the harness's cases and
`check-op --list` (`checks/operators/operator_specs.py`), the op classes the tolerance contract must cover,
the model profiles' op list (`models/profiles.py`), the GPU gate's op list and the docs table (a
test compares `docs/kernels.md` with the records).

Backends, each from the record:
- `reference`: the gold op called as a reference (fp32, TF32 off; float64 stays float64);
- `torch`: the gold op's `baseline`, the plain PyTorch call users make today in their own dtype
  (F.rms_norm, SDPA, `@`, an fp32 log-softmax over bf16 logits); the baseline-relative tolerance rows
  and the `torch_bf16` profile both use it, so there is one baseline;
- `triton`: our kernel.
"""

from __future__ import annotations

from dataclasses import dataclass

GOLD_PACKAGE = "rl_engine.kernels.ops.pytorch"
TRITON_PACKAGE = "rl_engine.kernels.ops.triton"
# Layouts a sample builder can produce: padded [B,S,...] (right padding), left-padded (seq_starts),
# packed ([1,T,...] + cu_seqlens, varlen), cached (new queries against a KV cache).
LAYOUTS = ("padded", "left_padded", "packed", "cached")


@dataclass(frozen=True)
class OpRecord:
    name: str
    module: str  # "norm.rms_norm": the file under ops/pytorch/ and ops/triton/
    stem: str  # class names Native<stem>Op and Triton<stem>Op
    op_class: str  # the tolerance contract's class that judges it
    grad_input_names: tuple = ()  # inputs with a backward; empty: forward-only, `--check-grad` is refused
    batch_input_names: tuple = ()  # inputs with a leading batch dim, sliced per row by the invariance check
    constructor_dims: tuple = ()  # OperatorDims fields passed to the op's constructor (e.g. eps)
    layouts: tuple = ("padded",)  # the layouts its samples cover; the first is the default
    in_models: bool = True  # dispatched by the decoder, so every model profile names a backend for it
    fp32_output: bool = False  # its output is fp32 whatever the activation dtype (logprobs: DESIGN rule 4)

    @property
    def gold_path(self) -> str:
        return f"{GOLD_PACKAGE}.{self.module}:Native{self.stem}Op"

    @property
    def triton_path(self) -> str:
        return f"{TRITON_PACKAGE}.{self.module}:Triton{self.stem}Op"

    @property
    def candidate_paths(self) -> dict:
        """Built-in candidates of check-op: the gold op itself (the checker's smoke test) and our kernel."""
        return {"pytorch": self.gold_path, "triton": self.triton_path}


def _record(name, module, stem, op_class, grads, batched, **kw) -> OpRecord:
    return OpRecord(name, module, stem, op_class, tuple(grads), tuple(batched), **kw)


_RECORDS = [
    _record("logp", "loss.logp", "Logp", "logprob", ["logits"], ["logits", "target_ids"], in_models=False,
            fp32_output=True),
    _record("linear_logp", "loss.linear_logp", "LinearLogp", "logprob", ["hidden", "lm_head_weight"],
            ["hidden", "target_ids"], fp32_output=True),
    _record("rms_norm", "norm.rms_norm", "RmsNorm", "reduction", ["x", "weight"], ["x"], constructor_dims=("eps",)),
    _record("matmul", "linear.matmul", "Matmul", "matmul", ["a", "b"], ["a"]),
    _record("lm_head", "linear.lm_head", "LmHead", "matmul", ["hidden", "weight"], ["hidden"]),
    # The experts of a MoE layer: each row through the weight its expert id names.
    _record("grouped_matmul", "linear.grouped_matmul", "GroupedMatmul", "matmul", ["x", "weight"],
            ["x", "expert_ids"]),
    _record("attention", "attention.attention", "Attention", "attention", ["q", "k", "v"],
            ["q", "k", "v", "seq_starts"], layouts=("padded", "left_padded", "packed")),
    # An inference op (decode and chunked prefill against a KV cache): no gradient inputs, no backward.
    _record("kv_cache_attention", "attention.kv_cache_attention", "KvCacheAttention", "attention", [],
            ["q", "k_cache", "v_cache", "cache_seqlens"], layouts=("cached",)),
    _record("silu", "activation.silu", "Silu", "elementwise", ["x"], ["x"], in_models=False),
    _record("swiglu", "activation.swiglu", "Swiglu", "elementwise", ["gate", "up"], ["gate", "up"]),
    _record("rope", "position.rope", "Rope", "elementwise", ["x"], ["x", "positions"], constructor_dims=("theta",)),
    _record("embedding", "embedding.embedding", "Embedding", "elementwise", ["weight"], ["token_ids"]),
    # Judged as masked per-token losses [B,T]: each sequence alone vs its row of the batch.
    _record("linear_policy_loss", "loss.linear_policy_loss", "LinearPolicyLoss", "policy_loss",
            ["hidden", "lm_head_weight"],
            ["hidden", "target_ids", "advantages", "old_logprobs", "ref_logprobs", "mask"],
            in_models=False, fp32_output=True),
]
OPS: dict[str, OpRecord] = {r.name: r for r in _RECORDS}
# The ops a decoder dispatches: every model profile declares a backend for each.
MODEL_OPS: tuple = tuple(r.name for r in _RECORDS if r.in_models)
OP_CLASSES: tuple = tuple(dict.fromkeys(r.op_class for r in _RECORDS))


def _validate() -> None:
    for r in _RECORDS:
        if not set(r.layouts) <= set(LAYOUTS):
            raise ValueError(f"{r.name}.layouts: expected a subset of {LAYOUTS}, got {r.layouts}")
    if len(OPS) != len(_RECORDS):
        raise ValueError("two records share a name")


_validate()
