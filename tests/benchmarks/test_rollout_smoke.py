"""benchmarks/rollout.py end to end on the CPU (toy model, interpreter): every path but the GPU figures,
so a Python error shows here and not in the H200's scarce minutes."""

import importlib.util
import json

import pytest


@pytest.fixture(scope="module")
def rollout(load_benchmark):
    return load_benchmark("rollout")


def _rows(out):
    return {(r["peer"], r["batch"], r["context"]): r for r in json.loads((out / "rollout.json").read_text())["rows"]}


def test_every_peer_gets_a_full_row_and_merge_keeps_the_rest(rollout, tmp_path):
    assert rollout.main(["--out", str(tmp_path), "--device", "cpu", "--batches", "2"]) == 0
    rows = _rows(tmp_path)
    assert set(rows) == {(p, 2, 6) for p in rollout.PEERS}
    for peer, row in ((k[0], v) for k, v in rows.items()):
        assert "error" not in row and "skipped" not in row, (peer, row)
        assert row["decode_tok_s"] > 0 and row["prefill_ms"] > 0 and row["e2e_tok_s"] > 0
        assert row["top_kernels"] and row["gpu_ms_per_step"] is None  # no GPU figure on a CPU
        # greedy on the same weights and prompts: the first tokens agree (a model given other weights would not)
        assert min(row["first_token_agree"].values()) == 1.0, (peer, row["first_token_agree"])
    for peer in rollout.ENGINE_PEERS:
        row = rows[(peer, 2, 6)]
        assert row["speedup_vs_hf"] > 0 and {"speedup_vs_hf_static", "speedup_vs_hf_dynamic"} <= set(row)
        # the one-graph step (decode graphs) or its three eager phases
        names = ("decode_graph_ms",) if peer != "triton_bf16_eager" else ("forward_ms", "sample_ms", "logprobs_ms")
        parts = [row[k] for k in names]
        # (per step over every decode step, the profiled ones included: on a CPU those run slower than the mean)
        assert all(p > 0 for p in parts) and row["other_ms"] == pytest.approx(row["decode_step_ms"] - sum(parts))
        assert row["overlapped_steps"] == (0 if peer == "triton_bf16_eager" else 1)  # 3 new tokens: 2 decode steps
        package = ".pytorch." if peer == "torch_bf16" else ".triton."
        assert row["ran"] and all(package in r for r in row["ran"]), row["ran"]  # the profile's ops ran
        # the rollout model's weights are packed: the Triton profile runs q/k/v and gate/up as one product each, and
        # q's and k's heads through one norm and one RoPE launch
        stacked = [] if peer == "torch_bf16" else ["gate_proj+up_proj", "q_norm+k_norm", "q_proj+k_proj+v_proj",
                                                   "q_rope+k_rope"]
        assert row["stacked_products"] == stacked, row["stacked_products"]
        assert bool(row["cuda_graphs"]) == (peer != "triton_bf16_eager"), row["cuda_graphs"]  # (captured on a GPU)
    assert rows[("hf_static", 2, 6)]["cache"] == "static" and rows[("hf_dynamic", 2, 6)]["cache"] == "dynamic"
    if importlib.util.find_spec("matplotlib"):
        assert (tmp_path / "rollout.png").exists()

    assert rollout.main(["--out", str(tmp_path), "--device", "cpu", "--batches", "1", "--peers", "hf_dynamic",
                         "--merge"]) == 0
    merged = _rows(tmp_path)
    assert set(merged) == set(rows) | {("hf_dynamic", 1, 6)}
    assert merged[("triton_bf16", 2, 6)]["decode_tok_s"] == rows[("triton_bf16", 2, 6)]["decode_tok_s"]
    # rows measured with other settings are not mixed in
    assert rollout.main(["--out", str(tmp_path), "--device", "cpu", "--batches", "1", "--peers", "hf_dynamic",
                         "--new-tokens", "4", "--merge"]) == 2
    assert _rows(tmp_path) == merged


@pytest.mark.parametrize("argv", [["--new-tokens", "2"], ["--batches", "0"], ["--temperature", "-1"],
                                  ["--layers", "99"]])  # more layers than the model has
