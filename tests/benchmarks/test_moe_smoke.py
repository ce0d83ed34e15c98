"""benchmarks/moe.py end to end on the CPU (toy shapes, Triton interpreter): every code path but the CUDA
timing, so a Python error shows here and not on the H200. Also: its implementations agree, and a layer
wired wrong shows in the diff columns."""

import importlib.util
import json

import pytest
import torch


@pytest.fixture(scope="module")
def bench(load_benchmark):
    return load_benchmark("moe")


def _close(row, name, rel=0.05):
    """bf16 implementations of one function: max |diff| within 5% of the reference's max |value|."""
    return row[f"{name}_max_diff"] <= rel * row[f"{name}_max_abs"]


def test_cpu_run_writes_every_row(bench, tmp_path):
    assert bench.main(["--out", str(tmp_path), "--device", "cpu", "--quick"]) == 0
    result = json.loads((tmp_path / "moe.json").read_text())
    assert (tmp_path / "moe.png").exists() or importlib.util.find_spec("matplotlib") is None
    assert result["shapes"]["experts"] == bench.TOY.experts and result["tokens"] == [8]

    gemm = {(r["gemm"], r["impl"]): r for r in result["gemm_rows"]}
    assert set(gemm) == {(g, i) for g in ("gate_up", "down") for i in bench.GEMM_IMPLS}
    for (g, impl), row in gemm.items():
        assert "error" not in row, (g, impl, row)
        assert row["ms"] > 0 and row["tflop_per_s"] > 0 and row["rows"] == 8 * bench.TOY.top_k
        if impl != "cublas_dense_ref":  # the others compute the same product as the cuBLAS loop
            assert row["max_abs_diff"] <= 0.05, (g, impl, row["max_abs_diff"])
    assert gemm[("gate_up", "triton_grouped")]["pct_of_best_peer"] > 0
    assert all(gemm[(g, "triton_grouped")]["bitwise_vs_triton_loop"] for g in ("gate_up", "down"))

    layer = {r["impl"]: r for r in result["layer_rows"]}
    assert set(layer) == set(bench.LAYER_IMPLS)  # transformers 5 defaults to grouped_mm: eager is timed too
    for impl, row in layer.items():
        assert "error" not in row, (impl, row)
        assert row["fwd_ms"] > 0 and row["fwd_bwd_ms"] > 0 and row["diff_reference"] == "grouped_mm_layer"
        for name in ("out", *bench.GRAD_NAMES):
            assert _close(row, name), (impl, name, row[f"{name}_max_diff"], row[f"{name}_max_abs"])
        assert row["fwd_bwd_x_grouped_mm"] > 0
    assert "grouped_matmul->triton" in layer["triton"]["backend"]
    for impl in bench.PROFILED:  # the kernel breakdown (the CPU's ops here)
        top = layer[impl]["top_kernels"]
        assert isinstance(top, list) and top and all(k["ms"] > 0 and k["calls"] > 0 for k in top), top
    assert layer["transformers"]["backend"].endswith("experts_implementation=grouped_mm")


def test_a_layer_wired_wrong_shows_in_the_diffs(bench, monkeypatch):
    """Planted: the grouped_mm layer (the reference) forgets to renormalise the top-k weights."""
    layer = bench.grouped_mm_layer
    monkeypatch.setattr(bench, "grouped_mm_layer", lambda x, r, gu, d, k, norm: layer(x, r, gu, d, k, False))
    weights = bench.make_weights(bench.TOY, "cpu")
    rows = bench.layer_section(bench.TOY, (8,), weights, bench.Timer("cpu", True), "cpu", None,
                               names=("grouped_mm_layer", "transformers"))
    row = next(r for r in rows if r["impl"] == "transformers")
    assert not _close(row, "out") and not _close(row, "drouter")


def test_without_cuda_the_gpu_run_exits_2(bench, tmp_path, capsys):
    if torch.cuda.is_available():
        pytest.skip("CUDA is available: the GPU run would start")
    with pytest.raises(SystemExit) as exit_info:
        bench.main(["--out", str(tmp_path)])
    assert exit_info.value.code == 2 and "needs CUDA" in capsys.readouterr().err
