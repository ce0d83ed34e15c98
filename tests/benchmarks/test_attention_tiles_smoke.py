"""benchmarks/attention_tiles.py times kernels on the GPU only: without CUDA it exits 2 with one line."""

import sys

import pytest
import torch


def test_without_cuda_it_exits_2_with_one_line(load_benchmark, tmp_path, capsys, monkeypatch):
    if torch.cuda.is_available():
        pytest.skip("CUDA is available: the GPU sweep would start")
    bench = load_benchmark("attention_tiles")
    monkeypatch.setattr(sys, "argv", ["attention_tiles.py", "--out", str(tmp_path)])
    with pytest.raises(SystemExit) as exit_info:
        bench.main()
    err = capsys.readouterr().err
    assert exit_info.value.code == 2 and "needs CUDA" in err and len(err.strip().splitlines()) == 1
