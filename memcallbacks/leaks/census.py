"""Tensor census: which tensors are alive, what they are for, and who holds them."""

from __future__ import annotations

import collections
import dataclasses
import gc
import logging
import os
import re
import sys
import threading
import time
import warnings
from collections.abc import Mapping
from dataclasses import dataclass, field
from itertools import compress
from typing import Any, Iterable, Iterator

import torch

from memcallbacks._storage import StorageKey, storage_keys

from memcallbacks._units import format_bytes

log = logging.getLogger(__name__)

__all__ = [
    "CATEGORIES",
    "Census",
    "HolderDelta",
    "HolderPath",
    "HolderSearch",
    "TensorRecord",
    "describe_tensor",
    "find_holders",
    "graph_tensors",
    "is_parameter",
    "iter_tensors",
    "storage_keys",
    "take_census",
]

CATEGORIES = (
    "parameters",
    "gradients",
    "optimizer state",
    "buffers",
    "current batch",
    "previous batches",
    "graph-held",
    "other",
)
"""Census categories, in precedence order: a storage gets the first one that applies."""

SUSPICIOUS = ("previous batches", "graph-held", "other")
"""Categories whose tensors get a holder path in a census."""

NO_ROOT = "(no root: a reference cycle awaiting gc, or held outside Python)"
NOT_SEARCHED = "(not searched: census time budget ran out)"
GRAPH_HOP = " -> autograd graph"

_PKG_DIR = os.path.dirname(os.path.abspath(__file__))
_SNAPSHOT_LOCALS = sys.version_info < (3, 13)  # before PEP 667, f_locals is a cached snapshot
_CO_OPTIMIZED = 0x1
_MODULE_DICT_KEYS = ("_modules", "_parameters", "_buffers")
_INTERNAL_MODULES = ("memcallbacks", "torch", "gc", "sys", "threading")



# ----------------------------------------------------------------------------------------------
# Small helpers shared with the detectors
# ----------------------------------------------------------------------------------------------


def describe_tensor(t: Any) -> str:
    """``"256x512 float32"`` (plus ``" on cuda:0"`` off the CPU); never raises."""
    try:
        shape = "x".join(str(int(s)) for s in t.shape) or "scalar"
        dtype = str(t.dtype).replace("torch.", "")
        dev = t.device
        where = "" if dev.type == "cpu" else f" on {dev}"
        return f"{shape} {dtype}{where}"
    except Exception:
        return type(t).__name__


def iter_tensors(obj: Any, *, max_depth: int = 8, max_items: int = 100_000) -> Iterator[torch.Tensor]:
    """Tensors in a batch-like structure: tensors, mappings, lists/tuples/sets, dataclasses.

    Arbitrary objects are not searched (a batch may reference a model). Never raises.
    """
    Tensor = torch.Tensor
    tp = type(obj)
    if tp is dict or tp is list or tp is tuple:  # fast path: a flat batch of tensors
        values = obj.values() if tp is dict else obj
        if all(isinstance(v, Tensor) for v in values):
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
            stack.extend((c, depth + 1) for c in reversed(list(children)))
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


# Per-type knowledge about autograd nodes: (is_node, tensor-valued saved attribute names, is_python)
_NODE_INFO: dict[type, tuple[bool, tuple[str, ...], bool]] = {}


def _node_info(tp: type) -> tuple[bool, tuple[str, ...], bool]:
    info = _NODE_INFO.get(tp)
    if info is None:
        is_node = hasattr(tp, "next_functions") and hasattr(tp, "register_hook") and hasattr(tp, "name")
        saved: tuple[str, ...] = ()
        is_python = False
        if is_node:
            names = dir(tp)
            saved = tuple("_saved_" + n[len("_raw_saved_"):] for n in names if n.startswith("_raw_saved_"))
            is_python = issubclass(tp, torch._C._FunctionBase)
        info = (is_node, saved, is_python)
        _NODE_INFO[tp] = info
    return info


def _is_node(obj: Any) -> bool:
    return _node_info(type(obj))[0]


