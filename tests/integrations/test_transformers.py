"""Patched transformers models compute what rl_engine's DecoderModel computes, bit for bit, under the same
profile and weights; unpatch restores the original; configs rl_engine cannot compute are refused in one line."""

import pytest
import torch
import transformers  # a dev dependency: its absence is a failure, not a skip

from rl_engine.errors import UsageError
from rl_engine.integrations.transformers import patch, selected_logprobs, unpatch
from rl_engine.models.decoder import DecoderModel
from rl_engine.models.profiles import ProfileOps, get_profile
from rl_engine.models.weights import config_from_hf

DIMS = {"vocab_size": 257, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16}
LLAMA3 = {"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
          "original_max_position_embeddings": 16, "rope_theta": 500000.0}


def hf_model(family, profile, layers=2, dims=None, **extra):
    torch.manual_seed(0)
    dims = {**(dims or DIMS), "num_hidden_layers": layers}
    if family == "qwen3":
        cfg = transformers.Qwen3Config(**dims, **extra)
        model = transformers.Qwen3ForCausalLM(cfg)
    elif family == "qwen2":
        cfg = transformers.Qwen2Config(**{k: v for k, v in dims.items() if k != "head_dim"}, **extra)
        model = transformers.Qwen2ForCausalLM(cfg)
    else:
        cfg = transformers.LlamaConfig(**dims, rope_parameters=LLAMA3, tie_word_embeddings=True, **extra)
        model = transformers.LlamaForCausalLM(cfg)
    with torch.no_grad():  # norm weights away from 1 and biases away from 0, so a dropped one shows
        for name, p in model.named_parameters():
            if name.endswith("norm.weight") or name.endswith(".bias"):
                p.add_(0.1 * torch.randn_like(p))
    model = model.to(get_profile(profile).dtype).eval()
    return model


def decoder(model, profile):
    config = config_from_hf(model.config.to_dict(), "m")
    return DecoderModel(config, dict(model.state_dict()), ProfileOps(get_profile(profile)))


