"""A launcher killed by SIGKILL leaves its store directory; the next launch removes it (and only such)."""

import os
import subprocess
import sys
import time

from rl_engine.parallel.launch import LEGACY_STALE_S, RUN_DIR_PREFIX, remove_stale_run_dirs


def test_the_directories_of_gone_launchers_are_removed_and_live_ones_kept(tmp_path):
    gone = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    dead_pid = int(gone.stdout)
    dirs = {
        "dead": tmp_path / f"{RUN_DIR_PREFIX}{dead_pid}_abc",
        "live": tmp_path / f"{RUN_DIR_PREFIX}{os.getpid()}_abc",
        "legacy_old": tmp_path / f"{RUN_DIR_PREFIX}x1y2",
        "legacy_new": tmp_path / f"{RUN_DIR_PREFIX}x3y4",
        "other": tmp_path / "someone_else",
    }
    for path in dirs.values():
        path.mkdir()
        (path / "store").write_text("")
    old = time.time() - LEGACY_STALE_S - 60
    os.utime(dirs["legacy_old"], (old, old))
    removed = remove_stale_run_dirs(str(tmp_path))
    assert sorted(removed) == sorted([str(dirs["dead"]), str(dirs["legacy_old"])])
    assert {p.name for p in tmp_path.iterdir()} == {dirs[k].name for k in ("live", "legacy_new", "other")}
