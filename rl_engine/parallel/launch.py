"""Run a function on N processes joined in a torch.distributed group (gloo on CPUs, NCCL on GPUs).

`spawn_group(fn, world_size, backend=..., device=...)` starts `world_size` processes with
torch.multiprocessing (spawn), joins them through a file:// store in a fresh temporary directory
(no TCP port to race for; its name carries the launcher's pid, and a launch first removes the
directories of launchers that are gone, e.g. SIGKILLed, so nothing stays behind for long), calls
`fn(rank, world_size, device, *args)` on each, and returns each rank's result (a dict of tensors,
moved to the CPU) in rank order. A failure on any rank raises here.

Interrupts belong to the launcher: the ranks ignore SIGINT (so Ctrl-C to the process group reaches
only this process, not four tracebacks) and die with it (PR_SET_PDEATHSIG); any exception here
(KeyboardInterrupt, SIGTERM as rl_engine.errors.Terminated) kills them before it propagates, instead
of waiting for them at exit until the process-group timeout.
"""

from __future__ import annotations

import ctypes
import datetime
import os
import shutil
import signal
import sys
import tempfile
import time
from contextlib import contextmanager

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

BACKENDS = {"gloo": "cpu", "nccl": "cuda"}
# NVLink multicast (NVLS) and symmetric-memory multicast are off: they are not lent reliably and
# would change NCCL's algorithm choice between machines. We never use all_reduce anyway.
COMMUNICATION_ENV = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1"}


def check_backend(backend: str, device: str) -> None:
    if backend not in BACKENDS:
        raise ValueError(f"backend: expected one of {sorted(BACKENDS)}, got {backend!r}")
    if device != BACKENDS[backend]:
        raise ValueError(f"device: backend {backend} runs on {BACKENDS[backend]}, got device {device!r}")


def _to_cpu(result):
    if isinstance(result, torch.Tensor):
        return result.detach().cpu()
    if isinstance(result, dict):
        return {k: _to_cpu(v) for k, v in result.items()}
    if isinstance(result, (list, tuple)):
        return type(result)(_to_cpu(v) for v in result)
    return result


def _die_with_parent() -> None:
    """The kernel kills this process when the launcher dies, even by SIGKILL (Linux only). torch sets
    SIGINT for this, which the ranks ignore."""
    if sys.platform.startswith("linux"):
        ctypes.CDLL(None, use_errno=True).prctl(1, int(signal.SIGKILL))  # 1 = PR_SET_PDEATHSIG


def _worker(rank, world_size, backend, device, store_path, out_dir, fn, args, num_threads, timeout_s):
    _die_with_parent()  # SIGINT is ignored (inherited): the launcher ends the ranks
    os.environ.update(COMMUNICATION_ENV)
    # One thread per rank: the ranks share the CPU, and every run (any TP) then uses the same CPU
    # kernels' work split, so a shard's bits cannot depend on how many processes are running.
    torch.set_num_threads(num_threads)
    options = {}
    if device == "cuda":
        torch.cuda.set_device(rank)
        options["device_id"] = torch.device("cuda", rank)
    dist.init_process_group(
        backend,
        init_method=f"file://{store_path}",
        rank=rank,
        world_size=world_size,
        timeout=datetime.timedelta(seconds=timeout_s),
        **options,
    )
    try:
        result = fn(rank, world_size, device, *args)
        torch.save(_to_cpu(result), os.path.join(out_dir, f"rank{rank}.pt"))
        dist.barrier()
    finally:
        dist.destroy_process_group()


@contextmanager
def _children_ignore_sigint():
    """Processes started inside ignore SIGINT from their first instruction: an ignored disposition is
    the one that survives exec (a rank that set it itself would do so only after seconds of importing
    torch, open to a group Ctrl-C and its traceback). SIGTERM keeps its default, a silent exit.
    Meanwhile this thread blocks both, so no interrupt lands between starting the ranks and holding
    them; on Linux a blocked signal stays pending even while ignored, and is delivered on unblocking."""
    stop = {signal.SIGINT, signal.SIGTERM}
    try:
        mask = signal.pthread_sigmask(signal.SIG_BLOCK, stop)
        handler = signal.signal(signal.SIGINT, signal.SIG_IGN)
    except ValueError:  # not the main thread: the dispositions are not ours to change
        yield
        return
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, signal.SIG_DFL if handler is None else handler)
        signal.pthread_sigmask(signal.SIG_SETMASK, mask)


RUN_DIR_PREFIX = "rl_engine_tp_"
LEGACY_STALE_S = 3600.0  # a directory without a pid in its name: stale once untouched this long


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's live process
        return True
    return True


def remove_stale_run_dirs(root: str | None = None) -> list[str]:
    """Remove the run directories (`rl_engine_tp_<pid>_*`) whose launcher is no longer running; returns them."""
    root = root or tempfile.gettempdir()
    removed = []
    try:
        names = os.listdir(root)
    except OSError:
        return removed
    for name in names:
        if not name.startswith(RUN_DIR_PREFIX):
            continue
        path = os.path.join(root, name)
        pid_text = name[len(RUN_DIR_PREFIX):].split("_", 1)[0]
        try:
            if pid_text.isdigit():
                stale = not _alive(int(pid_text))
            else:
                stale = time.time() - os.stat(path).st_mtime > LEGACY_STALE_S
            if stale and os.path.isdir(path) and not os.path.islink(path):
                shutil.rmtree(path)
                removed.append(path)
        except OSError:  # another launcher removed it first, or it is not ours to remove
            continue
    return removed


def spawn_group(
    fn, world_size: int, *, backend: str = "gloo", device: str = "cpu", args: tuple = (),
    num_threads: int = 1, timeout_s: int = 300,
) -> list:
    """Results of `fn(rank, world_size, device, *args)` on each of `world_size` ranks, in rank order."""
    check_backend(backend, device)
    if device == "cuda" and torch.cuda.device_count() < world_size:
        raise ValueError(f"world_size: {world_size} ranks need {world_size} GPUs, found {torch.cuda.device_count()}")
    remove_stale_run_dirs()
    with tempfile.TemporaryDirectory(prefix=f"{RUN_DIR_PREFIX}{os.getpid()}_") as tmp:
        context = None
        try:
            with _children_ignore_sigint():
                context = mp.start_processes(
                    _worker,
                    args=(world_size, backend, device, os.path.join(tmp, "store"), tmp, fn, args, num_threads,
                          timeout_s),
                    nprocs=world_size,
                    join=False,
                    start_method="spawn",
                )
            while not context.join():
                pass
        except BaseException:
            if context is not None:  # a signal held back during the start is raised on leaving the `with`
                _kill(context.processes)
            raise
        return [torch.load(os.path.join(tmp, f"rank{r}.pt"), weights_only=False) for r in range(world_size)]


def _kill(processes, timeout_s: float = 2.0) -> None:
    """End every rank still running: nothing of theirs is worth a graceful shutdown once the run is abandoned."""
    for process in processes:
        if process.is_alive():
            process.kill()
    for process in processes:
        process.join(timeout_s)
