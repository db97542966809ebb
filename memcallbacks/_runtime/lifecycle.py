"""What the monitor changes in the process, and how every change is undone on every exit path.

The monitor changes process-global state: torch's global optimizer-step hooks, forward hooks on
the user's modules, Python's automatic garbage collection (``gc_disable_automatic``), the CUDA
allocator's history and OOM observer (``auto_snapshot``), and an output folder it owns for the
run. ``Cleanup`` keeps the undo for each one without holding the adapter, so that a
``weakref.finalize`` on the adapter can run it when a ``Monitor`` is dropped without ``close()``
(after an exception in the loop body, say). Hooks registered with :func:`weak_method` hold the
adapter weakly for the same reason: torch's global hook table would otherwise keep it alive
forever. ``mallopt`` (``cpu_mmap_threshold``) cannot be undone within a process: glibc has no way
back to its adaptive threshold; docs/reliability.md says so.

An exception that nobody catches (the README's plain loop without ``with``: the error leaves the
loop and ``close()`` is never reached) ends a run too: while a monitor runs, ``sys.excepthook`` is
an :class:`ExceptHook` chained to the hook it replaced (as sentry-python and faulthandler chain
theirs). The previous hook prints the traceback first, as it would have, then each running monitor
records the exception, explains an out-of-memory error and writes its files. The hook is restored
when the last monitor stops.
"""

from __future__ import annotations

import logging
import os
import sys
import threading
import weakref
from typing import Any, Callable

import torch

from memcallbacks._base.errors import OutputDirError
from memcallbacks._base.torch_private import lazily_disabled

log = logging.getLogger(__name__)

__all__ = ["weak_method", "WeakHook", "GatedHook", "InertHook", "Cleanup", "claim_folder", "release_folder", "output_folder",
           "ExceptHook", "watch_uncaught", "unwatch_uncaught"]


def weak_method(method: Any) -> "WeakHook":
    """A callable calling ``method`` (a bound method) while its object lives, else doing nothing.

    The hooks the monitor registers on the user's objects (the model's forward hooks, output
    tensors' hooks) are these, so that the objects can still be pickled, ``torch.save``d and
    deep-copied (``copy.deepcopy``, ``AveragedModel``): a deep copy gets an inert hook (:class:`InertHook`)
    that carries no monitor, does nothing, and takes itself off a module at that module's first
    forward, so the copy is not watched and does not stay on torch's slower hooked call path; a
    pickled copy gets ``(0).__init__``, a no-op of Python itself, so loading it needs no memcallbacks."""
    return WeakHook(method)


class WeakHook:
    """A module-level callable (a local function cannot be pickled) holding a bound method weakly."""

    __slots__ = ("_ref", "__name__", "__weakref__")

    def __init__(self, method: Any) -> None:
        self._ref = weakref.WeakMethod(method)
        self.__name__ = getattr(method, "__name__", "hook")

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if _is_compiling():  # true only while dynamo traces this call: see _run_eagerly
            return _run_eagerly(self, args, kwargs)
        bound = self._ref()
        if bound is not None:
            return bound(*args, **kwargs)
        _unhook(self, args)  # the monitor is gone: take this hook off the module it was called for
        return None

    # A copy of the user's object must not carry (nor revive) the monitor. copy.deepcopy gives an
    # InertHook; pickling (torch.save) gives a no-op of Python itself, so loading the file needs no
    # memcallbacks. copy.copy shares the hook dicts, so it needs nothing.
    def __reduce__(self) -> tuple[Any, tuple[Any, ...]]:
        return _PICKLED_NO_OP

    def __deepcopy__(self, memo: dict[int, Any]) -> "InertHook":
        return InertHook(self.__name__)

    def __repr__(self) -> str:
        return f"<memcallbacks hook {self.__name__} ({'live' if self._ref() is not None else 'inert'})>"


class GatedHook(WeakHook):
    """A :class:`WeakHook` with a gate: closed (``open = False``), a call returns at once, before the
    weak reference and the monitor's guard. The plain loop closes its forward pre-hook for the rest
    of a step once the step has begun, and its forward hook on steps that keep no outputs: torch
    calls a hook at every forward (four a step under gradient accumulation of 4), and after the
    step's compute each full call costs 20-30 µs of cold caches (the nanoGPT-style loop of
    benchmarks/nanogpt_budget.py). An open call goes through ``meter`` (a
    :class:`~memcallbacks._runtime.schedule.HookMeter`), which counts its whole time as the monitor's."""

    __slots__ = ("open", "meter")

    def __init__(self, method: Any, meter: Any = None) -> None:
        super().__init__(method)
        self.open = True
        self.meter = meter

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if _is_compiling():  # first: dynamo must not trace (and guard on) the gate
            return _run_eagerly(self, args, kwargs)
        meter = self.meter
        if meter is not None:
            meter.calls += 1  # every call, open or closed, went through torch's hooked call path (the dispatch estimate)
        if not self.open:
            return None
        bound = self._ref()
        if bound is None:
            _unhook(self, args)
            return None
        return bound(*args, **kwargs) if meter is None else meter.call(bound, args, kwargs)


