"""TRL's GRPOTrainer on rl_engine: `RLEngineGRPOTrainer`, a drop-in GRPOTrainer with one extra argument, `profile`.

    from rl_engine.integrations.trl import RLEngineGRPOTrainer
    trainer = RLEngineGRPOTrainer(model, reward_funcs=..., args=GRPOConfig(...), train_dataset=...,
                                  profile="triton_bf16")

What changes against TRL's GRPOTrainer (TRL >= 1.10, < 1.17; the hooks below are private to TRL and move
between releases, so other versions are refused at import):
- the policy model (and the reference model, when `beta` > 0) are patched in place by
  `rl_engine.integrations.transformers.patch` under `profile` (the same Parameters; TRL keeps training them);
- every forward of the trainer (old, reference and training logprobs) runs one packed row [1, sum of lengths]
  of the real tokens, positions restarting at 0 per sequence (as verl's remove-padding path and as the rollout
  engine sees them), instead of TRL's left+right padded batch;
- the per-token logprobs and the loss are rl_engine's fused linear policy loss (`rl_engine.losses`): the
  [tokens, V] logits are never materialised under a Triton profile. TRL's loss types map onto its
  aggregation modes (grpo: seq-mean-token-mean, bnpo / dapo: token-mean, dr_grpo: seq-mean-token-sum, each
  with TRL's normaliser), `importance_sampling_level="sequence"` onto its GSPO, `beta` onto its k3 KL.
  Where verl's formulas (which the op computes) differ from TRL's: log-ratios and the KL's log-ratio are
  clamped to [-20, 20] and the KL value to [-10, 10], GSPO's sequence log-ratio to <= 10;
- generation goes through `rl_engine.rollout.RolloutEngine` (paged cache, continuous batching, seeded
  sampling on the same profile), installed as TRL's `rollout_func` hook; pass `rollout_func=` to keep yours;
- the old policy's logprobs are always recomputed by the trainer after generation (verl's `old_log_prob`),
  and verl's `rollout_corr/*` metrics (trainer vs rollout logprobs, rl_engine.metrics) go to TRL's logs,
  with the loss's own metrics as `actor/<name>` (verl's names) next to TRL's `kl`, `entropy` and
  `clip_ratio/region_mean`. Under triton_bf16 the rollout's logprobs are the trainer's bits: every
  rollout_corr mismatch metric is 0.

Refused in one line, naming the setting: loss types the op lacks (cispo, sapo, luspo, vespo), `delta`,
`top_entropy_quantile` < 1, `entropy_coef` / adaptive entropy, `off_policy_mask_threshold`,
`use_bias_correction_kl`, vLLM, transformers' continuous batching / paged generation, tools and
environments, multimodal inputs, `repetition_penalty` != 1, `generation_kwargs`, MoE auxiliary losses,
more than one process (the packed forwards call the unwrapped model, past DDP's and FSDP's wrappers).
"""

from __future__ import annotations

import itertools
from types import SimpleNamespace

import torch

from rl_engine.errors import UsageError
from rl_engine.integrations.transformers import patch
from rl_engine.losses import linear_policy_loss
from rl_engine.metrics import rollout_corr_metrics
from rl_engine.models.decoder import DecoderModel
from rl_engine.rollout import Request, RolloutEngine, SamplingParams, tempered_logprobs

try:
    import trl
    from packaging.version import Version
    from trl import GRPOTrainer
except ImportError as exc:  # one line, naming what is missing
    raise ImportError(f"rl_engine.integrations.trl needs TRL (pip install 'rl_engine[trl]'): {exc}") from None

# The range pyproject's `trl` extra declares. Tested (tests/integrations/test_trl.py): 1.10.0, 1.12.0, 1.13.0,
# 1.14.2, 1.15.0, 1.16.0; GRPOTrainer._compute_loss is the same from 1.10 to 1.16 (1.7's dapo normaliser differs).
TRL_VERSIONS = (">=1.10", "<1.17")
if not Version("1.10") <= Version(trl.__version__) < Version("1.17"):
    raise ImportError(f"rl_engine.integrations.trl supports TRL {','.join(TRL_VERSIONS)}, found {trl.__version__}")

# TRL loss type -> the op's aggregation mode (the normaliser is set per call, as TRL's).
LOSS_TYPES = {"grpo": "seq-mean-token-mean", "bnpo": "token-mean", "dapo": "token-mean",
              "dr_grpo": "seq-mean-token-sum"}