def _node_children(node: Any) -> list[tuple[Any, str]]:
    """Children of an autograd node as ``(object, how)``; how is "node", "leaf" or "saved"."""
    out: list[tuple[Any, str]] = []
    _, saved, is_python = _node_info(type(node))
    try:
        for fn, _ in node.next_functions:
            if fn is not None:
                out.append((fn, "node"))
    except Exception:
        pass
    var = getattr(node, "variable", None) if type(node).__name__ == "AccumulateGrad" else None
    if var is not None:
        out.append((var, "leaf"))
    for name in saved:
        try:
            value = getattr(node, name)
        except Exception:  # freed by backward, or not a tensor after all
            continue
        if isinstance(value, torch.Tensor):
            out.append((value, "saved"))
        elif isinstance(value, (list, tuple)):
            out.extend((v, "saved") for v in value if isinstance(v, torch.Tensor))
    if is_python:
        try:
            out.extend((v, "saved") for v in node.saved_tensors if isinstance(v, torch.Tensor))
        except Exception:
            pass
        try:  # attributes stored on ctx (ctx.foo = tensor)
            out.extend((v, "saved") for v in vars(node).values() if isinstance(v, torch.Tensor))
        except Exception:
            pass
    return out


def graph_tensors(
    start: Iterable[Any], *, max_nodes: int = 1_000_000, visited: set[int] | None = None
) -> Iterator[tuple[torch.Tensor, str]]:
    """Walk autograd graphs from tensors or nodes; yield ``(tensor, "leaf" | "saved")``.

    Leaves are the tensors ``AccumulateGrad`` nodes keep (parameters and hand-made leaves);
    saved tensors are what nodes keep for backward (gone after ``backward()`` unless
    ``retain_graph``). ``visited`` (node ids) lets several walks share work.
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
        for child, how in _node_children(node):
            if how == "node":
                if id(child) not in seen:
                    seen.add(id(child))
                    keep.append(child)
                    stack.append(child)
            else:
                yield child, how


# ----------------------------------------------------------------------------------------------
# Records and results
# ----------------------------------------------------------------------------------------------


@dataclass
class TensorRecord:
    """One storage in a census (views of the same storage are one record)."""

    device: str
    data_ptr: int
    """Address of the storage (matches allocator snapshots and ``untyped_storage().data_ptr()``)."""
    nbytes: int
    shape: str
    """``"256x512 float32"`` for the first tensor seen on this storage."""
    category: str
    path: str | None = None
    """Reference path from a root, for suspicious categories; ``None`` when not searched."""
    holder: str | None = None
    """``path`` with item subscripts dropped: what to group by (``"LitModel.cache"``)."""
    via_graph: bool = False
    """True when the only path found runs through an autograd graph."""

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


@dataclass
class HolderPath:
    """A reference path from a root to a tensor."""

    path: str
    """e.g. ``"train() local outputs['loss'] (train.py:42) -> autograd graph -> leaf tensor 256x512 float32"``."""
    holder: str
    """The container, for grouping: ``"LitModel.cache"``, ``"module m: global SEEN"``."""
    tensor: str
    """``"256x512 float32"``."""
    nbytes: int
    via_graph: bool

    def __str__(self) -> str:
        return f"{self.path} ({format_bytes(self.nbytes)})"


@dataclass
class HolderSearch:
    """Result of :func:`find_holders`."""

    paths: list[HolderPath]
    missing: int
    """Targets for which no path was found (unreachable from roots, or budget ran out)."""
    seconds: float
    objects_scanned: int
    truncated: bool
    """True when the time budget ran out before every target was found."""


@dataclass
class HolderDelta:
    """Change of one holder between two censuses."""

    holder: str
    tensors: int
    bytes: int

    def __str__(self) -> str:
        verb = "grew" if self.bytes >= 0 else "shrank"
        n = abs(self.tensors)
        return f"{self.holder} {verb} by {n} tensor{'s' if n != 1 else ''} / {format_bytes(abs(self.bytes))}"


@dataclass
class Census:
    """Live tensors by category and holder, and what the census cost."""

    step: int | None
    bytes_by_category: dict[str, int]
    tensors_by_category: dict[str, int]
    records: list[TensorRecord] = field(repr=False)
    seconds: float
    objects_scanned: int
    """Python objects looked at: ``gc.get_objects()`` plus the objects the path search visited."""
    truncated: bool
    """True when the path search stopped at the time budget (some holders are unknown)."""
    paths: list[HolderPath] = field(default_factory=list, repr=False)
    """Paths to the explicit ``targets`` given to :func:`take_census`."""

    @property
    def total_bytes(self) -> int:
        return sum(self.bytes_by_category.values())

    def by_holder(self) -> dict[str, tuple[int, int]]:
        """``{holder: (tensors, bytes)}``; unattributed storages group under their category."""
        out: dict[str, list[int]] = {}
        for r in self.records:
            key = r.holder if r.holder is not None else r.category
            acc = out.setdefault(key, [0, 0])
            acc[0] += 1
            acc[1] += r.nbytes
        return {k: (v[0], v[1]) for k, v in out.items()}

    def diff(self, before: Census, *, min_bytes: int = 1) -> list[HolderDelta]:
        """What changed since ``before``, by holder: growth first, largest first, with the
        :data:`NOT_SEARCHED` group (storages whose holder a truncated census did not search) after
        every named holder that grew; then what shrank."""
        now, then = self.by_holder(), before.by_holder()
        deltas = []
        for key in set(now) | set(then):
            n1, b1 = now.get(key, (0, 0))
            n0, b0 = then.get(key, (0, 0))
            if abs(b1 - b0) >= min_bytes:
                deltas.append(HolderDelta(key, n1 - n0, b1 - b0))
        deltas.sort(key=lambda d: (d.bytes <= 0, d.holder == NOT_SEARCHED, -d.bytes))
        return deltas

    def top_holders(self, n: int = 5, categories: Iterable[str] = SUSPICIOUS) -> list[tuple[str, int, int]]:
        """``(holder, tensors, bytes)`` of the ``n`` largest holders among the given categories.

        Named holders come first, largest first. When the path search ran out of time, the
        storages it did not reach follow as one last entry, whatever their size, labelled
        :data:`NOT_SEARCHED` (so up to ``n + 1`` entries): a group nobody searched names no
        culprit, and must not push the holders that were found out of the first line.
        """
        cats = set(categories)
        acc: dict[str, list[int]] = {}
        for r in self.records:
            if r.category in cats:
                a = acc.setdefault(r.holder or r.category, [0, 0])
                a[0] += 1
                a[1] += r.nbytes
        unsearched = acc.pop(NOT_SEARCHED, None)
        top = sorted(((k, v[0], v[1]) for k, v in acc.items()), key=lambda x: -x[2])[:n]
        if unsearched is not None:
            top.append((NOT_SEARCHED, unsearched[0], unsearched[1]))
        return top

    def to_dict(self) -> dict[str, Any]:
        return {
            "step": self.step,
            "bytes_by_category": dict(self.bytes_by_category),
            "tensors_by_category": dict(self.tensors_by_category),
            "records": [r.to_dict() for r in self.records],
            "paths": [dataclasses.asdict(p) for p in self.paths],
            "seconds": self.seconds,
            "objects_scanned": self.objects_scanned,
            "truncated": self.truncated,
        }

    def to_frame(self) -> Any:
        """Records as a pandas DataFrame (pandas imported on call)."""
        import pandas as pd

        return pd.DataFrame([r.to_dict() for r in self.records])

    def summary(self) -> str:
        parts = [f"{c} {format_bytes(b)}" for c, b in self.bytes_by_category.items() if b]
        cost = f"{self.seconds:.2f} s, {self.objects_scanned} objects{', truncated' if self.truncated else ''}"
        return f"census: {', '.join(parts) or 'no tensors'} ({cost})"


# ----------------------------------------------------------------------------------------------
# Roots and the path search
# ----------------------------------------------------------------------------------------------


def _frame_locals(frame: Any) -> list[tuple[str, Any]]:
    """A frame's local variables, without pinning them (pre-3.13 f_locals is a cached snapshot)."""
    try:
        d = frame.f_locals
        items = list(d.items())
        if _SNAPSHOT_LOCALS and frame.f_code.co_flags & _CO_OPTIMIZED and d is not frame.f_globals:
            d.clear()  # else the snapshot keeps values alive after the code deletes them
        return items
    except Exception:
        return []


