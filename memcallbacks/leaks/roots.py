"""Where a reference search starts: the locals of every frame and the globals of every module."""

from __future__ import annotations

import os
import sys
import threading
from typing import Any

__all__ = ["CO_OPTIMIZED", "PACKAGE_DIR", "Roots", "frame_locals"]

PACKAGE_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
"""The ``memcallbacks`` package: frames running its code are never roots (they hold what they inspect)."""

CO_OPTIMIZED = 0x1
"""``co_flags`` bit of a function frame (module and class bodies keep their locals in a dict)."""

_PACKAGE_PREFIX = PACKAGE_DIR + os.sep
_SNAPSHOT_LOCALS = sys.version_info < (3, 13)  # before PEP 667, f_locals is a cached snapshot
_INTERNAL_MODULES = ("memcallbacks", "torch", "gc", "sys", "threading")


def frame_locals(frame: Any) -> list[tuple[str, Any]]:
    """A frame's local variables, without pinning them (pre-3.13 f_locals is a cached snapshot)."""
    try:
        d = frame.f_locals
        items = list(d.items())
        if _SNAPSHOT_LOCALS and frame.f_code.co_flags & CO_OPTIMIZED and d is not frame.f_globals:
            d.clear()  # else the snapshot keeps values alive after the code deletes them
        return items
    except Exception:
        return []


_STDLIB_PREFIX = os.path.dirname(os.__file__) + os.sep


def _is_library_file(fname: str) -> bool:
    """Whether code in ``fname`` is installed or standard-library code (not the user's)."""
    return "site-packages" in fname or "dist-packages" in fname or fname.startswith(_STDLIB_PREFIX)


def _is_library(name: str, mod: Any) -> bool:
    """Whether a module's globals are searched late: memcallbacks, torch, installed and stdlib modules."""
    if name == "__main__":
        return False
    fname = getattr(mod, "__file__", None) or ""
    return (
        name.split(".")[0] in _INTERNAL_MODULES
        or "site-packages" in fname
        or "dist-packages" in fname
        or fname.startswith(sys.base_prefix)
        or not fname
    )


class Roots:
    """Root objects, in three phases: the locals of user code's frames and user-module globals, then
    the locals of library frames (Lightning's loops, the Transformers Trainer), then library-module
    globals.

    Most holders are found from the first phase. Library frames come second so that a holder is
    named from a stable owner (``Trainer.callbacks[1] (ImageLogger).pending``, reached from the
    user's ``trainer``) rather than from whichever framework frame happened to be on the stack
    (``_call_callback_hooks() local callback.pending``); what only a library frame holds is still
    found. Library globals (a large part of the heap) are searched only when targets remain.
    Labels are made on demand.
    """

    def __init__(self) -> None:
        self.phases: list[list[Any]] = [[], [], []]
        self.library_frame_values: set[int] = set()  # ids of root values that only library frames hold
        self.blocked: set[int] = set()  # ids of module objects and dicts, frames: never expanded
        self._frame_roots: dict[int, tuple[str, str]] = {}
        self._globals: list[tuple[str, dict[str, Any]]] = []
        self._add_frames()
        self._add_globals()

    def _add_frames(self) -> None:
        try:
            frames = sys._current_frames()
        except Exception:
            return
        me = threading.get_ident()
        for tid in sorted(frames, key=lambda t: t != me):
            f = frames[tid]
            while f is not None:
                self.blocked.add(id(f))  # an id, not the frame: holding our own frame would make a cycle
                code = f.f_code
                if not code.co_filename.startswith(_PACKAGE_PREFIX) and code.co_flags & CO_OPTIMIZED:
                    where = f"({os.path.basename(code.co_filename)}:{f.f_lineno})"
                    library = _is_library_file(code.co_filename)
                    values = self.phases[1 if library else 0]
                    for name, value in frame_locals(f):
                        if id(value) not in self._frame_roots:
                            self._frame_roots[id(value)] = (f"{code.co_name}() local {name}", where)
                            if library:
                                self.library_frame_values.add(id(value))
                        values.append(value)
                f = f.f_back
        del frames

    def _add_globals(self) -> None:
        mods = list(sys.modules.items())
        mods.sort(key=lambda item: (item[0] != "__main__", _is_library(*item)))
        for name, mod in mods:
            try:
                d = vars(mod)
            except Exception:
                continue
            self.blocked.add(id(mod))
            self.blocked.add(id(d))
            if name.split(".")[0] == "memcallbacks":
                continue
            self._globals.append((name, d))
            self.phases[2 if _is_library(name, mod) else 0].extend(d.values())

    def is_frame_local(self, obj: Any) -> bool:
        """Whether ``obj`` is a root because a frame's local variable holds it."""
        return id(obj) in self._frame_roots

    def label(self, obj: Any) -> tuple[str, str]:
        """``(label, where)`` of a root object; where is ``"(file:line)"`` for frame locals."""
        i = id(obj)
        if i in self._frame_roots:
            return self._frame_roots[i]
        for name, d in self._globals:
            if i in map(id, d.values()):
                for key, value in list(d.items()):
                    if value is obj:
                        return f"module {name}: global {key}", ""
        return type(obj).__name__, ""

    def release(self) -> None:
        """Drop every reference to root objects and labelled values."""
        self.phases = [[], [], []]
        self.library_frame_values = set()
        self._frame_roots = {}
        self._globals = []
