"""A cell whose logprobs or gradients are not finite fails and says so: NaN == NaN bit for bit is no result."""

import math

import torch

from rl_engine.checks.forward_invariance.harness import _max, compare, compare_gradients


def test_identical_nans_are_not_a_bitwise_pass():
    canonical = {0: torch.tensor([-1.0, float("nan"), -2.0]), 1: torch.tensor([-0.5])}
    candidate = {k: v.clone() for k, v in canonical.items()}
    result = compare(candidate, canonical)
    assert not result["bitwise"] and result["mismatched_tokens"] == 0
    assert result["non_finite_tokens"] == {"candidate": 1, "canonical": 1}
    assert result["error"] == "non-finite values (NaN/inf): 1 tokens in this cell, 1 in the canonical cell"
    assert math.isnan(result["max_abs_diff"])


def test_an_inf_gradient_token_fails_the_gradient_cell_and_finite_cells_still_pass():
    canonical = {0: torch.ones(3, 4)}
    candidate = {0: torch.ones(3, 4)}
    assert compare_gradients(candidate, canonical) == {"bitwise": True, "mismatched_tokens": 0, "tokens": 3,
                                                       "max_abs_diff": 0.0}
    candidate[0][1, 2] = float("inf")
    result = compare_gradients(candidate, canonical)
    assert not result["bitwise"] and result["non_finite_tokens"] == {"candidate": 1, "canonical": 0}


def test_the_max_of_several_samples_keeps_a_nan_wherever_it_is():
    assert math.isnan(_max([float("nan"), 1.0])) and math.isnan(_max([1.0, float("nan")]))
    assert _max([1.0, 3.0]) == 3.0 and _max([]) == 0.0


def test_a_nan_weight_in_a_checkpoint_fails_the_forward_cells(tmp_path, capsys):
    import json

    from safetensors.torch import save_file

    from rl_engine import cli
    from rl_engine.models.weights import config_from_hf, synthetic_weights
    from rl_engine.workload.manifest import MANIFEST_PATH

    hf = {"model_type": "qwen3", "vocab_size": 257, "hidden_size": 64, "intermediate_size": 128,
          "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
          "rms_norm_eps": 1e-6, "rope_theta": 1e6, "tie_word_embeddings": False, "hidden_act": "silu"}
    weights = synthetic_weights(config_from_hf(hf, "t"), 0)
    weights["model.layers.0.self_attn.q_proj.weight"][0, 0] = float("nan")
    (tmp_path / "ckpt").mkdir()
    (tmp_path / "ckpt" / "config.json").write_text(json.dumps(hf))
    save_file(weights, str(tmp_path / "ckpt" / "model.safetensors"))
    raw = json.loads(MANIFEST_PATH.read_text())
    raw["matrix"], raw["parity"] = raw["matrix"][:2], ["b1"]  # two cells keep the run short
    (tmp_path / "manifest.json").write_text(json.dumps(raw))
    code = cli.main(["check-invariance", "--profile", "torch_bf16", "--weights-path", str(tmp_path / "ckpt"),
                     "--no-gradients", "--manifest", str(tmp_path / "manifest.json"), "--json"])
    report = json.loads(capsys.readouterr().out)
    assert code == 1 and not report["forward_invariance"]["passed"]
    for cell in report["forward_invariance"]["cells"].values():
        assert not cell["bitwise"] and cell["error"].startswith("non-finite values (NaN/inf)")
