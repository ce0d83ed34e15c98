"""rl_engine.nn.FusedLinearPolicyLoss is the functional op (rl_engine.losses.linear_policy_loss), bit for bit,
loss, metrics and gradients; it refuses an unknown loss type by name at construction."""

import pytest
import torch

from rl_engine.losses import linear_policy_loss
from rl_engine.nn import FusedLinearPolicyLoss

B, T, H, V = 2, 5, 16, 24


def inputs(seed=0):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(B, T, H, generator=g)
    weight = torch.randn(V, H, generator=g) / 4
    ids = torch.randint(0, V, (B, T), generator=g)
    adv = torch.randn(B, generator=g)
    old = -torch.rand(B, T, generator=g) * 3
    ref = -torch.rand(B, T, generator=g) * 3
    mask = torch.ones(B, T)
    mask[1, 3:] = 0
    return hidden, weight, ids, adv, old, mask, ref


@pytest.mark.parametrize("backend", ["pytorch", "triton"])
@pytest.mark.parametrize("options", [
    {"policy_loss": "ppo", "clip_ratio_high": 0.28, "kl_coef": 0.1, "entropy_coef": 0.01, "temperature": 0.9},
    {"policy_loss": "gspo", "compute_entropy": True},
])
def test_module_equals_functional_op_bitwise(backend, options):
    runs = []
    for call in ("module", "functional"):
        hidden, weight, ids, adv, old, mask, ref = inputs()
        hidden.requires_grad_(True)
        weight.requires_grad_(True)
        if call == "module":
            loss, metrics = FusedLinearPolicyLoss(**options, backend=backend)(hidden, weight, ids, adv, old, mask, ref)
        else:
            loss, metrics = linear_policy_loss(hidden, weight, ids, adv, old, mask, ref, **options, backend=backend)
        loss.backward()
        runs.append((loss.detach(), metrics, hidden.grad, weight.grad))
    (l1, m1, gh1, gw1), (l2, m2, gh2, gw2) = runs
    assert torch.isfinite(l1) and torch.equal(l1, l2)
    assert m1.keys() == m2.keys() and all(torch.equal(m1[k], m2[k]) for k in m1)
    assert torch.equal(gh1, gh2) and torch.equal(gw1, gw2)


def test_unknown_loss_type_refused_by_name():
    with pytest.raises(ValueError, match="policy_loss.*'cispo'"):
        FusedLinearPolicyLoss("cispo")
    with pytest.raises(ValueError, match="loss_agg_mode.*'seq-sum'"):
        FusedLinearPolicyLoss(loss_agg_mode="seq-sum")
    with pytest.raises(ValueError, match="backend.*'cuda'"):
        FusedLinearPolicyLoss(backend="cuda")
