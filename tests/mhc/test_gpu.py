"""On CUDA the oracle, run through torch, gives the CPU's bytes: the golden hashes (H200 runs)."""

import pytest
import torch

from rl_engine.checks.mhc_acceptance import check_provider
from rl_engine.mhc import numerics as nm
from rl_engine.mhc.fixtures import CASES, load_golden, oracle_trace
from rl_engine.mhc.provider import ReferenceProvider
from rl_engine.mhc.trace import tensor_sha256

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_oracle_on_cuda_reproduces_the_golden_hashes(case):
    golden = load_golden()["cases"][case.name]["boundaries"]
    trace = oracle_trace(case, "cuda")
    assert all(t.is_cuda for t in trace.values())
    mismatched = [name for name, t in trace.items() if tensor_sha256(t) != golden[name]["sha256"]]
    assert not mismatched, f"CUDA bytes differ from the CPU golden hashes at {mismatched}"


@pytest.mark.parametrize("name", ["exp", "log", "sigmoid", "sqrt_rn", "rsqrt"])
def test_numerics_same_bytes_on_cpu_and_cuda(name):
    g = torch.Generator().manual_seed(7)
    x = torch.randn(1 << 22, generator=g) * 30
    if name in ("log", "sqrt_rn", "rsqrt"):
        x = x.abs() * torch.exp(torch.randn(1 << 22, generator=g) * 10)
    fn = getattr(nm, name)
    assert torch.equal(fn(x).view(torch.int32), fn(x.cuda()).cpu().view(torch.int32))


def test_lane_sum_same_bytes_on_cpu_and_cuda():
    x = torch.randn(64, 24, 16384, generator=torch.Generator().manual_seed(3))
    assert torch.equal(nm.lane_sum(x, 64).view(torch.int32), nm.lane_sum(x.cuda(), 64).cpu().view(torch.int32))


def test_reference_provider_passes_on_cuda():
    report = check_provider(ReferenceProvider(), [c for c in CASES if not c.production], device="cuda",
                            progress=None)
    assert report["passed"], [c["failures"] for c in report["cases"]]
