"""Triton candidates, one file per op. On a machine without CUDA they run under Triton's CPU interpreter."""

from rl_engine.environment import use_triton_interpreter_without_cuda

use_triton_interpreter_without_cuda()
