"""docs/results.md from benchmarks/results/*.json: every table of every benchmark run, never copied by hand.

    python benchmarks/results_table.py           # rewrites docs/results.md
    python benchmarks/results_table.py --check   # exit 1 if docs/results.md differs from what the JSON gives

A list of records in a result file becomes a table (one column per field); the other fields are listed above it.
Floats are shown to 4 significant digits; the JSON beside each section has the full values.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
PAGE = ROOT / "docs" / "results.md"

HEADER = """# Benchmark results on the H200

Generated from `benchmarks/results/*.json` by `python benchmarks/results_table.py`: do not edit by hand
(`tests/benchmarks/test_results_table.py` fails when this page and the JSON disagree). Each section is one
benchmark script's last run (`benchmarks/<name>.py`), with the run's environment and the ceilings it measured;
the PNG beside each JSON plots it. The README has one summary row per op; `docs/kernels.md` says what each
number cost and what was tried; `docs/evidence/` holds the logs.
"""


def fmt(value, cell: bool = True) -> str:
    """A value: floats to 4 significant digits, nested values as compact JSON (a long one in a table cell is
    left to the JSON), `|` escaped."""
    if isinstance(value, bool) or value is None:
        text = str(value)
    elif isinstance(value, float):
        text = f"{value:.4g}"
    elif isinstance(value, (dict, list)):
        text = json.dumps(value, separators=(", ", ": "), default=str, ensure_ascii=False)
        text = text if not cell or len(text) <= 160 else f"({len(value)} entries: see the JSON)"
    else:
        text = str(value)
    return " ".join(text.split()).replace("|", "\\|")


def is_table(value) -> bool:
    return isinstance(value, list) and bool(value) and all(isinstance(r, dict) for r in value)


def table(rows: list[dict]) -> list[str]:
    columns = list(dict.fromkeys(k for r in rows for k in r))
    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    lines += ["| " + " | ".join(fmt(r.get(c, "")) for c in columns) + " |" for r in rows]
    return lines


def bullets(key: str, value, indent: str = "") -> list[str]:
    if isinstance(value, dict) and value:
        return [f"{indent}- {key}:"] + [line for k, v in value.items() for line in bullets(k, v, indent + "  ")]
    return [f"{indent}- {key}: {fmt(value, cell=False)}"]


def section(name: str, data: dict, depth: int = 3) -> list[str]:
    """The scalar and nested fields as a list, then each list of records as a table (sub-dicts recurse)."""
    lines, tables = [], []
    for key, value in data.items():
        if is_table(value):
            tables.append((key, value))
        elif isinstance(value, dict) and any(is_table(v) for v in value.values()):
            tables.append((key, value))
        else:
            lines += bullets(key, value)
    for key, value in tables:
        lines += ["", f"{'#' * depth} {name} / {key}", ""]
        lines += table(value) if isinstance(value, list) else section(f"{name} / {key}", value, depth + 1)
    return lines


def render(results: Path = RESULTS) -> str:
    out = [HEADER]
    files = sorted(results.glob("*.json"))
    out.append("Benchmarks: " + ", ".join(f"[{p.stem}](#{p.stem.replace('_', '-')})" for p in files) + ".\n")
    for path in files:
        data = json.loads(path.read_text())
        out += [f"## {path.stem}", "", f"`benchmarks/results/{path.name}`"
                + (f", plot `{path.stem}.png`" if path.with_suffix(".png").exists() else ""), ""]
        out += section(path.stem, data)
        out.append("")
    return "\n".join(out).rstrip() + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="exit 1 if docs/results.md is not up to date")
    args = parser.parse_args(argv)
    text = render()
    if args.check:
        if PAGE.read_text() != text:
            print("docs/results.md is out of date: run python benchmarks/results_table.py", file=sys.stderr)
            return 1
        return 0
    PAGE.write_text(text)
    print(f"wrote {PAGE.relative_to(ROOT)} from {len(list(RESULTS.glob('*.json')))} result files")
    return 0


if __name__ == "__main__":
    sys.exit(main())
