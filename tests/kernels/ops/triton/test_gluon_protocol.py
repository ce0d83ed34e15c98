"""A pure-Python model of the Gluon attention kernels' barrier protocols (gluon_forward.py, gluon_backward.py),
run under random interleavings: the K/V (or Q/dO) ring with its drains, the dK/dV kernel's per-head ring
slots. It restates the kernels' index rules (it cannot run their code: Gluon has no CPU
interpreter), so a hang found here is a hang there; each test also shows the model catching a planted bug."""

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
    """Steps a random runnable agent until all finish ("ok") or none can move ("deadlock")."""
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


def _drain(ready, empty, first, last, glo, stages):
    for j in range(first, last):
        t = j - glo
        yield ("wait", ready[t % stages], (t // stages) & 1)
        yield ("arrive", empty[t % stages])


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
        assert slots[t % stages] == (0, lo)
        for j in range(lo + 1, hi):
            t = j - glo
            yield ("wait", ready[t % stages], (t // stages) & 1)
            assert slots[t % stages] == (0, j) and slots[(t - 1) % stages] == (0, j - 1), "a stage reused too early"
            yield ("arrive", empty[(t - 1) % stages])
        yield ("arrive", empty[(hi - 1 - glo) % stages])
    yield from _drain(ready, empty, max(hi, lo), ghi, glo, stages)


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


def forward(rng, consumers, stages):
    ranges, glo, ghi = _tiles(rng, consumers)
    ready, empty = [Barrier(1) for _ in range(stages)], [Barrier(consumers) for _ in range(stages)]
    slots = [None] * stages
    agents = [_producer(ready, empty, slots, glo, ghi, stages)]
    agents += [_consumer(lo, hi, glo, ghi, ready, empty, slots, stages) for lo, hi in ranges]
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
    try:
        return run(agents, rng)
    except AssertionError as e:  # the model's own checks: the first line names the fault
        return str(e).splitlines()[0]


@pytest.mark.parametrize("consumers, stages", [(2, 4), (3, 3)])
def test_the_forward_and_dq_rings_never_deadlock(consumers, stages):
    rng = random.Random(consumers * 10 + stages)
    assert {forward(rng, consumers, stages) for _ in range(3000)} == {"ok"}


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
