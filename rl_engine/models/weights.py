"""Model weights: synthetic from a seed, or a Hugging Face checkpoint directory (safetensors).

Synthetic tensors are drawn per name (seed mixed with the tensor's name), so the first N layers of
a truncated model (`--layers N`) are the same tensors as in the full one. Linear weights are
N(0, 1/fan_in) (activations stay O(1) through depth), embeddings N(0, 1), norm weights 1 + N(0, 0.05²),
biases N(0, 0.1²).

The content hash runs where the tensors live: each tensor's raw bits, as integers, enter a
position-weighted sum modulo the prime 2^31 - 1 under two multipliers (exact int64 arithmetic, so
CPU and GPU give the same number for the same bits); the per-tensor sums, names, shapes and dtypes
then go through sha256 on the host. 16 GB of bf16 weights never cross to the CPU.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import replace
from pathlib import Path

import torch

from rl_engine.models.config import ModelConfig, MoeConfig, RopeScaling
from rl_engine.models.families import family_for_model_type, get_family
from rl_engine.models.hf_fields import LLAMA3_KEYS, REQUIRED

HASH_ALGORITHM = "bits-weighted-sum-mod-2^31-1-x2/sha256-v1"
_PRIME = 2**31 - 1
_MULTIPLIERS = (2654435761, 2246822519)
_CHUNK = 1 << 24


def _tensors(config: ModelConfig) -> list[tuple[str, tuple[int, ...], tuple[str, int] | None]]:
    """(HF tensor name, shape, (model name of its expert stack, expert index) or None) for every tensor
    of the family's recipe, in HF order."""
    c, family = config, get_family(config.family)
    q, kv = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
    layer = {
        "input_norm": (c.hidden_size,),
        "q_proj": (q, c.hidden_size),
        "k_proj": (kv, c.hidden_size),
        "v_proj": (kv, c.hidden_size),
        "q_bias": (q,),
        "k_bias": (kv,),
        "v_bias": (kv,),
        "q_norm": (c.head_dim,),
        "k_norm": (c.head_dim,),
        "o_proj": (c.hidden_size, q),
        "post_norm": (c.hidden_size,),
        "gate_proj": (c.intermediate_size, c.hidden_size),
        "up_proj": (c.intermediate_size, c.hidden_size),
        "down_proj": (c.hidden_size, c.intermediate_size),
    }
    experts = c.moe.num_experts if c.moe is not None else 0
    if c.moe is not None:
        e, moe_i = experts, c.moe.expert_intermediate_size
        layer.update({"router": (e, c.hidden_size), "expert_gate_proj": (moe_i, c.hidden_size),
                      "expert_up_proj": (moe_i, c.hidden_size), "expert_down_proj": (c.hidden_size, moe_i)})
    names = family.hf_names
    tensors = [(names["embed"], (c.vocab_size, c.hidden_size), None)]
    for i in range(c.num_layers):
        for role in family.roles(config, i):
            if "{j}" in names[role]:  # one HF tensor per expert, in expert order
                stack = family.weight_name(role, i)
                tensors += [(names[role].format(i=i, j=j), layer[role], (stack, j)) for j in range(experts)]
            else:
                tensors.append((names[role].format(i=i), layer[role], None))
    tensors.append((names["final_norm"], (c.hidden_size,), None))
    if not c.tie_word_embeddings:
        tensors.append((names["lm_head"], (c.vocab_size, c.hidden_size), None))
    return tensors


def checkpoint_shapes(config: ModelConfig) -> dict[str, tuple[int, ...]]:
    """HF tensor name -> shape, as a checkpoint stores them (one tensor per expert)."""
    return {name: shape for name, shape, _ in _tensors(config)}


def weight_shapes(config: ModelConfig) -> dict[str, tuple[int, ...]]:
    """The model's tensor name -> shape: the HF tensors, with each expert role's per-expert tensors held
    as one [E, ...] stack (Family.weight_name)."""
    shapes = {}
    for name, shape, stack in _tensors(config):
        if stack is None:
            shapes[name] = shape
        else:
            shapes[stack[0]] = (stack[1] + 1, *shape)
    return shapes


