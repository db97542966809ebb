"""Rendering a chain of objects (root -> ... -> tensor) as a path string and a holder to group by."""

from __future__ import annotations

import collections
import re
from typing import Any

import torch

from memcallbacks._runtime.torch_private import is_autograd_node
from memcallbacks.leaks.roots import Roots, frame_locals
from memcallbacks.leaks.tensors import describe_tensor

__all__ = ["GRAPH_HOP", "edge_fragment", "holder_of", "render_chain"]

GRAPH_HOP = " -> autograd graph"
"""The fragment of a path where it enters an autograd graph (written once per path)."""

_MODULE_DICT_KEYS = ("_modules", "_parameters", "_buffers")
_SUBSCRIPT_TAIL = re.compile(r"(\[[^\[\]]*\]|\{[^{}]*\})+$")


def _key_repr(key: Any) -> str:
    if isinstance(key, (str, int, float, bool)) or key is None:
        return repr(key)
    if isinstance(key, tuple) and len(key) <= 4 and all(isinstance(k, (str, int, float, bool)) for k in key):
        return repr(key)
    if isinstance(key, torch.Tensor):
        return f"<tensor {describe_tensor(key)}>"
    return f"<{type(key).__name__}>"


def _index_of(seq: Any, child: Any) -> int | None:
    for i, v in enumerate(seq):
        if v is child:
            return i
    return None


def edge_fragment(parent: Any, child: Any, attr_mode: bool) -> tuple[str, bool]:
    """Path fragment for the reference parent -> child, and whether the next dict is attribute-style."""
    if isinstance(parent, dict):
        return _dict_edge(parent, child, attr_mode)
    if isinstance(parent, (list, tuple, collections.deque)):
        i = _index_of(parent, child)
        return (f"[{i}]" if i is not None else f" -> {type(child).__name__}"), False
    if isinstance(parent, (set, frozenset)):
        return "{item}", False
    if isinstance(parent, torch.Tensor):
        return _tensor_edge(parent, child)
    if is_autograd_node(parent):
        return _node_edge(parent, child)
    if type(parent).__name__ == "cell":
        return "", False
    if isinstance(parent, type):
        if child is parent.__dict__ or isinstance(child, dict):
            return "", True
    if getattr(parent, "__dict__", None) is child:
        return "", True
    return _function_edge(parent, child)


def _dict_edge(parent: dict[Any, Any], child: Any, attr_mode: bool) -> tuple[str, bool]:
    for k, v in parent.items():
        if v is child:
            if attr_mode and isinstance(k, str):
                if k in _MODULE_DICT_KEYS and isinstance(child, dict):
                    return "", True
                return f".{k}", False
            return f"[{_key_repr(k)}]", False
    return " -> dict key", False


def _tensor_edge(parent: torch.Tensor, child: Any) -> tuple[str, bool]:
    try:
        if parent.is_leaf and parent.grad is child:
            return ".grad", False
        if parent._base is child:
            return "._base", False
        if parent.grad_fn is child:
            return GRAPH_HOP, False
    except Exception:
        pass
    if child is getattr(parent, "__dict__", None):
        return "", True
    return _attr_edge(parent, child)


def _node_edge(parent: Any, child: Any) -> tuple[str, bool]:
    if is_autograd_node(child):
        return "", False
    if type(parent).__name__ == "AccumulateGrad" and getattr(parent, "variable", None) is child:
        return f" -> leaf tensor {describe_tensor(child)}", False
    try:
        for k, v in vars(parent).items():
            if v is child:
                return f" -> ctx.{k} tensor {describe_tensor(child)}", False
    except Exception:
        pass
    return f" -> saved tensor {describe_tensor(child)}", False


def _function_edge(parent: Any, child: Any) -> tuple[str, bool]:
    """Closures, bound methods, generators and frames; then plain attributes."""
    if hasattr(parent, "__code__") and child is getattr(parent, "__closure__", None):
        return f" -> closure of {getattr(parent, '__qualname__', '?')}()", False
    if getattr(parent, "__self__", None) is child:
        return ".__self__", False
    if hasattr(parent, "gi_frame") or hasattr(parent, "cr_frame"):
        frame = getattr(parent, "gi_frame", None) or getattr(parent, "cr_frame", None)
        if frame is not None:
            for name, value in frame_locals(frame):
                if value is child:
                    return f" -> generator {parent.__qualname__}() local {name}", False
    if type(parent).__name__ == "frame":
        for name, value in frame_locals(parent):
            if value is child:
                return f" -> frame {parent.f_code.co_name}() local {name}", False
    return _attr_edge(parent, child)


def _attr_edge(parent: Any, child: Any) -> tuple[str, bool]:
    try:
        for k, v in vars(parent).items():
            if v is child:
                if k in _MODULE_DICT_KEYS and isinstance(child, dict):
                    return "", True
                return f".{k}", False
    except Exception:
        pass
    for cls in type(parent).__mro__:
        for slot in getattr(cls, "__slots__", ()) or ():
            try:
                if getattr(parent, slot) is child:
                    return f".{slot}", False
            except Exception:
                continue
    return f" -> {type(child).__name__}", False


def render_chain(chain: list[Any], roots: Roots) -> tuple[str, str, bool]:
    """``(path, holder, via_graph)`` for a chain root value -> ... -> tensor.

    A path through an nn.Module starts at the outermost module (``LitModel.cache[17]``),
    whichever frame or global led to it.
    """
    for k, obj in enumerate(chain):
        if isinstance(obj, torch.nn.Module):
            chain = chain[k:]
            path, where = type(obj).__name__, ""
            break
        if is_autograd_node(obj) or isinstance(obj, torch.Tensor):
            path, where = roots.label(chain[0])
            break
    else:
        path, where = roots.label(chain[0])
    attr_mode = False
    via_graph = False
    skip = 0
    for i, (parent, child) in enumerate(zip(chain, chain[1:])):
        if skip:
            skip -= 1
            continue
        frag, attr_mode = edge_fragment(parent, child, attr_mode)
        if frag.startswith(" -> closure of") and i + 2 < len(chain):
            cells = child
            index = _index_of(cells, chain[i + 2])
            names = getattr(getattr(parent, "__code__", None), "co_freevars", ())
            if index is not None and index < len(names):
                frag = f" -> {getattr(parent, '__qualname__', '?')}() closure variable {names[index]}"
                skip = 2  # tuple -> cell -> value
                attr_mode = False
        if frag.startswith(" -> ") and where:
            path += " " + where
            where = ""
        if frag == GRAPH_HOP:
            if via_graph:
                continue
            via_graph = True
        path += frag
    if where:
        path += " " + where
    return path, holder_of(path), via_graph


def holder_of(path: str) -> str:
    """Group key: the path up to the first hop, without location and trailing subscripts."""
    head, sep, _rest = path.partition(" -> ")
    head = re.sub(r" \([^()]*:\d+\)$", "", head)
    head = _SUBSCRIPT_TAIL.sub("", head)
    if sep and GRAPH_HOP.strip() in path:
        head += GRAPH_HOP
    elif sep:
        head += " -> ..."
    return head
