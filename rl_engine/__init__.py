"""rl_engine: batch-invariant kernels for RL post-training and the tools that prove their numerics.

The public API is importable from here (`from rl_engine import patch, selected_logprobs`). Each name
loads its module on first use, so `import rl_engine` stays cheap: it imports neither torch nor Triton.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

__version__ = "0.1.0"

# name -> the module that defines it (one place to update when a module moves).
_EXPORTS = {
    # transformers models: swap in rl_engine's ops, then per-token fp32 logprobs without logits
    "patch": "rl_engine.integrations.transformers",
    "unpatch": "rl_engine.integrations.transformers",
    "selected_logprobs": "rl_engine.integrations.transformers",
    # flash-attn 2's functions on rl_engine's attention kernel
    "flash_attn_func": "rl_engine.integrations.flash_attn",
    "flash_attn_varlen_func": "rl_engine.integrations.flash_attn",
    "flash_attn_with_kvcache": "rl_engine.integrations.flash_attn",
    # aten matmul, log_softmax and last-dim sums routed to batch-invariant kernels
    "batch_invariant_mode": "rl_engine.integrations.batch_invariant",
    # the fused lm_head + RL policy loss
    "linear_policy_loss": "rl_engine.losses",
    "PolicyLossConfig": "rl_engine.losses",
    # generation on the trainer's bits
    "RolloutEngine": "rl_engine.rollout",
    "SamplingParams": "rl_engine.rollout",
    "Request": "rl_engine.rollout",
    "Completion": "rl_engine.rollout",
    # verl's rollout_corr/* mismatch metrics
    "rollout_corr_metrics": "rl_engine.metrics",
    # judging a kernel from a test suite
    "assert_operator_matches": "rl_engine.checks.testing",
}

__all__ = ["__version__", *_EXPORTS]

if TYPE_CHECKING:  # what a type checker and an IDE see; at run time __getattr__ loads them
    from rl_engine.checks.testing import assert_operator_matches  # noqa: F401
    from rl_engine.integrations.batch_invariant import batch_invariant_mode  # noqa: F401
    from rl_engine.integrations.flash_attn import flash_attn_func, flash_attn_varlen_func, flash_attn_with_kvcache  # noqa: F401
    from rl_engine.integrations.transformers import patch, selected_logprobs, unpatch  # noqa: F401
    from rl_engine.losses import PolicyLossConfig, linear_policy_loss  # noqa: F401
    from rl_engine.metrics import rollout_corr_metrics  # noqa: F401
    from rl_engine.rollout import Completion, Request, RolloutEngine, SamplingParams  # noqa: F401


def __getattr__(name: str):
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'rl_engine' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value  # later lookups skip this function
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *_EXPORTS})