def _name_seed(seed: int, name: str) -> int:
    return int.from_bytes(hashlib.sha256(f"{seed}:{name}".encode()).digest()[:7], "little")


def synthetic_weights(config: ModelConfig, seed: int, *, device="cpu", dtype=torch.bfloat16) -> dict:
    """Weights drawn on `device` with its own generator (CPU and CUDA draws differ; the hash says which).
    Each HF tensor is drawn from its own name, an expert's into its slot of the stack."""
    device = torch.device(device)
    embed = get_family(config.family).hf_names["embed"]
    shapes = weight_shapes(config)
    weights = {}
    for name, shape, stack in _tensors(config):
        gen = torch.Generator(device=device).manual_seed(_name_seed(seed, name))
        t = torch.randn(shape, generator=gen, device=device, dtype=torch.float32)
        if name.endswith("norm.weight"):
            t = 1.0 + 0.05 * t
        elif name.endswith(".bias"):
            t = 0.1 * t
        elif name != embed:
            t = t * shape[1] ** -0.5
        if stack is None:
            weights[name] = t.to(dtype)
        else:
            if stack[0] not in weights:
                weights[stack[0]] = torch.empty(shapes[stack[0]], device=device, dtype=dtype)
            weights[stack[0]][stack[1]] = t
    return weights


# Projections of one input whose weights `pack_projections` stacks by rows, so that a layer runs each group as one
# product (DecoderModel._projections): at small M one wide product streams the weights faster than three narrow ones.
# q's and k's norm weights likewise, so that their heads, adjacent in the q/k/v product, are normed in one launch.
PACKED_ROLES = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"), ("q_norm", "k_norm"))


def pack_projections(weights: dict, config: ModelConfig) -> dict:
    """A new dict in which each layer's q/k/v, gate/up and q/k norm weights are row views of one buffer (copied
    there); every other tensor is the same object. For a model that generates (the rollout engine's): a trainer's
    parameters stay separate tensors. `update_weights` writes into the views in place."""
    family = get_family(config.family)
    packed = dict(weights)
    for i in range(config.num_layers):
        for roles in PACKED_ROLES:
            names = [family.weight_name(role, i) for role in roles]
            if not all(n in weights for n in names):  # a sparse layer has no dense gate/up
                continue
            parts = [weights[n] for n in names]
            buffer = torch.cat(parts)
            rows = [t.shape[0] for t in parts]
            packed.update(zip(names, buffer.split(rows)))
    return packed


def _bits(t: torch.Tensor) -> torch.Tensor:
    flat = t.detach().contiguous().view(-1)
    as_int = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[flat.element_size()]
    bits = flat.view(as_int).to(torch.int64)
    return bits & ((1 << (8 * flat.element_size())) - 1) if flat.element_size() < 8 else bits


def tensor_digest(t: torch.Tensor) -> list[int]:
    bits = _bits(t)
    sums = [0, 0]
    for start in range(0, bits.numel(), _CHUNK):
        x = (bits[start : start + _CHUNK] % _PRIME) + 1
        idx = torch.arange(start, start + x.numel(), device=x.device, dtype=torch.int64)
        for j, mult in enumerate(_MULTIPLIERS):
            w = (idx * (mult % _PRIME) + 1) % _PRIME
            sums[j] = (sums[j] + int((x * w % _PRIME).sum())) % _PRIME
    return sums


def content_hash(weights: dict) -> str:
    h = hashlib.sha256(HASH_ALGORITHM.encode())
    for name in sorted(weights):
        t = weights[name]
        h.update(json.dumps([name, list(t.shape), str(t.dtype), tensor_digest(t)]).encode())
    return h.hexdigest()


# -- Hugging Face checkpoints ---------------------------------------------------------------------
#
# Each family declares which config.json fields set the math (and the values rl_engine computes) and
# which cannot change it (rl_engine/models/hf_fields.py); every other field is refused, fail closed.


