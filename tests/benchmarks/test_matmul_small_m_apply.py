"""matmul_small_m.py --apply: the sweep's winner is written into a copy of matmul.py as a shape's override only where
it kept the bits and beats the config dispatched now; the file stays valid Python and its other lines are kept."""

from __future__ import annotations

import ast
import shutil


def _row(shape, ms, bits=0, block_k=256, persistent=True, ms_m128=None, swap_ab=False):
    return {"swap_ab": swap_ab, "shape": shape, "bits_differ": bits, "ms_m1": ms,
            "ms_m128": ms if ms_m128 is None else ms_m128, "block_m": 64, "block_n": 64, "block_k": block_k,
            "group_m": 8, "num_warps": 4, "num_stages": 3, "tma": True, "persistent": persistent}


def test_apply_writes_only_faster_bit_equal_winners(load_benchmark, tmp_path):
    mod = load_benchmark("matmul_small_m")
    path = tmp_path / "matmul.py"
    shutil.copy(mod.MATMUL_SOURCE, path)
    before = path.read_text()
    timing = [{"shape": s, "M": m, "ours_ms": 0.05} for s in ("qkv", "down", "k/v") for m in mod.SWEEP_BATCH]
    sweep = [
        _row("qkv", 0.03), _row("qkv", 0.01, bits=5),  # the faster one changed bits: never chosen
        _row("qkv", 0.02, persistent=False),  # one-tile: not written (the line's form is persistent)
        _row("down", 0.049),  # 2% faster: under the margin
        _row("k/v", 0.04, block_k=128),  # replaces the existing k/v line
    ]
    written = mod.apply_overrides(sweep, timing, str(path))
    assert [w.split(":")[0] for w in written] == ['("bfloat16", 6144, 4096)', '("bfloat16", 1024, 4096)']
    after = path.read_text()
    ast.parse(after)
    assert after.count('("bfloat16", 1024, 4096)') == 1 and "MatmulConfig(64, 64, 128," in after
    assert "SmallMConfig(128, MatmulConfig(64, 64, 256, num_warps=4))" in after  # M = 1 and 128's tiers, merged
    assert after.replace(after[after.index("SMALL_M_OVERRIDES: "):after.index("\n}\n", after.index(
        "SMALL_M_OVERRIDES: "))], "") == before.replace(before[before.index("SMALL_M_OVERRIDES: "):before.index(
            "\n}\n", before.index("SMALL_M_OVERRIDES: "))], "")  # nothing outside the dict changed
    assert mod.apply_overrides([_row("qkv", 0.06)], timing, str(path)) == []  # slower: nothing written


def test_apply_writes_a_tier_per_m_where_the_winners_differ(load_benchmark, tmp_path):
    """A candidate faster at M = 1 only takes the narrow tier; the wide tier keeps the config dispatched at M = 128."""
    mod = load_benchmark("matmul_small_m")
    path = tmp_path / "matmul.py"
    shutil.copy(mod.MATMUL_SOURCE, path)
    timing = [{"shape": "gate_up", "M": m, "ours_ms": 0.05} for m in mod.SWEEP_BATCH]
    (line,) = mod.apply_overrides([_row("gate_up", 0.03, block_k=128, ms_m128=0.09)], timing, str(path))
    now = ", ".join(f"SmallMConfig({t.max_m}, {mod.source(t.config)})"
                    for t in mod.table_tiers(mod.DTYPE, 24576, 4096)[1:])
    assert line.startswith(f'("bfloat16", 24576, 4096): (SmallMConfig({mod.NARROW_MAX_M}, MatmulConfig(64, 64, 128, '
                           f'num_warps=4)), {now}),  # gate_up'), line
    ast.parse(path.read_text())


