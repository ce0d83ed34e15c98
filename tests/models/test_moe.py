"""The qwen3_moe family: agreement with transformers' Qwen3MoeForCausalLM (fp32 within 1e-5), its
config.json fields (fail closed), the router's tie-break, and the hand-written backward of the MoE
block against autograd in float64. The bitwise invariance checks are in test_moe_invariance.py."""

import dataclasses

import pytest
import torch
from hf_models import randomise

from rl_engine.models.config import ModelConfig, MoeConfig
from rl_engine.models.decoder import DecoderModel
from rl_engine.models.families import CONFIGS, FAMILIES
from rl_engine.models.moe import Dispatch, _Combine, _Permute, route, router_softmax
from rl_engine.models.profiles import ProfileOps, get_profile
from rl_engine.models.weights import (
    CheckpointError,
    config_from_hf,
    load_hf_checkpoint,
    load_hf_config,
    synthetic_weights,
    weight_shapes,
)

DIMS = {"vocab_size": 257, "hidden_size": 64, "intermediate_size": 128, "num_attention_heads": 4,
        "num_key_value_heads": 2, "head_dim": 16, "rope_theta": 1e6, "num_experts": 8, "num_experts_per_tok": 2,
        "moe_intermediate_size": 32}
HF_MOE = {
    "renormalised": {"norm_topk_prob": True},
    "not-renormalised": {"norm_topk_prob": False},
    "dense-layers": {"norm_topk_prob": True, "mlp_only_layers": [1], "decoder_sparse_step": 1},
    "sparse-step": {"norm_topk_prob": True, "decoder_sparse_step": 2, "tie_word_embeddings": True},
}


def _hf_checkpoint(tmp_path, key, layers=3):
    """A transformers Qwen3-MoE (fp32, eval), norms perturbed and projections N(0, 1/fan_in), saved."""
    import transformers

    hf_config = transformers.Qwen3MoeConfig(**DIMS, num_hidden_layers=layers, **HF_MOE[key])
    torch.manual_seed(0)
    hf = randomise(transformers.Qwen3MoeForCausalLM(hf_config).float().eval())
    hf.save_pretrained(tmp_path, safe_serialization=True)
    return hf


def _inputs(vocab, batch=2, seq=12):
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(1, vocab, (batch, seq), generator=gen)
    targets = torch.randint(0, vocab, (batch, seq), generator=gen)
    return ids, targets, (torch.arange(seq) * 997).expand(batch, seq)


def _hf_logp(hf, ids, targets, positions):
    with torch.no_grad():
        logits = hf(input_ids=ids, position_ids=positions).logits.float()
    return torch.log_softmax(logits, -1).gather(-1, targets[..., None])[..., 0]


def _our_logp(config, weights, ids, targets, positions, profile="reference_fp32"):
    model = DecoderModel(config, weights, ProfileOps(get_profile(profile)))
    with torch.no_grad():
        return model.selected_logprobs(model.forward(ids, positions), targets)


@pytest.mark.parametrize("key", list(HF_MOE))
def test_fp32_reference_agrees_with_transformers(tmp_path, key):
    hf = _hf_checkpoint(tmp_path, key)
    config = load_hf_config(tmp_path)
    assert config.family == "qwen3_moe" and config.moe.norm_topk_prob == HF_MOE[key]["norm_topk_prob"]
    sparse = [config.sparse_layer(i) for i in range(config.num_layers)]
    assert sparse == {"dense-layers": [True, False, True], "sparse-step": [False, True, False]}.get(key, [True] * 3)
    weights = load_hf_checkpoint(tmp_path, config)
    assert set(weights) == set(weight_shapes(config))
    ids, targets, positions = _inputs(config.vocab_size)
    ours = _our_logp(config, weights, ids, targets, positions)
    assert float((ours - _hf_logp(hf, ids, targets, positions)).abs().max()) <= 1e-5


