"""The triton_bf16 profile end to end: under the CPU interpreter (small and short), and on the GPU."""

import dataclasses

import pytest
import torch

from rl_engine.checks.forward_invariance.harness import run_harness
from rl_engine.models.families import CONFIGS
from rl_engine.models.weights import synthetic_weights
from rl_engine.workload.layouts import Sample
from rl_engine.workload.manifest import load_workload

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _mini(workload):
    """Two short samples and four cells: the interpreter takes seconds per op call."""
    a, b = workload.samples[0], workload.samples[1]
    samples = [Sample(0, a.token_ids[:4], 3), Sample(1, b.token_ids[:6], 3)]
    cells = [c for c in workload.cells if c.name in ("bn_packed", "b1_full", "bn_pad_left", "bn_chunked")]
    return dataclasses.replace(workload, samples=samples, permutation=[1, 0], chunk_size=4, cells=cells)


def test_triton_bf16_bitwise_invariance_and_parity(tiny_one_layer):
    config, weights, workload = tiny_one_layer
    weights = {n: t.to(DEVICE) for n, t in weights.items()}
    report = run_harness(config, weights, _mini(workload), "triton_bf16", DEVICE, gradients=False)
    assert report["provenance"]["passed"], report["provenance"]["failures"]
    assert not report["errors"], report["errors"]
    assert report["forward_invariance"]["passed"], report["forward_invariance"]
    for agg in report["parity"]["infer"].values():
        assert agg["bitwise"] and agg["max_abs_dlogp"] == agg["k3_kl"] == agg["clipfrac"] == 0.0
    assert report["accuracy"]["passed"], report["accuracy"]


@pytest.mark.gpu
def test_triton_bf16_passes_every_check_on_gpu():
    config = CONFIGS["tiny"]
    workload = load_workload(config)
    weights = {n: t.cuda() for n, t in synthetic_weights(config, workload.weight_seed).items()}
    report = run_harness(config, weights, workload, "triton_bf16", "cuda")
    assert not report["errors"], report["errors"]
    for check in ("forward_invariance", "gradient_invariance", "parity", "provenance", "accuracy"):
        assert report[check]["passed"], (check, report[check])


@pytest.mark.gpu
def test_torch_bf16_on_gpu_runs_and_reports():
    config = CONFIGS["tiny"]
    workload = load_workload(config)
    weights = {n: t.cuda() for n, t in synthetic_weights(config, workload.weight_seed).items()}
    report = run_harness(config, weights, workload, "torch_bf16", "cuda", gradients=False)
    assert not report["errors"], report["errors"]
    assert report["provenance"]["passed"]


@pytest.mark.gpu
def test_qwen3_8b_two_layers_triton_bitwise_on_gpu():
    from rl_engine.models.weights import content_hash

    config = CONFIGS["qwen3-8b"]
    workload = load_workload(config)
    short = config.with_layers(2)
    weights = synthetic_weights(short, workload.weight_seed, device="cuda")
    assert len(content_hash(weights)) == 64
    report = run_harness(short, weights, workload, "triton_bf16", "cuda", gradients=False)
    assert not report["errors"], report["errors"]
    assert report["forward_invariance"]["passed"] and report["parity"]["passed"] and report["provenance"]["passed"]
