"""Errors shared by the library and its commands."""

import os
import signal
import sysconfig

_STDLIB = sysconfig.get_paths()["stdlib"]


class UsageError(Exception):
    """A usage or configuration error: the commands print it as one line and exit with code 2."""


class Terminated(KeyboardInterrupt):
    """SIGTERM, raised like Ctrl-C's KeyboardInterrupt so that every cleanup path treats both alike."""

    signum = int(signal.SIGTERM)


def safe_to_raise(frame) -> bool:
    """Whether a stop exception may be raised in `frame`, the code a signal interrupted. Not in the standard
    library below Triton's code: Triton's native code calls back into it (nanobind converting an enum under Triton
    3.9's interpreter), and an exception raised there cannot unwind through the C++ frames above it: the process
    aborts (SIGABRT; seen once in CI). Elsewhere (a launcher waiting in subprocess, our own code) it may."""
    if frame is None or not frame.f_code.co_filename.startswith(_STDLIB):
        return True
    caller = frame.f_back
    while caller is not None:
        if f"{os.sep}triton{os.sep}" in caller.f_code.co_filename:
            return False
        caller = caller.f_back
    return True
