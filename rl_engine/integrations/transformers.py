"""Patch a loaded transformers model so it computes with rl_engine's ops: `patch`, `unpatch`, `selected_logprobs`.

`patch(model, profile)` swaps, in place, each layer's RMSNorms, MLP and attention, the final norm, the
rotary embedding and lm_head (the logits `generate` picks from) for the layers of rl_engine.nn, which share
the original Parameter objects (no copies: optimizers, FSDP and checkpoints keep seeing the same tensors and
state_dict keys). A patch never changes what a layer means: the patched model computes what rl_engine's
`DecoderModel` computes under the same profile and weights, bit for bit. It refuses, in one line, any model
whose config rl_engine would not compute as stated (the family's config.json check, fail closed).
`unpatch` puts the original modules back.

Attention layouts seen by the patched attention (transformers hands it the 2D padding mask, as it does
for flash attention): no mask (right padding needs none), a left-padded mask (`seq_starts`), a packed
row [1,T] whose position_ids restart at 0 (`cu_seqlens`), and a transformers DynamicCache (prefill, then
decode through `kv_cache_attention`). Padding in the middle of a row, padding while decoding, or another
cache (static, sliding, quantized) is refused.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass

import torch
from torch import nn

from rl_engine.errors import UsageError
from rl_engine.integrations.nn import Attention, GatedMLP, LmHead, RMSNorm, SelectedLogprobHead, profile_ops
from rl_engine.models.config import ModelConfig
from rl_engine.models.decoder import rope_inv_freq
from rl_engine.models.families import get_family
from rl_engine.models.profiles import ProfileOps, get_profile
from rl_engine.models.weights import CheckpointError, config_from_hf

SUPPORTED = ("Qwen3ForCausalLM", "Qwen2ForCausalLM", "LlamaForCausalLM")
ATTN_IMPLEMENTATION = "rl_engine"  # our name in transformers' mask registry: it hands attention the 2D mask


@dataclass
class _Patch:
    profile: str
    ops: ProfileOps
    config: ModelConfig
    swaps: list  # (parent module, attribute, original module)
    attn_implementation: str
    head: SelectedLogprobHead


def _register_mask_function() -> None:
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, flash_attention_mask

    ALL_MASK_ATTENTION_FUNCTIONS.register(ATTN_IMPLEMENTATION, flash_attention_mask)


def check(model: nn.Module, profile: str) -> ModelConfig:
    """The ModelConfig the patched model computes, or a UsageError (one line) saying why it cannot be patched."""
    name = type(model).__name__
    if name not in SUPPORTED:
        raise UsageError(f"patch: {name} is not supported (expected one of {', '.join(SUPPORTED)})")
    if getattr(model, "_rl_engine_patch", None) is not None:
        raise UsageError(f"patch: this {name} is already patched (unpatch it first)")
    try:
        prof = get_profile(profile)
        config = config_from_hf(model.config.to_dict(), name, source=f"{name}.config")
    except (CheckpointError, ValueError) as exc:
        raise UsageError(f"patch: {exc}") from None
    if len(model.model.layers) != config.num_layers:
        raise UsageError(f"patch: {name} has {len(model.model.layers)} layers, its config says {config.num_layers}")
    foreign = _foreign_modules(model, config)
    if foreign:
        shown = "; ".join(foreign[:3]) + (f"; and {len(foreign) - 3} more" if len(foreign) > 3 else "")
        raise UsageError(f"patch: would replace forwards it did not write: {shown} (an adapter such as LoRA, or a "
                         f"subclass: merge or remove it first)")
    # The profile computes in its dtype; converting here would copy every weight, so the caller does it once.
    wrong = {str(p.dtype) for p in model.parameters() if p.is_floating_point() and p.dtype != prof.dtype}
    if prof.dtype != torch.float32 and wrong:
        raise UsageError(f"patch: profile {profile} computes in {prof.dtype}, the model holds {sorted(wrong)} "
                         f"parameters (call model.to({prof.dtype}) first)")
    return config


def _replaced_modules(model: nn.Module, config: ModelConfig):
    """(path, module, the transformers class it must be) for every module patch replaces or takes weights from."""
    modeling = importlib.import_module(type(model).__module__)
    prefix = type(model).__name__.removesuffix("ForCausalLM")

    def cls(suffix):
        return getattr(modeling, prefix + suffix)

    family = get_family(config.family)
    for i, layer in enumerate(model.model.layers):
        p = f"model.layers.{i}"
        yield f"{p}.input_layernorm", layer.input_layernorm, cls("RMSNorm")
        yield f"{p}.post_attention_layernorm", layer.post_attention_layernorm, cls("RMSNorm")
        yield f"{p}.mlp", layer.mlp, cls("MLP")
        for proj in ("gate_proj", "up_proj", "down_proj"):
            yield f"{p}.mlp.{proj}", getattr(layer.mlp, proj, None), nn.Linear
        yield f"{p}.self_attn", layer.self_attn, cls("Attention")
        for proj in ("q_proj", "k_proj", "v_proj", "o_proj"):
            yield f"{p}.self_attn.{proj}", getattr(layer.self_attn, proj, None), nn.Linear
        if family.qk_norm:
            for n in ("q_norm", "k_norm"):
                yield f"{p}.self_attn.{n}", getattr(layer.self_attn, n, None), cls("RMSNorm")
    yield "model.norm", model.model.norm, cls("RMSNorm")
    yield "model.rotary_emb", model.model.rotary_emb, cls("RotaryEmbedding")
    yield "lm_head", model.lm_head, nn.Linear


def _foreign_modules(model: nn.Module, config: ModelConfig) -> list[str]:
    """The replaced modules whose forward is not the transformers class's own: another class (a subclass, a LoRA
    layer), a forward set on the instance, forward hooks, or submodules the class does not have."""
    found = []
    for path, module, expected in _replaced_modules(model, config):
        if type(module) is not expected:
            found.append(f"{path} is a {type(module).__module__}.{type(module).__qualname__}, "
                         f"not {expected.__module__}.{expected.__qualname__}")
        elif "forward" in vars(module):
            found.append(f"{path} has its own forward on the instance")
        elif module._forward_hooks or module._forward_pre_hooks:
            found.append(f"{path} has forward hooks")
        elif expected is nn.Linear and any(True for _ in module.children()):
            found.append(f"{path} (nn.Linear) has submodules {', '.join(n for n, _ in module.named_children())}")
    return found


def _share(ours: nn.Module, theirs: nn.Module, names) -> nn.Module:
    for n in names:
        setattr(ours, n, getattr(theirs, n))  # the same Parameter object (or None)
    return ours


def patch(model: nn.Module, profile: str = "triton_bf16") -> None:
    """Make `model` (Qwen3/Qwen2/LlamaForCausalLM) compute with rl_engine's ops under `profile`, in place."""
    config = check(model, profile)
    family = get_family(config.family)
    ops = profile_ops(profile)
    device = model.model.embed_tokens.weight.device
    inv_freq = rope_inv_freq(config)
    inv_freq = None if inv_freq is None else inv_freq.to(device)
    c = config
    swaps = []

    def swap(parent, attr, new):
        swaps.append((parent, attr, getattr(parent, attr)))
        setattr(parent, attr, new)

    def norm(theirs, node, size):
        with torch.device("meta"):  # built without storage: the parameters are the model's own
            ours = RMSNorm(size, c.rms_norm_eps, profile=ops, node=node)
        return _share(ours, theirs, ("weight",))

    for i, layer in enumerate(model.model.layers):
        p = f"model.layers.{i}"
        swap(layer, "input_layernorm", norm(layer.input_layernorm, f"{p}.input_layernorm", c.hidden_size))
        swap(layer, "post_attention_layernorm",
             norm(layer.post_attention_layernorm, f"{p}.post_attention_layernorm", c.hidden_size))
        with torch.device("meta"):
            mlp = GatedMLP(c.hidden_size, c.intermediate_size, profile=ops, node=f"{p}.mlp")
            attn = _HfAttention(c.hidden_size, c.num_heads, c.num_kv_heads, c.head_dim, qkv_bias=family.qkv_bias,
                                qk_norm=family.qk_norm, rms_norm_eps=c.rms_norm_eps, rope_theta=c.rope_theta,
                                profile=ops, node=f"{p}.self_attn")
        for proj in ("gate_proj", "up_proj", "down_proj"):
            _share(getattr(mlp, proj), getattr(layer.mlp, proj), ("weight",))
        theirs = layer.self_attn
        for proj in ("q_proj", "k_proj", "v_proj", "o_proj"):
            _share(getattr(attn, proj), getattr(theirs, proj), ("weight", "bias"))
        if family.qk_norm:
            _share(attn.q_norm, theirs.q_norm, ("weight",))
            _share(attn.k_norm, theirs.k_norm, ("weight",))
        attn.q_rope.inv_freq = attn.k_rope.inv_freq = inv_freq
        attn.layer_idx = theirs.layer_idx
        swap(layer, "mlp", mlp)
        swap(layer, "self_attn", attn)
    swap(model.model, "norm", norm(model.model.norm, "model.norm", c.hidden_size))
    swap(model.model, "rotary_emb", _Positions())
    with torch.device("meta"):
        head = SelectedLogprobHead(c.hidden_size, c.vocab_size, profile=ops, node="logp")
        logits = LmHead(c.hidden_size, c.vocab_size, profile=ops, node="lm_head")
    head.weight = logits.weight = model.lm_head.weight  # the embedding matrix itself when tied, as DecoderModel
    # generate() picks tokens from model(...).logits: through the lm_head op they are batch invariant too.
    swap(model, "lm_head", logits)
    _register_mask_function()
    model._rl_engine_patch = _Patch(profile, ops, config, swaps, model.config._attn_implementation, head)
    model.config._attn_implementation = ATTN_IMPLEMENTATION


