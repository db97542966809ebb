"""Graph marks: a sentinel key in ``grad_fn.metadata``, and the live tensor whose graph carries one."""

from __future__ import annotations

import gc
import logging
import os
import weakref
import sys
import types
import warnings
from typing import Any

import torch

from memcallbacks._base.torch_private import node_metadata
from memcallbacks.leaks.roots import PACKAGE_DIR, frame_locals

log = logging.getLogger(__name__)

__all__ = ["METADATA_KEY", "Sentinel", "find_graph_root", "mark_graphs"]

METADATA_KEY = "memcallbacks"
"""Key of the sentinel memcallbacks puts into ``grad_fn.metadata``."""

_Tensor = torch.Tensor
_MARKABLE: dict[type, bool] = {}


class Sentinel:
    """Lives in ``grad_fn.metadata``: dies exactly when the autograd node dies."""

    __slots__ = ("step", "loss_ref", "__weakref__")
    step: int
    loss_ref: Any  # a weak reference to the marked loss: the chain's root without a heap scan


def _markable(node_type: type) -> bool:
    """Whether a node may carry the sentinel: not AccumulateGrad, which can outlive the graph
    (DDP keeps references to them)."""
    ok = _MARKABLE.get(node_type)
    if ok is None:
        ok = _MARKABLE[node_type] = node_type.__name__ != "AccumulateGrad"
    return ok


def mark_graphs(step: int, graphs: list[torch.Tensor]) -> Sentinel:
    """Put one :class:`Sentinel` for ``step`` into ``grad_fn.metadata`` of the first 8 ``graphs``'
    nodes, and of the loss's (``graphs[0]``) next nodes: a framework may hand over ``loss / n``."""
    sentinel = Sentinel()
    sentinel.step = step
    sentinel.loss_ref = weakref.ref(graphs[0])
    try:
        for i, t in enumerate(graphs[:8]):
            fn = t.grad_fn
            node_metadata(fn)[METADATA_KEY] = sentinel
            if i == 0:
                for nxt, _ in fn.next_functions:
                    if nxt is not None and _markable(type(nxt)):
                        node_metadata(nxt)[METADATA_KEY] = sentinel
    except Exception:  # exotic node types without metadata
        log.debug("could not mark the loss graph of step %s", step, exc_info=True)
    return sentinel
_ModuleType = types.ModuleType
_PACKAGE_PREFIX = PACKAGE_DIR + os.sep


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
