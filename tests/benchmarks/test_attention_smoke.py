"""benchmarks/attention.py end to end on the CPU (toy shapes, Triton interpreter): every code path but the
CUDA timing, so a Python error shows here and not in the H200's scarce minutes. FlashAttention-4 is a
stand-in package (SDPA inside) reached through a .pth file in --site-dir, as the real one is on the H200."""

import importlib.util
import json
import sys

import pytest
import torch
import triton

FAKE_FA4 = '''
import torch.nn.functional as F


def flash_attn_func(q, k, v, softmax_scale=None, causal=False):
    # [B,S,H,D] in and out, GQA by head counts, (out, lse) as flash-attn-4 4.0.0b36 returns
    qt, kt, vt = (t.transpose(1, 2) for t in (q, k, v))
    return F.scaled_dot_product_attention(qt, kt, vt, is_causal=causal, enable_gqa=True).transpose(1, 2), None
'''


@pytest.fixture(scope="module")
def bench(load_benchmark):
    return load_benchmark("attention")


@pytest.fixture
def fake_fa4_site(tmp_path, monkeypatch):
    """A site folder whose .pth file points at a stand-in flash_attn.cute (+ its dist-info)."""
    packages = tmp_path / "packages"
    (packages / "flash_attn" / "cute").mkdir(parents=True)
    (packages / "flash_attn" / "__init__.py").write_text("")
    (packages / "flash_attn" / "cute" / "__init__.py").write_text(FAKE_FA4)
    info = packages / "flash_attn_4-4.0.0b36.dist-info"
    info.mkdir()
    info.joinpath("METADATA").write_text("Metadata-Version: 2.1\nName: flash-attn-4\nVersion: 4.0.0b36\n")
    site_dir = tmp_path / "site"
    site_dir.mkdir()
    (site_dir / "fa4.pth").write_text(f"{packages}\n")
    monkeypatch.setattr(sys, "path", list(sys.path))
    yield site_dir
    for name in [n for n in sys.modules if n == "flash_attn" or n.startswith("flash_attn.")]:
        del sys.modules[name]


def test_cpu_run_writes_every_row(bench, fake_fa4_site, tmp_path):
    out = tmp_path / "out"
    assert bench.main(["--out", str(out), "--device", "cpu", "--quick", "--site-dir", str(fake_fa4_site)]) == 0
    result = json.loads((out / "attention.json").read_text())
    assert (out / "attention.png").exists() or importlib.util.find_spec("matplotlib") is None
    assert result["peers"]["fa4"] == "flash-attn-4 4.0.0b36"
    assert result["sections_done"] == ["prefill", "decode", "consistency"]

    toy = bench.TOY
    prefill = {(r["S"], r["head_dim"], r["mode"]): r for r in result["prefill"]}
    assert set(prefill) == {(s, d, m) for s, d in toy.quick_prefill for m in bench.MODES}
    for key, row in prefill.items():
        assert not [k for k in row if k.endswith("error")], (key, row)
        for name in ("triton", *bench.PEERS):
            assert row[f"{name}_ms"] > 0 and row[f"{name}_tflop_per_s"] > 0, (key, name)
            assert row[f"ratio_vs_{name}"] > 0 if name != "triton" else True
        assert row["B"] * row["S"] == toy.tokens
        assert row["triton_path"] == "flash.py (interpreter)" and row["triton_version"] == triton.__version__
        # CPU torch runs its own flash kernel whichever backend is asked for; the profiler names it.
        assert row["sdpa_backend"] == row["sdpa_flash_backend"] == "flash_cpu", row
        assert row["fastest_peer"].split(" ")[0] in bench.PEERS and row["ratio_vs_fastest"] > 0
        assert row["ratio_vs_fastest_timing"] == "single calls"  # pairs of wall-clock calls would add nothing
        if row["mode"] == "forward":
            for name in bench.PEERS:  # bf16 outputs of one function; a layout or mask slip is O(1)
                assert row[f"max_abs_diff_vs_{name}"] <= 0.05, (key, name, row[f"max_abs_diff_vs_{name}"])
            assert row["goal_status"] == "n/a"  # the forward goal starts at S = 4096
        else:
            assert row["goal_status"] in ("met", "missed") and row["goal"] == ">= 0.75x fastest peer"

    decode = {(r["batch"], r["cached"]): r for r in result["decode"]}
    assert set(decode) == {(b, n) for b in toy.quick_batches for n in toy.quick_cache_lens}
    for key, row in decode.items():
        assert "error" not in row and "triton_error" not in row and "sdpa_error" not in row, (key, row)
        assert row["triton_ms"] > 0 and row["ratio_vs_sdpa"] > 0 and row["sdpa_backend"] == "flash_cpu"
        assert row["triton_path"] == "flash.py (interpreter)" and row["triton_version"] == triton.__version__
        assert row["max_abs_diff_vs_sdpa"] <= 0.05, (key, row["max_abs_diff_vs_sdpa"])
    assert decode[(1, toy.quick_cache_lens[0])]["goal_status"] in ("met", "missed")

    consistency = result["consistency"]
    assert consistency["tokens"] == sum(toy.consistency_lengths)
    assert {k: v for k, v in consistency.items() if k.endswith("mismatching_tokens")} == {
        "packed_mismatching_tokens": 0, f"chunked_{toy.chunk}_mismatching_tokens": 0, "decode_mismatching_tokens": 0}


