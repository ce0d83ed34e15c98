"""Output files of the commands: checked before the work starts, written atomically.

`check_writable(path, flag)` is called by every command on each output flag before any compute, so
a bad path costs a second, not a whole run. `write_atomic` / `atomic_path` write to a temporary file
in the target's directory and `os.replace` it over the target: an interrupted run leaves the old
file or none, never half a report. (Not named `io`: that would shadow the standard library when a
file of this package is run as a script.)
"""

from __future__ import annotations

import os
import secrets
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from rl_engine.errors import UsageError


def check_writable(path: str | os.PathLike, flag: str, *, directory: bool = False) -> Path:
    """`path` (a file, or a directory when `directory`) can be written; missing parents can be created.

    Raises UsageError naming `flag` and `path` otherwise. Creates nothing that stays.
    """
    path = Path(path)
    where = f"{flag} {path}"
    if directory and path.exists() and not path.is_dir():
        raise UsageError(f"{where}: exists and is not a directory")
    if not directory and path.is_dir():
        raise UsageError(f"{where}: is a directory, expected a file path")
    existing = path if directory else path.parent
    while not existing.exists():  # the nearest ancestor that exists is where directories get created
        existing = existing.parent
    if not existing.is_dir():
        raise UsageError(f"{where}: cannot write ({existing} is not a directory)")
    # A real probe, not os.access: root passes os.access checks that the filesystem then refuses.
    try:
        fd, probe = tempfile.mkstemp(dir=existing, prefix=".rl_engine_probe_")
        os.close(fd)
        os.unlink(probe)
    except OSError as exc:
        raise UsageError(f"{where}: cannot write in {existing} ({exc.strerror or exc})") from None
    return path


@contextmanager
def atomic_path(path: str | os.PathLike, flag: str | None = None) -> Iterator[Path]:
    """A temporary path beside `path` (same suffix, so writers that read it still work); on success it
    replaces `path`, on any error or interrupt it is removed."""
    path = Path(path)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise UsageError(f"{flag or 'output'} {path}: cannot write ({exc.strerror or exc})") from None
    # Not mkstemp: its 0600 mode would stick to the report; a fresh name created by the writer gets the umask.
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{secrets.token_hex(4)}.tmp{path.suffix}")
    try:
        yield tmp
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def write_atomic(path: str | os.PathLike, text: str, flag: str | None = None) -> Path:
    """Write `text` to `path` atomically (see atomic_path)."""
    path = Path(path)
    with atomic_path(path, flag) as tmp:
        try:
            tmp.write_text(text)
        except OSError as exc:
            raise UsageError(f"{flag or 'output'} {path}: cannot write ({exc.strerror or exc})") from None
    return path
