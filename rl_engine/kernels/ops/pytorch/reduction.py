"""Fixed-order reductions in torch: the order the gold ops (rl_engine.models.moe's router and combine) and
`batch_invariant_mode`'s last-dim sums add in, so a row's bits never depend on the batch."""

from __future__ import annotations

import torch


def tree_sum(x: torch.Tensor) -> torch.Tensor:
    """Sum over the last axis, in x's dtype, by a fixed tree: zero-pad to a power of two, then add the
    upper half to the lower half until one column is left. Elementwise adds only, so a row's bits
    depend on that row alone, on every device and for every batch. (parallel.canonical's tree over
    shards is another order, fixed by the TP decomposition.)"""
    n = x.shape[-1]
    width = 1 << max(n - 1, 0).bit_length()
    if width != n:
        x = torch.nn.functional.pad(x, (0, width - n))
    while width > 1:
        width //= 2
        x = x[..., :width] + x[..., width:]
    return x[..., 0]
