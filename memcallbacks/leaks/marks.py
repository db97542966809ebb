"""Graph marks: the sentinel key in ``grad_fn.metadata``, and finding the live tensor whose graph carries a mark."""

from __future__ import annotations

import gc
import warnings
from typing import Any

import torch

from memcallbacks._base.torch_private import node_metadata

__all__ = ["METADATA_KEY", "find_graph_root"]

METADATA_KEY = "memcallbacks"
"""Key of the sentinel memcallbacks puts into ``grad_fn.metadata``."""

_Tensor = torch.Tensor


def find_graph_root(sentinel: Any) -> Any:
    """A live tensor whose graph reaches a node carrying ``sentinel`` (a scan of the heap: only
    called when the graph is known to be alive, i.e. when something is already suspicious)."""
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
