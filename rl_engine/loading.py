"""The one loader of objects named by a path: "package.module:attr" (attr may be dotted, "Class.method"),
or "package.module.attr" where no colon is given (the last dot splits).

Every failure is a UsageError of one line that names the path and the cause, so a command prints it
and exits 2. Errors raised while a user's module imports or its class is constructed (SystemExit
included) are caught too: they are the user's code failing to load, not a crash of ours.
"""

from __future__ import annotations

import functools
import importlib
import inspect
import os
import sys

from rl_engine.errors import UsageError


def _one_line(exc: BaseException) -> str:
    return " ".join(f"{type(exc).__name__}: {exc}".split())


def _search_working_directory() -> None:
    """Find the user's own modules where `python -m` would: the console script's sys.path lacks the working
    directory, so `--candidate my_kernels:my_logp` run beside my_kernels.py would not import. Searched last."""
    if os.getcwd() not in sys.path and "" not in sys.path:
        sys.path.append(os.getcwd())


def split_path(path: str, what: str) -> tuple[str, str]:
    """(module, attribute) of a path; UsageError when either part is empty."""
    module_name, sep, attr = path.partition(":") if ":" in path else path.rpartition(".")
    if not module_name or not attr or not sep:
        raise UsageError(f"{what} must be 'module:attr', got {path!r}")
    return module_name, attr


def module_file(path: str) -> str | None:
    """The source file the module of `path` would be imported from, found on sys.path without importing
    anything (a provider's code must not run in the checker); None when not found (a namespace, a
    built-in, an already imported module without a file)."""
    try:
        module_name, _ = split_path(path, "module")
    except UsageError:
        return None
    module = sys.modules.get(module_name)
    if module is not None:
        return getattr(module, "__file__", None)
    _search_working_directory()
    parts = module_name.split(".")
    for entry in sys.path:
        base = os.path.join(entry or os.getcwd(), *parts)
        for candidate in (base + ".py", os.path.join(base, "__init__.py")):
            if os.path.isfile(candidate):
                return candidate
    return None


def load_object(path: str, what: str):
    """The object `path` names; `what` ("candidate", "provider", ...) starts every error message."""
    module_name, attr = split_path(path, what)
    _search_working_directory()
    try:
        module = importlib.import_module(module_name)
    except KeyboardInterrupt:
        raise
    except BaseException as exc:  # noqa: BLE001 - ImportError, SyntaxError, anything raised at import (SystemExit too)
        raise UsageError(f"cannot import {what} module {module_name!r}: {_one_line(exc)}") from None
    obj = module
    for part in attr.split("."):
        if not hasattr(obj, part):
            raise UsageError(f"{what} {path}: module {module_name!r} has no attribute {attr!r}")
        obj = getattr(obj, part)
    return obj


def construct(cls, path: str, what: str, **kwargs):
    """`cls(**kwargs)`; UsageError naming `path` and the exception when construction raises."""
    try:
        return cls(**kwargs)
    except KeyboardInterrupt:
        raise
    except BaseException as exc:  # noqa: BLE001 - SystemExit included
        raise UsageError(f"cannot construct {what} {path}: {_one_line(exc)}") from None


def load_callable(path: str, what: str, **constructor_kwargs):
    """The callable a path names: a class is constructed with the kwargs, a function bound to them."""
    obj = load_object(path, what)
    if not callable(obj):
        raise UsageError(f"{what} {path} is a {type(obj).__name__}, not callable")
    if inspect.isclass(obj):
        obj = construct(obj, path, what, **constructor_kwargs)
        if not callable(obj):
            raise UsageError(f"{what} {path}: an instance of {type(obj).__name__} is not callable (no __call__)")
        return obj
    return functools.partial(obj, **constructor_kwargs) if constructor_kwargs else obj
