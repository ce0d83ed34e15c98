"""On the H200: each family at a real width (Qwen3-8B, Qwen2.5-7B, Llama-3.1-8B; 3 layers, bf16;
Qwen3-30B-A3B, 2 layers, read from a checkpoint transformers wrote).

- agreement: the same synthetic weights in transformers' own model; our `triton_bf16` selected
  logprobs must stay within the harness's baseline-relative rule of transformers' fp32 (TF32 off),
  calibrated by transformers' own bf16 error;
- the invariance harness (layout matrix, train/infer parity, provenance) is bitwise for each.
"""

import dataclasses

import pytest
import torch
from hf_models import as_bf16, randomise

from rl_engine.checks.forward_invariance.harness import model_accuracy_tolerance, run_harness
from rl_engine.kernels.ops.pytorch.base import tf32_off
from rl_engine.models.decoder import DecoderModel
from rl_engine.models.families import CONFIGS
from rl_engine.models.profiles import ProfileOps, get_profile
from rl_engine.models.weights import load_hf_checkpoint, load_hf_config, synthetic_weights
from rl_engine.workload.manifest import load_workload

WIDTHS = ["qwen3-8b", "qwen2.5-7b", "llama-3.1-8b"]
LAYERS = 3
POSITION_STRIDE = 509  # query-key distances up to ~3e4: Llama 3's scaled low frequencies turn


def hf_model(config, weights, device):
    """transformers' model for `config` (fp32) holding `weights`."""
    import transformers

    stem = {"qwen3": "Qwen3", "qwen2": "Qwen2", "llama": "Llama"}[config.family]
    kwargs = dict(
        vocab_size=config.vocab_size, hidden_size=config.hidden_size, intermediate_size=config.intermediate_size,
        num_hidden_layers=config.num_layers, num_attention_heads=config.num_heads,
        num_key_value_heads=config.num_kv_heads, head_dim=config.head_dim, rms_norm_eps=config.rms_norm_eps,
        rope_theta=config.rope_theta, tie_word_embeddings=config.tie_word_embeddings, max_position_embeddings=131072,
    )
    s = config.rope_scaling
    if s is not None:
        kwargs["rope_scaling"] = {"rope_type": "llama3", "factor": s.factor, "low_freq_factor": s.low_freq_factor,
                                  "high_freq_factor": s.high_freq_factor,
                                  "original_max_position_embeddings": s.original_max_position_embeddings}
    with torch.device(device):
        hf = getattr(transformers, f"{stem}ForCausalLM")(getattr(transformers, f"{stem}Config")(**kwargs))
    missing, unexpected = hf.load_state_dict({n: t.float() for n, t in weights.items()}, strict=False)
    assert not unexpected and set(missing) <= ({"lm_head.weight"} if config.tie_word_embeddings else set())
    return hf.float().eval()


def selected(hf, ids, targets, positions):
    with torch.no_grad(), tf32_off():
        logits = hf(input_ids=ids, position_ids=positions).logits.float()
    return torch.log_softmax(logits, -1).gather(-1, targets[..., None])[..., 0]


def agreement(hf, config, weights, device) -> tuple[float, float]:
    """(max |triton_bf16 - transformers fp32|, max |transformers bf16 - transformers fp32|) of the selected
    logprobs of 2 x 64 tokens at positions up to ~32k; `hf` is left in bf16."""
    gen = torch.Generator(device=device).manual_seed(0)
    ids = torch.randint(1, config.vocab_size, (2, 64), device=device, generator=gen)
    targets = torch.randint(0, config.vocab_size, (2, 64), device=device, generator=gen)
    positions = (torch.arange(64, device=device) * POSITION_STRIDE).expand(2, 64)
    reference = selected(hf, ids, targets, positions)
    hf_error = float((selected(as_bf16(hf), ids, targets, positions) - reference).abs().max())
    model = DecoderModel(config, weights, ProfileOps(get_profile("triton_bf16")))
    with torch.no_grad():
        ours = model.selected_logprobs(model.forward(ids, positions), targets)
    return float((ours - reference).abs().max()), hf_error