def test_bad_arguments_exit_2_with_one_line(rollout, tmp_path, capsys, argv):
    with pytest.raises(SystemExit) as exc:
        rollout.main(["--out", str(tmp_path), "--device", "cpu", *argv])
    assert exc.value.code == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "invalid" in err


def test_spent_budget_skips_cells_and_a_failed_model_fills_its_rows(rollout, tmp_path, monkeypatch):
    assert rollout.main(["--out", str(tmp_path), "--device", "cpu", "--budget-s", "0"]) == 0
    rows = _rows(tmp_path)
    assert set(rows) == {(p, 1, 6) for p in rollout.PEERS} | {(p, 2, 6) for p in rollout.PEERS}
    assert all("time budget" in r["skipped"] and "decode_tok_s" not in r for r in rows.values())

    def broken(*args):
        raise RuntimeError("no transformers model today")

    monkeypatch.setattr(rollout, "hf_model", broken)
    assert rollout.main(["--out", str(tmp_path), "--device", "cpu", "--batches", "1", "--peers", "hf_static"]) == 0
    (row,) = _rows(tmp_path).values()
    assert row["peer"] == "hf_static" and "no transformers model today" in row["error"]


def test_gpu_probe_summary_on_recorded_kernels(rollout):
    """The CUDA branch of the profiler summary, on kernel events as torch.profiler reports them."""
    import torch
    from torch.autograd import DeviceType

    class Span:
        def __init__(self, start, us):
            self.start, self.end = start, start + us

        def elapsed_us(self):
            return self.end - self.start

    class Event:
        def __init__(self, name, device_type, start, us):
            self.name, self.device_type, self.time_range, self.self_cpu_time_total = (
                name, device_type, Span(start, us), us)

    class Prof:
        def events(self):
            return [Event("sm90_xmma_gemm_bf16", DeviceType.CUDA, 0.0, 2500.0),
                    Event("sm90_xmma_gemm_bf16", DeviceType.CUDA, 2000.0, 500.0),  # PDL: started inside the one before
                    Event("fmha_cutlassF_bf16_aligned_64x128_rf_sm80", DeviceType.CUDA, 3000.0, 1000.0),
                    Event("aten::mm", DeviceType.CPU, 0.0, 9000.0)]  # host time: not GPU time

    probe = rollout._Probe(torch.device("cuda"), steps=2)
    probe.prof = Prof()
    got = probe.summary()
    assert got["gpu_ms_per_step"] == 1.75  # busy 0-2.5 ms and 3-4 ms over 2 steps; the durations' sum would say 2.0
    # the dependent's wait inside the first gemm is the first gemm's time: 2.5 ms of gemm, 1 ms of fmha, over 2 steps
    assert [k["ms_per_step"] for k in got["top_kernels"]] == [1.25, 0.5]
    assert [k["name"] for k in got["top_kernels"]] == ["sm90_xmma_gemm_bf16",
                                                       "fmha_cutlassF_bf16_aligned_64x128_rf_sm80"]
    assert rollout._sdpa_backend(got["attention_kernels"]) == "efficient"
    assert rollout._sdpa_backend(["pytorch_flash::flash_fwd_kernel"]) == "flash"
    assert rollout._sdpa_backend(["cudnn_generated_fort_native_sdpa_sm90"]) == "cudnn"
    assert rollout._sdpa_backend([]) == "unknown"


def test_the_byte_floor_counts_weights_once_embedding_rows_and_the_batch_kv(rollout):
    import torch

    from rl_engine.models.weights import synthetic_weights

    config = rollout.SETUPS["cpu"]["model"]()
    weights = synthetic_weights(config, 0)
    embed = next(n for n in weights if "embed" in n)
    body = sum(t.numel() * 2 for n, t in weights.items() if n != embed)
    kv_token = 2 * config.num_layers * config.num_kv_heads * config.head_dim * 2
    assert weights[embed].dtype == torch.bfloat16
    assert rollout.step_bytes(config, weights, 1, 6, 4) == body + config.hidden_size * 2 + 8 * kv_token
    # a second row adds its embedding row and its KV, not the weights again
    assert rollout.step_bytes(config, weights, 3, 6, 4) - rollout.step_bytes(config, weights, 1, 6, 4) == (
        2 * config.hidden_size * 2 + 2 * 8 * kv_token)
