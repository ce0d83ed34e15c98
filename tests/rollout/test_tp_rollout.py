"""The rollout engine on the tensor-parallel decoder (TP = 2, gloo, 2 CPU processes, Triton interpreter):
every rank's tokens and logprobs are the single-process engine's bits, before and after a weight update;
a gathered lm_head left stale by an update is caught."""

import pytest
import torch
from tp_rollout_cases import CONFIG, ENGINE, engine_run, rollout_ranks, weights

from rl_engine.checks.forward_invariance.harness import build_model
from rl_engine.parallel.launch import spawn_group
from rl_engine.rollout import RolloutEngine


@pytest.fixture(scope="module")
def ranks():
    return spawn_group(rollout_ranks, 2, backend="gloo", device="cpu")


@pytest.fixture(scope="module")
def single():
    return {name: engine_run(RolloutEngine(build_model(CONFIG, weights(seed), "triton_bf16"), **ENGINE))
            for name, seed in (("old", 3), ("new", 4))}


def same(a: dict, b: dict) -> bool:
    """Tokens equal and every logprob bit equal, for every request."""
    bits = [torch.equal(x.view(torch.int32), y.view(torch.int32)) for i in a for x, y in zip(a[i][1:], b[i][1:])]
    return a.keys() == b.keys() and all(a[i][0] == b[i][0] for i in a) and all(bits)


@pytest.mark.parametrize("weights_name", ["old", "new"])
def test_tp2_rollout_has_the_single_process_bits(ranks, single, weights_name):
    assert not same(single["old"], single["new"])
    for out in ranks:
        assert same(out[weights_name], single[weights_name])


def test_a_stale_gathered_head_is_caught(ranks, single):
    assert not any(same(out["planted_stale_head"], single["old"]) for out in ranks)
