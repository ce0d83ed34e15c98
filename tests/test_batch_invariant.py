"""batch_invariant_mode: an unpatched nn.Module becomes batch invariant inside it (CPU: Triton interpreter)."""

import pytest
import torch

from rl_engine.integrations.batch_invariant import batch_invariant_mode
from rl_engine.kernels.ops.pytorch.reduction import tree_sum


def _model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.GELU(), torch.nn.Linear(64, 100))


def _rows_alone_vs_batch(fn, x) -> int:
    """Elements of any row that differ between the row run alone and the same row in the batch."""
    full = fn(x)
    return sum(int((fn(x[i:i + 1])[0] != full[i]).sum()) for i in range(x.shape[0]))


def test_an_unpatched_module_becomes_batch_invariant_inside_the_mode():
    model, x = _model(), torch.randn(9, 32, generator=torch.Generator().manual_seed(1))

    def logp(t):
        return torch.log_softmax(model(t), -1)

    assert _rows_alone_vs_batch(logp, x) > 0  # plain PyTorch on this CPU: rows depend on the batch
    with batch_invariant_mode():
        assert _rows_alone_vs_batch(logp, x) == 0
        inside = logp(x)
    assert (inside - logp(x)).abs().max() < 1e-5  # the same function: only rounding differs


def test_gradients_are_routed_and_row_invariant():
    model, x = _model(), torch.randn(6, 32, generator=torch.Generator().manual_seed(2))
    w = torch.randn(6, 100, generator=torch.Generator().manual_seed(3))

    def input_grad(t):
        t = t.clone().requires_grad_(True)
        (torch.log_softmax(model(t), -1) * w[: t.shape[0]]).sum().backward()
        return t.grad

    with batch_invariant_mode():
        full = input_grad(x)
        for i in range(x.shape[0]):
            t = x[i:i + 1].clone().requires_grad_(True)
            (torch.log_softmax(model(t), -1) * w[i:i + 1]).sum().backward()
            assert torch.equal(t.grad[0], full[i]), i
    reference = input_grad(x)
    assert (full - reference).abs().max() < 1e-5


def test_sum_and_mean_over_the_last_dim_use_the_fixed_tree():
    x = torch.randn(5, 37, generator=torch.Generator().manual_seed(4))
    with batch_invariant_mode():
        s, m = x.sum(-1), x.mean(dim=-1, keepdim=True)
    assert torch.equal(s, tree_sum(x)) and torch.equal(m[:, 0], tree_sum(x) / 37)
    assert tree_sum(torch.arange(5.0)) == 10.0 and tree_sum(x.double()).dtype == torch.float64
    assert torch.allclose(s, x.sum(-1), atol=1e-5)


def test_other_dtypes_and_ops_run_as_before():
    a, b = torch.randn(3, 4, dtype=torch.float64), torch.randn(4, 5, dtype=torch.float64)
    ints = torch.arange(12).reshape(3, 4)
    with batch_invariant_mode():
        assert torch.equal(a @ b, torch.mm(a, b)) and (a @ b).dtype == torch.float64
        assert torch.equal(ints.sum(0), torch.tensor([12, 15, 18, 21]))


def test_a_batch_dependent_route_would_be_caught(monkeypatch):
    """The check above can fail: a planted route that adds the batch size breaks row invariance."""
    import rl_engine.integrations.batch_invariant as mode

    real = mode._mm
    monkeypatch.setitem(mode._ROUTES, torch.ops.aten.mm.default,
                        lambda a, b: real(a, b) + a.shape[0] * 1e-3)
    monkeypatch.setitem(mode._ROUTES, torch.ops.aten.addmm.default,
                        lambda bias, a, b, **kw: real(a, b) + bias + a.shape[0] * 1e-3)
    model, x = _model(), torch.randn(4, 32, generator=torch.Generator().manual_seed(5))
    with batch_invariant_mode():
        assert _rows_alone_vs_batch(model, x) > 0


@pytest.mark.gpu
def test_on_the_gpu_an_unpatched_module_is_batch_invariant_in_bf16():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4096, 4096), torch.nn.SiLU(),
                                torch.nn.Linear(4096, 32000)).cuda().bfloat16()
    x = torch.randn(64, 4096, device="cuda", dtype=torch.bfloat16)

    def logp(t):
        return torch.log_softmax(model(t).float(), -1)

    with torch.no_grad():
        outside = _rows_alone_vs_batch(logp, x)
        with batch_invariant_mode():
            assert _rows_alone_vs_batch(logp, x) == 0
    print(f"plain PyTorch: {outside} elements differ between rows alone and in the batch")
