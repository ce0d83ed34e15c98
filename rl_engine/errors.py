"""Errors shared by the library and its commands."""

import signal


class UsageError(Exception):
    """A usage or configuration error: the commands print it as one line and exit with code 2."""


class Terminated(KeyboardInterrupt):
    """SIGTERM, raised like Ctrl-C's KeyboardInterrupt so that every cleanup path treats both alike."""

    signum = int(signal.SIGTERM)
