"""mHC placements across ranks, bitwise equal to the replicated strict-fp32 oracle for 1, 2 and 4 ranks.

The oracle's long reductions are a lane fold (L lanes; lane j adds elements j, j+L, j+2L, … in
order) and then a pairwise tree over the L lanes (rl_engine.mhc.numerics). The top two levels of
that tree combine four subtrees, each over a group of L/4 consecutive lanes:
((g0 + g1) + (g2 + g3)). So the canonical shards of a reduced axis are the **lane groups**: shard c
holds the elements whose index i has (i mod L) div (L/4) = c — blocks of L/4 elements, dealt
cyclically. A shard's partial is `lane_sum` over its own elements with L/4 lanes (the very same
lanes and subtree), and the four partials meet in `tree4`. With TP = 1, 2 or 4 each rank holds whole
lane groups (rank r: groups r*S .. r*S+S-1, S = 4/TP, i.e. blocks of L/TP elements dealt
cyclically), computes their partials, sums its own groups (a whole subtree), all-gathers one partial
per rank and finishes the tree: the same as `tree4` over the four groups. The result is the
oracle's own bits, for any length (missing lanes are +0.0 in both), with no extra rounding.
It needs L ≥ 4 (the contract pins L = 64).

A contiguous split (rank r holding elements [r*n/TP, (r+1)*n/TP)) cannot match the oracle: each lane
would then be folded partly on one rank and partly on another, and continuing a fold across ranks is
a serial hand-off. The lane-group split costs nothing: it is a strided view of replicated data.

Placements:
- `tp_sharded`: the controller GEMM p = φ x and s = Σ x² (K = 4C) split over K by lane groups. The
  streams stay replicated (mhc_pre/post are per token and cheap); each rank holds φ's lane-group
  columns. Backward is local per k: d_x[:, k] sums over the 24 outputs, d_φ[:, k] over tokens.
- `cp_token_sharded`: tokens split by lane groups of the token index (blocks of L/CP tokens). Per-token
  math is local, so exact. The four token sums — rmsnorm_residual's d_gamma, the controller's d_phi,
  d_alpha, d_bias — are lane-group partials all-gathered and combined with `tree4`.
"""

from __future__ import annotations

import torch

from rl_engine.mhc import oracle
from rl_engine.mhc.contract import LayerContract, ResidualBatch
from rl_engine.mhc.numerics import div, lane_sum, sqrt_rn
from rl_engine.parallel.canonical import CANONICAL_SHARDS, ShardLayout, sum_shards

PLACEMENTS = ("tp_sharded", "cp_token_sharded")
F32 = torch.float32


def _check_lanes(lanes: int) -> int:
    if lanes < CANONICAL_SHARDS or lanes % CANONICAL_SHARDS:
        raise ValueError(f"lanes: the contract's lane count must be a multiple of {CANONICAL_SHARDS} "
                         f"to split into lane groups, got {lanes}")
    return lanes // CANONICAL_SHARDS


def lane_groups(n: int, lanes: int, device=None) -> torch.Tensor:
    """Canonical shard (lane group) of each index 0..n-1: (i mod L) div (L/4)."""
    return (torch.arange(n, device=device) % lanes) // _check_lanes(lanes)


def shard_indices(n: int, lanes: int, shards, device=None) -> torch.Tensor:
    """Indices 0..n-1 whose lane group is in `shards`, increasing: a rank's elements of the axis."""
    groups = lane_groups(n, lanes, device)
    keep = torch.zeros_like(groups, dtype=torch.bool)
    for s in shards:
        keep |= groups == s
    return keep.nonzero().squeeze(1)


def sharded_lane_sum(local: torch.Tensor, n: int, lanes: int, layout: ShardLayout, dim: int) -> torch.Tensor:
    """The oracle's `lane_sum(full, lanes, dim)`, from this rank's lane-group elements of an axis of length n.

    `local` holds, along `dim`, the elements `shard_indices(n, lanes, layout.local_shards)` in order.
    Returns the full reduction (dim removed), the same bits on every rank and as the oracle's.
    """
    group_lanes = _check_lanes(lanes)
    mine = shard_indices(n, lanes, layout.local_shards, local.device)
    if local.shape[dim] != mine.numel():
        raise ValueError(f"local: expected {mine.numel()} elements along dim {dim} (this rank's lane groups "
                         f"of {n}), got {local.shape[dim]}")
    groups = lane_groups(n, lanes, local.device)[mine]
    partials = [
        lane_sum(local.index_select(dim, (groups == s).nonzero().squeeze(1)), group_lanes, dim)
        for s in layout.local_shards
    ]
    # sum_shards is the numerics' tree4, (g0 + g1) + (g2 + g3), with a rank's own groups summed first.
    return sum_shards(torch.stack(partials), layout)


