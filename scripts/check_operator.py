#!/usr/bin/env python
"""Check a candidate operator against its PyTorch gold: the same as `rl-engine check-op`.

Exit codes: 0 passed, 1 failed, 2 usage or configuration error (one line on stderr).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

from rl_engine.errors import UsageError  # noqa: E402
from rl_engine.kernels.gtest import check_op  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="check_operator.py", description=check_op.__doc__.splitlines()[0])
    check_op.add_arguments(parser)
    args = parser.parse_args(argv)
    try:
        return check_op.run(args)
    except UsageError as exc:
        print(f"check_operator.py: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
