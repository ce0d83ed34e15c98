#!/usr/bin/env python
"""A few steps of TRL's GRPOTrainer on rl_engine (rl_engine.integrations.trl), on the CPU, with no hub access.

A tiny Qwen3 with random weights (transformers' Qwen3Config), a word-level tokenizer built here with
`tokenizers`, a toy reward (the fraction of the completion's words that are "a"), and RLEngineGRPOTrainer:
the model patched, generation through rl_engine's RolloutEngine, logprobs and the loss from the fused op.
Prints TRL's logs of each step, with verl's rollout_corr/* metrics (trainer vs rollout logprobs): under
triton_bf16 the mismatch metrics (kl, k3_kl, log_ppl_diff, max_abs_dlogp, ...) are exactly 0; under
torch_bf16 they need not be (its ops are not batch invariant).

    python examples/trl_grpo.py --profile triton_bf16 --steps 3
Exit codes: 0 done, 2 usage error (one line on stderr).
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
from pathlib import Path

import torch

if not torch.cuda.is_available():  # Triton kernels run under the CPU interpreter (set before they are imported)
    os.environ.setdefault("TRITON_INTERPRET", "1")
os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")  # TRL warns that rollout_func is experimental
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

WORDS = ["a", "b", "c", "d", "e", "f", "g", "h"]
SPECIALS = ["<pad>", "<eos>", "<unk>"]
DIMS = {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 1, "num_attention_heads": 2,
        "num_key_value_heads": 1, "head_dim": 16}


def tokenizer(words=WORDS):
    """A word-level tokenizer over `words` (split on spaces), as a transformers fast tokenizer: no hub."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {w: i for i, w in enumerate(SPECIALS + list(words))}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.decoder = decoders.WordPiece(prefix="##")  # joins words with spaces
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="<eos>", unk_token="<unk>")


def tiny_qwen3(vocab_size: int, seed: int = 0, dims=None, tie_word_embeddings=False):
    """A Qwen3ForCausalLM with random weights, bf16 (DIMS unless `dims`; pad id 0, eos id 1)."""
    import transformers

    torch.manual_seed(seed)
    config = transformers.Qwen3Config(vocab_size=vocab_size, **(dims or DIMS), pad_token_id=0, eos_token_id=1,
                                      bos_token_id=None, tie_word_embeddings=tie_word_embeddings)
    return transformers.Qwen3ForCausalLM(config).to(torch.bfloat16)


def reward_a(completions, **kwargs) -> list[float]:
    """The toy reward: the fraction of a completion's words that are "a"."""
    return [c.split().count("a") / max(len(c.split()), 1) for c in completions]


def run(profile="triton_bf16", steps=2, beta=0.0, loss_type="dapo", generations=4, max_completion_length=4,
        output_dir=None, device=None) -> list[dict]:
    """TRL's log history of `steps` GRPO steps (one dict per logged step). device: "cpu" or "cuda" (default:
    cuda when there is one and Triton is not interpreting)."""
    if device is None:
        device = "cuda" if torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1" else "cpu"
    from datasets import Dataset
    from trl import GRPOConfig

    from rl_engine.integrations.trl import RLEngineGRPOTrainer

    tok = tokenizer()
    prompts = ["a b c", "d e", "f g h a", "b b"]
    dataset = Dataset.from_dict({"prompt": prompts * steps})
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "tiny-qwen3"  # TRL builds the reference model (beta > 0) from the policy's path
        tiny_qwen3(len(tok)).save_pretrained(path)
        args = GRPOConfig(
            output_dir=output_dir or str(Path(tmp) / "out"), use_cpu=device == "cpu", max_steps=steps, logging_steps=1,
            per_device_train_batch_size=generations, num_generations=generations,
            max_completion_length=max_completion_length, learning_rate=1e-3, beta=beta, loss_type=loss_type,
            use_bias_correction_kl=False,  # verl's k3 KL term: the IS-weighted one is refused (rl_engine lacks it)
            report_to="none", save_strategy="no", disable_tqdm=True, seed=0,
            model_init_kwargs={"dtype": torch.bfloat16},
        )
        trainer = RLEngineGRPOTrainer(str(path), reward_funcs=reward_a, args=args, train_dataset=dataset,
                                      processing_class=tok, profile=profile)
        trainer.train()
    return [h for h in trainer.state.log_history if "loss" in h]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--profile", default="triton_bf16", help="triton_bf16 or torch_bf16")
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--beta", type=float, default=0.0, help="KL coefficient (> 0: a patched reference model)")
    p.add_argument("--loss-type", default="dapo", help="TRL's loss_type: grpo, bnpo, dr_grpo or dapo")
    p.add_argument("--device", default=None, help="cpu or cuda (default: cuda if present)")
    a = p.parse_args(argv)
    from rl_engine.errors import UsageError

    try:
        logs = run(a.profile, a.steps, a.beta, a.loss_type, device=a.device)
    except UsageError as exc:
        print(f"trl_grpo: {exc}", file=sys.stderr)
        return 2
    for step, log in enumerate(logs, 1):
        corr = {k: v for k, v in log.items() if k.startswith("rollout_corr/")}
        print(f"step {step}: loss {log['loss']:.6g} reward {log.get('reward', float('nan')):.4g} "
              f"actor/ppo_kl {log.get('actor/ppo_kl', float('nan')):.3g}")
        print("  " + " ".join(f"{k}={v:.3g}" for k, v in sorted(corr.items())))
    return 0


if __name__ == "__main__":
    sys.exit(main())
