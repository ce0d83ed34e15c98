"""The tensor-parallel decoder on the Triton kernels (gloo, 4 CPU processes, interpreter): TP = 1, 2, 4
each bitwise equal to the single-process `triton_bf16` DecoderModel, forward logprobs and input
gradients; a row's bits do not depend on the other rows; partials summed by all_reduce are caught.
"""

from __future__ import annotations

import dataclasses

import pytest
from tp_decoder_cases import CONFIG, decoder_run, op_run, run_ranks, single_run, tp_run, weight_grad_mismatches

from rl_engine.bits import bitwise_equal
from rl_engine.models.decoder import DecoderModel
from rl_engine.models.profiles import ProfileOps, get_profile
from rl_engine.models.weights import synthetic_weights
from rl_engine.parallel.launch import spawn_group
from rl_engine.parallel.tp_kernels import Ranks, vocab_bounds


@pytest.fixture(scope="module")
def ranks():
    """Rank results per TP size: TP = 2 from its first group only (the second repeats it)."""
    return spawn_group(run_ranks, 4, backend="gloo", device="cpu", args=((2, 4),))


@pytest.fixture(scope="module")
def tp1():
    """The TP class on one process (group None): what TP = 1 runs."""
    return {**op_run(None), **tp_run(CONFIG, synthetic_weights(CONFIG, 3), None)}


@pytest.fixture(scope="module")
def single():
    """The single-process model of the `triton_bf16` profile (not the TP class), and the ops without a group;
    its weight gradients under "weight_grads"."""
    out, grads = single_run(CONFIG, synthetic_weights(CONFIG, 3))
    return {**out, **op_run(None), "weight_grads": grads}


def _runs(ranks, tp1, tp: str) -> list:
    return [tp1] if tp == "1" else [r[tp] for r in ranks if tp in r]


def _mismatches(results: dict, reference: dict) -> list:
    return sorted(k for k, v in reference.items() if k != "weight_grads" and not bitwise_equal(results[k], v))


@pytest.mark.parametrize("tp", ["1", "2", "4"])
def test_tp_model_and_ops_equal_the_single_process_model_bitwise(ranks, tp1, single, tp):
    runs = _runs(ranks, tp1, tp)
    assert len(runs) == int(tp)
    for rank, results in enumerate(runs):
        assert _mismatches(results, single) == [], (tp, rank)
    assert single["decoder_3.grad_embeds"].abs().max() > 0  # the gradients are not vacuous


@pytest.mark.parametrize("tp", ["1", "2", "4"])
def test_every_weight_gradient_slice_equals_the_single_process_model(ranks, tp1, single, tp):
    runs = _runs(ranks, tp1, tp)
    assert [weight_grad_mismatches(r["weight_grads"], single["weight_grads"]) for r in runs] == [[]] * int(tp)


def test_a_row_has_the_same_bits_at_other_token_counts(ranks, tp1, single):
    for results in [single] + [run for tp in ("1", "2", "4") for run in _runs(ranks, tp1, tp)]:
        for key in ("logp", "grad_embeds"):
            assert bitwise_equal(results[f"decoder_1.{key}"], results[f"decoder_3.{key}"][:1]), key


def test_the_check_catches_partials_summed_by_all_reduce(ranks, single):
    # On the fp32 product: through the tiny bf16 model a 1-ulp fp32 change is mostly rounded away.
    reference = single["row_parallel_fp32.forward"]
    assert all(bitwise_equal(r["4"]["row_parallel_fp32.forward"], reference) for r in ranks)
    assert any(not bitwise_equal(r["planted_allreduce"], reference) for r in ranks)


@dataclasses.dataclass(frozen=True)
class _FourRanks(Ranks):
    size: int = 4
    rank: int = 1


def test_splits_that_are_not_whole_are_refused():
    with pytest.raises(ValueError, match="num_kv_heads = 2"):
        _FourRanks().even_split("num_kv_heads", 2)
    assert _FourRanks().even_split("intermediate_size", 128) == slice(32, 64)
    with pytest.raises(ValueError, match="fewer than TP"):
        vocab_bounds(100, 4, 64)


def test_vocabulary_runs_fall_on_chunk_borders():
    bounds = vocab_bounds(151936, 2, 4096)  # Qwen3's vocabulary, linear_logp's GPU chunk
    assert bounds == [0, 77824, 151936] and all(b % 4096 == 0 for b in bounds[:-1])
    assert vocab_bounds(151936, 4, 4096) == [0, 36864, 77824, 114688, 151936]


def test_ranks_read_their_slices_of_a_checkpoint_and_keep_the_bits(tmp_path, single):
    import json

    import transformers
    from safetensors.torch import save_file
    from tp_decoder_cases import checkpoint_run

    hf = transformers.Qwen3Config(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=1,
                                  num_attention_heads=4, num_key_value_heads=4, head_dim=16, rope_theta=1e6,
                                  tie_word_embeddings=False, max_window_layers=1).to_dict()
    (tmp_path / "config.json").write_text(json.dumps(hf))
    save_file(synthetic_weights(CONFIG, 3), str(tmp_path / "model.safetensors"))
    ranks = spawn_group(checkpoint_run, 2, backend="gloo", device="cpu", args=(str(tmp_path),))
    for results in ranks:
        assert bitwise_equal(results["decoder_3.logp"], single["decoder_3.logp"])
        assert bitwise_equal(results["decoder_3.grad_embeds"], single["decoder_3.grad_embeds"])
    assert ranks[0]["shape.model.layers.0.self_attn.o_proj.weight"].tolist() == [64, 32]  # K 64 / 2
    assert ranks[1]["shape.model.embed_tokens.weight"].tolist() == [64, 64]  # vocabulary rows 64 .. 128


def test_qwen2_and_llama_at_tp2_equal_their_single_process_models():
    from tp_decoder_cases import families_run

    from rl_engine.models.families import get_config

    ranks = spawn_group(families_run, 2, backend="gloo", device="cpu")
    for name in ("tiny-qwen2", "tiny-llama"):
        config = get_config(name).with_layers(1)
        model = DecoderModel(config, synthetic_weights(config, 3), ProfileOps(get_profile("triton_bf16")))
        single = decoder_run(model, 3)
        for results in ranks:
            for key in ("logp", "grad_embeds"):
                assert bitwise_equal(results[f"{name}.{key}"], single[key]), (name, key)
