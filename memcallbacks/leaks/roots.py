"""Where reference searches start (frame locals, module globals); the tensor a marked graph hangs on."""

from __future__ import annotations

import gc
import os
import sys
import threading
import types
import warnings
from typing import Any

import torch

from memcallbacks._base.torch_private import node_metadata

__all__ = ["find_graph_roots", "CO_OPTIMIZED", "METADATA_KEY", "PACKAGE_DIR", "Roots", "frame_locals", "find_graph_root"]

METADATA_KEY = "memcallbacks"
"""Key of the sentinel the lingering detector puts into ``grad_fn.metadata`` (here: the graph root's search reads it)."""

_Tensor = torch.Tensor

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


# ------------------------------------------------------------------ the root of a marked graph
_ModuleType = types.ModuleType


def find_graph_root(sentinel: Any, *, heap: bool = True) -> Any:
    """A live tensor whose graph reaches a node carrying ``sentinel`` (only called when the graph is
    known to be alive).

    The roots a loop keeps its loss in are looked at first: the local variables of every frame and
    the globals of ``__main__`` (nanoGPT's ``loss = loss / gradient_accumulation_steps`` at module
    level, a function's ``loss``), and tensors one container deep in them; a few microseconds. Only
    when none of them reaches the mark is the heap scanned (``gc.get_objects()``, 0.1-0.5 s on a big
    heap), and only with ``heap=True``."""
    found = _root_in_variables(sentinel)
    if found is not None or not heap:
        return found
    return _root_in_heap(sentinel)


def find_graph_roots(sentinels: list[Any]) -> list[Any]:
    """A live tensor for each of several marked graphs (a chain's steps) that has one: the variables first, then at
    most one heap scan for all of the others, matching a tensor whose node, or the node after it, carries a mark."""
    found: dict[int, Any] = {}
    for sentinel in sentinels:
        root = _root_in_variables(sentinel)
        if root is not None:
            found[id(sentinel)] = root
    missing = {id(s) for s in sentinels} - set(found)
    if missing:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            objects = [obj for obj in gc.get_objects() if isinstance(obj, _Tensor)]
        for obj in objects:
            try:
                fn = obj.grad_fn
                if fn is None:
                    continue
                nodes = [fn, *(n for n, _ in fn.next_functions if n is not None)]
                for node in nodes:
                    mark = id(node_metadata(node).get(METADATA_KEY))
                    if mark in missing and mark not in found:
                        found[mark] = obj
                        break
            except Exception:
                continue
        del objects
    return list(found.values())


_NODE_BUDGET = 256  # graph nodes walked over all the candidates of the cheap search


def _candidates(value: Any, out: list[Any], seen: set[int]) -> None:
    """Tensors with a graph in ``value`` and one container (tuple, list, dict, ``__dict__``) deep."""
    if isinstance(value, _Tensor):
        if id(value) not in seen:
            seen.add(id(value))
            out.append(value)
        return
    tp = type(value)
    if tp is tuple or tp is list:
        items: Any = value[:16]
    elif tp is dict:
        items = list(value.values())[:16]
    else:
        d = getattr(value, "__dict__", None) if not isinstance(value, (type, _ModuleType)) else None
        if type(d) is not dict or isinstance(value, torch.nn.Module):
            return
        items = list(d.values())[:16]
    for item in items:
        if isinstance(item, _Tensor) and id(item) not in seen:
            seen.add(id(item))
            out.append(item)


def _root_in_variables(sentinel: Any) -> Any:
    """The cheap search of :func:`find_graph_root`: frame locals and ``__main__``'s globals."""
    values: list[Any] = []
    try:
        frames = sys._current_frames()
        for f in frames.values():
            while f is not None:
                if not f.f_code.co_filename.startswith(_PACKAGE_PREFIX):
                    values.extend(v for _, v in frame_locals(f))
                f = f.f_back
        del frames, f
    except Exception:
        pass
    main = sys.modules.get("__main__")
    if main is not None:
        try:
            values.extend(vars(main).values())
        except Exception:
            pass
    tensors: list[Any] = []
    seen: set[int] = set()
    for value in values:
        _candidates(value, tensors, seen)
    del values
    with_graph = []
    for t in tensors:
        try:
            fn = t.grad_fn
        except Exception:
            continue
        if fn is not None:
            with_graph.append((t, fn))
    del tensors
    # shallow first (the user's `loss / k` is one node above the marked loss node), then a bounded walk
    for t, fn in with_graph:
        try:
            if node_metadata(fn).get(METADATA_KEY) is sentinel:
                return t
            for nxt, _ in fn.next_functions:
                if nxt is not None and node_metadata(nxt).get(METADATA_KEY) is sentinel:
                    return t
        except Exception:
            continue
    return _reaching_sentinel(with_graph, sentinel, budget=_NODE_BUDGET)


def _root_in_heap(sentinel: Any) -> Any:
    """The heap scan of :func:`find_graph_root`."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # proxies of deprecated names warn when isinstance() looks at them
        objects = [obj for obj in gc.get_objects() if isinstance(obj, _Tensor)]
    with_graph = []
    for obj in objects:
        try:
            fn = obj.grad_fn
        except Exception:
            continue
        if fn is None:
            continue
        try:
            if node_metadata(fn).get(METADATA_KEY) is sentinel:
                return obj
        except Exception:
            continue
        with_graph.append((obj, fn))
    del objects
    return _reaching_sentinel(with_graph, sentinel)


def _reaching_sentinel(with_graph: list[tuple[torch.Tensor, Any]], sentinel: Any, budget: int = 20_000) -> Any:
    """The first tensor whose graph (``(tensor, grad_fn)`` pairs) reaches a node marked with ``sentinel``.

    ``budget``: nodes visited over all candidates.
    """
    seen: set[int] = set()
    for obj, fn in with_graph:
        stack = [fn]
        while stack and budget > 0:
            node = stack.pop()
            if id(node) in seen:
                continue
            seen.add(id(node))
            budget -= 1
            try:
                if node_metadata(node).get(METADATA_KEY) is sentinel:
                    return obj
                stack.extend(n for n, _ in node.next_functions if n is not None)
            except Exception:
                continue
    return None
