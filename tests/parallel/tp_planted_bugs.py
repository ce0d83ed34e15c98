"""Planted bugs for the TP-invariance checker: each is a case (layout, inputs) -> results, run on the ranks.

Kept beside the tests (spawned ranks import this module by name: spawn passes sys.path on).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from rl_engine.parallel.canonical import gather_shards, local_shard, tree_reduce
from rl_engine.parallel.vocab_parallel import merge_logsumexp, shard_partials, vocab_parallel_logp


def _data(seed: int, *shape, scale=1.0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)) * scale


def planted_allreduce_row_parallel(layout, inputs) -> dict:
    """Row-parallel linear summed with all_reduce: the backend's order, and one GEMM per rank over K/TP."""
    x = layout.split(_data(1, 64, 256), 1)
    w = layout.split(_data(2, 32, 256, scale=1 / 16), 1)
    y = x @ w.t()
    if layout.distributed:
        dist.all_reduce(y, group=layout.group)
    return {"planted_allreduce_row_parallel.forward": y}


def planted_rank_rotated_logp(layout, inputs) -> dict:
    """Canonical shard partials, but each rank starts the tree at its own shards: the order depends on rank."""
    logits, size = _data(3, 256, 32, scale=3.0), 8
    targets = torch.zeros(256, dtype=torch.long)
    local = layout.split(logits, 1)
    parts = torch.stack([shard_partials(local_shard(local, 1, j, size), targets, shard * size)
                         for j, shard in enumerate(layout.local_shards)])
    rotated = gather_shards(parts, layout).roll(-layout.rank * layout.shards_per_rank, 0)
    m, s = tree_reduce([(p[0], p[1]) for p in rotated.unbind(0)], merge_logsumexp)
    return {"planted_rank_rotated_logp.lse": m + torch.log(s)}


def planted_one_ulp_on_rank1(layout, inputs) -> dict:
    """The correct vocab-parallel logp, then rank 1 of each group moves one element by one ulp."""
    logits = layout.split(inputs["logits"], 2)
    logp = vocab_parallel_logp(logits, inputs["target_ids"], group=layout.group)
    if layout.rank == 1:
        logp = logp.clone()
        logp.view(-1)[0] = torch.nextafter(logp.view(-1)[0], torch.tensor(float("inf")))
    return {"planted_one_ulp_on_rank1.forward": logp}


PLANTED = (planted_allreduce_row_parallel, planted_rank_rotated_logp, planted_one_ulp_on_rank1)