def test_planted_bugs_break_the_agreement(tmp_path):
    """Without the renormalisation, with one expert fewer per token, or with the dense MLP on a sparse
    layer's place (mlp_only_layers ignored), the same comparison fails by far."""
    hf = _hf_checkpoint(tmp_path, "dense-layers")
    config = load_hf_config(tmp_path)
    weights = load_hf_checkpoint(tmp_path, config)
    ids, targets, positions = _inputs(config.vocab_size)
    expected = _hf_logp(hf, ids, targets, positions)
    moe = config.moe
    for plant in (dataclasses.replace(moe, norm_topk_prob=False), dataclasses.replace(moe, top_k=1),
                  dataclasses.replace(moe, dense_layers=())):
        planted = dataclasses.replace(config, moe=plant)
        ws = weights
        if plant.dense_layers != moe.dense_layers:  # layer 1 now sparse: give it experts it does not have
            ws = {**weights, **{n: t for n, t in synthetic_weights(planted, 0).items() if n not in weights}}
        got = _our_logp(planted, ws, ids, targets, positions)
        assert float((got - expected).abs().max()) > 1e-3, plant


def test_bf16_within_transformers_own_bf16_error(tmp_path):
    from rl_engine.checks.forward_invariance.harness import model_accuracy_tolerance

    hf = _hf_checkpoint(tmp_path, "renormalised", layers=2)
    config = load_hf_config(tmp_path)
    weights = load_hf_checkpoint(tmp_path, config, dtype=torch.bfloat16)
    ids, targets, positions = _inputs(config.vocab_size, seq=8)
    reference = _hf_logp(hf, ids, targets, positions)
    hf_error = float((_hf_logp(hf.to(torch.bfloat16), ids, targets, positions) - reference).abs().max())
    error = float((_our_logp(config, weights, ids, targets, positions, "torch_bf16") - reference).abs().max())
    assert 0 < hf_error and error <= model_accuracy_tolerance(torch.bfloat16).max_abs_bound(hf_error), (error, hf_error)


# -- config.json ----------------------------------------------------------------------------------

# As published on huggingface.co (config.json of Qwen/Qwen3-30B-A3B).
PUBLISHED_30B_A3B = {
    "architectures": ["Qwen3MoeForCausalLM"], "attention_bias": False, "attention_dropout": 0.0,
    "bos_token_id": 151643, "decoder_sparse_step": 1, "eos_token_id": 151645, "head_dim": 128, "hidden_act": "silu",
    "hidden_size": 2048, "initializer_range": 0.02, "intermediate_size": 6144, "max_position_embeddings": 40960,
    "max_window_layers": 48, "mlp_only_layers": [], "model_type": "qwen3_moe", "moe_intermediate_size": 768,
    "norm_topk_prob": True, "num_attention_heads": 32, "num_experts": 128, "num_experts_per_tok": 8,
    "num_hidden_layers": 48, "num_key_value_heads": 4, "output_router_logits": False, "rms_norm_eps": 1e-06,
    "rope_scaling": None, "rope_theta": 1000000.0, "router_aux_loss_coef": 0.001, "sliding_window": None,
    "tie_word_embeddings": False, "torch_dtype": "bfloat16", "transformers_version": "4.51.0", "use_cache": True,
    "use_sliding_window": False, "vocab_size": 151936,
}


def test_the_published_config_builds_qwen3_30b_a3b():
    config = CONFIGS["qwen3-30b-a3b"]
    assert config_from_hf(PUBLISHED_30B_A3B, "qwen3-30b-a3b") == config
    # transformers >= 5 writes num_experts as num_local_experts.
    renamed = {k: v for k, v in PUBLISHED_30B_A3B.items() if k != "num_experts"} | {"num_local_experts": 128}
    assert config_from_hf(renamed, "qwen3-30b-a3b") == config
    assert sum(torch.Size(s).numel() for s in weight_shapes(config).values()) == 30_532_122_624  # "30.5B"


