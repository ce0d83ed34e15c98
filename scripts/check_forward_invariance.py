"""Config invariance and train/infer parity of a Qwen3 model under a backend profile.

Same as `rl-engine check-invariance`; see docs/invariance.md.
"""

import sys

from rl_engine.cli import main

if __name__ == "__main__":
    sys.exit(main(["check-invariance", *sys.argv[1:]]))
