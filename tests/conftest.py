import os

import torch

# Without CUDA, Triton kernels run under the CPU interpreter. Triton reads this when a kernel is
# decorated, so it must be set before any kernel module is imported.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import interpreter_memos  # noqa: E402  (tests/interpreter_memos.py: test speed only)
import pytest  # noqa: E402

interpreter_memos.install()


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs CUDA")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(autouse=True)
def _give_back_cached_gpu_memory():
    # The GPU gate runs the suite in several processes on one GPU: a process keeping an 8B-width test's
    # cached blocks would starve the others (seen: out-of-memory failures that depend on scheduling).
    yield
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
