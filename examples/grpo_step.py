#!/usr/bin/env python
"""One GRPO step on a Qwen3 config with synthetic weights, end to end on rl_engine's ops.

rollouts (rl_engine.rollout: paged cache, continuous batching, seeded sampling) on a verifiable task
-> rewards -> group-normalised advantages -> one packed teacher-forced forward (the trainer) ->
old logprobs recomputed from it -> rollout_corr/* metrics (rl_engine.metrics) -> the fused linear
policy loss (rl_engine.losses) -> backward into fp32 master weights -> AdamW step; prints the metrics
and where the time went.

Task: prompts of random token ids; each completion's reward is the fraction of its tokens with an even
id (stop token 0 ends a completion and is not scored). Under triton_bf16 every mismatch metric
(rollout_corr/kl, k3_kl, log_ppl_diff, max_abs_dlogp, ...) is exactly 0 and the loss's ppo_kl is 0:
the rollout's logprobs are the trainer's bits. Under torch_bf16 they are not, where its ops are not
batch invariant (decode attention vs packed attention, fp32 GEMMs of different heights).

    python examples/grpo_step.py --profile triton_bf16 --config tiny --device cpu
Exit codes: 0 done, 2 usage error (one line on stderr).
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

import torch

if not torch.cuda.is_available():  # Triton kernels run under the CPU interpreter (set before they are imported)
    os.environ.setdefault("TRITON_INTERPRET", "1")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

from rl_engine.errors import UsageError  # noqa: E402
from rl_engine.losses import linear_policy_loss  # noqa: E402
from rl_engine.metrics import rollout_corr_metrics  # noqa: E402
from rl_engine.models.decoder import DecoderModel  # noqa: E402
from rl_engine.models.families import get_config  # noqa: E402
from rl_engine.models.profiles import PROFILES, ProfileOps, get_profile  # noqa: E402
from rl_engine.models.weights import synthetic_weights  # noqa: E402
from rl_engine.rollout import Request, RolloutEngine, SamplingParams, loss_backend, tempered_logprobs  # noqa: E402
from rl_engine.workload.layouts import Sample, pack  # noqa: E402

STOP_TOKEN = 0


def reward(tokens: list[int]) -> float:
    scored = [t for t in tokens if t != STOP_TOKEN]
    return sum(t % 2 == 0 for t in scored) / max(len(scored), 1)


def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--profile", default="triton_bf16", help=f"one of {sorted(PROFILES)}")
    p.add_argument("--config", default="tiny", help="a named model config (rl_engine.models.families)")
    p.add_argument("--layers", type=int, default=None, help="keep the first N layers (default: all)")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--prompts", type=int, default=1)
    p.add_argument("--group-size", type=int, default=4, help="completions per prompt (GRPO group)")
    p.add_argument("--prompt-len", type=int, default=4)
    p.add_argument("--max-new-tokens", type=int, default=4)
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--max-batch-size", type=int, default=4)
    p.add_argument("--chunk-size", type=int, default=4)
    p.add_argument("--page-size", type=int, default=4)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args(argv)


def setup(args):
    """(model, master weights, sampling params), or UsageError for a bad flag."""
    try:
        config = get_config(args.config)
        if args.layers is not None:
            config = config.with_layers(args.layers)
        profile = get_profile(args.profile)
        device = torch.device(args.device)
        if device.type == "cuda" and not torch.cuda.is_available():
            raise ValueError("device: cuda asked for, but CUDA is not available")
        for name in ("prompts", "group_size", "prompt_len", "max_batch_size", "chunk_size", "page_size"):
            if getattr(args, name) < 1:
                raise ValueError(f"--{name.replace('_', '-')}: expected a positive integer, got {getattr(args, name)}")
        if args.group_size < 2:
            raise ValueError("--group-size: GRPO normalises within a group, expected at least 2")
        params = SamplingParams(temperature=args.temperature, top_p=args.top_p, max_new_tokens=args.max_new_tokens,
                                stop_token_ids=(STOP_TOKEN,), seed=args.seed)
        if params.greedy:
            raise ValueError("--temperature: expected > 0 (GRPO needs sampled, distinct completions)")
    except (ValueError, RuntimeError) as e:
        raise UsageError(str(e)) from None
    # fp32 master weights; the model casts them to the profile's dtype (a differentiable cast, so the
    # gradient of the bf16 forward lands in the masters).
    master = {n: t.float().requires_grad_(True) for n, t in synthetic_weights(config, args.seed, device=device).items()}
    return DecoderModel(config, master, ProfileOps(profile)), master, params


def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def run(args) -> dict:
    """One GRPO step; returns {"metrics", "loss_metrics", "rewards", "seconds"}."""
    model, master, params = setup(args)
    device = model.lm_head_weight.device
    seconds = {}
    gen = torch.Generator().manual_seed(args.seed)
    vocab = model.config.vocab_size
    prompts = [tuple(torch.randint(1, vocab, (args.prompt_len,), generator=gen).tolist()) for _ in range(args.prompts)]
    requests = [Request(p * args.group_size + j, prompts[p], params) for p in range(args.prompts)
                for j in range(args.group_size)]

    t0 = time.perf_counter()
    engine = RolloutEngine(model, max_batch_size=args.max_batch_size, chunk_size=args.chunk_size,
                           page_size=args.page_size,
                           num_pages=1 + len(requests) * -(-(args.prompt_len + args.max_new_tokens) // args.page_size))
    done = engine.generate(requests)
    seconds["rollout"] = time.perf_counter() - t0
    seconds.update({f"rollout.{k}": v for k, v in engine.stats.seconds.items()})

    completions = [done[r.request_id] for r in requests]
    rewards = torch.tensor([reward(c.token_ids) for c in completions], dtype=torch.float32)
    groups = rewards.view(args.prompts, args.group_size)
    # GRPO (verl compute_grpo_outcome_advantage): (r - group mean) / (group std + 1e-6), unbiased std.
    advantages = ((groups - groups.mean(-1, keepdim=True)) / (groups.std(-1, keepdim=True) + 1e-6)).view(-1)

    # The trainer: one packed teacher-forced forward over prompt + completion of every sequence.
    t0 = time.perf_counter()
    samples = [Sample(i, c.prompt_ids + tuple(c.token_ids), len(c.prompt_ids)) for i, c in enumerate(completions)]
    layout = pack(samples).to(device)
    hidden = model.forward(layout.token_ids, layout.positions, cu_seqlens=layout.cu_seqlens)[0]  # [T,H]
    sync(device)
    seconds["train.forward"] = time.perf_counter() - t0

    t0 = time.perf_counter()
    targets = layout.target_ids[0]
    with torch.no_grad():
        old = tempered_logprobs(model, hidden.detach()[None], targets[None], params.temperature)[0]
    n_seq, width = len(samples), max(len(c.token_ids) for c in completions)
    mask_tok = torch.zeros(targets.shape, device=device)
    adv_tok = torch.zeros(targets.shape, device=device)
    train_rows = torch.zeros(n_seq, width, device=device)
    rollout_rows = torch.zeros(n_seq, width, device=device)
    mask_rows = torch.zeros(n_seq, width, device=device)
    for i, (s, start) in enumerate(zip(samples, layout.cu_seqlens.tolist())):
        n = s.length - s.prompt_len
        slots = slice(start + s.prompt_len - 1, start + s.length - 1)  # the slots that predict the completion
        mask_tok[slots] = 1.0
        adv_tok[slots] = advantages[i]
        train_rows[i, :n] = old[slots]
        rollout_rows[i, :n] = completions[i].logprobs.to(device)
        mask_rows[i, :n] = 1.0
    metrics = rollout_corr_metrics(train_rows, rollout_rows, mask_rows)
    sync(device)
    seconds["train.old_logprobs"] = time.perf_counter() - t0

    t0 = time.perf_counter()
    loss, loss_metrics = linear_policy_loss(hidden, model.lm_head_weight, targets, adv_tok, old, mask_tok,
                                            temperature=params.temperature, backend=loss_backend(model))
    loss.backward()
    sync(device)
    seconds["train.loss+backward"] = time.perf_counter() - t0

    t0 = time.perf_counter()
    optimizer = torch.optim.AdamW(master.values(), lr=args.lr)
    optimizer.step()
    sync(device)
    seconds["optimizer"] = time.perf_counter() - t0
    grad_norm = torch.sqrt(sum((p.grad.double() ** 2).sum() for p in master.values() if p.grad is not None))
    return {"metrics": metrics, "loss": loss.detach(), "loss_metrics": loss_metrics, "rewards": rewards,
            "grad_norm": grad_norm, "seconds": seconds, "tokens": int(mask_tok.sum())}


def main(argv=None) -> int:
    args = parse_args(argv)
    try:
        out = run(args)
    except UsageError as e:
        print(f"grpo_step: {e}", file=sys.stderr)
        return 2
    print(f"profile={args.profile} config={args.config} device={args.device} sequences={len(out['rewards'])} "
          f"completion_tokens={out['tokens']} mean_reward={float(out['rewards'].mean()):.4f}")
    print(f"loss={float(out['loss']):.6g} grad_norm={float(out['grad_norm']):.6g} "
          + " ".join(f"{k}={float(v):.6g}" for k, v in out["loss_metrics"].items()))
    for k, v in out["metrics"].items():
        print(f"{k} {float(v):.6g}")
    total = sum(v for k, v in out["seconds"].items() if "." not in k or k.startswith("train") or k == "optimizer")
    print("time: " + " ".join(f"{k}={v:.3f}s" for k, v in out["seconds"].items()) + f" total={total:.3f}s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
