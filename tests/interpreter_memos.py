"""Test speed only: `install` is called by conftest and by the modules whose functions run in spawned ranks (they do
not load conftest)."""

import os

_installed = False


def install() -> None:
    """Two memos for Triton's interpreter (its hot spots in this suite; the kernels run the same interpreted code):
    - It patches triton.language on every launch AND on every call of a nested @triton.jit helper; a nested patch
      finds the launch's patches in place (it re-binds nothing) and costs ~1 ms of inspect.getmembers. Skip one
      whose language modules this launch has patched already; a launch's restore forgets them.
    - `_get_np_dtype` builds a 20-entry dict on each of its ~10^5 calls a test: memoise it per dtype name."""
    global _installed
    if _installed or os.environ.get("TRITON_INTERPRET") != "1":
        return
    _installed = True
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