class _Roots:
    """Root objects, in two phases: frame locals and user-module globals, then library-module globals.

    Most holders are found from the first phase; library globals (a large part of the heap) are
    searched only when targets remain. Labels are made on demand.
    """

    def __init__(self) -> None:
        self.phases: list[list[Any]] = [[], []]
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
        values = self.phases[0]
        for tid in sorted(frames, key=lambda t: t != me):
            f = frames[tid]
            while f is not None:
                self.blocked.add(id(f))  # an id, not the frame: holding our own frame would make a cycle
                code = f.f_code
                if not code.co_filename.startswith(_PKG_DIR) and code.co_flags & _CO_OPTIMIZED:
                    where = f"({os.path.basename(code.co_filename)}:{f.f_lineno})"
                    for name, value in _frame_locals(f):
                        if id(value) not in self._frame_roots:
                            self._frame_roots[id(value)] = (f"{code.co_name}() local {name}", where)
                        values.append(value)
                f = f.f_back
        del frames

    def _add_globals(self) -> None:
        mods = list(sys.modules.items())

        def is_library(name: str, mod: Any) -> bool:
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

        mods.sort(key=lambda item: (item[0] != "__main__", is_library(*item)))
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
            self.phases[1 if is_library(name, mod) else 0].extend(d.values())

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


