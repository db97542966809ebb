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
"""

from __future__ import annotations

import logging
import os
import threading
import weakref
from typing import Any, Callable

from memcallbacks._base.errors import OutputDirError

log = logging.getLogger(__name__)

__all__ = ["weak_method", "Cleanup", "claim_folder", "release_folder"]


def weak_method(method: Any) -> Callable[..., Any]:
    """A plain function calling ``method`` (a bound method) while its object lives, else doing nothing."""
    ref = weakref.WeakMethod(method)

    def call(*args: Any, **kwargs: Any) -> Any:
        bound = ref()
        return bound(*args, **kwargs) if bound is not None else None

    call.__name__ = getattr(method, "__name__", "hook")
    return call


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


def claim_folder(folder: str | os.PathLike[str], session: Any, owner: str) -> None:
    """Refuse a folder another live monitor writes to: its files would overwrite this one's."""
    key = os.path.realpath(folder)
    with _claims_lock:
        ref = _claims.get(key)
        other = ref() if ref is not None else None
        if other is not None and other is not session and getattr(other, "live", False):
            raise OutputDirError(
                f"{owner}: output_dir {str(folder)!r} is already used by a running {other.owner}, so one would overwrite "
                "the other's history.csv, report.json and memory.png. Give each monitor its own output_dir=..., close() "
                "the other one first, or pass write_files=False to all but one."
            )
        _claims[key] = weakref.ref(session)


def release_folder(folder: str | os.PathLike[str] | None, session: Any) -> None:
    if folder is None:
        return
    key = os.path.realpath(folder)
    with _claims_lock:
        ref = _claims.get(key)
        if ref is not None and ref() in (session, None):
            del _claims[key]
