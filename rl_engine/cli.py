"""The `rl-engine` command: the checkers of rl_engine/checks/, and the mHC golden hashes (rl_engine/mhc/fixtures.py).

A subcommand module exposes `add_arguments(parser)` and `run(args) -> int`; this file only routes
and is the boundary where errors become one line on stderr.
Exit codes everywhere: 0 passed, 1 failed, 2 usage or configuration error (out of memory included),
130 interrupted by SIGINT, 143 by SIGTERM, 141 when the reader of the output went away (`| head`).
"""

from __future__ import annotations

import argparse
import importlib
import os
import re
import signal
import sys
import threading
from collections.abc import Callable
from contextlib import contextmanager
from types import SimpleNamespace
from typing import NoReturn

from rl_engine import __version__
from rl_engine.errors import Terminated, UsageError, safe_to_raise

SUBCOMMANDS = {
    "check-op": ("rl_engine.checks.operators.check_op", "gold vs candidate operator check"),
    "check-invariance": ("rl_engine.checks.forward_invariance.check", "config invariance and train/infer parity"),
    "check-p1": ("rl_engine.checks.mhc_acceptance", "mHC provider acceptance against the strict-fp32 oracle"),
    "check-tp": ("rl_engine.checks.tp_invariance.check", "tensor-parallel invariance across TP = 1, 2, 4"),
    "mhc-golden": ("rl_engine.mhc.fixtures", "regenerate the mHC golden hashes (explicit only)"),
}
STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)
STOP_GRACE_S = 3.0  # after a stop signal, the process ends within this whatever the command does


class ArgumentParser(argparse.ArgumentParser):
    """argparse, but a usage error is one line on stderr (argparse prints the whole usage block first)."""

    def error(self, message: str):
        print(f"{self.prog}: error: {' '.join(message.split())}", file=sys.stderr)
        sys.exit(2)


@contextmanager
def stop_signals(prog: str = "rl-engine"):
    """SIGINT raises KeyboardInterrupt and SIGTERM raises Terminated, so `finally` blocks and the
    process launcher clean up on both; the state records the first signal. Repeats are ignored: the
    cleanup they would interrupt is bounded, and cutting it short could leave rank processes behind.

    Python swallows an exception raised inside a finalizer (`__del__`, a weakref callback): a stop
    signal landing there would be lost, and the command would run on. So that case is kept silent
    (no "Exception ignored" traceback) and a watchdog ends the process STOP_GRACE_S after the signal
    whatever happens, with the same one line and exit code. Where raising would abort the process
    (`safe_to_raise`), the signal is sent again 10 ms later instead."""
    state = SimpleNamespace(signum=None, reported=False, raised=False)

    def end():
        """The one way out after a stop signal: one line, then 128 + the signal (from any thread)."""
        if not state.reported:
            state.reported = True
            print(f"{prog}: interrupted", file=sys.stderr)
        _exit_now(128 + int(state.signum))

    state.end = end

    def handler(signum, frame):
        if state.raised:
            return
        if state.signum is None:
            state.signum = signum
            watchdog = threading.Timer(STOP_GRACE_S, end)
            watchdog.daemon = True
            watchdog.start()
        if not safe_to_raise(frame):  # try again in 10 ms, when the main thread is elsewhere
            retry = threading.Timer(0.01, os.kill, (os.getpid(), state.signum))
            retry.daemon = True
            retry.start()
            return
        state.raised = True
        raise Terminated() if state.signum == signal.SIGTERM else KeyboardInterrupt()

    previous_hook = sys.unraisablehook

    def unraisable(info):
        if not (state.signum is not None and isinstance(info.exc_value, KeyboardInterrupt)):
            previous_hook(info)

    try:
        previous = {s: signal.signal(s, handler) for s in STOP_SIGNALS}
    except ValueError:  # not the main thread: signals are not ours to take
        previous = {}
    sys.unraisablehook = unraisable
    try:
        yield state
    finally:
        sys.unraisablehook = previous_hook
        for s, h in previous.items():
            signal.signal(s, h)


# CPU: "DefaultCPUAllocator: can't allocate memory: you tried to allocate 320000000000 bytes";
# CUDA: "CUDA out of memory. Tried to allocate 2.00 GiB".
_ALLOCATION = re.compile(r"tried to allocate (\d+ bytes|[\d.]+ [KMGTP]i?B)", re.IGNORECASE)
_OOM_MARKERS = ("DefaultCPUAllocator", "not enough memory", "out of memory")


