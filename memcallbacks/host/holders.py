"""Who holds the host containers that grew: reference paths from the tensor census's stable roots
(:class:`~memcallbacks.leaks.roots.Roots`, :class:`~memcallbacks.leaks.search.ReferenceSearch` with
object ids as targets, :func:`~memcallbacks.leaks.paths.render_chain`), the entries a container
added, and their deep size."""

from __future__ import annotations

import collections
import gc
import itertools
import sys
from typing import Any, Iterable

from memcallbacks.leaks.paths import render_chain
from memcallbacks.leaks.roots import Roots
from memcallbacks.leaks.search import ReferenceSearch

__all__ = ["deep_size", "empty_containers", "holder_paths", "new_entries"]

_SKIP_DEEP = (type, type(sys), type(len), type(lambda: 0))


def deep_size(values: list[Any], budget: int = 20_000, by_type: dict[type, list[int]] | None = None) -> int:
    """Bytes of ``values`` and what they refer to (not types, modules or functions), each object once;
    ``by_type`` (when given) gets ``[count, bytes]`` per type: floats and strings too, which the garbage
    collector does not track and a census of ``gc.get_objects()`` never sees."""
    seen: set[int] = set()
    total = 0
    stack = list(values)
    while stack and budget > 0:
        obj = stack.pop()
        i = id(obj)
        if i in seen or isinstance(obj, _SKIP_DEEP):
            continue
        seen.add(i)
        budget -= 1
        size = sys.getsizeof(obj, 0)
        total += size
        if by_type is not None:
            entry = by_type.setdefault(type(obj), [0, 0])
            entry[0] += 1
            entry[1] += size
        stack.extend(gc.get_referents(obj))
    return total


def empty_containers(dataset: Any) -> tuple[str, ...]:
    """``Type.attribute`` of the Dataset's (and a wrapped ``.dataset``'s) dicts, lists, sets and deques that are
    empty in this process: a cache filled in ``__getitem__`` is filled in each worker, never in the parent."""
    out: list[str] = []
    for obj in (dataset, getattr(dataset, "dataset", None)):
        attributes = getattr(obj, "__dict__", None)
        if not isinstance(attributes, dict):
            continue
        for name, value in attributes.items():
            if isinstance(value, (dict, list, set, collections.deque)) and not value:
                out.append(f"{type(obj).__name__}.{name}")
    return tuple(out[:4])


def new_entries(obj: Any, grown: int) -> list[Any]:
    """The entries most likely added last (dicts keep insertion order; lists and deques append)."""
    if isinstance(obj, dict):
        values = list(obj.values())
        return values[-grown:] if grown < len(values) else values
    if isinstance(obj, (list, collections.deque)):
        items = list(obj)
        return items[-grown:] if grown < len(items) else items
    return list(itertools.islice(iter(obj), grown))


class _ObjectSearch(ReferenceSearch):
    """The tensor census's breadth-first search, with object ids as targets instead of storages."""

    def _visit_special(self, frontier: list[Any], remaining: set[Any], depth: int) -> list[tuple[Any, Any]]:
        hits = remaining.intersection(map(id, frontier))
        if hits:
            for obj in frontier:
                if id(obj) in hits:
                    self.found[id(obj)] = (obj, depth)  # type: ignore[index]
            remaining -= hits
        return []


def _is_own(obj: Any) -> bool:
    """An object of memcallbacks' own classes (the monitor, its session, readers and records)."""
    return type(obj).__module__.startswith("memcallbacks.")


def holder_paths(targets: list[Any], ignore: Iterable[Any], deadline: float) -> tuple[dict[int, str], set[int]]:
    """``({id(target): path}, own)``: paths from the stable roots, for the targets a root reaches. A
    target whose path passes through one of memcallbacks' own objects (the monitor's history rows, its
    readers' reads, reached from a global the user keeps the monitor in or from ``gc.callbacks``) gets
    no path and its id is in ``own``: the monitor's records are not what the user's run keeps."""
    roots = Roots()
    out: dict[int, str] = {}
    own: set[int] = set()
    wanted: set[int] = set()
    for obj in targets:
        label, where = roots.label(obj)
        if label != type(obj).__name__:  # a global or a frame's local itself
            out[id(obj)] = f"{label} {where}".strip()
        else:
            wanted.add(id(obj))
    if wanted:
        search = _ObjectSearch(roots, list(ignore) + [targets], deadline)
        search.run(wanted)  # type: ignore[arg-type]
        found = list(search.found.values())
        chains = search.chains([(t, d) for t, d in found])
        for t, _ in found:
            chain = chains.get(id(t))
            if chain is not None and any(map(_is_own, chain[:-1])):
                own.add(id(t))
            elif chain is not None:
                out[id(t)] = render_chain(chain, roots)[0]
        search.release()
    roots.release()
    return out, own
