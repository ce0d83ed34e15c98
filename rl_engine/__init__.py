"""rl_engine: batch-invariant kernels for RL post-training and the tools that prove their numerics."""

__version__ = "0.1.0"