def unpatch(model: nn.Module) -> None:
    """Put back the modules `patch` replaced (their parameters are the ones the patched model trained)."""
    state = getattr(model, "_rl_engine_patch", None)
    if state is None:
        raise UsageError(f"unpatch: this {type(model).__name__} is not patched")
    for parent, attr, original in reversed(state.swaps):
        setattr(parent, attr, original)
    model.config._attn_implementation = state.attn_implementation
    model._rl_engine_patch = None


class _Positions(nn.Module):
    """Stands for transformers' rotary embedding: it hands the positions on, and each attention applies the
    rope op to them (the cos/sin tables transformers would build are not used)."""

    def forward(self, x, position_ids):
        return position_ids


def _padding_layout(mask: torch.Tensor, node: str) -> dict:
    if mask.dim() != 2:
        raise UsageError(f"{node}: expected a 2D padding mask [B,S], got {mask.dim()} dims")
    m = mask.bool()
    if bool((m[:, 1:] >= m[:, :-1]).all()):  # left padding: 0..0 1..1
        return {"seq_starts": (~m).sum(-1).to(torch.int32)}
    if bool((m[:, 1:] <= m[:, :-1]).all()):  # right padding: causality hides it, no mask needed
        return {}
    raise UsageError(f"{node}: padding must be all on the left or all on the right of every row")


