import dataclasses

import pytest
import torch

from rl_engine.checks.forward_invariance.provenance import ProvenanceError, check_provenance, provenance_failures
from rl_engine.kernels.registry import MissingImplementation, Registry
from rl_engine.models.decoder import DecoderModel
from rl_engine.models.families import CONFIGS
from rl_engine.models.profiles import ProfileOps, get_profile
from rl_engine.models.weights import synthetic_weights

TINY = CONFIGS["tiny"]


def _run(model):
    ids = torch.randint(1, TINY.vocab_size, (1, 4), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        model.selected_logprobs(model.forward(ids, torch.arange(4)[None]), ids)
    return provenance_failures(
        model.ops.recorder.records, model.ops.profile, model.required_nodes(), model.known_nodes()
    )


def _model(profile="torch_bf16", registry=None):
    ops = ProfileOps(get_profile(profile), registry) if registry else ProfileOps(get_profile(profile))
    return DecoderModel(TINY, synthetic_weights(TINY, 1), ops)


def _copy_registry():
    from rl_engine.kernels.registry import REGISTRY

    registry = Registry()
    for impl in REGISTRY.implementations():
        registry.register(impl)
    return registry


def test_honest_profiles_have_clean_provenance():
    assert _run(_model("torch_bf16")) == []
    assert _run(_model("reference_fp32")) == []


def test_wrong_output_dtype_names_the_node():
    registry = _copy_registry()
    honest = registry.lookup("linear_logp", "torch")
    registry.register(dataclasses.replace(honest, adapter=lambda f, p, i: honest.adapter(f, p, i).double()))
    failures = _run(_model("torch_bf16", registry))
    assert failures == ["node logp: op linear_logp returned fp64, profile torch_bf16 declares fp32"]


def test_tf32_on_fails():
    # The same API the gold ops use to turn TF32 off, so the global state is restored cleanly.
    torch.set_float32_matmul_precision("high")
    try:
        failures = _run(_model("torch_bf16"))
    finally:
        torch.set_float32_matmul_precision("highest")
    assert "node model.layers.0.self_attn.q_proj: op matmul ran with TF32 enabled" in failures
    assert torch.get_float32_matmul_precision() == "highest"


def test_node_that_bypasses_the_registry_is_missing():
    class Bypass(DecoderModel):
        def selected_logprobs(self, hidden, target_ids):  # computes logprobs without dispatching
            logits = hidden.float() @ self.w["lm_head.weight"].float().t()
            return torch.log_softmax(logits, -1).gather(-1, target_ids[..., None])[..., 0]

    model = Bypass(TINY, synthetic_weights(TINY, 1), ProfileOps(get_profile("torch_bf16")))
    failures = _run(model)
    assert failures == ["node logp: required but never dispatched"]
    with pytest.raises(ProvenanceError, match="node logp"):
        check_provenance(model.ops.recorder.records, model.ops.profile, model.required_nodes(), model.known_nodes())


def test_unknown_node_fails():
    model = _model()
    model.ops(
        "swiglu", "model.layers.7.mlp.swiglu", gate=torch.ones(1, 1, 2).bfloat16(), up=torch.ones(1, 1, 2).bfloat16()
    )
    assert "node model.layers.7.mlp.swiglu: not a node of the model (op swiglu)" in _run(model)


def test_missing_kernel_fails_loudly_without_fallback():
    registry = _copy_registry()
    honest = registry.lookup("rope", "triton")
    registry.register(dataclasses.replace(honest, target="rl_engine.kernels.ops.triton.position.absent:TritonRopeOp"))
    with pytest.raises(MissingImplementation, match="op 'rope', backend 'triton'.*no fallback"):
        registry.dispatch("rope", "triton", "n", None, {}, x=torch.zeros(1, 1, 1, 2), positions=torch.zeros(1, 1))
    with pytest.raises(MissingImplementation, match="no implementation for backend 'cuda'"):
        registry.lookup("rope", "cuda")
