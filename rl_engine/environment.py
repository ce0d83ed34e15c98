"""The environment record every report carries: what a result was produced on."""

from __future__ import annotations

import datetime
import os
import platform

import torch


def use_triton_interpreter_without_cuda() -> None:
    """Without a CUDA device Triton kernels run only under Triton's CPU interpreter, which Triton picks when a kernel
    is decorated: the kernel packages call this before their modules load. A value the user exported wins."""
    if "TRITON_INTERPRET" not in os.environ and not torch.cuda.is_available():
        os.environ["TRITON_INTERPRET"] = "1"


def _version(module: str) -> str:
    try:
        from importlib.metadata import version

        return version(module)
    except Exception:  # noqa: BLE001 - not installed, or an odd install: the record says so
        return "unavailable"


def environment(device=None) -> dict:
    """Date, Python, torch, Triton, numpy, CUDA; the device and its name (GPU count and NCCL on CUDA)."""
    env = {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "triton": _version("triton"),
        "numpy": _version("numpy"),
        "cuda": torch.version.cuda or "none",
    }
    if device is None:
        device = "cuda" if torch.cuda.is_available() else "cpu"
    dev = torch.device(device)
    env["device"] = str(dev)
    if dev.type == "cuda":
        env["device_name"] = torch.cuda.get_device_name(dev)
        env["gpu_count"] = torch.cuda.device_count()
        try:
            env["nccl"] = ".".join(map(str, torch.cuda.nccl.version()))
        except Exception:  # noqa: BLE001 - a build without NCCL: the record says so
            env["nccl"] = "unavailable"
    else:
        env["device_name"] = platform.processor() or platform.machine()
    return env
