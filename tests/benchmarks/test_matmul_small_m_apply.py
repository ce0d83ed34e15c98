"""matmul_small_m.py --apply: the sweep's winner is written into a copy of matmul.py as a shape's override only where
it kept the bits and beats the config dispatched now; the file stays valid Python and its other lines are kept."""

from __future__ import annotations

import ast
import shutil


def _row(shape, ms, bits=0, block_k=256, persistent=True, ms_m128=None, **fields):
    return {**fields, "shape": shape, "bits_differ": bits, "ms_m1": ms, "ms_m128": ms if ms_m128 is None else ms_m128,
            "block_m": 64, "block_n": 64,
            "block_k": block_k, "group_m": 8, "num_warps": 4, "num_stages": 3, "tma": True, "persistent": persistent}


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
    assert 'SmallMConfig(256, MatmulConfig(64, 64, 256, num_warps=4)),  # qkv' in after
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
    now = mod.source(mod.table_tiers(mod.DTYPE, 24576, 4096)[-1].config)
    assert line.startswith(f'("bfloat16", 24576, 4096): (SmallMConfig({mod.NARROW_MAX_M}, MatmulConfig(64, 64, 128, '
                           f'num_warps=4)), SmallMConfig(128, {now})),  # gate_up'), line
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
    for l2 in (1 << 16, 1 << 17):
        mod.apply_overrides([_row("gate_up", 0.03, block_k=128, ms_m128=0.09, l2_prefetch=l2, swap_ab=True)], timing,
                            str(path))
        text = path.read_text()
        assert max(len(x) for x in text.splitlines()) <= mod.SOURCE_LINE_CHARS
        namespace = {}
        exec(compile(ast.parse(text), str(path), "exec"), namespace)
        tiers = namespace["SMALL_M_OVERRIDES"][("bfloat16", 24576, 4096)]
        assert [t.max_m for t in tiers] == [mod.NARROW_MAX_M, 128] and tiers[0].config.l2_prefetch == l2
        assert text.count('("bfloat16", 24576, 4096)') == 1 and text.count("l2_prefetch=") == 1