_TYPE_KIND: dict[type, int] = {}
_SPECIAL_TYPES: set[type] = set()  # tensor and autograd-node types seen so far
_NORMAL, _TENSOR, _NODE = 0, 1, 2


def _type_kind(tp: type) -> int:
    kind = _TYPE_KIND.get(tp)
    if kind is None:
        if issubclass(tp, torch.Tensor):
            kind = _TENSOR
        elif _node_info(tp)[0]:
            kind = _NODE
        else:
            kind = _NORMAL
        _TYPE_KIND[tp] = kind
        if kind:
            _SPECIAL_TYPES.add(tp)
    return kind


def _tensor_extra(t: torch.Tensor) -> list[Any]:
    """References of a tensor that gc cannot see: its grad, its base, a C++ grad_fn."""
    out = []
    try:
        if t.is_leaf:
            g = t.grad
            if g is not None:
                out.append(g)
        else:
            fn = t.grad_fn
            if fn is not None:
                out.append(fn)
        base = t._base
        if base is not None:
            out.append(base)
    except Exception:
        pass
    return out


class _Search:
    """Breadth-first search from the roots, one level at a time.

    Each level is expanded with one ``gc.get_referents(*level)`` call plus the autograd edges
    of the tensors and nodes in it, so the per-object work stays in C. Parents are not
    recorded on the way down; :meth:`chains` finds them afterwards for the few objects that
    need a path, scanning each level in chunks.
    """

    _CHUNK = 512

    def __init__(self, roots: _Roots, ignore: Iterable[Any], deadline: float) -> None:
        self.roots = roots
        self.levels: list[list[Any]] = []
        self.root_levels: set[int] = set()
        self.special: dict[int, Any] = {}  # child id -> parent, for edges gc cannot see
        self.keep: list[Any] = []  # node wrappers and saved tensors made during the search
        self.found: dict[StorageKey, tuple[torch.Tensor, int]] = {}
        self.seen: set[int] = set(map(id, ignore))
        self.seen.update(roots.blocked)
        self.deadline = deadline
        self.scanned = 0
        self.truncated = False
        self.exhausted = False

    def _start(self, values: list[Any]) -> list[Any]:
        values = list(filter(gc.is_tracked, values))
        d = dict(zip(map(id, values), values))  # first occurrence keeps its place
        for i in self.seen.intersection(d):
            del d[i]
        self.seen.update(d)
        return list(d.values())

    def run(self, targets: set[StorageKey]) -> None:
        remaining = set(targets)
        seen = self.seen
        get_referents = gc.get_referents
        is_tracked = gc.is_tracked
        special_types = _SPECIAL_TYPES
        phases = list(self.roots.phases)
        frontier: list[Any] = []
        while remaining:
            if not frontier:
                if not phases:
                    break
                frontier = self._start(phases.pop(0))
                self.root_levels.add(len(self.levels))
                if not frontier:
                    continue
            depth = len(self.levels)
            self.levels.append(frontier)
            self.scanned += len(frontier)
            types = list(map(type, frontier))
            for tp in set(types).difference(_TYPE_KIND):
                _type_kind(tp)
            extra: list[tuple[Any, Any]] = []
            for obj in compress(frontier, map(special_types.__contains__, types)):
                if _TYPE_KIND[type(obj)] == _TENSOR:
                    for key, _ in storage_keys(obj):
                        if key in remaining:
                            remaining.discard(key)
                            self.found[key] = (obj, depth)
                    extra.extend((c, obj) for c in _tensor_extra(obj))
                else:
                    extra.extend((c, obj) for c, _ in _node_children(obj))
            if not remaining:
                break
            if time.perf_counter() > self.deadline:
                self.truncated = True
                break
            kids = list(filter(is_tracked, get_referents(*frontier)))
            d = dict(zip(map(id, kids), kids))
            del kids
            if extra:
                self.keep.append(extra)
                special = self.special
                for c, p in extra:
                    i = id(c)
                    if i not in d and i not in seen:
                        d[i] = c
                        special[i] = p
            for i in seen.intersection(d):  # iterates d, not the (large) seen set
                del d[i]
            frontier = list(d.values())
            seen.update(d)
            del d, types
        self.exhausted = not remaining or (not frontier and not phases and not self.truncated)

    def release(self) -> None:
        """Drop every reference the search holds (levels, roots), keeping only its counters."""
        self.levels = []
        self.keep = []
        self.found = {}
        self.special = {}
        self.seen = set()
        self.roots.phases = [[], []]
        self.roots._frame_roots = {}
        self.roots._globals = []

    def chains(self, objs: list[tuple[Any, int]]) -> dict[int, list[Any]]:
        """``{id(obj): [root, ..., obj]}`` for objects found at the given depths."""
        get_referents = gc.get_referents
        objs = list({id(o): (o, depth) for o, depth in objs}.values())
        chains: dict[int, list[Any]] = {id(o): [o] for o, _ in objs}
        by_depth: dict[int, dict[int, list[list[Any]]]] = collections.defaultdict(dict)
        for o, depth in objs:
            by_depth[depth].setdefault(id(o), []).append(chains[id(o)])
        for depth in range(max(by_depth, default=0), 0, -1):
            heads = by_depth.pop(depth, None)
            if not heads or depth in self.root_levels:
                continue
            parents: dict[int, Any] = {}
            for i in heads:
                p = self.special.get(i)
                if p is not None:
                    parents[i] = p
            needed = set(heads).difference(parents)
            level = self.levels[depth - 1]
            step = self._CHUNK
            for start in range(0, len(level), step):
                if not needed:
                    break
                chunk = level[start : start + step]
                if needed.isdisjoint(map(id, get_referents(*chunk))):
                    continue
                for p in chunk:
                    hit = needed.intersection(map(id, get_referents(p)))
                    for i in hit:
                        parents[i] = p
                    needed -= hit
            up = by_depth[depth - 1]
            for i, lists in heads.items():
                p = parents.get(i)
                if p is None:  # only if the heap changed under us
                    for chain in lists:
                        chain.append(_LOST)
                    continue
                for chain in lists:
                    chain.append(p)
                up.setdefault(id(p), []).extend(lists)
        out = {}
        for o, _ in objs:
            chain = chains[id(o)]
            if chain[-1] is _LOST:
                continue
            chain.reverse()
            out[id(o)] = chain
        return out


