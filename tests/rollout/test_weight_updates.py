"""RolloutEngine.update_weights: in-place copies between RL steps give the bits of a fresh engine on the new
weights; derived tensors are refreshed; bad updates are one error that changes nothing."""

import pytest
import torch

from rl_engine.checks.forward_invariance.harness import build_model
from rl_engine.models.decoder import DecoderModel
from rl_engine.models.profiles import ProfileOps, get_profile
from rl_engine.models.weights import pack_projections, synthetic_weights
from rl_engine.rollout import Request, RolloutEngine, SamplingParams

# torch_bf16: the fp32 synthetic weights are cast into bf16 tensors, as the constructor casts them.
PROFILE = "torch_bf16"
REQUESTS = [Request(i, p, SamplingParams(temperature=t, max_new_tokens=4, seed=3))
            for i, (p, t) in enumerate([((5, 17, 33), 1.0), ((40, 41, 2, 9, 11), 0.0)])]


def fresh(weights):
    return {n: t.clone() for n, t in weights.items()}


def same(a: dict, b: dict) -> bool:
    return all(a[i].token_ids == b[i].token_ids and torch.equal(a[i].logprobs.view(torch.int32), b[i].logprobs.view(
        torch.int32)) and torch.equal(a[i].raw_logprobs.view(torch.int32), b[i].raw_logprobs.view(torch.int32))
        for i in a)


class FusedQkvModel(DecoderModel):
    """A model holding a derived tensor: q, k, v projections read one fused, transposed [H, q+k+v] copy."""

    def __init__(self, config, weights, ops):
        super().__init__(config, weights, ops)
        self.fused = {i: self._fuse(i) for i in range(config.num_layers)}

    def _fuse(self, layer):
        return torch.cat([self._weight(r, layer) for r in ("q_proj", "k_proj", "v_proj")]).t().contiguous()

    def refresh_derived(self, names):
        for i, fused in self.fused.items():
            fused.copy_(self._fuse(i))  # in place: a captured graph keeps reading this tensor

    def _linear(self, node, x, role, layer):
        if role not in ("q_proj", "k_proj", "v_proj"):
            return super()._linear(node, x, role, layer)
        sizes = [self._weight(r, layer).shape[0] for r in ("q_proj", "k_proj", "v_proj")]
        start = sum(sizes[: ("q_proj", "k_proj", "v_proj").index(role)])
        cols = self.fused[layer][:, start : start + self._weight(role, layer).shape[0]]
        return self.ops("matmul", node, a=x, b=cols)


@pytest.fixture(scope="module")
def weights(micro_config):
    return synthetic_weights(micro_config, 0), synthetic_weights(micro_config, 1)


@pytest.mark.parametrize("graphs", [False, True], ids=["eager", "decode-graphs"])
def test_generate_after_an_update_equals_a_fresh_engine(micro_config, weights, graphs):
    old, new = weights
    engine = RolloutEngine(build_model(micro_config, fresh(old), PROFILE), cuda_graphs=graphs)
    before = engine.generate(REQUESTS)
    places = {n: t.data_ptr() for n, t in engine.model.w.items()}
    assert sorted(engine.update_weights(new.items())) == sorted(new)
    assert {n: t.data_ptr() for n, t in engine.model.w.items()} == places  # copied in place
    after = engine.generate(REQUESTS)
    want = RolloutEngine(build_model(micro_config, fresh(new), PROFILE), cuda_graphs=graphs).generate(REQUESTS)
    assert same(after, want) and not same(before, want)


def test_an_update_reaches_stacked_projections(micro_config, weights):
    # pack_projections' q/k/v and gate/up are views of one buffer per layer, run as one product (triton_bf16)
    old, new = weights
    engine = RolloutEngine(build_model(micro_config, pack_projections(fresh(old), micro_config), "triton_bf16"),
                           cuda_graphs=True)
    engine.update_weights(new.items())
    after = engine.generate(REQUESTS)
    assert any("+" in r.node for r in engine.model.ops.recorder.records)  # the stacked products ran
    want = RolloutEngine(build_model(micro_config, fresh(new), "triton_bf16"), cuda_graphs=True).generate(REQUESTS)
    assert same(after, want)


@pytest.mark.parametrize("planted", [False, True], ids=["refreshed", "planted-stale-fused-copy"])
def test_derived_tensors_are_refreshed(micro_config, weights, monkeypatch, planted):
    old, new = weights

    def model(w):
        return FusedQkvModel(micro_config, fresh(w), ProfileOps(get_profile(PROFILE)))

    engine = RolloutEngine(model(old))
    if planted:  # the bug: the fused copy keeps the old q/k/v weights
        monkeypatch.setattr(FusedQkvModel, "refresh_derived", lambda self, names: None)
    engine.update_weights(new.items())
    assert same(engine.generate(REQUESTS), RolloutEngine(model(new)).generate(REQUESTS)) != planted


def _bad(name, weights):
    q = "model.layers.0.self_attn.q_proj.weight"
    w = weights[q]
    return {
        "unknown": ([("model.layers.9.self_attn.q_proj.weight", w)], ValueError, "unknown weight name"),
        "twice": ([(q, w), (q, w)], ValueError, "given twice"),
        "shape": ([(q, w[:-1])], ValueError, r"q_proj.weight: expected shape \(32, 32\), got \(31, 32\)"),
        "dtype": ([(q, w.to(torch.int32))], TypeError, "expected a floating-point dtype, got torch.int32"),
        "nan": ([(q, torch.where(w > 0, w, float("nan")))], ValueError, "holds NaN or inf"),
        "overflow": ([(q, w.double() * 1e300)], ValueError, r"holds NaN or inf \(in torch.bfloat16\)"),
        "not-a-pair": ([q], TypeError, r"expected \(name, tensor\) pairs"),
    }[name]


@pytest.mark.parametrize("case", ["unknown", "twice", "shape", "dtype", "nan", "overflow", "not-a-pair"])
def test_bad_updates_are_one_error_and_change_nothing(micro_config, weights, case):
    old, new = weights
    engine = RolloutEngine(build_model(micro_config, fresh(old), PROFILE))
    before = fresh(engine.model.w)
    good = ("model.layers.0.mlp.up_proj.weight", new["model.layers.0.mlp.up_proj.weight"])
    pairs, error, match = _bad(case, new)
    with pytest.raises(error, match=match):
        engine.update_weights([good] + pairs)  # the good pair first: nothing is copied until all are checked
    assert all(torch.equal(before[n], t) for n, t in engine.model.w.items())
