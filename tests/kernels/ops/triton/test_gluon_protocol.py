"""A pure-Python model of the Gluon attention kernels' barrier protocols (gluon_forward.py, gluon_backward.py,
gluon_decode.py), run under random interleavings: the K/V (or Q/dO) ring with its drains, the dK/dV kernel's per-head
ring slots, the decode walk's m handed from softmax warpgroup to softmax warpgroup. It restates the kernels' index
rules (it cannot run their code: Gluon has no CPU interpreter), so a hang found here is a hang there; each test also
shows the model catching a planted bug."""

from __future__ import annotations

import random

import pytest


class Barrier:
    """An mbarrier: `count` arrivals complete a phase; wait(parity) passes once the phase of that parity has
    completed (a fresh barrier passes parity 1)."""

    def __init__(self, count):
        self.count, self.pending, self.phases = count, 0, 0

    def arrive(self):
        self.pending += 1
        if self.pending == self.count:
            self.phases, self.pending = self.phases + 1, 0

    def passes(self, parity):
        return (self.phases & 1) != parity


def run(agents, rng) -> str:
    """Steps a random runnable agent until all finish ("ok"), none can move ("deadlock") or one of the model's checks
    fails (the first line of its message names the fault)."""
    try:
        return _step(agents, rng)
    except AssertionError as e:
        return str(e).splitlines()[0]


def _step(agents, rng) -> str:
    waiting = [None] * len(agents)
    alive = [True] * len(agents)
    while any(alive):
        runnable = [i for i in range(len(agents))
                    if alive[i] and (waiting[i] is None or waiting[i][0].passes(waiting[i][1]))]
        if not runnable:
            return "deadlock"
        i = rng.choice(runnable)
        waiting[i] = None
        op = next(agents[i], None)
        if op is None:
            alive[i] = False
        elif op[0] == "wait":
            waiting[i] = op[1:]
        elif op[0] == "write":  # a consumer's store into a ring slot: it must still hold the block it means
            slots, stage, block = op[1:]
            assert slots[stage] == block, "wrote into another block"
        else:
            op[1].arrive()
    return "ok"


