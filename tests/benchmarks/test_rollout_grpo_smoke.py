"""benchmarks/rollout_grpo.py end to end on the CPU (toy model, interpreter): every row, the sharing check and the
bits rows, so a Python error shows here and not in the GPU's scarce minutes."""

import importlib.util
import json

import pytest
import torch

from rl_engine.rollout import Completion

# 6 of the greedy probe's ids: at the toy sizes some sequences then stop (4 would stop none)
TOY = ["--device", "cpu", "--stops", "6"]


@pytest.fixture(scope="module")
def grpo(load_benchmark):
    return load_benchmark("rollout_grpo")


def _load(out):
    return json.loads((out / "rollout_grpo.json").read_text())


@pytest.fixture(scope="module")
def full_run(grpo, tmp_path_factory):
    out = tmp_path_factory.mktemp("grpo")
    grpo.TRAIN_TOKENS = 20  # the trainer's recompute in micro-batches of 2 toy sequences (9 tokens each)
    return grpo.main(["--out", str(out), *TOY]), out


def test_every_row_and_the_bits(grpo, full_run):
    code, out = full_run
    assert code == 0
    data = _load(out)
    assert data["complete"] and data["workload"]["samples"] == 2 and data["stop_ids_from"] == "greedy probe"
    assert len(data["stop_ids"]) == 6
    rows = {r["peer"]: r for r in data["rows"]}
    assert set(rows) == {*grpo.ENGINE_ROWS, grpo.HF_ROW}
    sequences = data["workload"]["prompts"] * data["workload"]["samples"]
    for peer, row in rows.items():
        assert "error" not in row and "skipped" not in row, (peer, row)
        assert row["wall_s"] > 0 and row["tok_s"] > 0 and row["sequences"] == sequences
        assert 0 < row["generated_tokens"] <= sequences * data["workload"]["new_tokens"]
        assert row["peak_gib"] is None and row["memory_goal_gib"] > row["weights_gib"] + row["kv_gib"]  # no GPU figure
    on, off = rows["triton_bf16"], rows["triton_bf16_no_sharing"]
    for row in (on, off):
        assert {"preemptions", "graph_steps", "overlapped_steps", "dropped_rows"} <= set(row)
        assert row["graph_steps"] > 0 and row["overlapped_steps"] > 0  # the decode graph path ran (eagerly on a CPU)
    assert 0 < on["stopped"] < sequences and on["stopped"] == off["stopped"]  # some stop, not all
    assert on["generated_tokens"] == off["generated_tokens"]
    # sharing: each group's later members read the prompt's pages instead of prefilling it
    assert on["shared_prompt_tokens"] > 0 and off["shared_prompt_tokens"] == 0
    assert on["prefill_tokens"] < off["prefill_tokens"]
    assert data["checks"]["sharing_on_vs_off"] == {"same_tokens": True, "same_logprobs": True,
                                                   "token_mismatches": [], "logprob_mismatches": []}
    assert data["ratios"]["sharing_on_over_off"] > 0 and data["ratios"]["sharing_on_over_hf"] > 0
    assert rows[grpo.HF_ROW]["cache"] in ("static", "dynamic")
    # triton_bf16: the rollout's logprobs are the trainer's bits; torch_bf16 is not batch invariant
    triton, torch_bits = data["bits"]["triton_bf16"], data["bits"]["torch_bf16"]
    assert triton["bitwise_equal"] and triton["metrics"]["rollout_corr/max_abs_dlogp"] == 0.0
    assert triton["metrics"]["rollout_corr/kl"] == 0.0 and triton["sequences"] == 2 * data["workload"]["samples"]
    assert "rollout_corr/max_abs_dlogp" in torch_bits["metrics"] and "error" not in torch_bits
    if importlib.util.find_spec("matplotlib"):
        assert (out / "rollout_grpo.png").exists()


def test_a_planted_token_difference_is_flagged(grpo, tmp_path, monkeypatch):
    generate = grpo.RolloutEngine.generate

    def planted(engine, requests):  # sharing off gets one token wrong in its timed run
        out = generate(engine, requests)
        if not engine.prefix_sharing:
            out[1].token_ids[-1] += 1
        return out

    monkeypatch.setattr(grpo.RolloutEngine, "generate", planted)
    argv = ["--out", str(tmp_path), "--device", "cpu", "--stop-ids", "4", "27",
            "--rows", "triton_bf16", "triton_bf16_no_sharing", "--bits-groups", "0", "--prompts", "1",
            "--max-batch", "2", "--new-tokens", "3"]
    assert grpo.main(argv) == 1
    check = _load(tmp_path)["checks"]["sharing_on_vs_off"]
    assert not check["same_tokens"] and not check["same_logprobs"] and check["token_mismatches"] == [1]


def test_compare_flags_logprob_bits_and_missing_sequences(grpo):
    def done(token, logprob):
        return {0: Completion(0, (1,), [token], torch.tensor([logprob]), torch.tensor([logprob]), "length")}

    assert grpo.compare(done(5, -1.0), done(5, -1.0))["same_logprobs"]
    bits = grpo.compare(done(5, -1.0), done(5, -1.0 + 2**-20))
    assert bits["same_tokens"] and not bits["same_logprobs"] and bits["logprob_mismatches"] == [0]
    assert not grpo.compare(done(5, -1.0), {})["same_tokens"]


def test_spent_budget_skips_every_row(grpo, tmp_path):
    assert grpo.main(["--out", str(tmp_path), *TOY, "--budget-s", "0", "--new-tokens", "3"]) == 0
    data = _load(tmp_path)
    assert all("time budget" in r["skipped"] for r in data["rows"]) and len(data["rows"]) == 3
    assert all("time budget" in b["skipped"] for b in data["bits"].values()) and data["checks"] is None


@pytest.mark.parametrize("argv", [["--samples", "0"], ["--top-p", "0"], ["--bits-groups", "-1"],
                                  ["--rows", "bits", "hf_generate"]])
def test_bad_arguments_exit_2_with_one_line(grpo, tmp_path, capsys, argv):
    with pytest.raises(SystemExit) as exc:
        grpo.main(["--out", str(tmp_path), "--device", "cpu", *argv])
    assert exc.value.code == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "invalid" in err


def test_merge_adds_a_row_to_an_earlier_run_of_the_same_workload_only(grpo, tmp_path, capsys):
    """A full-size run split over device calls: the engine rows first, transformers in a later call (--merge)."""
    small = ["--out", str(tmp_path), *TOY, "--prompts", "1", "--max-batch", "2", "--new-tokens", "3",
             "--bits-groups", "1"]
    assert grpo.main([*small, "--rows", "triton_bf16", "triton_bf16_no_sharing", "bits"]) == 0
    first = _load(tmp_path)
    assert grpo.main([*small, "--rows", "hf_generate", "--merge"]) == 0
    merged = _load(tmp_path)
    assert [r["peer"] for r in merged["rows"]] == ["triton_bf16", "triton_bf16_no_sharing", "hf_generate"]
    assert merged["rows"][0] == first["rows"][0] and merged["bits"] == first["bits"]
    assert merged["checks"] == first["checks"] and merged["stop_ids"] == first["stop_ids"]
    assert merged["ratios"]["sharing_on_over_hf"] > 0
    with pytest.raises(SystemExit) as exc:  # another workload: refused, the file kept
        grpo.main([*small[:-4], "--new-tokens", "4", "--bits-groups", "1", "--rows", "hf_generate", "--merge"])
    assert exc.value.code == 2 and "another workload" in capsys.readouterr().err
    assert _load(tmp_path) == merged
