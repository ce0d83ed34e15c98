"""docs/results.md is what benchmarks/results_table.py makes of benchmarks/results/*.json, so no number is copied by
hand: a result file changed without regenerating the page fails here."""

import json
import shutil


def test_results_page_is_up_to_date(load_benchmark):
    results_table = load_benchmark("results_table")
    assert results_table.PAGE.read_text() == results_table.render(), \
        "docs/results.md is out of date: run python benchmarks/results_table.py"


def test_a_changed_number_changes_the_page(load_benchmark, tmp_path):
    results_table = load_benchmark("results_table")
    shutil.copy(results_table.RESULTS / "tp_decoder.json", tmp_path)
    before = results_table.render(tmp_path)
    data = json.loads((tmp_path / "tp_decoder.json").read_text())
    data["rows"][0]["tp_rank_ms"] = 12345.0  # planted
    (tmp_path / "tp_decoder.json").write_text(json.dumps(data))
    after = results_table.render(tmp_path)
    assert "12345" not in before and "| 1.234e+04 |" in after


def test_check_flag(load_benchmark, monkeypatch, tmp_path):
    results_table = load_benchmark("results_table")
    assert results_table.main(["--check"]) == 0
    stale = tmp_path / "results.md"
    stale.write_text(results_table.PAGE.read_text().replace("tp_decoder", "tp_decoder_renamed", 1))
    monkeypatch.setattr(results_table, "PAGE", stale)
    assert results_table.main(["--check"]) == 1