def _bytes(n: int) -> str:
    for unit, factor in (("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= factor:
            return f"{n} bytes ({n / factor:.1f} {unit})"
    return f"{n} bytes"


def out_of_memory_message(exc: BaseException) -> str | None:
    """One line for an allocation that failed (naming the size asked for when the error has it), else None."""
    text = str(exc)
    if not (isinstance(exc, MemoryError) or type(exc).__name__ == "OutOfMemoryError"
            or any(m in text for m in _OOM_MARKERS)):
        return None
    match = _ALLOCATION.search(text)
    if match is None:
        return "out of memory; use smaller sizes"
    size = match.group(1)
    if size.endswith(" bytes"):
        size = _bytes(int(size.split()[0]))
    return f"out of memory: tried to allocate {size}; use smaller sizes"


def _build_parser() -> tuple[argparse.ArgumentParser, dict]:
    """The parser, and command -> (module, its subparser)."""
    parser = ArgumentParser(prog="rl-engine", description=__doc__.splitlines()[0])
    parser.add_argument("--version", action="version", version=f"rl-engine {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    modules = {}
    for name, (module_path, help_text) in SUBCOMMANDS.items():
        try:
            module = importlib.import_module(module_path)
        except ModuleNotFoundError as exc:
            if exc.name and module_path.startswith(exc.name):
                continue  # subcommand not built yet
            raise
        modules[name] = (module, sub.add_parser(name, help=help_text, description=help_text))
        module.add_arguments(modules[name][1])
    return parser, modules


def _exit_now(code: int) -> NoReturn:
    """End the process with `code` after a stop signal, skipping interpreter shutdown: CPython's exit
    path could still turn it into a death by SIGINT (returncode -2 instead of 130; seen in CI under
    load, about one run in eight). Everything the command wrote is flushed first; its `finally` blocks
    (rank processes ended, no half-written report) have already run."""
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):  # a closed pipe or stream: nothing left to save
            pass
    os._exit(code)


def run_guarded(prog: str, command: Callable[[], int]) -> int:
    """`command()` with the command-line boundary around it: stop signals become an exception, then
    'interrupted' and 128 + the signal; a UsageError or a failed allocation becomes one line and 2."""
    with stop_signals(prog) as stop:
        try:
            code = command()
        except BaseException as exc:
            # After a stop signal, whatever unwinds (KeyboardInterrupt, or a rank's death seen first) is the interrupt.
            if stop.signum is not None:
                stop.end()
            if isinstance(exc, KeyboardInterrupt):  # raised, not signalled (in-process callers)
                print(f"{prog}: interrupted", file=sys.stderr)
                return 128 + int(getattr(exc, "signum", signal.SIGINT))
            if isinstance(exc, BrokenPipeError):  # `| head` closed the pipe: stop quietly, as shell tools do
                os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # the exit flush must not raise
                return 128 + int(signal.SIGPIPE)
            if isinstance(exc, UsageError):
                message = str(exc)
            elif isinstance(exc, Exception) and (message := out_of_memory_message(exc)) is not None:
                pass
            else:
                raise  # SystemExit from argparse, or a bug: its traceback is the right report
            print(f"{prog}: error: {' '.join(message.split())}", file=sys.stderr)
            return 2
        if stop.signum is not None:  # the stop exception was swallowed on the way (a finalizer): still an interrupt
            stop.end()
        return code


def _route(argv: list[str] | None) -> int:
    parser, modules = _build_parser()  # inside the guard: it imports torch, seconds open to a Ctrl-C
    args, unknown = parser.parse_known_args(argv)
    if args.command is None:
        parser.error(f"unrecognized arguments: {' '.join(unknown)}" if unknown else
                     f"a command is required: {', '.join(modules)} (see rl-engine --help)")
    module, subparser = modules[args.command]
    if unknown:  # said by the subcommand's parser, so the line names the subcommand
        subparser.error(f"unrecognized arguments: {' '.join(unknown)}")
    return int(module.run(args))


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    prog = f"rl-engine {argv[0]}" if argv and argv[0] in SUBCOMMANDS else "rl-engine"
    return run_guarded(prog, lambda: _route(argv))


if __name__ == "__main__":
    sys.exit(main())