_LOST = object()


# ----------------------------------------------------------------------------------------------
# Rendering a chain of objects as a path string
# ----------------------------------------------------------------------------------------------

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


def _edge(parent: Any, child: Any, attr_mode: bool) -> tuple[str, bool]:
    """Path fragment for the reference parent -> child, and whether the next dict is attribute-style."""
    if isinstance(parent, dict):
        for k, v in parent.items():
            if v is child:
                if attr_mode and isinstance(k, str):
                    if k in _MODULE_DICT_KEYS and isinstance(child, dict):
                        return "", True
                    return f".{k}", False
                return f"[{_key_repr(k)}]", False
        return " -> dict key", False
    if isinstance(parent, (list, tuple, collections.deque)):
        i = _index_of(parent, child)
        return (f"[{i}]" if i is not None else f" -> {type(child).__name__}"), False
    if isinstance(parent, (set, frozenset)):
        return "{item}", False
    if isinstance(parent, torch.Tensor):
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
    if _is_node(parent):
        if _is_node(child):
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
    if type(parent).__name__ == "cell":
        return "", False
    if isinstance(parent, type):
        if child is parent.__dict__ or isinstance(child, dict):
            return "", True
    if getattr(parent, "__dict__", None) is child:
        return "", True
    if hasattr(parent, "__code__") and child is getattr(parent, "__closure__", None):
        return f" -> closure of {getattr(parent, '__qualname__', '?')}()", False
    if getattr(parent, "__self__", None) is child:
        return ".__self__", False
    if hasattr(parent, "gi_frame") or hasattr(parent, "cr_frame"):
        frame = getattr(parent, "gi_frame", None) or getattr(parent, "cr_frame", None)
        if frame is not None:
            for name, value in _frame_locals(frame):
                if value is child:
                    return f" -> generator {parent.__qualname__}() local {name}", False
    if type(parent).__name__ == "frame":
        for name, value in _frame_locals(parent):
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