def gather_axis(local: torch.Tensor, n: int, lanes: int, layout: ShardLayout, dim: int) -> torch.Tensor:
    """Reassemble a full axis of length n from every rank's lane-group elements (copies only).

    Ranks can hold different counts (n not a multiple of L), so each pads to the largest count first.
    """
    if not layout.distributed:
        return local
    counts = [shard_indices(n, lanes, _rank_shards(layout, r)).numel() for r in range(layout.world_size)]
    width = max(counts)
    pad = list(local.shape)
    pad[dim] = width - local.shape[dim]
    padded = torch.cat([local, local.new_zeros(pad)], dim=dim).contiguous()
    parts = [torch.empty_like(padded) for _ in range(layout.world_size)]
    torch.distributed.all_gather(parts, padded, group=layout.group)
    shape = list(local.shape)
    shape[dim] = n
    full = local.new_empty(shape)
    for r, (part, count) in enumerate(zip(parts, counts)):
        index = shard_indices(n, lanes, _rank_shards(layout, r), local.device)
        full.index_copy_(dim, index, part.narrow(dim, 0, count))
    return full


def _rank_shards(layout: ShardLayout, rank: int) -> range:
    return range(rank * layout.shards_per_rank, (rank + 1) * layout.shards_per_rank)


# --- tp_sharded: the controller GEMM split over K ------------------------------------------------------

def tp_sharded_gemm_rms_fwd(x_local: torch.Tensor, phi_local: torch.Tensor, contract: LayerContract,
                            layout: ShardLayout):
    """x_local [T, K_r], phi_local [24, K_r]: this rank's lane-group columns of x = vec(X) and φ.

    → (p [T, 24], r [T]) fp32, the oracle's `fp32_gemm_rms_fwd` bits on every rank.
    """
    k, lanes = contract.k, contract.lanes
    x = x_local.to(F32)
    p = sharded_lane_sum(x.unsqueeze(1) * phi_local.to(F32).unsqueeze(0), k, lanes, layout, dim=-1)
    s = sharded_lane_sum(x * x, k, lanes, layout, dim=-1)
    return p, oracle._rms_factor(s, k, contract)  # the oracle's own r formula (private helper, reused)


def tp_sharded_gemm_rms_bwd(x_local, phi_local, r, d_p, d_r, contract: LayerContract, layout: ShardLayout):
    """→ (d_x_local [T, K_r], d_phi_local [24, K_r] or None when the mixer is frozen), fp32.

    Both are local per k (the same formulas as `oracle.fp32_gemm_rms_bwd`); only the eps-outside form
    needs the global s = Σ x², recomputed with `sharded_lane_sum`.
    """
    k = contract.k
    x = x_local.to(F32)
    need_w = contract.trainability == "full"
    d_x, d_phi = oracle.fixed_k_gemm_bwd(x, phi_local, d_p, contract, need_w_grad=need_w)
    d_r = d_r.to(F32)
    if contract.rms_eps_placement == "inside":
        ds = div(((d_r * r) * r) * r * -0.5, k)
    else:
        q = sqrt_rn(div(sharded_lane_sum(x * x, k, contract.lanes, layout, dim=-1), k))
        den = (q + q) * float(k)
        safe_den = torch.where(q > 0, den, torch.ones_like(den))
        ds = torch.where(q > 0, -div((d_r * r) * r, safe_den), torch.zeros_like(den))
    return d_x + (ds + ds).unsqueeze(1) * x, d_phi