class CheckpointError(ValueError):
    """A checkpoint rl_engine cannot load faithfully; the message is one line naming the file."""


def _normalised(hf: dict) -> dict:
    """One spelling of RoPE: transformers >= 5 keeps rope_theta inside rope_parameters, and < 5 calls
    rope_parameters rope_scaling; whichever of the two is given is checked under both names."""
    hf = dict(hf)
    if hf.get("rope_parameters") is None and hf.get("rope_scaling") is not None:
        hf["rope_parameters"] = hf["rope_scaling"]
    elif hf.get("rope_scaling") is None and hf.get("rope_parameters") is not None:
        hf["rope_scaling"] = hf["rope_parameters"]
    rope = hf.get("rope_parameters")
    if "rope_theta" not in hf and isinstance(rope, dict) and "rope_theta" in rope:
        hf["rope_theta"] = rope["rope_theta"]
    # transformers >= 5 writes num_experts (Qwen3-MoE's name) as num_local_experts.
    if "num_experts" not in hf and "num_local_experts" in hf:
        hf["num_experts"] = hf["num_local_experts"]
    elif "num_local_experts" not in hf and "num_experts" in hf:
        hf["num_local_experts"] = hf["num_experts"]
    return hf


def check_hf_config(hf, config: ModelConfig, source: str = "config.json") -> None:
    """Raise CheckpointError, one line naming `source` and every field rl_engine would not compute as stated."""
    if not isinstance(hf, dict):
        raise CheckpointError(f"{source}: expected a JSON object, got a {type(hf).__name__}")
    family = get_family(config.family)
    given, hf = hf, _normalised(hf)
    wrong = []
    for field, (default, check, why) in family.hf_math_fields.items():
        if field not in hf and default is REQUIRED:
            wrong.append(f"{field} missing ({why})")
            continue
        value = hf.get(field, default)
        expected = check(value, config)
        if expected is not None:
            shown = json.dumps(value, default=str) + ("" if field in given else " (absent)")
            wrong.append(f"{field}={shown} (expected {expected}: {why})")
    unknown = sorted(set(hf) - set(family.hf_math_fields) - set(family.hf_inert_fields))
    if unknown:
        wrong.append(f"unknown fields {', '.join(unknown)} (refused: they may change the math)")
    if wrong:
        raise CheckpointError(f"{source}: not loadable as {config.name}: " + "; ".join(wrong))


def _number(value):
    """JSON ints and floats as float (1000000 and 1e6 are one theta); anything else as is, for the checks."""
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else value


def config_from_hf(hf, name: str, source: str = "config.json") -> ModelConfig:
    """The ModelConfig a config.json describes, when rl_engine computes exactly that model; else CheckpointError."""
    if not isinstance(hf, dict):
        raise CheckpointError(f"{source}: expected a JSON object, got a {type(hf).__name__}")
    family = family_for_model_type(hf.get("model_type"))
    if family is None:
        from rl_engine.models.families import FAMILIES

        supported = sorted(t for f in FAMILIES.values() for t in f.model_types)
        shown = json.dumps(hf.get("model_type"), default=str)
        raise CheckpointError(f"{source}: model_type={shown} is not a supported family (expected one of {supported})")
    fields = family.hf_math_fields
    missing = [f"{f} missing ({why})" for f, (default, _, why) in fields.items() if default is REQUIRED and f not in hf]
    if missing:
        raise CheckpointError(f"{source}: not loadable as {family.name}: " + "; ".join(missing))
    norm = _normalised(hf)

    def get(field):
        return norm.get(field, fields[field][0])

    try:
        rope = norm.get("rope_parameters")
        scaling = None
        if isinstance(rope, dict) and rope.get("rope_type", rope.get("type")) == "llama3":
            scaling = RopeScaling(*(_number(rope.get(k)) for k in LLAMA3_KEYS[:3]), rope.get(LLAMA3_KEYS[3]))
        hidden, heads, head_dim = get("hidden_size"), get("num_attention_heads"), get("head_dim")
        config = ModelConfig(
            name=name,
            family=family.name,
            vocab_size=get("vocab_size"),
            hidden_size=hidden,
            intermediate_size=get("intermediate_size"),
            num_layers=get("num_hidden_layers"),
            num_heads=heads,
            num_kv_heads=get("num_key_value_heads"),
            head_dim=head_dim if head_dim is not None else hidden // heads,  # transformers' rule
            rms_norm_eps=_number(get("rms_norm_eps")),
            rope_theta=_number(get("rope_theta")),
            tie_word_embeddings=get("tie_word_embeddings"),
            rope_scaling=scaling,
            moe=_moe_from_hf(get) if family.mlp == "moe" else None,
        )
        family.check(config)
    except (TypeError, ValueError, ZeroDivisionError) as exc:
        raise CheckpointError(f"{source}: not loadable as {family.name}: {_one_line(exc)}") from None
    check_hf_config(hf, config, source)
    return config


