#!/usr/bin/env python
"""Config invariance and train/infer parity of a Qwen3 model under a backend profile: the same as
`rl-engine check-invariance` (docs/invariance.md).

Exit codes: 0 passed, 1 failed, 2 usage or configuration error (one line on stderr).
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

from rl_engine.cli import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main(["check-invariance", *sys.argv[1:]]))
