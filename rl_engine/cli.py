"""The `rl-engine` command. Each subcommand lives beside the library code it drives.

A subcommand module exposes `add_arguments(parser)` and `run(args) -> int`; this file only routes.
Exit codes everywhere: 0 passed, 1 failed, 2 usage or configuration error.
"""

from __future__ import annotations

import argparse
import importlib
import sys

from rl_engine.errors import UsageError

SUBCOMMANDS = {
    "check-op": ("rl_engine.kernels.gtest.check_op", "gold vs candidate operator check"),
    "check-invariance": ("rl_engine.invariance.check", "config invariance and train/infer parity"),
    "check-p1": ("rl_engine.mhc.acceptance", "mHC provider acceptance against the strict-fp32 oracle"),
    "check-tp": ("rl_engine.parallel.check", "tensor-parallel invariance across TP = 1, 2, 4"),
    "mhc-golden": ("rl_engine.mhc.fixtures", "regenerate the mHC golden hashes (explicit only)"),
}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="rl-engine", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    modules = {}
    for name, (module_path, help_text) in SUBCOMMANDS.items():
        try:
            module = importlib.import_module(module_path)
        except ModuleNotFoundError as exc:
            if exc.name and module_path.startswith(exc.name):
                continue  # subcommand not built yet
            raise
        modules[name] = module
        module.add_arguments(sub.add_parser(name, help=help_text, description=help_text))
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help()
        return 2
    try:
        return int(modules[args.command].run(args))
    except UsageError as exc:
        print(f"rl-engine {args.command}: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