REFUSED = [
    ({"num_local_experts": 64}, "num_local_experts=64 (expected 128"),  # disagrees with num_experts
    ({"num_experts_per_tok": 200}, "moe.top_k: expected at most num_experts"),
    ({"num_experts": 0}, "moe.num_experts: expected a positive integer"),  # transformers: every layer dense
    ({"mlp_only_layers": [True]}, "moe.dense_layers: expected sorted distinct layer indices"),
    ({"shared_expert_intermediate_size": 512}, "unknown fields shared_expert_intermediate_size"),  # Qwen2-MoE's
    ({"mlp_bias": True}, "unknown fields mlp_bias"),
    ({"use_sliding_window": True}, "use_sliding_window=true"),
]


@pytest.mark.parametrize(("edit", "message"), REFUSED, ids=[m for _, m in REFUSED])
def test_a_moe_config_rl_engine_does_not_compute_is_refused(edit, message):
    with pytest.raises(CheckpointError) as info:
        config_from_hf({**PUBLISHED_30B_A3B, **edit}, "x", source="/ckpt/config.json")
    assert str(info.value).startswith("/ckpt/config.json: ") and "\n" not in str(info.value)
    assert message in str(info.value)


@pytest.mark.parametrize(("edit", "message"), [
    ({"num_experts": 64, "num_local_experts": 64}, "num_experts=64 (expected 128"),
    ({"norm_topk_prob": False}, "norm_topk_prob=false"),
    ({"mlp_only_layers": [0, 5]}, "mlp_only_layers=[0, 5] (expected []"),
    ({"decoder_sparse_step": 2}, "decoder_sparse_step=2"),
    ({"moe_intermediate_size": 512}, "moe_intermediate_size=512"),
])
def test_a_checkpoint_is_checked_against_the_named_moe_config(edit, message):
    from rl_engine.models.weights import check_hf_config

    check_hf_config(PUBLISHED_30B_A3B, CONFIGS["qwen3-30b-a3b"])
    with pytest.raises(CheckpointError) as info:
        check_hf_config({**PUBLISHED_30B_A3B, **edit}, CONFIGS["qwen3-30b-a3b"])
    assert message in str(info.value)


def test_mlp_only_layers_is_read_as_a_set_as_transformers_does():
    hf = {**PUBLISHED_30B_A3B, "num_hidden_layers": 4, "mlp_only_layers": [3, 1, 3]}
    config = config_from_hf(hf, "x")
    assert config.moe.dense_layers == (1, 3) and [config.sparse_layer(i) for i in range(4)] == [1, 0, 1, 0]
    assert config_from_hf({**hf, "mlp_only_layers": None}, "x").moe.dense_layers == ()


def test_every_transformers_field_is_classified():
    import transformers

    family = FAMILIES["qwen3_moe"]
    fields = set(transformers.Qwen3MoeConfig().to_dict())
    assert fields <= set(family.hf_math_fields) | set(family.hf_inert_fields)


def test_a_family_and_a_config_must_agree_on_the_mlp():
    with pytest.raises(ValueError, match="it needs a moe config"):
        FAMILIES["qwen3_moe"].check(dataclasses.replace(CONFIGS["tiny-moe"], moe=None))
    with pytest.raises(ValueError, match="it has no moe config"):
        FAMILIES["qwen3"].check(dataclasses.replace(CONFIGS["tiny"], moe=CONFIGS["tiny-moe"].moe))
    with pytest.raises(ValueError, match="moe.dense_layers"):
        MoeConfig(8, 2, 32, True, dense_layers=(3, 1))
    # The dense families' fingerprints do not see the new field (their manifest pins stay valid).
    assert "moe" not in CONFIGS["tiny"].fingerprint() and isinstance(CONFIGS["tiny"], ModelConfig)


# -- the router -----------------------------------------------------------------------------------


