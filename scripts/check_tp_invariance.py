#!/usr/bin/env python
"""Tensor-parallel invariance: every parallel op and mHC placement on TP = 1, 2, 4, bit for bit.

    python scripts/check_tp_invariance.py --backend gloo --device cpu --world-sizes 1,2,4 --json PATH
    python scripts/check_tp_invariance.py --backend nccl --device cuda --world-sizes 1,2,4 --preset large

Exit codes: 0 passed, 1 failed, 2 usage or configuration error (one line on stderr). See docs/parallel.md.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

from rl_engine.errors import UsageError  # noqa: E402
from rl_engine.parallel import check  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="check_tp_invariance.py", description=check.__doc__.splitlines()[0])
    check.add_arguments(parser)
    args = parser.parse_args(argv)
    try:
        return check.run(args)
    except UsageError as exc:
        print(f"check_tp_invariance.py: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
