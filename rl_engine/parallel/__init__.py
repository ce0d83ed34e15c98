"""Tensor parallelism with one GPU's bits at every TP size: see docs/parallel.md.

tp_kernels / tp_decoder: the Triton kernels' row-, column- and vocab-parallel forms and the
tensor-parallel decoder; canonical / mhc_placements: the strict-fp32 mHC oracle's lane tree split
over ranks; expert_parallel: MoE experts over ranks. The TP-invariance check is rl_engine/checks/tp_invariance/.
Importing this package imports no kernel (the CLI imports it to build its parser).
"""

from rl_engine.parallel.canonical import CANONICAL_SHARDS, ShardLayout, gather_shards, tree_reduce, tree_sum

__all__ = ["CANONICAL_SHARDS", "ShardLayout", "gather_shards", "tree_reduce", "tree_sum"]
