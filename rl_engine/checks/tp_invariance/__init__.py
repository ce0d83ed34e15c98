"""Tensor-parallel invariance: `harness` holds the cases and comparisons, `check` the `rl-engine check-tp` command."""
