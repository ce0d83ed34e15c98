#!/usr/bin/env python
"""docs/api.md from the docstrings and signatures of the public API (`rl_engine.__all__`).

    python scripts/api_page.py           # rewrites docs/api.md
    python scripts/api_page.py --check   # exit 1 if docs/api.md differs from what the code gives
"""

from __future__ import annotations

import argparse
import inspect
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PAGE = ROOT / "docs" / "api.md"

HEADER = """# API

Generated from the docstrings by `python scripts/api_page.py`: do not edit by hand (`tests/test_package.py`
fails when this page and the code disagree). Every name below imports from the package itself
(`from rl_engine import patch`); `import rl_engine` stays cheap, each name loads its module on first use.
The commands (`rl-engine ...`) are in [usage.md](usage.md).
"""


def _signature(obj) -> str:
    try:
        text = str(inspect.signature(obj))
    except (TypeError, ValueError):  # a builtin without a signature
        return "(...)"
    # Annotations are strings (`from __future__ import annotations`): shown as written, without the quotes.
    return re.sub(r"(: |-> )'([^']*)'", r"\1\2", text)


def _doc(obj) -> str:
    doc = inspect.getdoc(obj) or ""
    # A dataclass without a docstring gets its signature as one: already shown.
    return "" if doc.startswith(f"{getattr(obj, '__name__', '')}(") else doc


def entry(name: str, obj) -> list[str]:
    lines = [f"## {name}", "", "```python", f"{obj.__module__}.{obj.__qualname__}{_signature(obj)}", "```", ""]
    if doc := _doc(obj) or (_doc(obj.__init__) if inspect.isclass(obj) and "__init__" in vars(obj) else ""):
        lines += [doc, ""]
    if inspect.isclass(obj):
        for attr, member in vars(obj).items():
            if attr.startswith("_") or not callable(member) or inspect.isclass(member):
                continue
            lines += [f"### {name}.{attr}", "", "```python", f"{attr}{_signature(member)}", "```", ""]
            if doc := _doc(member):
                lines += [doc, ""]
    return lines


def render() -> str:
    import rl_engine

    names = [n for n in rl_engine.__all__ if n != "__version__"]
    out = [HEADER, "Contents: " + ", ".join(f"[{n}](#{n.lower()})" for n in names) + ".", ""]
    for name in names:
        out += entry(name, getattr(rl_engine, name))
    return "\n".join(out).rstrip() + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="exit 1 if docs/api.md is not up to date")
    args = parser.parse_args(argv)
    text = render()
    if args.check:
        if PAGE.read_text() != text:
            print("docs/api.md is out of date: run python scripts/api_page.py", file=sys.stderr)
            return 1
        return 0
    PAGE.write_text(text)
    print(f"wrote {PAGE.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
