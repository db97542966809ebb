"""Rendering a chain of objects (root -> ... -> tensor) as a path string and a holder to group by."""

from __future__ import annotations

import collections
import re
import types
from typing import Any

import torch

from memcallbacks._base.torch_private import is_autograd_node
from memcallbacks.leaks.roots import Roots, frame_locals
from memcallbacks.leaks.tensors import describe_tensor

__all__ = ["GRAPH_HOP", "edge_fragment", "holder_of", "is_owner", "render_chain"]

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


_CONTAINERS = (dict, list, tuple, set, frozenset, collections.deque)
_NOT_OWNERS = (type, types.ModuleType, types.FunctionType, types.MethodType, types.BuiltinFunctionType, types.FrameType, torch.Tensor)


def is_owner(obj: Any) -> bool:
    """An instance of a class that owns state by attribute (a Trainer, a callback, a user's object):
    not a container, tensor, function, frame, module object or autograd node."""
    tp = type(obj)
    if tp.__module__ == "builtins" or isinstance(obj, _CONTAINERS) or isinstance(obj, _NOT_OWNERS) or is_autograd_node(obj):
        return False
    return hasattr(obj, "__dict__") or bool(getattr(tp, "__slots__", None))


def _start(chain: list[Any], roots: Roots) -> tuple[int, str, str]:
    """Where a path starts: ``(index in chain, label, where)``.

    The outermost nn.Module on the way (``LitModel.cache[17]``), whichever frame or global led to
    it; else, from a frame's local, the owning object by its type (``MyTrainer._train_logits``,
    ``Trainer.callbacks[1] (ImageLogger).pending``): the local itself when it is one, the first
    one on the way when the local is a library frame's (its name says nothing stable). Globals
    and user locals that are containers or tensors keep their names (``local logits``)."""
    for k, obj in enumerate(chain):
        if isinstance(obj, torch.nn.Module):
            return k, type(obj).__name__, ""
        if is_autograd_node(obj) or isinstance(obj, torch.Tensor):
            break
    label, where = roots.label(chain[0])
    if not roots.is_frame_local(chain[0]):
        return 0, label, where
    library = id(chain[0]) in roots.library_frame_values
    for k, obj in enumerate(chain[:-1]):
        if is_autograd_node(obj) or isinstance(obj, torch.Tensor):
            break
        if is_owner(obj):
            return k, type(obj).__name__, ""
        if not library:
            break
    return 0, label, where


def render_chain(chain: list[Any], roots: Roots) -> tuple[str, str, bool]:
    """``(path, holder, via_graph)`` for a chain root value -> ... -> tensor (see :func:`_start`).

    An object reached by subscript on the way is named by its type when the path goes on through
    its attributes: ``Trainer.callbacks[1] (ImageLogger).pending``.
    """
    k, path, where = _start(chain, roots)
    chain = chain[k:]
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
        if frag.endswith("]") and i + 2 < len(chain) and is_owner(child) and not isinstance(child, torch.nn.Module):
            frag += f" ({type(child).__name__})"
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