def _moe_from_hf(get) -> MoeConfig:
    dense = get("mlp_only_layers")
    return MoeConfig(
        num_experts=get("num_experts"),
        top_k=get("num_experts_per_tok"),
        expert_intermediate_size=get("moe_intermediate_size"),
        norm_topk_prob=get("norm_topk_prob"),
        sparse_step=get("decoder_sparse_step"),
        # transformers reads null as [] and only asks `i in mlp_only_layers`: order and repeats do not matter.
        dense_layers=() if dense is None else tuple(sorted(set(dense))) if isinstance(dense, list) else dense,
    )


def _one_line(exc: Exception) -> str:
    return " ".join(str(exc).split())


def read_hf_config(config_file: Path) -> dict:
    try:
        hf = json.loads(Path(config_file).read_text())
    except (OSError, ValueError) as exc:  # ValueError: invalid JSON or bytes that are not UTF-8
        raise CheckpointError(f"{config_file}: not a readable JSON file ({_one_line(exc)})") from None
    if not isinstance(hf, dict):
        raise CheckpointError(f"{config_file}: expected a JSON object, got a {type(hf).__name__}")
    return hf


def load_hf_config(path) -> ModelConfig:
    """The ModelConfig of a config.json file, or of a checkpoint directory's config.json.

    Its name is the directory's name for a config.json (Qwen3-1.7B/config.json -> "Qwen3-1.7B"), else the file's stem.
    """
    path = Path(path)
    config_file = path if path.is_file() or path.suffix == ".json" else path / "config.json"
    if not config_file.is_file():
        raise CheckpointError(f"{path}: no such file" if config_file == path else f"{path} has no config.json")
    stem = config_file.parent.resolve().name if config_file.name == "config.json" else config_file.stem
    return config_from_hf(read_hf_config(config_file), stem or "config", source=str(config_file))


# config.json's torch_dtype (or dtype) -> its safetensors dtype
_SAFETENSORS_DTYPES = {"bfloat16": "BF16", "float16": "F16", "float32": "F32"}


def _config_dtype(hf: dict, source: str) -> tuple[str, ...]:
    """The safetensors dtypes a checkpoint's tensors may have: bf16, fp16 or fp32, whatever config.json's torch_dtype
    says (transformers loads a float checkpoint under another float torch_dtype by casting, and so do we); integer and
    float8 tensors are quantised weights this loader would silently misread. An unknown torch_dtype is refused."""
    declared = hf.get("torch_dtype", hf.get("dtype"))
    if declared is not None and str(declared).removeprefix("torch.") not in _SAFETENSORS_DTYPES:
        raise CheckpointError(f"{source}: torch_dtype {declared!r} is not one of {sorted(_SAFETENSORS_DTYPES)}")
    return tuple(_SAFETENSORS_DTYPES.values())


