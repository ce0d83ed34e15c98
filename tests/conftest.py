import os

import torch

# Without CUDA, Triton kernels run under the CPU interpreter. Triton reads this when a kernel is
# decorated, so it must be set before any kernel module is imported.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402


def _speed_up_the_interpreter() -> None:
    """Two memos for Triton's interpreter (its hot spots in this suite; the kernels run the same interpreted code):
    - It patches triton.language on every launch AND on every call of a nested @triton.jit helper; a nested patch
      finds the launch's patches in place (it re-binds nothing) and costs ~1 ms of inspect.getmembers. Skip one
      whose language modules this launch has patched already; a launch's restore forgets them.
    - `_get_np_dtype` builds a 20-entry dict on each of its ~10^5 calls a test: memoise it per dtype name."""
    if os.environ.get("TRITON_INTERPRET") != "1":
        return
    from triton.runtime import interpreter

    patch, scope = getattr(interpreter, "_patch_lang", None), getattr(interpreter, "_LangPatchScope", None)
    np_dtype = getattr(interpreter, "_get_np_dtype", None)
    if patch is None or np_dtype is None or scope is None or not hasattr(scope, "restore"):
        return  # another interpreter layout: leave it as it is
    langs = (interpreter.tl, interpreter.tl.core)
    langs_of: dict = {}  # jit function -> ids of the language modules in its globals
    patched: set = set()  # ids of the language modules patched since the last restore

    def patch_once(fn):
        mine = langs_of.get(fn)
        if mine is None:
            mine = langs_of[fn] = frozenset(id(v) for v in fn.__globals__.values() if any(v is m for m in langs))
        if mine and mine <= patched:
            return scope()  # nothing to restore: the launch's own scope restores what it patched
        result = patch(fn)
        patched.update(mine)
        return result

    restore = scope.restore

    def restore_and_forget(self):
        patched.clear()
        restore(self)

    np_dtypes: dict = {}

    def np_dtype_memo(tt_dtype):
        key = tt_dtype.name  # a block type is unhashable; its name spells its element type and shape
        try:
            return np_dtypes[key]
        except KeyError:
            np_dtypes[key] = result = np_dtype(tt_dtype)
            return result

    interpreter._patch_lang = patch_once
    scope.restore = restore_and_forget
    interpreter._get_np_dtype = np_dtype_memo


_speed_up_the_interpreter()


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
