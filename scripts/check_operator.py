#!/usr/bin/env python
"""Check a candidate operator against its PyTorch gold: the same as `rl-engine check-op`.

Exit codes: 0 passed, 1 failed, 2 usage or configuration error (one line on stderr). See docs/harness.md.
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

from rl_engine.cli import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main(["check-op", *sys.argv[1:]]))