def _read(f, name: str, shape, part, part_as: str | None = None) -> torch.Tensor:
    """A tensor of an open safetensors file, whole or the part `part` picks (by `part_as`'s name)."""
    whole = f.get_slice(name)
    found = tuple(whole.get_shape())
    if shape is not None and found != shape:
        raise CheckpointError(f"weights_path: {name} has shape {found}, expected {shape}")
    index = part(part_as or name, found) if part is not None else None
    return f.get_tensor(name) if index is None else whole[index]


def load_hf_checkpoint(path, config: ModelConfig, *, device="cpu", dtype=None, part=None) -> dict:
    """Load a checkpoint directory (config.json + *.safetensors) for `config`, after checking its config.

    A tensor the model does not use is refused rather than dropped (a bias would change the math),
    except the layers beyond a truncated config's depth. A tied model's file may still hold lm_head:
    transformers then ignores it, and so do we, but only when it equals the embedding bit for bit.
    Every tensor is bf16, fp16 or fp32 (cast to `dtype` as transformers casts to torch_dtype; never an integer
    or float8 tensor) and lives in one shard: a tensor in two files is refused (which copy wins would be the
    listing's order).
    The per-expert tensors are returned stacked, one [E, ...] tensor per layer and role (weight_shapes).
    part(name, shape) -> index or None: read only that part of a tensor (a tensor-parallel rank's slice;
    safetensors reads the slice alone), shapes checked on the whole tensor first.
    """
    from safetensors import SafetensorError, safe_open

    path = Path(path)
    config_file = path / "config.json"
    if not config_file.is_file():
        raise CheckpointError(f"weights_path: {path} has no config.json")
    hf = read_hf_config(config_file)
    check_hf_config(hf, config, source=str(config_file))
    names = get_family(config.family).hf_names
    wanted = checkpoint_shapes(config)
    known = checkpoint_shapes(replace(config, num_layers=hf["num_hidden_layers"], tie_word_embeddings=False))
    weights, tied_head, seen = {}, None, {}
    dtypes = _config_dtype(hf, str(config_file))
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise CheckpointError(f"weights_path: {path} has no *.safetensors files")
    for file in files:
        try:
            with safe_open(str(file), framework="pt", device=str(device)) as f:
                for name in f.keys():
                    if name not in known:
                        raise CheckpointError(f"{file}: tensor {name} is not part of a {config.family} model "
                                              "rl_engine computes (refused rather than dropped)")
                    if name in seen:  # which copy would win is the order of a directory listing
                        raise CheckpointError(f"{file}: tensor {name} is also in {seen[name]}; a tensor belongs "
                                              "to one shard")
                    seen[name] = file.name
                    found = f.get_slice(name).get_dtype()
                    if found not in dtypes:
                        raise CheckpointError(f"{file}: tensor {name} has dtype {found}; the loader takes "
                                              f"{'/'.join(dtypes)} (not quantised weights)")
                    if name in wanted:
                        t = _read(f, name, wanted[name], part)
                        weights[name] = t if dtype is None else t.to(dtype)
                    elif name == names["lm_head"] and config.tie_word_embeddings:
                        tied_head = (file, _read(f, name, None, part, names["embed"]))
        except (SafetensorError, OSError) as exc:
            raise CheckpointError(f"{file}: not a readable safetensors file ({_one_line(exc)})") from None
    missing = [n for n in wanted if n not in weights]
    if missing:
        raise CheckpointError(f"weights_path: {path} lacks {len(missing)} tensors, e.g. {missing[:3]}")
    if tied_head is not None:
        file, head = tied_head
        embed = weights[names["embed"]]
        if head.shape != embed.shape or not torch.equal(head.to(embed.dtype), embed):
            raise CheckpointError(f"{file}: tensor {names['lm_head']} differs from {names['embed']} although "
                                  "tie_word_embeddings is true (transformers would ignore it)")
    stacks = {}
    for name, _, stack in _tensors(config):
        if stack is not None:
            stacks.setdefault(stack[0], []).append(name)
    for stack, members in stacks.items():  # one stack at a time: its experts' tensors are freed as it is made
        weights[stack] = torch.stack([weights.pop(name) for name in members])
    return weights
