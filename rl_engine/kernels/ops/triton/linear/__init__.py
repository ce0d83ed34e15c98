"""Linear-family Triton candidates: the batch-invariant persistent GEMM and the ops built on it."""

from rl_engine.kernels.ops.triton.linear.lm_head import TritonLmHeadOp, triton_lm_head
from rl_engine.kernels.ops.triton.linear.matmul import MatmulConfig, TritonMatmulOp, batch_invariant_mm, triton_matmul

__all__ = ["MatmulConfig", "TritonLmHeadOp", "TritonMatmulOp", "batch_invariant_mm", "triton_lm_head", "triton_matmul"]
