"""TRL GRPO step time at Qwen3-0.6B shape (random weights): stock TRL GRPOTrainer vs RLEngineGRPOTrainer.

    python benchmarks/trl_grpo.py --out benchmarks/results            # GPU: Qwen3-0.6B shape
    python benchmarks/trl_grpo.py --out /tmp/r --quick --device cpu   # toy sizes, smoke (Triton interpreter)

Model: transformers' Qwen3ForCausalLM at Qwen3-0.6B's shape (28 layers, hidden 1024, 16/8 heads of 128,
intermediate 3072, vocab 151936, tied embeddings), random weights, bf16; one fresh model per implementation,
from the same seed, saved to a temporary directory (TRL loads it from there). Tokenizer: word-level over
the whole vocabulary, built in the script (no hub). Prompts: --prompt-len random words; completions up
to --completion-len tokens (a random-weight model rarely stops early); reward: the fraction of completion
words w<i> with an even i (so advantages are not all zero).
Per step: --batch completions (--batch / --generations prompts), one optimizer step, TRL's own
`step_time` (generation + logprobs + loss + backward + optimizer) from its logs; the first --warmup steps
(Triton JIT, allocator) are dropped and the median of the rest reported.
Implementations:
  stock      trl.GRPOTrainer: transformers generate() (sdpa), TRL's chunked fused LM head, TRL's loss
  rl_engine  rl_engine.integrations.trl.RLEngineGRPOTrainer(profile="triton_bf16"): RolloutEngine
             generation, packed forwards, rl_engine's fused linear policy loss
  liger      not measured: TRL 1.16 has no Liger GRPO-loss path (its `use_liger_kernel` applies Liger's
             layer kernels only; the loss is TRL's fused LM head), recorded as unavailable
Writes trl_grpo.json (rows and the ratio rl_engine/stock).
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")
ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "examples")]

from common import arg_parser, environment, module_version  # noqa: E402

QWEN3_0_6B = {"hidden_size": 1024, "intermediate_size": 3072, "num_hidden_layers": 28, "num_attention_heads": 16,
              "num_key_value_heads": 8, "head_dim": 128, "rope_theta": 1000000.0, "max_position_embeddings": 40960}
VOCAB = 151936
QUICK = {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 1, "num_attention_heads": 2,
         "num_key_value_heads": 1, "head_dim": 16}


def reward_even(completions, **kwargs) -> list[float]:
    words = [c.split() for c in completions]
    return [sum(w[1:].isdigit() and int(w[1:]) % 2 == 0 for w in ws) / max(len(ws), 1) for ws in words]


def run_impl(impl: str, args, tmp: Path) -> dict:
    import trl_grpo
    from datasets import Dataset
    from trl import GRPOConfig, GRPOTrainer

    dims, vocab = (QUICK, 64) if args.quick else (QWEN3_0_6B, VOCAB)
    tok = trl_grpo.tokenizer([f"w{i}" for i in range(vocab - len(trl_grpo.SPECIALS))])
    path = tmp / "qwen3"
    if not path.exists():
        trl_grpo.tiny_qwen3(len(tok), dims=dims, tie_word_embeddings=True).save_pretrained(path)
    g = torch.Generator().manual_seed(0)
    steps = args.warmup + args.steps
    n_prompts = args.batch // args.generations
    prompts = [" ".join(f"w{int(i)}" for i in torch.randint(0, vocab - 3, (args.prompt_len,), generator=g))
               for _ in range(n_prompts * steps)]
    config = GRPOConfig(
        output_dir=str(tmp / impl), use_cpu=args.device == "cpu", max_steps=steps, logging_steps=1,
        per_device_train_batch_size=args.batch, num_generations=args.generations,
        max_completion_length=args.completion_len, learning_rate=1e-6, report_to="none", save_strategy="no",
        disable_tqdm=True, seed=0, model_init_kwargs={"dtype": torch.bfloat16}, use_bias_correction_kl=False,
    )
    kwargs = dict(reward_funcs=reward_even, args=config, train_dataset=Dataset.from_dict({"prompt": prompts}),
                  processing_class=tok)
    if impl == "rl_engine":
        from rl_engine.integrations.trl import RLEngineGRPOTrainer

        trainer = RLEngineGRPOTrainer(str(path), profile="triton_bf16", **kwargs)
    else:
        trainer = GRPOTrainer(str(path), **kwargs)
    start = time.perf_counter()
    trainer.train()
    wall = time.perf_counter() - start
    logs = [h for h in trainer.state.log_history if "step_time" in h]
    times = [h["step_time"] for h in logs][args.warmup:]
    corr = {k: v for k, v in logs[-1].items() if k.startswith("rollout_corr/")} if logs else {}
    row = {"impl": impl, "steps_timed": len(times), "step_s_median": statistics.median(times) if times else None,
           "step_s": times, "train_wall_s": wall, "completions_mean_length": logs[-1].get("completions/mean_length")}
    if corr:
        row["rollout_corr_last_step"] = corr
    del trainer
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return row


def main(argv=None) -> int:
    p = arg_parser(__doc__.splitlines()[0])
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--impls", default="stock,rl_engine")
    p.add_argument("--batch", type=int, default=16, help="completions per step")
    p.add_argument("--generations", type=int, default=8, help="completions per prompt (GRPO group)")
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--completion-len", type=int, default=256)
    p.add_argument("--steps", type=int, default=4, help="timed steps")
    p.add_argument("--warmup", type=int, default=1, help="untimed first steps")
    args = p.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        p.exit(2, f"{p.prog}: error: --device cuda needs CUDA (or pass --device cpu --quick)\n")
    if args.quick:
        args.batch, args.generations, args.prompt_len, args.completion_len = 4, 2, 4, 3
        args.steps, args.warmup = min(args.steps, 2), min(args.warmup, 1)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for impl in args.impls.split(","):
            if impl not in ("stock", "rl_engine"):
                p.exit(2, f"{p.prog}: error: --impls: expected stock and/or rl_engine, got {impl!r}\n")
            rows.append(run_impl(impl, args, Path(tmp)))
            print(json.dumps({k: v for k, v in rows[-1].items() if k != "rollout_corr_last_step"}))
    rows.append({"impl": "liger", "unavailable": "TRL 1.16 has no Liger GRPO-loss path (use_liger_kernel: layer "
                 "kernels only, the loss is TRL's fused LM head)"})
    by = {r["impl"]: r.get("step_s_median") for r in rows}
    ratio = by["rl_engine"] / by["stock"] if by.get("rl_engine") and by.get("stock") else None
    payload = {"benchmark": "trl_grpo", "environment": {**environment(), "trl": module_version("trl")},
               "shape": "quick" if args.quick else "qwen3-0.6b", "args": vars(args), "rows": rows,
               "ratio_rl_engine_over_stock": ratio}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "trl_grpo.json").write_text(json.dumps(payload, indent=1) + "\n")
    print(f"rl_engine / stock step time: {ratio}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
