"""Breadth-first reference search from the roots to target storages, and the chains back up."""

from __future__ import annotations

import collections
import gc
import time
from itertools import compress
from typing import Any, Iterable

import torch

from memcallbacks._base.torch_private import is_autograd_node_type
from memcallbacks._base.storage import StorageKey, storage_keys
from memcallbacks.leaks.roots import Roots
from memcallbacks.leaks.tensors import node_children

__all__ = ["ReferenceSearch"]

_TYPE_KIND: dict[type, int] = {}
_SPECIAL_TYPES: set[type] = set()  # tensor and autograd-node types seen so far
_NORMAL, _TENSOR, _NODE = 0, 1, 2
_LOST = object()  # ends a chain whose parent vanished (the heap changed under the search)


def _type_kind(tp: type) -> int:
    kind = _TYPE_KIND.get(tp)
    if kind is None:
        if issubclass(tp, torch.Tensor):
            kind = _TENSOR
        elif is_autograd_node_type(tp):
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


class ReferenceSearch:
    """Breadth-first search from the roots, one level at a time.

    Each level is expanded with one ``gc.get_referents(*level)`` call plus the autograd edges
    of the tensors and nodes in it, so the per-object work stays in C. Parents are not
    recorded on the way down; :meth:`chains` finds them afterwards for the few objects that
    need a path, scanning each level in chunks.
    """

    _CHUNK = 512

    def __init__(self, roots: Roots, ignore: Iterable[Any], deadline: float) -> None:
        """``deadline``: on the clock of ``time.thread_time()`` (the search's CPU time, not the wall)."""
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
        """Search level by level until every target storage is found, the roots run out, or time does."""
        remaining = set(targets)
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
            extra = self._visit_special(frontier, remaining, depth)
            if not remaining:
                break
            # CPU time (time.thread_time): on a busy machine a search preempted by another process is not cut short
            if time.thread_time() > self.deadline:
                self.truncated = True
                break
            frontier = self._next_level(frontier, extra)
        self.exhausted = not remaining or (not frontier and not phases and not self.truncated)

    def _visit_special(self, frontier: list[Any], remaining: set[StorageKey], depth: int) -> list[tuple[Any, Any]]:
        """Record the targets among the level's tensors; return the ``(child, parent)`` edges gc cannot see."""
        types = list(map(type, frontier))
        for tp in set(types).difference(_TYPE_KIND):
            _type_kind(tp)
        extra: list[tuple[Any, Any]] = []
        for obj in compress(frontier, map(_SPECIAL_TYPES.__contains__, types)):
            if _TYPE_KIND[type(obj)] == _TENSOR:
                for key, _ in storage_keys(obj):
                    if key in remaining:
                        remaining.discard(key)
                        self.found[key] = (obj, depth)
                extra.extend((c, obj) for c in _tensor_extra(obj))
            else:
                extra.extend((c, obj) for c, _ in node_children(obj))
        return extra

    def _next_level(self, frontier: list[Any], extra: list[tuple[Any, Any]]) -> list[Any]:
        """The objects the level refers to (gc's referents plus ``extra``) that were not seen before."""
        seen = self.seen
        kids = list(filter(gc.is_tracked, gc.get_referents(*frontier)))
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
        seen.update(d)
        return list(d.values())

    def release(self) -> None:
        """Drop every reference the search holds (levels, roots), keeping only its counters."""
        self.levels = []
        self.keep = []
        self.found = {}
        self.special = {}
        self.seen = set()
        self.roots.release()

    def chains(self, objs: list[tuple[Any, int]]) -> dict[int, list[Any]]:
        """``{id(obj): [root, ..., obj]}`` for objects found at the given depths."""
        objs = list({id(o): (o, depth) for o, depth in objs}.values())
        chains: dict[int, list[Any]] = {id(o): [o] for o, _ in objs}
        by_depth: dict[int, dict[int, list[list[Any]]]] = collections.defaultdict(dict)
        for o, depth in objs:
            by_depth[depth].setdefault(id(o), []).append(chains[id(o)])
        for depth in range(max(by_depth, default=0), 0, -1):
            heads = by_depth.pop(depth, None)
            if not heads or depth in self.root_levels:
                continue
            parents = self._parents(heads, self.levels[depth - 1])
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

    def _parents(self, heads: Iterable[int], level: list[Any]) -> dict[int, Any]:
        """``{child id: parent}`` for the ids in ``heads``, parents taken from the level above."""
        get_referents = gc.get_referents
        parents: dict[int, Any] = {}
        for i in heads:
            p = self.special.get(i)
            if p is not None:
                parents[i] = p
        needed = set(heads).difference(parents)
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
        return parents