def check_args(args) -> None:
    """A UsageError (one line) naming the first GRPOConfig setting rl_engine does not compute."""
    if args.loss_type not in LOSS_TYPES:
        raise UsageError(f"GRPOConfig.loss_type={args.loss_type!r} is not supported by rl_engine "
                         f"(expected one of {sorted(LOSS_TYPES)})")
    def get(name, default=None):  # a field an older TRL lacks has its off value
        return getattr(args, name, default)

    refused = [
        ("delta", get("delta") is not None, "two-sided clipping"),
        ("top_entropy_quantile", get("top_entropy_quantile", 1.0) < 1.0, "entropy masking"),
        ("entropy_coef", get("entropy_coef", 0.0) != 0.0, "TRL's entropy bonus"),
        ("use_adaptive_entropy", get("use_adaptive_entropy", False), "TRL's entropy controller"),
        ("off_policy_mask_threshold", get("off_policy_mask_threshold") is not None, "off-policy sequence masking"),
        ("use_bias_correction_kl", get("use_bias_correction_kl", False) and args.beta != 0.0,
         "the IS-corrected KL"),
        ("use_vllm", get("use_vllm", False), "generation runs on rl_engine's RolloutEngine"),
        ("use_transformers_continuous_batching", get("use_transformers_continuous_batching", False),
         "generation runs on rl_engine's RolloutEngine"),
        ("use_transformers_paged", get("use_transformers_paged", False),
         "generation runs on rl_engine's RolloutEngine"),
        ("repetition_penalty", get("repetition_penalty", 1.0) != 1.0, "the rollout sampler has none"),
        ("generation_kwargs", bool(get("generation_kwargs")), "the rollout sampler takes GRPOConfig's fields only"),
        ("max_tool_calling_iterations", get("max_tool_calling_iterations") is not None, "tools"),
    ]
    for name, bad, why in refused:
        if bad:
            raise UsageError(f"GRPOConfig.{name}={get(name)!r} is not supported by rl_engine ({why})")
    if get("importance_sampling_level", "token") not in ("token", "sequence"):
        raise UsageError(f"GRPOConfig.importance_sampling_level={get('importance_sampling_level')!r}: expected "
                         "'token' or 'sequence'")


def _packed(input_ids: torch.Tensor, attention_mask: torch.Tensor, logits_to_keep: int):
    """TRL's padded batch [B, P+K] (prompts left-padded, completions right-padded) as one packed row.

    (ids [1, N], cu_seqlens [B+1], idx [B, K]): the completion token k of row b is predicted by packed
    position idx[b, k] (its hidden row, and its logprob in the next-token logprobs of the packed row);
    columns past a completion's end point at its last real row and are masked by the caller."""
    m = attention_mask.bool()
    b, s = input_ids.shape
    lengths = m.sum(-1)
    starts = torch.cat([lengths.new_zeros(1), lengths.cumsum(0)])
    cu = starts.to(torch.int32)
    completion = m[:, s - logits_to_keep:].sum(-1)  # real completion tokens (contiguous from the start)
    prompt = lengths - completion
    k = torch.arange(logits_to_keep, device=input_ids.device)
    idx = starts[:-1, None] + prompt[:, None] - 1 + torch.minimum(k[None], (completion - 1).clamp(min=0)[:, None])
    return input_ids[m][None], cu, idx.clamp(min=0)


def _hidden(model, input_ids, attention_mask, logits_to_keep):
    """The last hidden states [B, K, H] predicting each completion column, from one packed forward."""
    ids, cu, idx = _packed(input_ids, attention_mask, logits_to_keep)
    positions = _positions(cu, ids.shape[1])
    out = model.model(input_ids=ids, position_ids=positions, use_cache=False, cu_seq_lens_q=cu, cu_seq_lens_k=cu)
    return out.last_hidden_state[0][idx]


def _positions(cu: torch.Tensor, n: int) -> torch.Tensor:
    from rl_engine.integrations.transformers import _packed_positions

    return _packed_positions(cu, n)[None]


def _patched(model, profile: str) -> None:
    """Patch `model` under `profile`, or keep it if `patch` already did so under the same profile."""
    state = getattr(model, "_rl_engine_patch", None)
    if state is None:
        patch(model, profile)
    elif state.profile != profile:
        raise UsageError(f"RLEngineGRPOTrainer: the model is patched under {state.profile}, not {profile} "
                         "(unpatch it first)")


def _state(model):
    state = getattr(model, "_rl_engine_patch", None)
    if state is None:
        raise UsageError(f"rl_engine: this {type(model).__name__} is not patched")
    return state


