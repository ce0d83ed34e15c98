"""A provider in its own process: the checker never shares an interpreter with the code it judges.

`IsolatedProvider(spec, device)` starts a fresh interpreter (`python -c`, the checker's sys.path; never
multiprocessing, which would re-run the caller's main script there) that constructs the provider,
reads its `numeric_profile` and `capabilities()` once, and then runs one operator per request. The
checker holds a stand-in with the recorded profile and capabilities, whose operators forward their
arguments and return the outputs.

Both directions carry `torch.save` bytes, so no memory is shared (a provider cannot write into the
checker's inputs). The checker reads the provider's answers with `torch.load(weights_only=True)`:
tensors, numbers, strings, None and containers only, so an answer cannot run code in the checker.
Whatever the provider does to its own interpreter (patching the checker's functions, changing its
profile after the first read, `sys.exit`, `os._exit`, a hang) stays there: an exception is reported
under its type name, a dead process fails the operator that was running, and a request that outlasts
the per-case time limit ends the process. The provider's stdout goes to stderr, so nothing it prints
reads as a line of the checker's report.
"""

from __future__ import annotations

import ctypes
import inspect
import io
import os
import signal
import socket
import subprocess
import sys
import time
from multiprocessing.connection import Connection

import torch

from rl_engine.errors import UsageError
from rl_engine.mhc.contract import LayerContract
from rl_engine.mhc.trace import OPERATORS

DEFAULT_CASE_TIMEOUT_S = 600.0
STARTUP_TIMEOUT_S = 300.0  # starting an interpreter and importing torch is not a case; a loaded machine takes seconds
_MISSING = object()
_CHILD = "from rl_engine.mhc.isolation import serve; serve()"


def _dumps(obj) -> bytes:
    buffer = io.BytesIO()
    torch.save(obj, buffer)
    return buffer.getvalue()


def _loads_untrusted(data: bytes):
    """What the provider's process sent: only tensors and plain data are accepted (never code)."""
    return torch.load(io.BytesIO(data), weights_only=True, map_location="cpu")


# --- the provider's process -------------------------------------------------------------------------------

def _plain(value, depth: int = 0):
    """A provider's output as data the checker will read: a tensor (as {"tensor", "device"}, its bytes on
    the CPU), None, a tuple/list of those one level deep, else {"object": type name}."""
    if isinstance(value, torch.Tensor):
        return {"tensor": value.detach().as_subclass(torch.Tensor).cpu(), "device": str(value.device)}
    if value is None:
        return None
    if isinstance(value, (tuple, list)) and depth == 0:
        return {"sequence": type(value).__name__, "items": [_plain(v, 1) for v in value]}
    return {"object": type(value).__name__}


def _failure(exc: BaseException) -> dict:
    return {"raised": type(exc).__name__, "message": " ".join(str(exc).split())}


def _hello(spec: str) -> tuple[object, dict]:
    """Construct the provider; read its profile and capabilities once (the presence check reads nothing)."""
    from rl_engine.loading import construct, load_object
    from rl_engine.mhc.provider import check_spec

    try:
        check_spec(spec)
        provider = construct(load_object(spec, "provider"), spec, "provider")
    except UsageError as exc:
        return None, {"usage_error": str(exc)}
    if (inspect.getattr_static(provider, "numeric_profile", _MISSING) is _MISSING
            or not callable(inspect.getattr_static(provider, "capabilities", None))):
        return None, {"usage_error": f"{spec} is not an mHC provider (needs numeric_profile and capabilities())"}
    hello = {"class_name": type(provider).__name__}
    try:
        profile = provider.numeric_profile
        hello["numeric_profile"] = profile if profile is None or isinstance(profile, str) else None
        hello["numeric_profile_repr"] = repr(profile)
    except BaseException as exc:  # noqa: BLE001 - a profile that cannot be read is not declared
        hello["numeric_profile_error"] = _failure(exc)
    try:
        declared = provider.capabilities()
        if isinstance(declared, dict):
            # non-string entries never name a mode; keep them visible, as data
            hello["capabilities"] = {str(k): [x if isinstance(x, str) else f"<{type(x).__name__}>" for x in v]
                                     if isinstance(v, (list, tuple, set, frozenset)) else repr(v)
                                     for k, v in declared.items()}
        else:
            hello["capabilities_type"] = type(declared).__name__
    except BaseException as exc:  # noqa: BLE001 - SystemExit included
        hello["capabilities_error"] = _failure(exc)
    hello["operators"] = [n for n in OPERATORS if callable(getattr(provider, n, None))]
    return provider, hello


