"""Triton kernels of the strict-fp32 mHC provider (`rl_engine.mhc.triton_provider`), one file per operator.

Every kernel mirrors `rl_engine.mhc.oracle` operation for operation and is launched with
`enable_fp_fusion=False` (no FMA contraction); `strict_fp32` holds the shared device functions.
"""

from rl_engine.environment import use_triton_interpreter_without_cuda

use_triton_interpreter_without_cuda()