def test_without_fa4_the_reason_is_recorded(bench, monkeypatch):
    monkeypatch.setitem(sys.modules, "flash_attn", None)  # as if absent, even where it is installed
    func, status = bench.load_fa4()
    assert func is None and status.startswith("unavailable: ModuleNotFoundError")


@pytest.mark.parametrize("names, path", [
    ({"gluon_forward_kernel", "aten::empty"}, "gluon"),
    ({"_flash_backward_delta_kernel", "gluon_dq_kernel", "gluon_dkdv_kernel"}, "gluon"),  # delta is flash.py's
    ({"_flash_forward_kernel", "_split_combine_kernel"}, "flash.py"),
    ({"_flash_backward_delta_kernel", "_flash_backward_dq_kernel", "_flash_backward_dkdv_kernel"}, "flash.py"),
    ({"void at::native::vectorized_elementwise_kernel"}, "unknown"),  # no attention kernel: never a guess
])
def test_our_path_is_named_from_the_kernels_that_ran(bench, names, path):
    assert bench.path_from_names(names).startswith(path)


@pytest.mark.parametrize("names, backend", [
    ({"aten::scaled_dot_product_attention", "aten::_scaled_dot_product_cudnn_attention",
      "cudnn_generated_fort_native_sdpa_sm90_flash_fprop_wgmma_f16_knob_7_64x128x128_4x1x1_kernel0_0"}, "cudnn"),
    ({"aten::_scaled_dot_product_flash_attention", "aten::_flash_attention_forward",
      "void pytorch_flash::flash_fwd_kernel<Flash_fwd_kernel_traits<128, 128, 64, 4>, true>(Flash_fwd_params)",
      "aten::_scaled_dot_product_flash_attention_backward", "void pytorch_flash::flash_bwd_dq_dk_dv_loop_kernel"},
     "flash"),
    ({"aten::_scaled_dot_product_efficient_attention", "fmha_cutlassF_bf16_aligned_64x64_rf_sm80"}, "efficient"),
    ({"aten::_scaled_dot_product_attention_math", "aten::bmm", "sm90_xmma_gemm_bf16bf16_bf16f32"}, "math"),
    ({"aten::_scaled_dot_product_flash_attention_for_cpu"}, "flash_cpu"),
    ({"cudnn_generated_fort_native_sdpa_sm90_knob_7"}, "cudnn"),  # kernels alone, when they agree
])
def test_sdpa_backend_is_named_from_ops_and_kernels(bench, names, backend):
    assert bench.sdpa_backend_from_names(names) == backend


@pytest.mark.parametrize("names", [
    {"aten::_scaled_dot_product_flash_attention", "cudnn_generated_fort_native_sdpa_sm90_knob_7"},  # disagree
    {"aten::_scaled_dot_product_flash_attention", "aten::_scaled_dot_product_efficient_attention"},
    {"aten::scaled_dot_product_attention", "aten::bmm"},  # nothing says which
])
def test_sdpa_backend_is_unknown_unless_the_evidence_agrees(bench, names):
    assert bench.sdpa_backend_from_names(names).startswith("unknown")


def test_sdpa_backend_from_the_profiler(bench):
    q = torch.randn(1, 8, 4, 16, dtype=torch.bfloat16)
    k, v = torch.randn(2, 1, 8, 2, 16, dtype=torch.bfloat16)
    assert bench.sdpa_backend(lambda: bench.sdpa(q, k, v), cuda=False) == "flash_cpu"

    def math_only():
        from torch.nn.attention import SDPBackend, sdpa_kernel

        with sdpa_kernel(SDPBackend.MATH):
            return bench.sdpa(q, k, v)

    assert bench.sdpa_backend(math_only, cuda=False) == "math"


def test_goals_are_marked_met_or_missed(bench):
    assert bench.prefill_goal("forward", 4096, 0.85) == (">= 0.85x fastest peer", "met")
    assert bench.prefill_goal("forward", 8192, 0.84)[1] == "missed"
    assert bench.prefill_goal("forward", 2048, 0.1) == (None, "n/a")
    assert bench.prefill_goal("forward+backward", 2048, 0.74)[1] == "missed"
    assert bench.prefill_goal("forward+backward", 2048, None)[1] == "not measured"
    assert bench.decode_goal({"batch": 16, "cached": 4096, "triton_pct_copy": 59.0})[1] == "missed"
    assert bench.decode_goal({"batch": 64, "cached": 8192, "triton_pct_copy": 61.0})[1] == "met"
    assert bench.decode_goal({"batch": 1, "cached": 1024, "ratio_vs_sdpa": 0.05})[1] == "missed"
    # With CUDA-graph times on both sides, batch 1 is judged on them (the host's launch cost removed).
    graphed = bench.decode_goal({"batch": 1, "cached": 1024, "ratio_vs_sdpa": 0.05, "graph_ratio_vs_sdpa": 0.7})
    assert graphed[1] == "met" and "CUDA graphs" in graphed[0]
    assert bench.decode_goal({"batch": 1, "cached": 1024, "triton_pct_copy": float("nan")})[1] == "not measured"
    assert bench.decode_goal({"batch": 4, "cached": 8192, "triton_pct_copy": 90.0}) == (None, "n/a")


