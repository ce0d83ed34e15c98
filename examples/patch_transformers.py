#!/usr/bin/env python
"""Use rl_engine inside a transformers model you train: patch, selected_logprobs, backward, generate.

A tiny random Qwen3 (1 layer) in bf16 is patched in place; its per-token logprobs are compared with the
unpatched model in fp32, checked bit for bit across batch layouts (alone, right-padded, left-padded, packed),
differentiated, and the model generates through transformers' own DynamicCache: the logprob of each token it
picked (from the hidden state of that step) is the trainer's teacher-forced one, bit for bit under triton_bf16.

    python examples/patch_transformers.py [--profile triton_bf16|torch_bf16|reference_fp32]
Without CUDA the Triton kernels run under the CPU interpreter (seconds at this size).
"""

from __future__ import annotations

import argparse
import copy
import os

import torch

if not torch.cuda.is_available():  # set before any Triton kernel is imported
    os.environ.setdefault("TRITON_INTERPRET", "1")

import transformers  # noqa: E402

from rl_engine.integrations.transformers import patch, selected_logprobs  # noqa: E402
from rl_engine.models.profiles import get_profile  # noqa: E402


def tiny_qwen3(device) -> transformers.Qwen3ForCausalLM:
    torch.manual_seed(0)
    config = transformers.Qwen3Config(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=1,
                                      num_attention_heads=4, num_key_value_heads=2, head_dim=16)
    return transformers.Qwen3ForCausalLM(config).to(device)


def run(profile: str = "triton_bf16") -> dict:
    device = "cuda" if torch.cuda.is_available() else "cpu"
    reference = tiny_qwen3(device)  # unpatched, fp32
    model = copy.deepcopy(reference).to(get_profile(profile).dtype)
    patch(model, profile)

    g = torch.Generator().manual_seed(1)
    a, b = torch.randint(0, 128, (5,), generator=g).to(device), torch.randint(0, 128, (8,), generator=g).to(device)
    ids = torch.stack([torch.cat([a.new_zeros(3), a]), b])  # a left-padded batch
    mask = torch.tensor([[0, 0, 0, 1, 1, 1, 1, 1], [1] * 8], device=device)

    # The trainer's forward: fp32 log p(ids[:, s+1] | ids[:, :s+1]), [2, 7]; no [B,S,V] logits under triton.
    logp = selected_logprobs(model, ids, attention_mask=mask)
    with torch.no_grad():
        positions = (mask.cumsum(-1) - 1).clamp(min=0)  # transformers' forward does not count them from the mask
        logits = reference(input_ids=ids, attention_mask=mask, position_ids=positions).logits.float()
    want = torch.log_softmax(logits, -1)[:, :-1].gather(-1, ids[:, 1:, None])[..., 0]
    active = (mask[:, :-1] * mask[:, 1:]).bool()  # a real token predicted from a real context
    max_diff = (logp - want)[active].abs().max().item()

    # The same sequence `a` alone, right-padded, and packed with `b`: the same bits?
    with torch.no_grad():
        alone = selected_logprobs(model, a[None])[0]
        right = selected_logprobs(model, torch.stack([torch.cat([a, a.new_zeros(3)]), b]),
                                  attention_mask=mask.flip(-1))[0, :4]
        packed = selected_logprobs(model, torch.cat([a, b])[None],
                                   cu_seqlens=torch.tensor([0, 5, 13], dtype=torch.int32, device=device))[0, :4]
    bitwise = all(torch.equal(x, alone) for x in (logp[0, 3:].detach(), right, packed))

    loss = -(logp * active).sum() / active.sum()
    loss.backward()
    grad_norm = torch.linalg.vector_norm(torch.stack([p.grad.float().norm() for p in model.parameters()])).item()

    # Rollout: greedy, through transformers' DynamicCache; each step's final hidden row -> the patched head.
    # generate's default cache is that DynamicCache (its keyword is past_key_values in 5.17, cache later).
    with torch.no_grad():
        out = model.generate(a[None], max_new_tokens=4, do_sample=False, output_hidden_states=True,
                             return_dict_in_generate=True, pad_token_id=0)
        new = out.sequences[:, 5:]
        rows = torch.cat([step[-1][:, -1:] for step in out.hidden_states], 1)
        rollout = model._rl_engine_patch.head(rows, new)
        teacher = selected_logprobs(model, out.sequences)[:, -4:]
    return {"profile": profile, "device": device, "shape": list(logp.shape), "max_diff": max_diff,
            "bitwise_layouts": bitwise, "loss": loss.item(), "grad_norm": grad_norm, "new_tokens": new[0].tolist(),
            "rollout_equals_teacher": torch.equal(rollout, teacher)}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--profile", default="triton_bf16", choices=["triton_bf16", "torch_bf16", "reference_fp32"])
    r = run(parser.parse_args(argv).profile)
    yes = {True: "yes", False: "no"}
    print(f"profile={r['profile']} device={r['device']} logp {r['shape']} fp32")
    print(f"max|Δ| vs unpatched transformers fp32: {r['max_diff']:.3g}")
    print(f"bitwise alone = left-padded = right-padded = packed: {yes[r['bitwise_layouts']]}")
    print(f"loss={r['loss']:.6g} grad_norm={r['grad_norm']:.6g}")
    print(f"generate: {r['new_tokens']}; rollout logprobs == teacher-forced, bitwise: "
          f"{yes[r['rollout_equals_teacher']]}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