def tokens(b, s, seed=1):
    return torch.randint(0, DIMS["vocab_size"], (b, s), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("family", ["qwen3", "qwen2", "llama"])
@pytest.mark.parametrize("profile", ["torch_bf16", "reference_fp32"])
def test_patched_model_equals_decoder(family, profile):
    model = hf_model(family, profile)
    ids = tokens(2, 7)
    pos = torch.arange(7)[None].expand(2, 7)
    patch(model, profile)
    with torch.no_grad():
        hidden = model.model(input_ids=ids).last_hidden_state
        ours = decoder(model, profile)
        want = ours.forward(ids, pos)
        assert torch.equal(hidden, want)
        lp = selected_logprobs(model, ids)
        assert lp.dtype == torch.float32 and lp.shape == (2, 6)
        assert torch.equal(lp, ours.selected_logprobs(want[:, :-1], ids[:, 1:]))
        logits = model(input_ids=ids).logits.float()  # the patched lm_head (the lm_head op): bf16 logits
        gathered = torch.log_softmax(logits, -1)[:, :-1].gather(-1, ids[:, 1:, None])[..., 0]
        torch.testing.assert_close(lp, gathered, rtol=0, atol=1e-5)


def test_layouts_equal_decoder():
    profile = "torch_bf16"
    model = hf_model("qwen3", profile)
    patch(model, profile)
    ours = decoder(model, profile)
    ids = tokens(2, 6)
    with torch.no_grad():
        mask = torch.tensor([[0, 0, 1, 1, 1, 1], [1, 1, 1, 1, 1, 1]])
        pos = (mask.cumsum(-1) - 1).clamp(min=0)
        got = model.model(input_ids=ids, attention_mask=mask, position_ids=pos).last_hidden_state
        assert torch.equal(got, ours.forward(ids, pos, seq_starts=torch.tensor([2, 0], dtype=torch.int32)))
        packed = ids.reshape(1, 12)
        cu = torch.tensor([0, 5, 12], dtype=torch.int32)
        lp = selected_logprobs(model, packed, target_ids=packed, cu_seqlens=cu)
        pos = torch.cat([torch.arange(5), torch.arange(7)])[None]
        assert torch.equal(lp, ours.selected_logprobs(ours.forward(packed, pos, cu_seqlens=cu), packed))
        with pytest.raises(UsageError, match="left or all on the right"):
            model.model(input_ids=ids, attention_mask=torch.tensor([[1, 0, 1, 1, 1, 1]] * 2))


def test_unpatch_restores_original_bit_for_bit():
    model = hf_model("qwen2", "torch_bf16")
    ids = tokens(2, 5)
    gate, head = model.model.layers[0].mlp.gate_proj.weight, model.lm_head.weight
    with torch.no_grad():
        before = model(input_ids=ids).logits
        patch(model, "torch_bf16")
        assert model.model.layers[0].mlp.gate_proj.weight is gate  # shared, not copied
        assert "model.layers.0.mlp.gate_proj.weight" in model.state_dict()
        unpatch(model)
        assert type(model.model.layers[0].mlp).__name__ == "Qwen2MLP"
        assert type(model.lm_head) is torch.nn.Linear and model.lm_head.weight is head
        assert torch.equal(model(input_ids=ids).logits, before)
    with pytest.raises(UsageError, match="not patched"):
        unpatch(model)


@pytest.mark.parametrize("case", ["gelu", "dtype", "twice"])
def test_refusals_are_one_line(case):
    model = hf_model("qwen3", "torch_bf16", hidden_act="gelu" if case == "gelu" else "silu")
    if case == "dtype":
        model = model.float()
    if case == "twice":
        patch(model, "torch_bf16")
    with pytest.raises(UsageError) as exc:
        patch(model, "torch_bf16")
    assert "\n" not in str(exc.value)
    assert {"gelu": "hidden_act", "dtype": "model.to", "twice": "already patched"}[case] in str(exc.value)


class LoraLinear(torch.nn.Linear):
    """A LoRA layer as adapters write it: nn.Linear plus a low-rank update in its own forward."""

    def __init__(self, base):
        super().__init__(base.in_features, base.out_features, bias=base.bias is not None)
        self.weight, self.bias = base.weight, base.bias
        self.lora_a = torch.nn.Linear(base.in_features, 2, bias=False, dtype=base.weight.dtype)
        self.lora_b = torch.nn.Linear(2, base.out_features, bias=False, dtype=base.weight.dtype)

    def forward(self, x):
        return super().forward(x) + self.lora_b(self.lora_a(x))


class Adapter(torch.nn.Module):
    def __init__(self, base):
        super().__init__()
        self.base = base

    def forward(self, x):
        return self.base(x) * 2


def _plant(model, case):
    layer = model.model.layers[1]
    if case == "lora subclass":
        layer.self_attn.q_proj = LoraLinear(layer.self_attn.q_proj)
        return f"model.layers.1.self_attn.q_proj is a {__name__}.LoraLinear, not torch.nn.modules.linear.Linear"
    if case == "adapter module":
        layer.mlp.down_proj = Adapter(layer.mlp.down_proj)
        return f"model.layers.1.mlp.down_proj is a {__name__}.Adapter"
    if case == "subclassed mlp":
        layer.mlp.__class__ = type("MyMLP", (type(layer.mlp),), {"forward": lambda self, x: x, "__module__": __name__})
        return f"model.layers.1.mlp is a {__name__}.MyMLP, not transformers.models.qwen3.modeling_qwen3.Qwen3MLP"
    if case == "instance forward":
        model.model.norm.forward = lambda x: x
        return "model.norm has its own forward on the instance"
    if case == "forward hook":
        model.lm_head.register_forward_hook(lambda *a: None)
        return "lm_head has forward hooks"
    layer.self_attn.o_proj.extra = torch.nn.Identity()
    return "model.layers.1.self_attn.o_proj (nn.Linear) has submodules extra"


@pytest.mark.parametrize("case", ["lora subclass", "adapter module", "subclassed mlp", "instance forward",
                                  "forward hook", "extra submodule"])
def test_modules_whose_forward_patch_did_not_write_are_refused_by_name(case):
    model = hf_model("qwen3", "torch_bf16", layers=2)
    message = _plant(model, case)
    with pytest.raises(UsageError) as exc:
        patch(model, "torch_bf16")
    text = str(exc.value)
    assert "\n" not in text and text.startswith("patch: would replace forwards it did not write: ")
    assert message in text, text
    assert getattr(model, "_rl_engine_patch", None) is None  # nothing swapped


def test_triton_profile_equals_decoder():
    model = hf_model("qwen3", "triton_bf16", layers=1)
    ids = tokens(1, 4)
    patch(model, "triton_bf16")
    with torch.no_grad():
        ours = decoder(model, "triton_bf16")
        want = ours.selected_logprobs(ours.forward(ids, torch.arange(4)[None])[:, :-1], ids[:, 1:])
        assert torch.equal(selected_logprobs(model, ids), want)
