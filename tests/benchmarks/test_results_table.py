"""docs/results.md and the README's results table are what benchmarks/results_table.py makes of
benchmarks/results/*.json, so no number is copied by hand: a result file changed without regenerating fails here."""

import json
import shutil

import pytest


@pytest.fixture
def results_table(load_benchmark):
    return load_benchmark("results_table")


def test_results_page_and_readme_table_are_up_to_date(results_table):
    assert results_table.PAGE.read_text() == results_table.render(), \
        "docs/results.md is out of date: run python benchmarks/results_table.py"
    readme = results_table.README.read_text()
    assert readme == results_table.readme_with_summary(readme), \
        "README.md's results table is out of date: run python benchmarks/results_table.py"


def test_a_changed_number_changes_the_page(results_table, tmp_path):
    shutil.copy(results_table.RESULTS / "tp_decoder.json", tmp_path)
    before = results_table.render(tmp_path)
    data = json.loads((tmp_path / "tp_decoder.json").read_text())
    data["rows"][0]["tp_rank_ms"] = 12345.0  # planted
    (tmp_path / "tp_decoder.json").write_text(json.dumps(data))
    after = results_table.render(tmp_path)
    assert "12345" not in before and "| 1.234e+04 |" in after


def test_a_changed_number_changes_the_readme_row(results_table, tmp_path):
    for path in results_table.RESULTS.glob("*.json"):
        shutil.copy(path, tmp_path)
    before = results_table.summary(tmp_path)
    data = json.loads((tmp_path / "logp.json").read_text())
    row = next(r for r in data["rows"] if r["impl"] == "triton" and r["tokens"] == 8192)
    row["fwd_ms"], row["fwd_pct_copy"] = 2.0, 29.0  # planted: a slower kernel misses its goal
    (tmp_path / "logp.json").write_text(json.dumps(data))
    after = results_table.summary(tmp_path)
    assert "| logp fwd, 8192×151936 | 2 ms | Liger 1.19 ms | 0.60× | ≥ 85% of copy: 29% ✗ |" in after
    assert before != after


def test_check_flag(results_table, monkeypatch, tmp_path):
    assert results_table.main(["--check"]) == 0
    stale = tmp_path / "results.md"
    stale.write_text(results_table.PAGE.read_text().replace("tp_decoder", "tp_decoder_renamed", 1))
    monkeypatch.setattr(results_table, "PAGE", stale)
    assert results_table.main(["--check"]) == 1


def test_readme_without_markers_is_refused(results_table):
    with pytest.raises(ValueError, match="markers"):
        results_table.readme_with_summary("# a README without the table\n")