def _render(chain: list[Any], roots: _Roots) -> tuple[str, str, bool]:
    """``(path, holder, via_graph)`` for a chain root value -> ... -> tensor.

    A path through an nn.Module starts at the outermost module (``LitModel.cache[17]``),
    whichever frame or global led to it.
    """
    for k, obj in enumerate(chain):
        if isinstance(obj, torch.nn.Module):
            chain = chain[k:]
            path, where = type(obj).__name__, ""
            break
        if _is_node(obj) or isinstance(obj, torch.Tensor):
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
        frag, attr_mode = _edge(parent, child, attr_mode)
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
    return path, _holder_of(path), via_graph


def _holder_of(path: str) -> str:
    """Group key: the path up to the first hop, without location and trailing subscripts."""
    head, sep, _rest = path.partition(" -> ")
    head = re.sub(r" \([^()]*:\d+\)$", "", head)
    head = _SUBSCRIPT_TAIL.sub("", head)
    if sep and GRAPH_HOP.strip() in path:
        head += GRAPH_HOP
    elif sep:
        head += " -> ..."
    return head


# ----------------------------------------------------------------------------------------------
# Public entry points
# ----------------------------------------------------------------------------------------------


def _as_list(obj: Any) -> list[Any]:
    if obj is None:
        return []
    if isinstance(obj, (list, tuple, set)):
        return list(obj)
    return [obj]


def _scan_heap() -> tuple[int, list[torch.Tensor], list[torch.nn.Module], list[Any]]:
    """One pass over ``gc.get_objects()``: (object count, tensors, modules, optimizers)."""
    tensors: list[torch.Tensor] = []
    modules: list[torch.nn.Module] = []
    optimizers: list[Any] = []
    Tensor, Module, Optimizer = torch.Tensor, torch.nn.Module, torch.optim.Optimizer
    kind_of: dict[type, int] = {}
    objects = gc.get_objects()
    n_objects = len(objects)
    for tp in set(map(type, objects)):
        kind_of[tp] = (
            1 if issubclass(tp, Tensor) else 2 if issubclass(tp, Module) else 3 if issubclass(tp, Optimizer) else 0
        )
    for o in compress(objects, map(kind_of.__getitem__, map(type, objects))):
        k = kind_of[type(o)]
        (tensors if k == 1 else modules if k == 2 else optimizers).append(o)
    del objects
    return n_objects, tensors, modules, optimizers


