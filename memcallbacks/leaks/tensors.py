"""Tensors in batches and autograd graphs: describe, find and walk them (census and detectors)."""

from __future__ import annotations

import collections
import dataclasses
import itertools
from collections.abc import Mapping
from typing import Any, Iterable, Iterator

import torch

from memcallbacks._base.storage import distinct_bytes

from memcallbacks._base.torch_private import saved_tensors_of

__all__ = [
    "batch_bytes",
    "graph_bytes",
    "describe_tensor",
    "graph_tensors",
    "is_parameter",
    "iter_tensors",
    "node_children",
]


def describe_tensor(t: Any, kind: type | None = None) -> str:
    """``"256x512 float32"`` (plus ``" on cuda:0"`` off the CPU); never raises. ``t``: a tensor, or what
    was kept of one (its ``shape``, ``dtype`` and ``device``); ``kind``: the type named when they do not
    describe it (a nested tensor's sizes), ``type(t)`` by default."""
    try:
        shape = "x".join(map(str, map(int, t.shape))) or "scalar"  # builtins: no generator frame
        dtype = str(t.dtype).replace("torch.", "")
        dev = t.device
        where = "" if dev.type == "cpu" else f" on {dev}"
        return f"{shape} {dtype}{where}"
    except Exception:
        return (kind or type(t)).__name__


def iter_tensors(obj: Any, *, max_depth: int = 8, max_items: int = 100_000) -> Iterator[torch.Tensor]:
    """Tensors in a batch-like structure: tensors, mappings, lists/tuples/sets, dataclasses.

    Arbitrary objects are not searched (a batch may reference a model). Never raises.
    """
    Tensor = torch.Tensor
    tp = type(obj)
    if tp is dict or tp is list or tp is tuple:  # fast path: a flat batch of tensors
        values = obj.values() if tp is dict else obj
        for v in values:  # a loop, not all(<generator>): this runs at every step that leaves marks
            if not isinstance(v, Tensor):
                break
        else:
            yield from values
            return
    elif isinstance(obj, Tensor):
        yield obj
        return
    stack: list[tuple[Any, int]] = [(obj, 0)]
    seen: set[int] = set()
    budget = max_items
    while stack and budget > 0:
        item, depth = stack.pop()
        budget -= 1
        try:
            if isinstance(item, Tensor):
                yield item
                continue
            if item is None or isinstance(item, (str, bytes, int, float, bool)) or depth >= max_depth:
                continue
            if id(item) in seen:
                continue
            seen.add(id(item))
            if isinstance(item, (list, tuple, set, frozenset, collections.deque)):
                children: Iterable[Any] = list(item)
            elif isinstance(item, Mapping):
                children = list(item.values())
            elif dataclasses.is_dataclass(item) and not isinstance(item, type):
                children = [getattr(item, f.name, None) for f in dataclasses.fields(item)]
            else:
                continue
            stack.extend(zip(reversed(list(children)), itertools.repeat(depth + 1)))
        except Exception:
            continue


_PARAM_TYPES: dict[type, bool] = {}


def is_parameter(t: Any) -> bool:
    """``isinstance(t, nn.Parameter)`` without the slow metaclass check (cached per type)."""
    tp = type(t)
    known = _PARAM_TYPES.get(tp)
    if known is None:
        known = _PARAM_TYPES[tp] = issubclass(tp, torch.nn.Parameter)
    return known


def node_children(node: Any, saved: bool = True) -> list[tuple[Any, str]]:
    """Children of an autograd node as ``(object, how)``; how is "node", "leaf" or "saved" (only
    with ``saved``)."""
    out: list[tuple[Any, str]] = []
    try:
        for fn, _ in node.next_functions:
            if fn is not None:
                out.append((fn, "node"))
    except Exception:
        pass
    var = getattr(node, "variable", None) if type(node).__name__ == "AccumulateGrad" else None
    if var is not None:
        out.append((var, "leaf"))
    if saved:
        out.extend((t, "saved") for t in saved_tensors_of(node))
    return out


def graph_tensors(
    start: Iterable[Any], *, max_nodes: int = 1_000_000, visited: set[int] | None = None, saved: bool = True
) -> Iterator[tuple[torch.Tensor, str]]:
    """Walk autograd graphs from tensors or nodes; yield ``(tensor, "leaf" | "saved")``.

    Leaves are the tensors ``AccumulateGrad`` nodes keep (parameters and hand-made leaves);
    saved tensors are what nodes keep for backward (gone after ``backward()`` unless
    ``retain_graph``). ``visited`` (node ids) lets several walks share work. ``saved=False``: leaves
    only (a graph known to be freed by ``backward()``: reading each freed saved tensor raises, ~30 µs).
    """
    seen = visited if visited is not None else set()
    keep: list[Any] = []  # node wrappers must outlive the walk so their ids stay unique
    stack: list[Any] = []
    for s in start:
        node = s.grad_fn if isinstance(s, torch.Tensor) else s
        if node is not None and id(node) not in seen:
            seen.add(id(node))
            keep.append(node)
            stack.append(node)
    while stack and len(keep) <= max_nodes:
        node = stack.pop()
        for child, how in node_children(node, saved):
            if how == "node":
                if id(child) not in seen:
                    seen.add(id(child))
                    keep.append(child)
                    stack.append(child)
            else:
                yield child, how


def graph_freed(root: Any, probe_nodes: int = 8) -> bool:
    """Whether ``backward()`` has freed the graph under ``root`` (a tensor): the first node among
    the first ``probe_nodes`` that declares saved tensors has them released. A graph backward ran
    through without ``retain_graph`` has every saved tensor of its nodes released."""
    from memcallbacks._base.torch_private import node_info

    stack = [getattr(root, "grad_fn", None)]
    seen = 0
    while stack and seen < probe_nodes:
        node = stack.pop()
        if node is None:
            continue
        seen += 1
        try:
            names = node_info(type(node))[1]
        except Exception:
            return False
        for name in names:
            try:
                value = getattr(node, name)
            except RuntimeError:
                return True
            except Exception:
                continue
            if value is not None:
                return False  # a saved tensor that reads: not freed
        try:
            stack.extend(n for n, _ in node.next_functions if n is not None)
        except Exception:
            return False
    return False


def batch_bytes(batch: Any) -> int:
    """Bytes of the distinct storages of the tensors in ``batch`` (nested containers)."""
    return distinct_bytes(iter_tensors(batch))


def graph_bytes(roots: list[torch.Tensor]) -> int:
    """Bytes of the distinct storages the tensors ``roots`` and their autograd graphs keep (leaves, their grads, saved
    tensors), parameters left out: what a chain of several steps' graphs keeps alive. One walk over every graph."""
    tensors = [r for r in roots if not is_parameter(r)]
    for t, _how in graph_tensors(roots):
        if not is_parameter(t):
            tensors.append(t)
            grad = t.grad if t.is_leaf else None
            if grad is not None:
                tensors.append(grad)
    return distinct_bytes(tensors)