def serve() -> None:
    """The provider's process (argv: socket fd, spec, device): hello, then one operator per request until
    the checker closes the socket."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the checker's to handle; it ends this process
    try:  # Linux: end with the checker even if it is SIGKILLed while an operator hangs (PR_SET_PDEATHSIG)
        ctypes.CDLL(None, use_errno=True).prctl(1, int(signal.SIGKILL))
    except (OSError, AttributeError):
        pass
    fd, spec, device = int(sys.argv[1]), sys.argv[2], sys.argv[3]
    conn = Connection(fd)
    if device == "cpu":
        torch.set_num_threads(1)
    provider, hello = _hello(spec)
    conn.send_bytes(_dumps(hello))
    if provider is None:
        return
    while True:
        try:
            request = torch.load(io.BytesIO(conn.recv_bytes()), weights_only=False)  # from the checker
        except EOFError:
            return
        name, args = request["operator"], request["args"]
        args = [LayerContract(**a["contract"]) if isinstance(a, dict) and "contract" in a else a for a in args]
        try:
            answer = {"result": _plain(getattr(provider, name)(*args))}
        except BaseException as exc:  # noqa: BLE001 - KeyboardInterrupt and SystemExit included: the provider's
            answer = _failure(exc)
        try:
            data = _dumps(answer)
        except BaseException as exc:  # noqa: BLE001
            data = _dumps(_failure(exc))
        conn.send_bytes(data)


# --- the checker's side ------------------------------------------------------------------------------------

class ProviderTimeout(Exception):
    """A request outlasted the per-case time limit; the provider's process was ended."""


class ProviderGone(Exception):
    """The provider's process ended (or was ended) before it answered."""


def _raised(answer: dict) -> BaseException:
    """The provider's exception, re-created under its type name (messages say 'raised SystemExit: 0')."""
    return type(str(answer["raised"]), (Exception,), {})(answer["message"])


def _restore(value, device_of):
    if isinstance(value, dict) and "tensor" in value:
        return value["tensor"].to(device_of(value["device"]))
    if isinstance(value, dict) and "sequence" in value:
        items = [_restore(v, device_of) for v in value["items"]]
        return tuple(items) if value["sequence"] == "tuple" else items
    if isinstance(value, dict) and "object" in value:
        return type(str(value["object"]), (), {})()  # described by its type name, as the provider's object was
    return value


