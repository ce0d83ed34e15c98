"""Output files of the commands: checked before the work starts, written atomically.

`check_writable(path, flag)` is called by every command on each output flag before any compute, so
a bad path costs a second, not a whole run; `check_run_paths` adds what only the whole run knows: no
output is an input of the same run (a checkpoint file, a config, a golden manifest, the provider's
source), and no two outputs land on one path. `write_atomic` / `atomic_path` write to a temporary file
in the target's directory and `os.replace` it over the target: an interrupted run leaves the old
file or none, never half a report. (Not named `io`: that would shadow the standard library when a
file of this package is run as a script.)
"""

from __future__ import annotations

import os
import secrets
import stat
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
    if not directory and path.exists() and not path.is_file():  # exists() and is_file() follow symlinks
        raise UsageError(f"{where}: exists and is {_kind(path)}, not a regular file; refusing to replace it")
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


def _kind(path: Path) -> str:
    mode = path.stat().st_mode
    for test, name in ((stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"),
                       (stat.S_ISFIFO, "a FIFO"), (stat.S_ISSOCK, "a socket"), (stat.S_ISDIR, "a directory")):
        if test(mode):
            return name
    return "not a regular file"


def _same_file(a: Path, b: Path) -> bool:
    """Whether two paths name one file (through symlinks, `..` and hard links); a path that does not exist
    yet is compared by its resolved name."""
    try:
        return os.path.samefile(a, b)
    except OSError:
        return os.path.realpath(a) == os.path.realpath(b)


def _inside(path: Path, directory: Path) -> bool:
    return os.path.realpath(path).startswith(os.path.realpath(directory).rstrip(os.sep) + os.sep)


def check_run_paths(outputs, inputs=()) -> None:
    """The outputs of one run, before any work: `outputs` and `inputs` are (flag, path) pairs (None paths
    are skipped). UsageError (one line, naming both flags) when an output is an input of the run, is an
    existing file inside an input directory (a checkpoint's own files), or shares its path with another
    output of the run. Writability is `check_writable`'s, called by the command per flag."""
    outputs = [(flag, Path(p)) for flag, p in outputs if p is not None]
    inputs = [(flag, Path(p)) for flag, p in inputs if p is not None]
    for i, (flag, path) in enumerate(outputs):
        for other_flag, other in outputs[:i]:
            if _same_file(path, other):
                raise UsageError(f"{flag} {path}: the same path as {other_flag} {other}; two outputs of one run "
                                 f"cannot share a file")
        for in_flag, source in inputs:
            if _same_file(path, source):
                raise UsageError(f"{flag} {path}: is {in_flag} {source}, an input of this run; refusing to "
                                 f"overwrite it")
            if source.is_dir() and path.exists() and _inside(path, source):
                raise UsageError(f"{flag} {path}: is a file of {in_flag} {source}, an input of this run; "
                                 f"refusing to overwrite it")


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