def _packed_positions(cu_seqlens: torch.Tensor, t: int) -> torch.Tensor:
    """[T] int64: each token's position within its sequence of a packed row (cu_seqlens[0] = 0).

    Searches all of cu (cu[0] <= every index, so it counts once), not cu[1:]: inductor's CUDA
    lowering of searchsorted cannot take a sliced view as its boundaries (NotImplementedError: SliceView)."""
    cu = cu_seqlens.long()
    idx = torch.arange(t, device=cu.device)
    return idx - cu[torch.searchsorted(cu, idx, right=True) - 1]


def _packed_layout(positions: torch.Tensor) -> dict:
    """cu_seqlens of a packed row [1,T] whose positions restart at 0 for each sequence (none if one sequence)."""
    pos = positions[0]
    starts = torch.nonzero(pos == 0).flatten()
    if starts.numel() <= 1 and pos[0] == 0:
        return {}
    t = pos.numel()
    cu = torch.cat([starts, torch.tensor([t], device=pos.device)]).to(torch.int32)
    if int(pos[0]) != 0 or not torch.equal(pos.long(), _packed_positions(cu, t)):
        raise UsageError("packed position_ids must count 0, 1, ... within each sequence")
    return {"cu_seqlens": cu}


def _given_cu_seqlens(kwargs: dict, node: str) -> torch.Tensor:
    """The packed layout a caller passes in transformers' flash-attention kwargs (TRL's padding-free path,
    `selected_logprobs`): no reading of positions, so a compiled model has no graph break here."""
    cu_q, cu_k = kwargs["cu_seq_lens_q"], kwargs.get("cu_seq_lens_k")
    if cu_k is not None and cu_k is not cu_q and (cu_k.shape != cu_q.shape or (
            not torch.compiler.is_compiling() and not torch.equal(cu_k, cu_q))):
        raise UsageError(f"{node}: cu_seq_lens_k must equal cu_seq_lens_q (self-attention over packed rows)")
    return cu_q