def _paths(
    wanted: Iterable[StorageKey], ignore: Iterable[Any], deadline: float
) -> tuple[dict[StorageKey, tuple[str, str, bool]], _Search]:
    """``{key: (path, holder, via_graph)}`` for the storages a search from the roots reached."""
    roots = _Roots()
    search = _Search(roots, ignore, deadline)
    search.run(set(wanted))
    found = list(search.found.items())
    chains = search.chains([(t, depth) for _, (t, depth) in found])
    out = {}
    for key, (t, _depth) in found:
        chain = chains.get(id(t))
        if chain is not None:
            out[key] = _render(chain, roots)
    search.release()
    return out, search


def _wanted(targets: Iterable[torch.Tensor]) -> dict[StorageKey, tuple[int, str]]:
    wanted: dict[StorageKey, tuple[int, str]] = {}
    for t in targets:
        for key, nbytes in storage_keys(t):
            wanted.setdefault(key, (nbytes, describe_tensor(t)))
    return wanted


def find_holders(
    targets: Iterable[torch.Tensor],
    *,
    time_budget_s: float = 2.0,
    ignore: Iterable[Any] = (),
) -> HolderSearch:
    """Reference paths from roots (locals of every frame, module globals) to ``targets``.

    Targets match by storage, so a path to any view counts. Paths may pass through autograd
    graphs (``... -> autograd graph -> leaf tensor 256x512 float32``); a path through an
    nn.Module is named from the outermost module (``LitModel.cache[17]``). ``ignore``: objects
    not to search through (e.g. the monitor that holds the targets itself).
    """
    start = time.perf_counter()
    if time_budget_s <= 0:
        raise ValueError(f"find_holders(time_budget_s={time_budget_s}) must be positive; try 2.0.")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # module attributes that warn when touched
        wanted = _wanted(targets)
        rendered, search = _paths(wanted, ignore, start + time_budget_s)
    paths = [
        HolderPath(path, holder, wanted[key][1], wanted[key][0], via_graph)
        for key, (path, holder, via_graph) in rendered.items()
    ]
    paths.sort(key=lambda p: -p.nbytes)
    return HolderSearch(
        paths=paths,
        missing=len(wanted) - len(paths),
        seconds=time.perf_counter() - start,
        objects_scanned=search.scanned,
        truncated=search.truncated,
    )


def take_census(
    *,
    model: torch.nn.Module | Iterable[torch.nn.Module] | None = None,
    optimizer: torch.optim.Optimizer | Iterable[torch.optim.Optimizer] | None = None,
    current_batch: Any = None,
    previous_batches: Iterable[Any] = (),
    targets: Iterable[torch.Tensor] = (),
    find_paths: bool = True,
    time_budget_s: float = 2.0,
    step: int | None = None,
    ignore: Iterable[Any] = (),
) -> Census:
    """Count live tensors by storage and category; find holders of the suspicious ones.

    Sees every tensor Python can reach (``gc.get_objects``), their ``.grad``s, optimizer state,
    and tensors only autograd graphs hold (``AccumulateGrad.variable``, saved tensors). Models
    and optimizers found in the heap are used even when not passed. ``previous_batches``: the
    batches of earlier steps the engine still has. ``targets`` get paths in ``Census.paths``
    whatever their category. Runs only on demand; its cost is in the result.
    """
    start = time.perf_counter()
    if time_budget_s <= 0:
        raise ValueError(f"take_census(time_budget_s={time_budget_s}) must be positive; try 2.0.")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return _take_census(
            start, model, optimizer, current_batch, previous_batches, targets, find_paths,
            start + time_budget_s, step, ignore,
        )


