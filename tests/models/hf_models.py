"""transformers models for agreement tests: random weights a checkpoint could hold, and the bf16 form
transformers' users get."""

import torch


def randomise(hf):
    """Norms perturbed around 1, every other matrix N(0, 1/fan_in) (router, experts, projections; the
    embeddings keep transformers' init): logits of a realistic scale, in place."""
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if name.endswith("norm.weight"):
                p.add_(0.1 * torch.randn_like(p))
            elif p.dim() >= 2 and "embed" not in name:  # router, experts (3D in transformers 5), projections
                p.normal_(0.0, p.shape[-1] ** -0.5)
    return hf


def as_bf16(hf):
    """The model in bf16 as from_pretrained(dtype=bfloat16) gives it: parameters in bf16, the rotary
    inv_freq buffer still fp32 (hf.to(bfloat16) would round it too, and with it every angle)."""
    for p in hf.parameters():
        p.data = p.data.to(torch.bfloat16)
    return hf
