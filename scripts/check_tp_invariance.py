#!/usr/bin/env python
"""Tensor-parallel invariance, TP = 1, 2, 4, bit for bit: the same as `rl-engine check-tp`.

    TRITON_INTERPRET=1 python scripts/check_tp_invariance.py --backend gloo --device cpu --world-sizes 1,2,4 --json PATH
    python scripts/check_tp_invariance.py --backend nccl --device cuda --world-sizes 1,2,4 --preset large

Exit codes: 0 passed, 1 failed, 2 usage or configuration error (one line on stderr). See docs/parallel.md.
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

from rl_engine.cli import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main(["check-tp", *sys.argv[1:]]))