class _HfAttention(Attention):
    """rl_engine's Attention behind the call transformers' decoder layers make."""

    def forward(self, hidden_states, position_embeddings=None, attention_mask=None, cache=None, **kwargs):
        b, s = hidden_states.shape[0], hidden_states.shape[1]
        positions = position_embeddings.expand(b, s)
        q, k, v = self.project(hidden_states, positions)
        if cache is None:  # older transformers (5.17) name the layer's cache past_key_values, newer ones cache
            cache = kwargs.get("past_key_values")
        if cache is not None:
            past = cache.get_seq_length(self.layer_idx)
            k_all, v_all = cache.update(k.transpose(1, 2), v.transpose(1, 2), self.layer_idx)
            layer = type(cache.layers[self.layer_idx]).__name__
            if layer != "DynamicLayer":  # a static, sliding or quantized layer hands back other keys than ours
                raise UsageError(f"{self.node}: only transformers' DynamicCache with full-attention layers is "
                                 f"supported, got a {layer}")
            if past:  # chunked prefill and decode read the cache, as DecoderModel.forward_cached
                if attention_mask is not None:
                    raise UsageError(f"{self.node}: decoding with a padding mask is not supported (one row per "
                                     "sequence, no padding)")
                seqlens = torch.full((b,), past + s, dtype=torch.int32, device=q.device)
                a = self.attend(q, None, None, k_cache=k_all.transpose(1, 2).contiguous(),
                                v_cache=v_all.transpose(1, 2).contiguous(), cache_seqlens=seqlens)
                return self.output(a), None
        if attention_mask is not None:
            layout = _padding_layout(attention_mask, self.node)
        elif b == 1 and kwargs.get("cu_seq_lens_q") is not None:  # given, as trainers pass it to flash-attn
            layout = {"cu_seqlens": _given_cu_seqlens(kwargs, self.node)}
        elif b == 1:
            layout = _packed_layout(positions)
        else:
            layout = {}
        return self.output(self.attend(q, k, v, **layout)), None


def selected_logprobs(model: nn.Module, input_ids: torch.Tensor, target_ids: torch.Tensor | None = None,
                      attention_mask: torch.Tensor | None = None, position_ids: torch.Tensor | None = None,
                      cu_seqlens: torch.Tensor | None = None) -> torch.Tensor:
    """fp32 log-probabilities of the selected tokens through a patched model, without materialising logits
    (under the triton profile).

    target_ids [B,S]: logp of target_ids[b, s] given input_ids[b, :s+1]; None: next-token logprobs of
    input_ids[:, 1:], shape [B,S-1]. Positions: position_ids, else counted from attention_mask (left
    padding), else restarting at each cu_seqlens boundary of a packed [1,T] row, else 0..S-1.
    """
    state = getattr(model, "_rl_engine_patch", None)
    if state is None:
        raise UsageError("selected_logprobs: the model is not patched (call rl_engine.integrations.transformers.patch)")
    if attention_mask is not None and cu_seqlens is not None:
        raise UsageError("selected_logprobs: give attention_mask (padded) or cu_seqlens (packed), not both")
    b, s = input_ids.shape
    if position_ids is None:
        if attention_mask is not None:
            position_ids = (attention_mask.long().cumsum(-1) - 1).clamp(min=0)
        elif cu_seqlens is not None:
            if b != 1:
                raise UsageError(f"selected_logprobs: cu_seqlens needs one packed row [1,T], got batch {b}")
            position_ids = _packed_positions(cu_seqlens.to(input_ids.device), s)[None]
        else:
            position_ids = torch.arange(s, device=input_ids.device)[None].expand(b, s)
    packed = {}
    if cu_seqlens is not None:  # the layout itself, so that no layer has to infer it from positions
        cu = cu_seqlens.to(device=input_ids.device, dtype=torch.int32)
        packed = {"cu_seq_lens_q": cu, "cu_seq_lens_k": cu}
    hidden = model.model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                         use_cache=False, **packed).last_hidden_state
    if target_ids is None:
        hidden, target_ids = hidden[:, :-1], input_ids[:, 1:]
    return state.head(hidden, target_ids)