def test_the_batch1_decode_goal_ratio_comes_from_graphs_in_abba_pairs(bench):
    """graph_ratio_in_pairs: SDPA's graph time over ours, both through timer.graph_ms in alternating order, so a
    bias of whichever graph is timed second cancels. Planted: one timing each, ours first (what decode_rows' single
    timings do) reads the same bias as a 10% faster step."""
    order = []

    class BiasedGraphs:
        def graph_ms(self, fn):  # ours 12 us, SDPA 7.2 us; the second of each back-to-back pair 10% slower
            order.append(fn())
            return {"ours": 0.012, "sdpa": 0.0072}[order[-1]] * (1.10 if len(order) % 2 == 0 else 1.0)

    timer = BiasedGraphs()
    ratio = bench.graph_ratio_in_pairs(lambda *a: "ours", lambda *a: "sdpa", (), timer)["ratio"]
    assert order[:4] == ["ours", "sdpa", "sdpa", "ours"] and abs(ratio - 0.6) < 0.005
    order.clear()
    single = timer.graph_ms(lambda: "sdpa") / timer.graph_ms(lambda: "ours")
    assert abs(single - 0.6) > 0.04


def test_the_ratio_panel_draws_both_goals(bench, monkeypatch, tmp_path):
    drawn = {}
    monkeypatch.setattr(bench, "save_plot", lambda out, name, panels: drawn.setdefault("panels", panels))
    rows = [{"S": 4096, "head_dim": 128, "mode": mode, "ratio_vs_fastest": 0.7}
            for mode in ("forward", "forward+backward")]
    bench.plot(str(tmp_path), rows, [], 800.0, 4000.0)
    ratio = next(p for p in drawn["panels"] if p["ylabel"] == "ratio" and p.get("kind") == "bar")
    assert ratio["hline"] == [(0.85, "forward goal"), (0.75, "forward+backward goal")]
    assert ratio["series"]["forward+backward"] == [0.7]
    monkeypatch.undo()  # the real save_plot: one line or several, both drawn
    assert bench.save_plot(str(tmp_path), "lines", [ratio, dict(ratio, hline=(0.5, "one"))]).endswith("lines.png")


def test_the_fastest_peer_is_timed_again_in_pairs_for_the_goal(bench):
    row = {"S": 4096, "mode": "forward", "triton_ms": 2.0, "sdpa_ms": 1.0, "sdpa_backend": "cudnn",
           "sdpa_flash_ms": 1.5, "fa4_error": "unavailable: x"}
    asked = []
    bench.judge_prefill(row, bench.PEERS, lambda peer: asked.append(peer) or 0.9)
    assert asked == ["sdpa"] and row["fastest_peer"] == "sdpa (cudnn)"
    # the goal is judged on the pairs' ratio (0.9: met), not on the single timings' (0.5: missed)
    assert row["ratio_vs_fastest"] == 0.9 and row["ratio_vs_fastest_timing"] == "ABBA pairs"
    assert row["goal_status"] == "met"
    assert row["ratio_vs_sdpa"] == 0.5 and row["ratio_vs_sdpa_flash"] == 0.75 and "ratio_vs_fa4" not in row
    single = dict(row)
    bench.judge_prefill(single, bench.PEERS)  # without pairs: the single timings' ratio
    assert single["ratio_vs_fastest"] == 0.5 and single["ratio_vs_fastest_timing"] == "single calls"
    assert single["goal_status"] == "missed"


def test_a_peer_computing_another_function_shows_in_the_diff(bench):
    """Planted: a peer that forgets the causal mask."""
    from rl_engine.kernels.ops.triton.attention import triton_attention

    q = torch.randn(1, 16, 4, 16, dtype=torch.bfloat16)
    k, v = torch.randn(2, 1, 16, 2, 16, dtype=torch.bfloat16)
    assert bench.max_abs_diff(triton_attention, bench.sdpa, (q, k, v))["max_abs_diff"] <= 0.05
    no_mask = bench.max_abs_diff(triton_attention, lambda *a: bench.sdpa(*a, causal=False), (q, k, v))
    assert no_mask["max_abs_diff"] > 0.1


def test_bad_command_lines_exit_2(bench, tmp_path, capsys):
    with pytest.raises(SystemExit) as exit_info:
        bench.main(["--out", str(tmp_path), "--device", "cpu", "--site-dir", str(tmp_path / "missing")])
    assert exit_info.value.code == 2 and "--site-dir: no such folder" in capsys.readouterr().err
    if torch.cuda.is_available():
        return
    with pytest.raises(SystemExit) as exit_info:
        bench.main(["--out", str(tmp_path)])
    assert exit_info.value.code == 2 and "needs CUDA" in capsys.readouterr().err