class TpShardedOps:
    """The oracle's operators with `fp32_gemm_rms` split over K (a provider for `oracle.mhc_site`).

    Streams and φ arrive replicated, as the site passes them; each rank keeps its lane-group columns,
    and the K-sharded gradients are all-gathered (copies) back to full tensors for the site.
    """

    def __init__(self, layout: ShardLayout):
        self.layout = layout

    def __getattr__(self, name):
        return getattr(oracle, name)

    def _columns(self, contract: LayerContract, device) -> torch.Tensor:
        return shard_indices(contract.k, contract.lanes, self.layout.local_shards, device)

    def fp32_gemm_rms_fwd(self, streams, phi, contract):
        cols = self._columns(contract, streams.device)
        x = streams.reshape(streams.shape[0], contract.k)
        return tp_sharded_gemm_rms_fwd(x.index_select(1, cols), phi.index_select(1, cols), contract, self.layout)

    def fp32_gemm_rms_bwd(self, streams, phi, r, d_p, d_r, contract):
        cols = self._columns(contract, streams.device)
        x = streams.reshape(streams.shape[0], contract.k).index_select(1, cols)
        d_x, d_phi = tp_sharded_gemm_rms_bwd(x, phi.index_select(1, cols), r, d_p, d_r, contract, self.layout)
        d_x = gather_axis(d_x, contract.k, contract.lanes, self.layout, dim=1)
        if d_phi is not None:
            d_phi = gather_axis(d_phi, contract.k, contract.lanes, self.layout, dim=1)
        return d_x.reshape(streams.shape), d_phi


def tp_sharded_site(batch, controller, norm, contract: LayerContract, group=None) -> dict:
    """One mHC site with the controller GEMM split over K across the group: every boundary replicated."""
    return oracle.mhc_site(batch, controller, norm, contract, ops=TpShardedOps(ShardLayout.from_group(group)))


# --- cp_token_sharded: tokens split across ranks --------------------------------------------------------

def token_indices(tokens: int, contract: LayerContract, group=None) -> torch.Tensor:
    """The global token indices this rank holds under cp_token_sharded: blocks of L/CP tokens, dealt cyclically."""
    return shard_indices(tokens, contract.lanes, ShardLayout.from_group(group).local_shards)


def cp_token_sharded_site(batch_local: ResidualBatch, tokens: int, controller, norm, contract: LayerContract,
                          group=None) -> dict:
    """One mHC site on this rank's tokens (`token_indices`) of a batch of `tokens`.

    Per-token boundaries are this rank's rows (the oracle's bits: the math is per token). The token
    sums d_gamma, d_phi, d_alpha, d_bias are the oracle's bits on every rank: lane-group partials,
    all-gathered, `tree4`. The oracle's own formulas give the per-token terms; only the sum over
    tokens moves.
    """
    layout = ShardLayout.from_group(group)
    expected = shard_indices(tokens, contract.lanes, layout.local_shards).numel()
    if batch_local.tokens != expected:
        block = contract.lanes // layout.world_size
        raise ValueError(f"batch_local: this rank holds {expected} of the {tokens} tokens under cp_token_sharded "
                         f"(blocks of {block} dealt cyclically), got {batch_local.tokens}")
    if expected == 0:
        raise ValueError(f"tokens: {tokens} tokens leave rank {layout.rank} none under cp_token_sharded; "
                         f"use at least {contract.lanes} tokens or fewer ranks")
    out = oracle.mhc_site(batch_local, controller, norm, contract)
    lanes = contract.lanes

    def token_sum(per_token: torch.Tensor) -> torch.Tensor:
        return sharded_lane_sum(per_token, tokens, lanes, layout, dim=0)

    # rmsnorm_residual: d_gamma = lane_sum_t(d_y · (h · r)), h the normalised input u.
    h32 = out["fwd.pre.u"].to(F32)
    r_norm = oracle._rms_norm_factor(h32, contract)
    out["bwd.norm.d_gamma"] = token_sum(out["bwd.sublayer.d_y"].to(F32) * (h32 * r_norm))
    if contract.trainability == "full":
        d_h, p, r = out["bwd.sinkhorn.d_h"], out["fwd.gemm_rms.p"], out["fwd.gemm_rms.r"]
        e = d_h * (r.unsqueeze(1) * p)
        n = contract.hc_mult
        segments = [lane_sum(e[:, a:b], lanes) for a, b in ((0, n), (n, 2 * n), (2 * n, e.shape[1]))]
        out["bwd.affine.d_alpha"] = torch.stack([token_sum(seg) for seg in segments])
        out["bwd.affine.d_bias"] = token_sum(d_h)
        x = batch_local.streams.reshape(batch_local.tokens, contract.k).to(F32)
        out["bwd.gemm_rms.d_phi"] = token_sum(out["bwd.affine.d_p"].unsqueeze(2) * x.unsqueeze(1))
    return out