def test_ties_go_to_the_lowest_expert_index():
    logits = torch.tensor([[0.0, 0.0, 0.0, 0.0], [1.0, 3.0, 3.0, 3.0], [2.0, 0.0, 2.0, 5.0]])
    for dtype in (torch.float32, torch.bfloat16):
        weights, experts = route(logits.to(dtype), 2, True)
        assert experts.tolist() == [[0, 1], [1, 2], [3, 0]]
        assert weights.dtype == dtype and weights[:2].float().eq(0.5).all()


def test_router_softmax_is_softmax():
    logits = torch.randn(37, 128, generator=torch.Generator().manual_seed(0)) * 4
    torch.testing.assert_close(router_softmax(logits), torch.softmax(logits, -1), rtol=2e-6, atol=1e-9)
    odd = logits[:, :6].to(torch.bfloat16)  # E not a power of two, bf16 logits: fp32 probabilities
    assert router_softmax(odd).dtype == torch.float32
    torch.testing.assert_close(router_softmax(odd), torch.softmax(odd.float(), -1), rtol=2e-6, atol=1e-9)


# -- the hand-written backward, against autograd in float64 ---------------------------------------


def _plan(tokens=6, experts=5, k=3, seed=0):
    gen = torch.Generator().manual_seed(seed)
    chosen = torch.stack([torch.randperm(experts, generator=gen)[:k] for _ in range(tokens)])
    return Dispatch(chosen, experts), gen


@pytest.mark.parametrize("norm", [True, False])
def test_router_backward_matches_autograd_in_float64(norm):
    # Spread logits: no near-tie flips the top-k under gradcheck's perturbation.
    logits = (torch.randperm(6 * 7, generator=torch.Generator().manual_seed(1)).view(6, 7) * 0.3).double()
    torch.autograd.gradcheck(lambda x: route(x, 3, norm)[0], (logits.requires_grad_(True),))


def test_permute_and_combine_backward_match_autograd_in_float64():
    plan, gen = _plan()
    x = torch.randn(6, 4, generator=gen, dtype=torch.float64, requires_grad=True)
    torch.autograd.gradcheck(lambda t: _Permute.apply(t, plan.token_of_row, plan.row_of_slot), (x,))
    rows = torch.randn(18, 4, generator=gen, dtype=torch.float64, requires_grad=True)
    w = torch.rand(6, 3, generator=gen, dtype=torch.float64, requires_grad=True)
    torch.autograd.gradcheck(lambda r, v: _Combine.apply(r, v, plan.row_of_slot), (rows, w))


def test_dispatch_groups_rows_by_expert_in_token_order():
    chosen = torch.tensor([[2, 0], [0, 1], [2, 1]])
    plan = Dispatch(chosen, 4)
    assert plan.counts.tolist() == [2, 2, 2, 0]
    assert plan.token_of_row.tolist() == [0, 1, 1, 2, 0, 2]
    assert plan.row_of_slot.tolist() == [[4, 0], [1, 2], [5, 3]]


def test_gradients_reach_inputs_router_and_experts():
    config = CONFIGS["tiny-moe"].with_layers(1)
    weights = {n: t.float().requires_grad_(True) for n, t in synthetic_weights(config, 3).items()}
    model = DecoderModel(config, weights, ProfileOps(get_profile("reference_fp32")))
    ids, targets, positions = _inputs(config.vocab_size, batch=1, seq=10)
    embeds = model.embed(ids).detach().requires_grad_(True)
    model.selected_logprobs(model.forward(ids, positions, embeds=embeds), targets).sum().backward()
    assert embeds.grad.abs().sum() > 0
    router = weights["model.layers.0.mlp.gate.weight"].grad
    assert router is not None and router.abs().sum() > 0
    # The stacked expert weights get their gradient (the grouped op's backward): zeros where no token went.
    down = weights["model.layers.0.mlp.experts.down_proj"].grad
    hit = [j for j in range(8) if down[j].abs().sum() > 0]
    assert len(hit) >= 2 and all(weights["model.layers.0.mlp.experts.gate_proj"].grad[j].abs().sum() > 0 for j in hit)
