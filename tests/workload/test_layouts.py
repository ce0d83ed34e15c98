import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from rl_engine.workload.layouts import LayoutError, Sample, chunk, pack, pad, permute, restore


@st.composite
def sample_sets(draw):
    lengths = draw(st.lists(st.integers(1, 9), min_size=1, max_size=5))
    ids = draw(st.permutations(list(range(len(lengths)))))
    samples = [
        Sample(sid, tuple(draw(st.lists(st.integers(1, 50), min_size=n, max_size=n))), 1)
        for sid, n in zip(ids, lengths)
    ]
    return samples


def _expected(samples):
    # Per-token values that name their slot: 1000 * sample id + position.
    return {s.sample_id: torch.arange(s.length) + 1000 * s.sample_id for s in samples}


def _values(layout):
    return torch.where(layout.keys[..., 0] >= 0, layout.keys[..., 0] * 1000 + layout.keys[..., 1], -7)


def _lengths(samples):
    return {s.sample_id: s.length for s in samples}


def _assert_identity(samples, pieces):
    restored = restore(pieces, _lengths(samples))
    for sid, want in _expected(samples).items():
        assert torch.equal(restored[sid], want)


@settings(max_examples=60, deadline=None)
@given(sample_sets(), st.sampled_from(["right", "left"]), st.integers(1, 6), st.randoms())
def test_restore_inverts_every_transform(samples, side, size, rnd):
    order = list(range(len(samples)))
    rnd.shuffle(order)
    shuffled = permute(samples, order)
    for layout in (pad(shuffled, side), pack(shuffled)):
        _assert_identity(samples, [(layout.keys, _values(layout))])
        # Tokens travel with their keys.
        tokens = restore([(layout.keys, layout.token_ids)], _lengths(samples))
        assert all(tokens[s.sample_id].tolist() == list(s.token_ids) for s in samples)
    chunks = chunk(pad(shuffled, "right"), size)
    _assert_identity(samples, [(c.keys, _values(c)) for c in chunks])
    _assert_identity(samples, [(pad([s]).keys, _values(pad([s]))) for s in shuffled])


def test_layout_details():
    a, b = Sample(0, (5, 6, 7), 1), Sample(1, (8, 9), 1)
    left = pad([a, b], "left")
    assert left.token_ids.tolist() == [[5, 6, 7], [0, 8, 9]]
    assert left.positions.tolist() == [[0, 1, 2], [0, 0, 1]]
    assert left.seq_starts.tolist() == [0, 1]
    assert left.target_ids.tolist() == [[6, 7, 0], [0, 9, 0]]
    packed = pack([a, b])
    assert packed.cu_seqlens.tolist() == [0, 3, 5] and packed.cu_seqlens.dtype == torch.int32
    assert packed.positions.tolist() == [[0, 1, 2, 0, 1]]
    assert [c.token_ids.shape[1] for c in chunk(pad([a, b]), 2)] == [2, 1]


def test_restore_dropping_a_token_fails_naming_it():
    samples = [Sample(0, (1, 2, 3), 1), Sample(1, (4, 5), 1)]
    layout = pack(samples)
    keys = layout.keys.clone()
    keys[0, 4] = -1  # planted bug: a transform that loses (sample 1, position 1)
    with pytest.raises(LayoutError, match=r"\(sample 1, position 1\) is missing"):
        restore([(keys, _values(layout))], _lengths(samples))


def test_restore_rejects_duplicates_and_strangers():
    samples = [Sample(0, (1, 2, 3), 1)]
    layout = pack(samples)
    with pytest.raises(LayoutError, match="present 2 times"):
        restore([(layout.keys, _values(layout))] * 2, _lengths(samples))
    with pytest.raises(LayoutError, match="unknown samples"):
        restore(
            [(layout.keys, _values(layout)), (pack([Sample(9, (1,), 1)]).keys, torch.zeros(1, 1))], _lengths(samples)
        )


def test_bad_arguments():
    with pytest.raises(ValueError, match="side"):
        pad([Sample(0, (1,), 1)], "middle")
    with pytest.raises(ValueError, match="order"):
        permute([Sample(0, (1,), 1)], [1])
    with pytest.raises(LayoutError, match="right-padded"):
        chunk(pack([Sample(0, (1,), 1)]), 2)