def _drain(ready, empty, first, last, glo, stages, v_stages=0):
    """gluon_forward's `_drain`: with separate rings (v_stages > 0) a block's V stage too, its barriers after K's."""
    for j in range(first, last):
        t = j - glo
        yield ("wait", ready[t % stages], (t // stages) & 1)
        yield ("arrive", empty[t % stages])
        if v_stages:
            yield ("wait", ready[stages + t % v_stages], (t // v_stages) & 1)
            yield ("arrive", empty[stages + t % v_stages])


def _producer(ready, empty, slots, glo, ghi, stages, group=1):
    nb = ghi - glo
    for g in range(group):
        for m in range(glo, ghi):
            t = g * nb + m - glo
            yield ("wait", empty[t % stages], ((t // stages) & 1) ^ 1)
            slots[t % stages] = (g, m)
            yield ("arrive", ready[t % stages])


def _consumer(lo, hi, glo, ghi, ready, empty, slots, stages):
    """gluon_forward's `_consumer` / `_step` (and gluon_backward's dQ consumer)."""
    yield from _drain(ready, empty, glo, lo, glo, stages)
    if hi > lo:
        t = lo - glo
        yield ("wait", ready[t % stages], (t // stages) & 1)
        assert slots[t % stages] == (0, lo), "read another block"
        for j in range(lo + 1, hi):
            t = j - glo
            yield ("wait", ready[t % stages], (t // stages) & 1)
            assert slots[t % stages] == (0, j) and slots[(t - 1) % stages] == (0, j - 1), "a stage reused too early"
            yield ("arrive", empty[(t - 1) % stages])
        yield ("arrive", empty[(hi - 1 - glo) % stages])
    yield from _drain(ready, empty, max(hi, lo), ghi, glo, stages)


def _split_producer(ready, empty, k_slots, v_slots, glo, ghi, stages, v_stages):
    """gluon_forward's `_producer` with K and V in separate rings: K_j, then V_{j-1}."""
    for j in range(glo, ghi + 1):
        if j < ghi:
            t = j - glo
            yield ("wait", empty[t % stages], ((t // stages) & 1) ^ 1)
            k_slots[t % stages] = j
            yield ("arrive", ready[t % stages])
        if j > glo:
            t = j - 1 - glo
            yield ("wait", empty[stages + t % v_stages], ((t // v_stages) & 1) ^ 1)
            v_slots[t % v_stages] = j - 1
            yield ("arrive", ready[stages + t % v_stages])


def _split_consumer(lo, hi, glo, ghi, ready, empty, k_slots, v_slots, stages, v_stages, v_early=False):
    """gluon_forward's `_consumer` / `_step` with separate rings: K_j released once its q·kᵀ is done, V_{j-1}
    after its p·v, in the same trip; a read spans its wait and its release (`v_early`: a planted release of V_{j-1}
    before its p·v)."""
    yield from _drain(ready, empty, glo, lo, glo, stages, v_stages)
    if hi > lo:
        t = lo - glo
        yield ("wait", ready[t % stages], (t // stages) & 1)
        assert k_slots[t % stages] == lo, "read another block"
        yield ("arrive", empty[t % stages])
        for j in range(lo + 1, hi + 1):
            t = j - glo
            if j < hi:
                yield ("wait", ready[t % stages], (t // stages) & 1)
            v = stages + (t - 1) % v_stages
            yield ("wait", ready[v], ((t - 1) // v_stages) & 1)
            if v_early:
                yield ("arrive", empty[v])
            if j < hi:
                assert k_slots[t % stages] == j, "read another block"
                yield ("arrive", empty[t % stages])
            assert v_slots[(t - 1) % v_stages] == j - 1, "a stage reused too early"
            if not v_early:
                yield ("arrive", empty[v])
    yield from _drain(ready, empty, max(hi, lo), ghi, glo, stages, v_stages)


def _dkdv_consumer(lo, hi, glo, ghi, group, ready, empty, slots, stages, slip=0, zero_late=False):
    """gluon_backward's `_dkdv_consumer`: per head of the group, ring slot g·nb + m - glo; a head's last block (the
    one that can hold rows past the sequence) has those rows zeroed in the slot before its release (`slip`: a planted
    off-by-one in the head's offset; `zero_late`: a planted zeroing after the release)."""
    nb = ghi - glo + slip
    for g in range(group):
        yield from _drain(ready, empty, glo, lo, glo - g * nb, stages)
        for m in range(lo, hi):
            t = g * nb - glo + m
            yield ("wait", ready[t % stages], (t // stages) & 1)
            assert slots[t % stages] == (g, m), "read another block"
            if m == hi - 1 and not zero_late:
                yield ("write", slots, t % stages, (g, m))
            yield ("arrive", empty[t % stages])
            if m == hi - 1 and zero_late:
                yield ("write", slots, t % stages, (g, m))
        yield from _drain(ready, empty, hi, ghi, glo - g * nb, stages)


def _tiles(rng, consumers, max_lo=5):
    """Per consumer [lo, hi) block ranges (or none), and the union: as the kernels' prologues compute them."""
    ranges = [None if rng.random() < 0.15 else (lo := rng.randint(0, max_lo), lo + rng.randint(1, 12))
              for _ in range(consumers)]
    real = [r for r in ranges if r]
    ghi = max((r[1] for r in real), default=0)
    glo = min((r[0] for r in real), default=ghi)
    return [r or (glo, glo) for r in ranges], glo, ghi


def forward(rng, consumers, stages, v_stages=0, v_early=False):
    """v_stages = 0: one ring (a block's K and V in one stage), else V in its own ring (gluon_forward.SHAPES)."""
    ranges, glo, ghi = _tiles(rng, consumers)
    ready, empty = ([Barrier(1) for _ in range(stages + v_stages)],
                    [Barrier(consumers) for _ in range(stages + v_stages)])
    if v_stages == 0:
        slots = [None] * stages
        agents = [_producer(ready, empty, slots, glo, ghi, stages)]
        agents += [_consumer(lo, hi, glo, ghi, ready, empty, slots, stages) for lo, hi in ranges]
    else:
        k_slots, v_slots = [None] * stages, [None] * v_stages
        agents = [_split_producer(ready, empty, k_slots, v_slots, glo, ghi, stages, v_stages)]
        agents += [_split_consumer(lo, hi, glo, ghi, ready, empty, k_slots, v_slots, stages, v_stages, v_early)
                   for lo, hi in ranges]
    return run(agents, rng)


def dkdv(rng, stages, slip=0, shared_tile=False, zero_late=False):
    """shared_tile: head_dim 256's form, a dV and a dK consumer on one key tile (the same block ranges)."""
    ranges, glo, ghi = _tiles(rng, 2, max_lo=4)
    if shared_tile:  # the first consumer's range for both (an empty one is (glo, glo): nothing streamed)
        (glo, ghi), = ranges[:1]
        ranges = [(glo, ghi)] * 2
    group = rng.randint(1, 4)
    ready, empty, slots = [Barrier(1) for _ in range(stages)], [Barrier(2) for _ in range(stages)], [None] * stages
    agents = [_producer(ready, empty, slots, glo, ghi, stages, group)]
    agents += [_dkdv_consumer(lo, hi, glo, ghi, group, ready, empty, slots, stages, slip, zero_late)
               for lo, hi in ranges]
    return run(agents, rng)


# (consumers, K/V or K stages, V stages): v_stages 0 is one K/V ring (the dQ kernel; the forward at head_dim 64),
# else separate K and V rings (the forward at 128 and 256), which work even 1-deep: no trip holds two K or two V stages
RINGS = [(2, 4, 0), (3, 3, 0), (2, 2, 0), (3, 3, 3), (2, 2, 2), (2, 2, 3), (3, 1, 1)]


@pytest.mark.parametrize("consumers, stages, v_stages", RINGS)
def test_the_forward_and_dq_rings_never_deadlock(consumers, stages, v_stages):
    rng = random.Random(consumers * 10 + stages + v_stages)
    assert {forward(rng, consumers, stages, v_stages) for _ in range(3000)} == {"ok"}


def test_the_kernels_rings_are_the_modelled_ones():
    from rl_engine.kernels.ops.triton.attention.gluon_backward import DQ_SHAPES
    from rl_engine.kernels.ops.triton.attention.gluon_forward import SHAPES

    kernels = {s[:3] for s in SHAPES.values()} | {(c, s, 0) for c, s, _ in DQ_SHAPES.values()}
    assert kernels <= set(RINGS), kernels - set(RINGS)


def test_the_model_catches_a_value_block_released_before_its_product():
    """Planted bug: V_{j-1}'s stage released before its p·v, so the producer may refill it under the product."""
    rng = random.Random(4)
    assert "a stage reused too early" in {forward(rng, 2, 2, 2, v_early=True) for _ in range(3000)}


@pytest.mark.parametrize("shared_tile", [False, True], ids=["two_tiles", "one_tile_dv_dk"])
def test_the_dkdv_ring_never_deadlocks_over_the_group(shared_tile):
    rng = random.Random(7)
    assert {dkdv(rng, 2, shared_tile=shared_tile) for _ in range(3000)} == {"ok"}


def test_the_model_catches_a_slot_zeroed_after_its_release():
    """Planted bug: the last block's rows zeroed after the consumer released the slot, when the producer may
    already have refilled it with the next head's block."""
    rng = random.Random(5)
    assert "wrote into another block" in {dkdv(rng, 2, zero_late=True) for _ in range(3000)}


def test_the_model_catches_a_ring_too_shallow_for_the_overlap():
    """Planted bug: a 1-deep ring, where a consumer holds blocks j-1 and j at once."""
    rng = random.Random(2)
    assert "deadlock" in {forward(rng, 2, 1) for _ in range(500)}


def test_the_model_catches_a_head_offset_off_by_one():
    """Planted bug: the dK/dV consumer's ring slots for head g shifted by g (nb + 1 blocks a head)."""
    rng = random.Random(3)
    assert {dkdv(rng, 4, slip=1) for _ in range(500)} - {"ok"}


def _decode_loader(n, stages, kv_ready, kv_empty, kv):
    """gluon_decode's prologue and `_loader`: block t into ring slot t % stages once the accumulator released the
    block `stages` before."""
    for t in range(n):
        yield ("wait", kv_empty[t % stages], ((t // stages) & 1) ^ 1)
        kv[t % stages] = t
        yield ("arrive", kv_ready[t % stages])


def _decode_softmax(first, groups, n, stages, slots, kv_ready, p_ready, m_ready, kv, m, p):
    """gluon_decode's `_softmax`, one of `groups` warpgroups: block t's scores once its K/V landed, block t - 1's m
    from m slot t % slots, block t's m into slot (t + 1) % slots, p̃ into the block's ring slot. An m slot holds
    (block, taken)."""
    for t in range(first, n, groups):
        yield ("wait", kv_ready[t % stages], (t // stages) & 1)
        assert kv[t % stages] == t, "scored another block"
        yield ("wait", m_ready[t % slots], (t // slots) & 1)
        assert m[t % slots] == (t - 1, False), "took another block's m"
        m[t % slots] = (t - 1, True)
        nxt = (t + 1) % slots
        assert m[nxt] is None or m[nxt][1], "overwrote an m not yet taken"
        m[nxt] = (t, False)
        yield ("arrive", m_ready[nxt])
        assert kv[t % stages] == t, "wrote p̃ beside another block"
        p[t % stages] = t
        yield ("arrive", p_ready[t % stages])


def _decode_accumulator(n, stages, slots, p_ready, kv_empty, m_ready, kv, m, p):
    """gluon_decode's `_accumulate`: block t's products once its p̃ is in, then the slot back to the loader; at the
    end the last block's m."""
    for t in range(n):
        yield ("wait", p_ready[t % stages], (t // stages) & 1)
        assert kv[t % stages] == t and p[t % stages] == t, "multiplied another block"
        yield ("arrive", kv_empty[t % stages])
    yield ("wait", m_ready[n % slots], (n // slots) & 1)
    assert m[n % slots] == (n - 1, False), "ended on another block's m"


def decode(rng, groups, slots=2, stages=6):
    """One split's walk (gluon_decode.py) under a random interleaving: "ok" or the model's first fault."""
    n = rng.randint(0, 14)
    kv_ready, kv_empty, p_ready = ([Barrier(1) for _ in range(stages)] for _ in range(3))
    m_ready = [Barrier(1) for _ in range(slots)]
    kv, p, m = [None] * stages, [None] * stages, [(-1, False)] + [None] * (slots - 1)  # M_INIT before block 0
    m_ready[0].arrive()
    agents = [_decode_loader(n, stages, kv_ready, kv_empty, kv),
              _decode_accumulator(n, stages, slots, p_ready, kv_empty, m_ready, kv, m, p)]
    agents += [_decode_softmax(g, groups, n, stages, slots, kv_ready, p_ready, m_ready, kv, m, p)
               for g in range(groups)]
    return run(agents, rng)


@pytest.mark.parametrize("groups, slots, stages", [(1, 2, 2), (2, 2, 2), (3, 2, 3), (3, 2, 6), (4, 3, 6)])
def test_the_decode_walk_hands_m_on_in_block_order(groups, slots, stages):
    """SOFTMAX_GROUPS warpgroups (3 in the kernel, 2 m slots, a 6-deep ring). A warpgroup waits for block t's K/V and
    for block t - 1's m right after its block t - groups, so its parity waits see the phase they mean when the ring
    has >= groups slots and m >= groups - 1: (4, 3, 6) is how four warpgroups would have to run."""
    rng = random.Random(groups * 100 + slots * 10 + stages)
    assert {decode(rng, groups, slots, stages) for _ in range(3000)} == {"ok"}


def test_the_model_catches_four_softmax_warpgroups_on_two_m_slots():
    """Planted bug, the four-warpgroup text edit that gave wrong bits on the H200 (docs/kernels.md): block t + 2's
    warpgroup can reach m slot t % 2 while its last completed phase is block t - 3's, of the parity it waits for, and
    take that stale m (an mbarrier's parity wait cannot tell phases two apart)."""
    rng = random.Random(4)
    assert "took another block's m" in {decode(rng, 4, slots=2) for _ in range(3000)}


def test_the_model_catches_a_ring_shallower_than_the_softmax_warpgroups():
    """Planted bug: three warpgroups on a 2-deep ring; block t's warpgroup can pass the wait for its K/V on block
    t - 2's phase of that slot (the same parity) and score whatever the slot holds."""
    rng = random.Random(6)
    assert "scored another block" in {decode(rng, 3, slots=2, stages=2) for _ in range(3000)}