@pytest.mark.gpu
@pytest.mark.parametrize("name", WIDTHS)
def test_triton_bf16_within_transformers_bf16_error_at_real_width(name):
    config = CONFIGS[name].with_layers(LAYERS)
    weights = synthetic_weights(config, 1234, device="cuda")
    error, hf_error = agreement(hf_model(config, weights, "cuda"), config, weights, "cuda")
    print(f"{name}[:{LAYERS}] max|triton_bf16 - hf_fp32| {error:.3g}, max|hf_bf16 - hf_fp32| {hf_error:.3g}")
    assert error <= model_accuracy_tolerance(torch.bfloat16).max_abs_bound(hf_error), (error, hf_error)


@pytest.mark.gpu
@pytest.mark.parametrize("name", WIDTHS)
def test_triton_bf16_layout_matrix_is_bitwise_at_real_width(name):
    config = CONFIGS[name]
    workload = load_workload(config)
    short = config.with_layers(LAYERS)
    weights = synthetic_weights(short, workload.weight_seed, device="cuda")
    report = run_harness(short, weights, workload, "triton_bf16", "cuda", gradients=False)
    assert not report["errors"], report["errors"]
    for check in ("forward_invariance", "parity", "provenance", "accuracy"):
        assert report[check]["passed"], (check, report[check])


def moe_checkpoint(config, path, device):
    """transformers' Qwen3MoeForCausalLM at `config`'s sizes (fp32, eval), projections N(0, 1/fan_in) and
    norms perturbed, every value bf16-exact; saved to `path` in bf16, so the fp32 model and the
    checkpoint hold the same numbers."""
    import transformers

    moe = config.moe
    hf_config = transformers.Qwen3MoeConfig(
        vocab_size=config.vocab_size, hidden_size=config.hidden_size, intermediate_size=config.intermediate_size,
        num_hidden_layers=config.num_layers, num_attention_heads=config.num_heads,
        num_key_value_heads=config.num_kv_heads, head_dim=config.head_dim, rms_norm_eps=config.rms_norm_eps,
        rope_theta=config.rope_theta, tie_word_embeddings=config.tie_word_embeddings,
        num_experts=moe.num_experts, num_experts_per_tok=moe.top_k, moe_intermediate_size=moe.expert_intermediate_size,
        norm_topk_prob=moe.norm_topk_prob, decoder_sparse_step=moe.sparse_step, mlp_only_layers=list(moe.dense_layers),
        max_position_embeddings=131072,
    )
    torch.manual_seed(0)
    with torch.device(device):
        hf = randomise(transformers.Qwen3MoeForCausalLM(hf_config))
    with torch.no_grad():
        for p in hf.parameters():
            p.copy_(p.to(torch.bfloat16).float())
    # A bf16 copy of the weights, not hf.to(bfloat16): that would round the rotary inv_freq buffer too.
    hf.save_pretrained(path, state_dict={n: t.to(torch.bfloat16) for n, t in hf.state_dict().items()},
                       safe_serialization=True)
    return hf.eval()


@pytest.mark.gpu
def test_qwen3_moe_within_transformers_bf16_error_at_30b_a3b_width(tmp_path):
    """Qwen3-30B-A3B width, 2 layers: transformers writes the checkpoint, our loader reads it (the config's
    sizes included), and our selected logprobs stay within transformers' own bf16 error of its fp32."""
    expected = CONFIGS["qwen3-30b-a3b"].with_layers(2)
    hf = moe_checkpoint(expected, tmp_path, "cuda")
    config = load_hf_config(tmp_path)
    assert dataclasses.replace(config, name=expected.name) == expected
    weights = load_hf_checkpoint(tmp_path, config, device="cuda", dtype=torch.bfloat16)
    error, hf_error = agreement(hf, config, weights, "cuda")
    print(f"qwen3-30b-a3b[:2] max|triton_bf16 - hf_fp32| {error:.3g}, max|hf_bf16 - hf_fp32| {hf_error:.3g}")
    assert error <= model_accuracy_tolerance(torch.bfloat16).max_abs_bound(hf_error), (error, hf_error)
