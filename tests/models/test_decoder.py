import pytest
import torch

from rl_engine.models.decoder import DecoderModel, KvCache
from rl_engine.models.families import CONFIGS, get_config
from rl_engine.models.profiles import ProfileOps, get_profile
from rl_engine.models.weights import (
    check_hf_config,
    content_hash,
    load_hf_checkpoint,
    synthetic_weights,
    tensor_digest,
    weight_shapes,
)

TINY = CONFIGS["tiny"]


def _model(profile, weights=None):
    return DecoderModel(TINY, weights or synthetic_weights(TINY, 7), ProfileOps(get_profile(profile)))


def _hf_model(tmp_path):
    import transformers  # a dev dependency: its absence is a failure, not a skip

    hf_config = transformers.Qwen3Config(
        vocab_size=TINY.vocab_size,
        hidden_size=TINY.hidden_size,
        intermediate_size=TINY.intermediate_size,
        num_hidden_layers=TINY.num_layers,
        num_attention_heads=TINY.num_heads,
        num_key_value_heads=TINY.num_kv_heads,
        head_dim=TINY.head_dim,
        rms_norm_eps=TINY.rms_norm_eps,
        rope_theta=TINY.rope_theta,
        tie_word_embeddings=False,
        max_position_embeddings=64,
        attention_bias=False,
    )
    torch.manual_seed(0)
    hf = transformers.Qwen3ForCausalLM(hf_config).float().eval()
    with torch.no_grad():  # HF inits norms to 1: perturb them so the norm weights are exercised
        for name, p in hf.named_parameters():
            if name.endswith("norm.weight"):
                p.add_(0.1 * torch.randn_like(p))
    hf.save_pretrained(tmp_path, safe_serialization=True)
    return hf


def test_reference_logits_match_transformers_qwen3(tmp_path):
    hf = _hf_model(tmp_path)
    weights = load_hf_checkpoint(tmp_path, TINY)
    model = _model("reference_fp32", weights)
    ids = torch.randint(1, TINY.vocab_size, (2, 12), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        expected = hf(input_ids=ids).logits
        got = model.logits(model.forward(ids, torch.arange(12).expand(2, 12)))
    assert got.dtype == torch.float32
    torch.testing.assert_close(got, expected, atol=2e-5, rtol=1e-5)


def test_hf_config_mismatch_names_fields():
    hf = {
        "vocab_size": 300,
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 16,
        "rms_norm_eps": 1e-6,
        "rope_theta": 1e6,
        "tie_word_embeddings": True,
    }
    with pytest.raises(ValueError, match="vocab_size=300.*tie_word_embeddings"):
        check_hf_config(hf, TINY)


def test_synthetic_weights_are_seeded_and_hashed():
    a, b = synthetic_weights(TINY, 3), synthetic_weights(TINY, 3)
    assert content_hash(a) == content_hash(b)
    assert content_hash(a) != content_hash(synthetic_weights(TINY, 4))
    assert {n: tuple(t.shape) for n, t in a.items()} == weight_shapes(TINY)
    assert all(t.dtype == torch.bfloat16 for t in a.values())
    # Truncating layers keeps the tensors of the layers that remain.
    short = synthetic_weights(TINY.with_layers(1), 3)
    assert torch.equal(short["model.layers.0.mlp.up_proj.weight"], a["model.layers.0.mlp.up_proj.weight"])


def test_tensor_digest_sees_one_bit():
    t = torch.randn(1000).bfloat16()
    u = t.clone()
    u.view(torch.int16)[517] ^= 1
    assert tensor_digest(t) != tensor_digest(u)
    # Same bits at another position also change the digest (position-weighted).
    assert tensor_digest(t) != tensor_digest(t.flip(0))


def test_prefill_then_decode_matches_full_forward_reference():
    model = _model("reference_fp32")
    ids = torch.randint(1, TINY.vocab_size, (1, 10), generator=torch.Generator().manual_seed(2))
    pos = torch.arange(10)[None]
    with torch.no_grad():
        full = model.forward(ids, pos)
        cache = KvCache.empty(TINY, 1, 10, torch.float32, "cpu")
        head = model.forward(ids[:, :6], pos[:, :6], cache=cache)
        steps = [
            model.forward_cached(ids[:, t : t + 1], pos[:, t : t + 1], cache, torch.tensor([t + 1]))
            for t in range(6, 10)
        ]
    torch.testing.assert_close(torch.cat([head, *steps], dim=1), full, atol=1e-5, rtol=1e-5)


def test_packed_and_left_padded_match_separate_rows_torch_bf16():
    model = _model("torch_bf16")
    a = torch.randint(1, TINY.vocab_size, (1, 5), generator=torch.Generator().manual_seed(3))
    b = torch.randint(1, TINY.vocab_size, (1, 7), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        ha = model.forward(a, torch.arange(5)[None]).float()
        hb = model.forward(b, torch.arange(7)[None]).float()
        packed = model.forward(
            torch.cat([a, b], 1),
            torch.cat([torch.arange(5), torch.arange(7)])[None],
            cu_seqlens=torch.tensor([0, 5, 12], dtype=torch.int32),
        ).float()
        left = model.forward(
            torch.cat([torch.zeros(1, 2, dtype=torch.long), a], 1),
            torch.cat([torch.zeros(2, dtype=torch.long), torch.arange(5)])[None],
            seq_starts=torch.tensor([2]),
        ).float()
    torch.testing.assert_close(packed[:, :5], ha, atol=3e-2, rtol=3e-2)
    torch.testing.assert_close(packed[:, 5:], hb, atol=3e-2, rtol=3e-2)
    torch.testing.assert_close(left[:, 2:], ha, atol=3e-2, rtol=3e-2)


def test_profiles_output_dtypes_and_nodes():
    for profile, dtype in (("reference_fp32", torch.float32), ("torch_bf16", torch.bfloat16)):
        model = _model(profile)
        ids = torch.randint(1, TINY.vocab_size, (2, 4))
        with torch.no_grad():
            hidden = model.forward(ids, torch.arange(4).expand(2, 4))
            logp = model.selected_logprobs(hidden, ids)
        assert hidden.dtype == dtype and logp.dtype == torch.float32
        assert {r.node for r in model.ops.recorder.records} == set(model.required_nodes())


def test_qwen3_8b_config_is_the_published_one():
    c = get_config("qwen3-8b")
    assert (
        c.num_layers,
        c.hidden_size,
        c.intermediate_size,
        c.num_heads,
        c.num_kv_heads,
        c.head_dim,
        c.vocab_size,
        c.rms_norm_eps,
        c.rope_theta,
    ) == (36, 4096, 12288, 32, 8, 128, 151936, 1e-6, 1e6)
    assert sum(torch.Size(s).numel() for s in weight_shapes(c).values()) == 8_190_735_360
    with pytest.raises(ValueError, match="num_layers"):
        c.with_layers(37)