class IsolatedProvider:
    """The checker's stand-in for a provider running in its own process (see the module docstring).

    `numeric_profile` and `capabilities()` are what the provider said when it started, read once.
    `begin_case()` starts the per-case time limit. Use as a context manager, or call `close()`."""

    def __init__(self, spec: str, device="cpu", case_timeout_s: float = DEFAULT_CASE_TIMEOUT_S):
        self.spec, self.device, self.case_timeout_s = spec, torch.device(device), float(case_timeout_s)
        self.deadline = time.monotonic() + max(self.case_timeout_s, STARTUP_TIMEOUT_S)
        self.failed: str | None = None  # why the process is gone, once it is
        ours, theirs = socket.socketpair()
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(p or os.getcwd() for p in sys.path))
        try:
            # stdout=2: the provider's prints go to stderr, never among the checker's report lines
            self._process = subprocess.Popen(
                [sys.executable, "-c", _CHILD, str(theirs.fileno()), spec, str(self.device)],
                pass_fds=(theirs.fileno(),), stdin=subprocess.DEVNULL, stdout=2, env=env,
                start_new_session=True)  # a Ctrl-C reaches the checker, which ends this process
        finally:
            theirs.close()
        self._conn = Connection(ours.detach())
        self.pid = self._process.pid
        try:
            hello = self._receive("while starting")
        except ProviderTimeout:
            self.close()
            raise UsageError(f"cannot construct provider {spec}: no answer within "
                             f"{max(self.case_timeout_s, STARTUP_TIMEOUT_S):g} s of starting its process") from None
        except ProviderGone as exc:
            self.close()
            raise UsageError(f"cannot construct provider {spec}: {exc}") from None
        except BaseException:
            self.close()
            raise
        if "usage_error" in hello:
            self.close()
            raise UsageError(hello["usage_error"])
        self.class_name = str(hello["class_name"])
        self._hello = hello
        self.numeric_profile = hello.get("numeric_profile")
        for name in OPERATORS:
            if name in hello["operators"]:
                setattr(self, name, self._operator(name))

    @property
    def profile_error(self) -> BaseException | None:
        """The exception reading numeric_profile raised in the provider's process, if it raised."""
        error = self._hello.get("numeric_profile_error")
        return None if error is None else _raised(error)

    @property
    def profile_repr(self) -> str:
        return self._hello.get("numeric_profile_repr", "None")

    def capabilities(self) -> dict:
        if "capabilities_error" in self._hello:
            raise _raised(self._hello["capabilities_error"])
        if "capabilities_type" in self._hello:
            return type(str(self._hello["capabilities_type"]), (), {})()
        return {k: list(v) if isinstance(v, list) else v for k, v in self._hello["capabilities"].items()}

    def begin_case(self) -> None:
        self.deadline = time.monotonic() + self.case_timeout_s

    def _device_of(self, name: str) -> torch.device:
        device = torch.device(name)
        # the provider's own device index stays its own; a tensor on the checked device type comes back there
        return self.device if device.type == self.device.type else torch.device("cpu")

    def _receive(self, what: str):
        remaining = self.deadline - time.monotonic()
        if self.failed is None and not self._conn.poll(max(remaining, 0.0)):
            self.failed = (f"no answer within the per-case time limit of {self.case_timeout_s:g} s; "
                           f"the provider's process was ended")
            self.close()
            raise ProviderTimeout(self.failed)
        if self.failed is not None:
            raise ProviderGone(self.failed)
        try:
            data = self._conn.recv_bytes()
        except (EOFError, OSError):
            try:
                code = self._process.wait(5)
            except subprocess.TimeoutExpired:
                code = None
            self.failed = (f"the provider's process ended {what}"
                           + (f" (exit code {code})" if code is not None and code >= 0 else
                              f" (signal {-code})" if code is not None else ""))
            self.close()
            raise ProviderGone(self.failed) from None
        try:
            return _loads_untrusted(data)
        except Exception as exc:  # noqa: BLE001 - whatever the provider sent, it is not an answer
            raise ProviderGone(f"the provider's process sent something other than tensors and data ({exc})") from None

    def _operator(self, name: str):
        def operator(*args):
            if self.failed is not None:
                raise ProviderGone(self.failed)
            sent = [{"contract": a.to_dict()} if isinstance(a, LayerContract) else a for a in args]
            try:
                self._conn.send_bytes(_dumps({"operator": name, "args": sent}))
            except OSError:
                pass  # the process is gone: receiving says how
            answer = self._receive(f"while running {name}")
            if "raised" in answer:
                raise _raised(answer)
            return _restore(answer["result"], self._device_of)
        operator.__name__ = name
        return operator

    def close(self) -> None:
        """End the provider's process (it has nothing to save)."""
        try:
            self._conn.close()
        except OSError:
            pass
        if self._process.poll() is None:
            self._process.kill()
        self._process.wait()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