def test_apply_writes_a_swapped_winner_with_its_flag(load_benchmark, tmp_path):
    mod = load_benchmark("matmul_small_m")
    path = tmp_path / "matmul.py"
    shutil.copy(mod.MATMUL_SOURCE, path)
    timing = [{"shape": "q/o", "M": m, "ours_ms": 0.05} for m in mod.SWEEP_BATCH]
    row = {**_row("q/o", 0.02, block_k=64, ms_m128=0.5), "block_m": 16, "swap_ab": True}
    (line,) = mod.apply_overrides([row], timing, str(path))
    assert f"SmallMConfig({mod.NARROW_MAX_M}, MatmulConfig(16, 64, 64, num_warps=4, swap_ab=True))" in line, line
    # q/o's other tiers (M 17-128, 129-256) are kept: a winner replaces only the tier of the M it won at
    rest = [f"SmallMConfig({t.max_m}, {mod.source(t.config)})" for t in mod.table_tiers(mod.DTYPE, 4096, 4096)[1:]]
    assert len(rest) == 2 and all(r in line for r in rest), line
    assert [c.swap_ab for c in mod.candidates(False, [64, 128], swap_ab=True)] == [True] * 16


def test_apply_writes_a_long_entry_one_tier_a_line_and_replaces_it_again(load_benchmark, tmp_path):
    """An entry past ruff's 120 characters is written a tier a line; a second --apply replaces all of its lines."""
    mod = load_benchmark("matmul_small_m")
    path = tmp_path / "matmul.py"
    shutil.copy(mod.MATMUL_SOURCE, path)
    timing = [{"shape": "gate_up", "M": m, "ours_ms": 0.05} for m in mod.SWEEP_BATCH]
    for stages in (5, 7):
        mod.apply_overrides([{**_row("gate_up", 0.03, block_k=128, ms_m128=0.09, swap_ab=True), "num_stages": stages}],
                            timing, str(path))
        text = path.read_text()
        assert max(len(x) for x in text.splitlines()) <= mod.SOURCE_LINE_CHARS
        namespace = {}
        exec(compile(ast.parse(text), str(path), "exec"), namespace)
        tiers = namespace["SMALL_M_OVERRIDES"][("bfloat16", 24576, 4096)]
        assert [t.max_m for t in tiers] == [t.max_m for t in mod.table_tiers(mod.DTYPE, 24576, 4096)]
        assert tiers[0].config.num_stages == stages
        assert text.count('("bfloat16", 24576, 4096)') == 1 and text.count(f"num_stages={stages}, swap_ab") == 1


def test_apply_splits_a_tier_whose_swept_ms_differ_and_adds_one_past_the_tiers(load_benchmark, tmp_path, monkeypatch):
    """A winner at M = 256 only takes 129..256 of a tier that also holds M = 128 (which keeps its config); at a shape
    whose tiers end below 256 it gets a tier of its own there."""
    mod = load_benchmark("matmul_small_m")
    monkeypatch.setattr(mod, "SWEEP_BATCH", [128, 256])
    path = tmp_path / "matmul.py"
    shutil.copy(mod.MATMUL_SOURCE, path)
    wide = {"block_m": 128, "block_n": 128, "block_k": 64, "num_warps": 8, "num_stages": 6}
    timing = [{"shape": s, "M": m, "ours_ms": 0.05} for s in ("qkv", "gate_up") for m in (128, 256)]
    sweep = [{**_row(s, 0.06, block_k=64, ms_m128=0.06), "ms_m256": 0.03, **wide} for s in ("qkv", "gate_up")]
    mod.apply_overrides(sweep, timing, str(path))
    namespace = {}
    exec(compile(ast.parse(path.read_text()), str(path), "exec"), namespace)
    winner = namespace["MatmulConfig"](128, 128, 64, num_warps=8, num_stages=6)
    for key in (("bfloat16", 6144, 4096), ("bfloat16", 24576, 4096)):
        before = mod.table_tiers(mod.DTYPE, *key[1:])
        after = namespace["SMALL_M_OVERRIDES"][key]
        assert [t.max_m for t in after][-2:] == [128, 256] and after[-1].config == winner, after
        assert [str(t.config) for t in after if t.max_m <= 128] == [str(t.config) for t in before if t.max_m <= 128]
