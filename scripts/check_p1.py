"""Acceptance of an mHC provider against the strict-fp32 oracle and the golden hashes.

    python scripts/check_p1.py --provider module:Class --device cpu|cuda [--cases ...] [--json PATH]

The same as `rl-engine check-p1`; the logic lives in rl_engine/mhc/acceptance.py.
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from rl_engine.cli import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main(["check-p1", *sys.argv[1:]]))