def _take_census(
    start: float,
    model: Any,
    optimizer: Any,
    current_batch: Any,
    previous_batches: Iterable[Any],
    targets: Iterable[torch.Tensor],
    find_paths: bool,
    deadline: float,
    step: int | None,
    ignore: Iterable[Any],
) -> Census:
    Tensor = torch.Tensor
    n_objects, tensors, modules, optimizers = _scan_heap()
    modules = list({id(m): m for m in _as_list(model) + modules if isinstance(m, torch.nn.Module)}.values())
    optimizers = list(
        {id(o): o for o in _as_list(optimizer) + optimizers if isinstance(o, torch.optim.Optimizer)}.values()
    )

    # Classify storages, most specific category first.
    category: dict[StorageKey, str] = {}
    info: dict[StorageKey, tuple[int, str]] = {}

    def mark(t: Any, cat: str) -> None:
        if not isinstance(t, Tensor):
            return
        for key, nbytes in storage_keys(t):
            if key not in category:
                category[key] = cat
                info[key] = (nbytes, describe_tensor(t))

    params: list[torch.Tensor] = []
    for m in modules:
        try:
            params.extend(p for p in m._parameters.values() if p is not None)
        except Exception:
            pass
    params.extend(t for t in tensors if isinstance(t, torch.nn.Parameter))
    for opt in optimizers:
        try:
            for group in opt.param_groups:
                params.extend(p for p in group.get("params", ()) if isinstance(p, Tensor))
        except Exception:
            pass
    for p in params:
        mark(p, "parameters")
    for p in params:
        try:
            mark(p.grad, "gradients")
        except Exception:
            pass
    for opt in optimizers:
        try:
            for state in list(opt.state.values()):
                for t in iter_tensors(state):
                    mark(t, "optimizer state")
        except Exception:
            pass
    for m in modules:
        try:
            for b in m._buffers.values():
                mark(b, "buffers")
        except Exception:
            pass
    for t in iter_tensors(current_batch):
        mark(t, "current batch")
    for batch in previous_batches or ():
        for t in iter_tensors(batch):
            mark(t, "previous batches")
    with_graph = []
    for t in tensors:
        try:
            if t.grad_fn is not None:
                with_graph.append(t)
        except Exception:
            pass
    for t, _how in graph_tensors(with_graph):
        mark(t, "graph-held")
        try:
            if t.is_leaf:
                mark(t.grad, "graph-held")
        except Exception:
            pass
    del with_graph
    for t in tensors:
        mark(t, "other")
        try:
            if t.is_leaf and t.requires_grad:
                mark(t.grad, "other")
        except Exception:
            pass
    target_keys: set[StorageKey] = set()
    for t in targets:
        for key, _ in storage_keys(t):
            target_keys.add(key)
        mark(t, "other")
    del tensors, params

    records: dict[StorageKey, TensorRecord] = {}
    for key, cat in category.items():
        nbytes, shape = info[key]
        records[key] = TensorRecord(device=str(key[0]), data_ptr=key[1], nbytes=nbytes, shape=shape, category=cat)
    del category, info

    # Paths for the suspicious storages and the explicit targets.
    scanned = n_objects
    truncated = False
    paths: list[HolderPath] = []
    if find_paths:
        wanted = {k for k, r in records.items() if r.category in SUSPICIOUS} | target_keys
        if wanted:
            rendered, search = _paths(wanted, ignore, deadline)
            scanned += search.scanned
            truncated = search.truncated
            for key in wanted:
                rec = records[key]
                got = rendered.get(key)
                if got is None:
                    rec.holder = NOT_SEARCHED if search.truncated else NO_ROOT
                    continue
                rec.path, rec.holder, rec.via_graph = got
                if rec.category == "other" and rec.via_graph:
                    rec.category = "graph-held"
                elif rec.category == "graph-held" and not rec.via_graph:
                    rec.category = "other"
                if key in target_keys:
                    paths.append(HolderPath(rec.path, rec.holder, rec.shape, rec.nbytes, rec.via_graph))
    paths.sort(key=lambda p: -p.nbytes)

    bytes_by: dict[str, int] = {c: 0 for c in CATEGORIES}
    count_by: dict[str, int] = {c: 0 for c in CATEGORIES}
    for r in records.values():
        bytes_by[r.category] += r.nbytes
        count_by[r.category] += 1
    return Census(
        step=step,
        bytes_by_category=bytes_by,
        tensors_by_category=count_by,
        records=sorted(records.values(), key=lambda r: -r.nbytes),
        seconds=time.perf_counter() - start,
        objects_scanned=scanned,
        truncated=truncated,
        paths=paths,
    )
