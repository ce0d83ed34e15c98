"""The Gluon names that differ between the Triton releases the Gluon attention kernels support (`SUPPORTED`): the
kernels import these from here, one source for every release. Each name is the newest release's spelling, bound to
the older one where that release lacks it (the same TMA copy op underneath: the same IR, the same bits)."""

from __future__ import annotations

import triton
from triton.experimental.gluon.language.nvidia.hopper import tma

# Triton releases (major.minor) whose Gluon API these kernels compile under for sm_90a: CI compiles them under
# 3.6, 3.7.1 and 3.9; 3.8.0 was compiled by hand (docs/kernels.md).
SUPPORTED = ("3.6", "3.7", "3.8", "3.9")

# TMA global -> shared copy: tma.async_load from Triton 3.8 on (async_copy_global_to_shared raises since 3.9).
async_load = tma.async_load if hasattr(tma, "async_load") else tma.async_copy_global_to_shared


def supported(version: str = triton.__version__) -> bool:
    """Whether a Triton version string ("3.7.1", "3.9.0+git...") is one of SUPPORTED's releases."""
    return ".".join(version.split(".")[:2]) in SUPPORTED
