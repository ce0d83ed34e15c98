"""Tensor parallelism whose bits do not depend on the TP size (1, 2 or 4): see docs/parallel.md."""

from rl_engine.parallel.canonical import CANONICAL_SHARDS, ShardLayout, gather_shards, tree_reduce, tree_sum
from rl_engine.parallel.linear import column_parallel_linear, row_parallel_linear
from rl_engine.parallel.vocab_parallel import vocab_parallel_linear_logp, vocab_parallel_logp

__all__ = [
    "CANONICAL_SHARDS",
    "ShardLayout",
    "column_parallel_linear",
    "gather_shards",
    "row_parallel_linear",
    "tree_reduce",
    "tree_sum",
    "vocab_parallel_linear_logp",
    "vocab_parallel_logp",
]