class InertHook:
    """What a copied or unpickled monitor hook becomes: does nothing and removes itself when called."""

    __slots__ = ("__name__",)

    def __init__(self, name: str = "hook") -> None:
        self.__name__ = name

    def __call__(self, *args: Any, **kwargs: Any) -> None:
        if _is_compiling():
            _run_eagerly(self, args, kwargs)
            return
        _unhook(self, args)

    def __reduce__(self) -> tuple[Any, tuple[Any, ...]]:
        return _PICKLED_NO_OP

    def __repr__(self) -> str:
        return f"<memcallbacks hook {self.__name__} (inert)>"


# ``(0).__init__``: int leaves object.__init__ alone and defines __new__, so it takes any arguments
# and returns None: a hook that does nothing, that pickle rebuilds as getattr(0, "__init__") with
# nothing but builtins (a model saved while a monitor was attached loads where memcallbacks is not
# installed). Unlike InertHook it stays on the loaded module: one C call per forward.
_PICKLED_NO_OP: tuple[Any, tuple[Any, ...]] = (getattr, (0, "__init__"))


_is_compiling = torch.compiler.is_compiling


@lazily_disabled
def _run_eagerly(hook: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """A hook called from a ``torch.compile``d forward runs here, outside the trace (a graph break):
    the monitor reads the clock, allocator counters and autograd graphs, which dynamo cannot trace
    (it failed on them). The check costs eager calls one function call, not the ~2 µs of a
    ``torch.compiler.disable`` wrapper around every call."""
    if isinstance(hook, WeakHook):
        bound = hook._ref()
        if bound is not None:
            return bound(*args, **kwargs)
    _unhook(hook, args)
    return None


_HOOK_DICTS = ("_forward_pre_hooks", "_forward_hooks", "_forward_pre_hooks_with_kwargs", "_forward_hooks_with_kwargs",
               "_forward_hooks_always_called")


def _unhook(hook: Any, args: tuple[Any, ...]) -> None:
    """Remove ``hook`` from the module it was called for (a forward hook's first argument). torch
    iterates over a tuple of the hooks, so removing one while they run is safe."""
    module = args[0] if args else None
    hooks = getattr(module, "__dict__", {}).get("_forward_pre_hooks")
    if hooks is None:
        return  # not a module hook (a tensor's hook, called once)
    try:
        ids = [k for name in ("_forward_pre_hooks", "_forward_hooks") for k, v in list(module.__dict__[name].items())
               if v is hook]
        for name in _HOOK_DICTS:
            table = module.__dict__.get(name)
            if table is not None:
                for k in ids:
                    table.pop(k, None)
    except Exception:  # pragma: no cover - torch's hook tables changed shape; the hook stays a no-op
        log.debug("could not remove an inert memcallbacks hook", exc_info=True)


class Cleanup:
    """Undo actions, each run once, each on its own (one that fails does not stop the others)."""

    def __init__(self, owner: str) -> None:
        self.owner = owner
        self.handles: list[Any] = []  # torch RemovableHandles
        self._undo: list[tuple[str, Callable[[], None]]] = []
        self.done = False

    def add(self, what: str, undo: Callable[[], None]) -> None:
        self._undo.append((what, undo))

    def remove_handles(self) -> None:
        handles, self.handles = self.handles, []
        for handle in handles:
            try:
                handle.remove()
            except Exception:  # pragma: no cover - torch's remove() does not raise
                log.debug("could not remove a hook handle", exc_info=True)

    def run(self) -> None:
        """Undo everything; safe to call twice (the second call does nothing)."""
        if self.done:
            return
        self.done = True
        self.remove_handles()
        for what, undo in reversed(self._undo):
            try:
                undo()
            except Exception:
                log.exception("memcallbacks: %s could not %s; continuing.", self.owner, what)
        self._undo = []

    def abandoned(self) -> None:
        """The finalizer of an adapter dropped without ``close()``."""
        if self.done:
            return
        log.warning("memcallbacks: a %s was dropped without close(); its hooks are removed and the process state it "
                    "changed is restored (no files are written). Call close(), or use `with %s(...) as monitor:`.",
                    self.owner, self.owner)
        self.run()


# ---------------------------------------------------------------------- one live monitor per output folder
_claims: dict[str, Any] = {}  # realpath -> weakref to the owning Session
_claims_lock = threading.Lock()


def claim_folder(folder: str | os.PathLike[str], session: object, owner: str) -> None:
    """Refuse a folder another live monitor writes to: its files would overwrite this one's."""
    key = os.path.realpath(folder)
    with _claims_lock:
        ref = _claims.get(key)
        other = ref() if ref is not None else None
        if other is not None and other is not session and getattr(other, "live", False):
            raise OutputDirError(
                f"{owner}: output_dir {str(folder)!r} is already used by a running {getattr(other, 'owner', 'monitor')}, so one would overwrite "
                "the other's history.csv, report.json and memory.png. Give each monitor its own output_dir=..., close() "
                "the other one first, or pass write_files=False to all but one."
            )
        _claims[key] = weakref.ref(session)


def release_folder(folder: str | os.PathLike[str] | None, session: object) -> None:
    if folder is None:
        return
    key = os.path.realpath(folder)
    with _claims_lock:
        ref = _claims.get(key)
        if ref is not None and ref() in (session, None):
            del _claims[key]


def output_folder(output_dir: Any, default: Any) -> str:
    """Where a run's files go: ``output_dir``, else the adapter's default (the framework's log folder),
    else ``memcallbacks_output`` in the working directory (not ``./memcallbacks``: from a source
    checkout that is the package). Resolved once, at start: a later ``chdir`` must not move them.
    An adapter's default ``memcallbacks`` folder directly in the working directory or the script's own
    (Lightning with ``logger=False``: ``default_root_dir`` is the working directory) is ``memcallbacks_output``
    too: there ``import memcallbacks`` finds the folder first, a namespace package that hides an editable
    install's package, and the script's next run fails to import the monitor (a user check)."""
    if output_dir:
        return os.path.realpath(output_dir)
    if default:
        folder = os.path.realpath(default)
        parent, name = os.path.split(folder)
        script_dir = sys.path[0] if sys.path and sys.path[0] else os.getcwd()  # "": an interactive interpreter's
        if name == "memcallbacks" and parent in {os.path.realpath(os.getcwd()), os.path.realpath(script_dir)}:
            return os.path.join(parent, "memcallbacks_output")
        return folder
    return os.path.realpath(os.path.join(os.getcwd(), "memcallbacks_output"))


# ---------------------------------------------------------------------- an exception nobody caught
class ExceptHook:
    """``sys.excepthook`` while a monitor runs. The hook it replaced (``previous``) prints the traceback
    first, unchanged and undelayed: if explaining ends the process (a C library's ``exit`` when an
    allocation fails), the error has been shown. Then every running monitor's handler gets the
    exception (record it, explain an OOM, write the files, undo the hooks). Each handler on its own,
    and nothing escapes: Python would print "Error in sys.excepthook" over the user's error.
    ``active`` is False once the last monitor stopped while a later hook chained to this one: it
    then only passes the exception on."""

    def __init__(self, previous: Callable[..., Any]) -> None:
        self.previous = previous
        self.active = True

    def __call__(self, exc_type: type[BaseException], exc: BaseException, tb: Any) -> Any:
        handlers = _handlers() if self.active else []
        try:
            return self.previous(exc_type, exc, tb)
        finally:
            for handler in handlers:
                try:
                    handler(exc)
                except BaseException:  # a second Ctrl-C, an internal error: the user's error was printed above
                    log.debug("memcallbacks: a monitor could not finish its run at an uncaught exception", exc_info=True)

    def __repr__(self) -> str:
        return f"<memcallbacks excepthook ({'active' if self.active else 'passing on'}), chained to {self.previous!r}>"


_uncaught: dict[int, "weakref.WeakMethod[Any]"] = {}  # id(session) -> what finishes its run at an uncaught exception
_hooks: list[ExceptHook] = []  # the installed hook, while a monitor runs
_uncaught_lock = threading.RLock()  # reentrant: a collected session's callback may run while the lock is held


def _handlers() -> list[Callable[[BaseException], Any]]:
    with _uncaught_lock:
        refs = list(_uncaught.values())
    return [h for h in (ref() for ref in refs) if h is not None]


def watch_uncaught(owner: object, handler: Callable[[BaseException], Any]) -> None:
    """Call ``handler(exc)`` (a bound method, held weakly) when an exception reaches ``sys.excepthook`` while
    ``owner`` runs; the first watch installs the chained hook."""
    key = id(owner)
    with _uncaught_lock:
        _uncaught[key] = weakref.WeakMethod(handler, lambda ref: _forget(key, ref))  # collected without stop(): forgotten
        if not _hooks:
            _hooks.append(ExceptHook(sys.excepthook))
            sys.excepthook = _hooks[0]


def unwatch_uncaught(owner: object) -> None:
    """``owner`` stopped; the last one restores the previous hook (or, where a later hook chained to ours,
    turns ours into a pass-through). Safe to call twice."""
    with _uncaught_lock:
        _uncaught.pop(id(owner), None)
        _restore_hook()


def _forget(key: int, ref: Any) -> None:
    with _uncaught_lock:
        if _uncaught.get(key) is ref:
            del _uncaught[key]
            _restore_hook()


def _restore_hook() -> None:
    """With no monitor left, the previous hook is back (or, where a later hook chained to ours, ours passes on)."""
    with _uncaught_lock:
        if _uncaught or not _hooks:
            return
        hook = _hooks.pop()
        if sys.excepthook is hook:
            sys.excepthook = hook.previous
        else:
            hook.active = False
