"""Errors shared by the library and its commands."""


class UsageError(Exception):
    """A usage or configuration error: the commands print it as one line and exit with code 2."""