def loss_options(trainer, num_items_in_batch, mask: torch.Tensor, mode: str) -> dict:
    """rl_engine.losses.linear_policy_loss's options that compute TRL's GRPO loss of `trainer` (its args,
    beta, epsilons, temperature, accumulation) on one micro-batch: the aggregation with TRL's normaliser,
    scaled for gradient accumulation as TRL scales it."""
    a = trainer.args
    accumulation = trainer.current_gradient_accumulation_steps if mode == "train" else 1
    b = mask.shape[0]
    if a.loss_type == "grpo":
        normalizer = b * accumulation
    elif a.loss_type == "bnpo":
        normalizer = mask.sum().clamp(min=1.0) * accumulation
    elif a.loss_type == "dr_grpo":
        normalizer = b * trainer.max_completion_length * accumulation
    else:  # dapo: the generation batch's active tokens, rescaled to one accumulation window (as TRL)
        normalizer = num_items_in_batch.clamp(min=1.0).float() / trainer.accelerator.num_processes
        if mode == "train":
            normalizer = normalizer * accumulation / a.steps_per_generation
    return {"policy_loss": "gspo" if a.importance_sampling_level == "sequence" else "ppo",
            "clip_ratio_low": trainer.epsilon_low, "clip_ratio_high": trainer.epsilon_high,
            "clip_ratio_c": float("inf"),  # TRL has no dual clip
            "loss_agg_mode": LOSS_TYPES[a.loss_type], "kl_coef": trainer.beta, "temperature": trainer.temperature,
            "compute_entropy": True, "normalizer": normalizer}


class RLEngineGRPOTrainer(GRPOTrainer):
    """TRL's GRPOTrainer computing with rl_engine (the module docstring says what changes and what is refused).

    profile: the rl_engine profile the patched models compute under ("triton_bf16": the model must hold
    bf16 weights). rollout_engine: RolloutEngine options (max_batch_size, chunk_size, page_size). All other
    arguments are GRPOTrainer's.
    """

    def __init__(self, *args, profile: str = "triton_bf16", rollout_engine: dict | None = None, **kwargs):
        config = kwargs.get("args", args[2] if len(args) > 2 else None)
        if config is not None:
            check_args(config)
        for name in ("tools", "environment_factory"):
            if kwargs.get(name) is not None:
                raise UsageError(f"RLEngineGRPOTrainer: {name} is not supported by rl_engine")
        own_rollout = kwargs.get("rollout_func") is None
        if own_rollout:
            kwargs["rollout_func"] = self._rollout
        self._rollout_options = dict(rollout_engine or {})
        self._request_ids = itertools.count()
        super().__init__(*args, **kwargs)
        check_args(self.args)
        if self.accelerator.num_processes > 1:  # the packed forwards call the unwrapped model: no DDP/FSDP hooks
            raise UsageError(f"RLEngineGRPOTrainer: one process only, got {self.accelerator.num_processes} "
                             "(DDP / FSDP / DeepSpeed are not supported yet)")
        if getattr(self, "aux_loss_enabled", False):
            raise UsageError("RLEngineGRPOTrainer: MoE auxiliary losses are not supported by rl_engine")
        self.profile = profile
        for m in (self.model, self.ref_model):
            if m is not None:
                _patched(self.accelerator.unwrap_model(m), profile)

    # -- generation: TRL's rollout_func hook --------------------------------------------------------
    def _rollout(self, prompts: list, trainer) -> dict:
        """TRL's rollout_func: prompts (one per completion, repeated per group) -> ids and sampling logprobs."""
        model = self.accelerator.unwrap_model(self.model)
        state = _state(model)
        prompt_ids, _, fields = self._tokenize_prompts(prompts)
        if fields:
            raise UsageError(f"RLEngineGRPOTrainer: multimodal prompts ({sorted(fields)}) are not supported")
        a = self.args
        params = SamplingParams(temperature=a.temperature, top_k=a.top_k or 0, top_p=a.top_p, min_p=a.min_p or 0.0,
                                max_new_tokens=a.max_completion_length, stop_token_ids=self._stop_token_ids(model),
                                seed=a.seed)
        requests = [Request(next(self._request_ids), tuple(int(t) for t in p), params) for p in prompt_ids]
        done = self._engine_for(model, state, requests).generate(requests)
        out = [done[r.request_id] for r in requests]
        return {"prompt_ids": [list(r.prompt_ids) for r in requests],
                "completion_ids": [c.token_ids for c in out],
                "logprobs": [c.logprobs.tolist() for c in out]}

    def _stop_token_ids(self, model) -> tuple[int, ...]:
        """TRL's stop tokens: its `eos_token_ids` (TRL >= 1.14), else the model's generation config's."""
        ids = getattr(self, "eos_token_ids", None)
        if ids is None:
            ids = model.generation_config.eos_token_id
            ids = [] if ids is None else [ids] if isinstance(ids, int) else ids
        return tuple(int(i) for i in ids)

    def _engine_for(self, model, state, requests) -> RolloutEngine:
        """The RolloutEngine of the last call if it still reads the model's own tensors and has room, else a
        new one. Its DecoderModel holds the model's Parameters themselves (a dtype cast would copy them:
        `patch` refused that), so every call samples from the weights the optimizer last wrote in place;
        keeping the engine keeps its captured decode graphs."""
        weights = dict(model.state_dict())
        key = tuple((name, t.data_ptr()) for name, t in weights.items())
        opts = {"page_size": 16, **self._rollout_options}
        pages = 1 + sum(-(-(len(r.prompt_ids) + r.params.max_new_tokens) // opts["page_size"]) for r in requests)
        engine = getattr(self, "_engine", None)
        if (engine is None or self._engine_key != key or engine.cache.num_pages < pages
                or engine.max_batch_size < len(requests)):
            opts.setdefault("max_batch_size", len(requests))
            opts.setdefault("num_pages", pages)
            engine = RolloutEngine(DecoderModel(state.config, weights, state.ops), **opts)
            self._engine, self._engine_key = engine, key
        return engine

    # -- the trainer's logprobs (old, reference) -------------------------------------------------------
    def _get_per_token_logps_and_entropies(self, model, input_ids, attention_mask, logits_to_keep, batch_size=None,
                                           compute_entropy=False, compute_aux_loss=False, **extra):
        """Per-token logprobs [B, K] at TRL's temperature from one packed forward, logits never materialised."""
        given = sorted(k for k, v in extra.items() if v is not None)
        if given or compute_entropy or compute_aux_loss:
            raise UsageError(f"RLEngineGRPOTrainer: {given or 'entropy / aux loss'} not supported here")
        model = self.accelerator.unwrap_model(model)
        with torch.no_grad():
            hidden = _hidden(model, input_ids, attention_mask, logits_to_keep)
            ids = input_ids[:, -logits_to_keep:]
            head = SimpleNamespace(lm_head_weight=_state(model).head.weight, ops=_state(model).ops)
            return tempered_logprobs(head, hidden, ids, self.temperature), None, None

    def _generate_and_score_completions(self, inputs):
        out = super()._generate_and_score_completions(inputs)
        mode = "train" if self.model.training else "eval"
        mask = out["completion_mask"] if "tool_mask" not in out else out["completion_mask"] * out["tool_mask"]
        if out.get("old_per_token_logps") is None:  # verl recomputes the old policy's logprobs: so do we
            ids = torch.cat([out["prompt_ids"], out["completion_ids"]], 1)
            am = torch.cat([out["prompt_mask"], out["completion_mask"]], 1)
            out["old_per_token_logps"] = self._get_per_token_logps_and_entropies(
                self.model, ids, am, out["completion_ids"].size(1))[0]
        sampling = out.get("sampling_per_token_logps")
        if sampling is not None:
            metrics = rollout_corr_metrics(out["old_per_token_logps"], sampling, mask)
            for name, value in metrics.items():
                self._metrics[mode][name].append(self.accelerator.gather(value.float()).nanmean().item())
        return out

    # -- the loss ----------------------------------------------------------------------------------
    def _compute_loss(self, model, inputs):
        mode = "train" if self.model.training else "eval"
        prompt_ids, completion_ids = inputs["prompt_ids"], inputs["completion_ids"]
        input_ids = torch.cat([prompt_ids, completion_ids], 1)
        attention_mask = torch.cat([inputs["prompt_mask"], inputs["completion_mask"]], 1)
        k = completion_ids.size(1)
        mask = inputs["completion_mask"]
        mask = (mask if "tool_mask" not in inputs else mask * inputs["tool_mask"]).to(torch.float32)
        unwrapped = self.accelerator.unwrap_model(model)
        hidden = _hidden(unwrapped, input_ids, attention_mask, k)
        state = _state(unwrapped)
        loss, metrics = linear_policy_loss(
            hidden, state.head.weight, completion_ids, inputs["advantages"].float(), inputs["old_per_token_logps"],
            mask, inputs.get("ref_per_token_logps") if self.beta != 0.0 else None,
            **loss_options(self, inputs["num_items_in_batch"], mask, mode),
            backend="triton" if state.ops.profile.backend("linear_logp") == "triton" else "pytorch")
        count = mask.sum()

        def global_mean(value):  # a mean over this process's active tokens -> over all processes' (as TRL)
            totals = self.accelerator.reduce(torch.stack([value.float() * count, count]), reduction="sum")
            return (totals[0] / totals[1].clamp(min=1.0)).item()

        logged = {name: global_mean(v) for name, v in metrics.items()}
        for name, value in logged.items():
            self._metrics[mode][f"actor/{name}"].append(value)
        if "kl_loss" in logged:
            self._metrics[mode]["kl"].append(logged["kl_loss"])
        self._metrics[mode]["entropy"].append(logged["entropy"])
        self._metrics[mode]["clip_ratio/region_mean"].append(logged["pg_clipfrac"])
        return loss
