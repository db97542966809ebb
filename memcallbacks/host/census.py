"""Host census: Python objects by type (counts, bytes), diffed between two points, and who holds them.

``before = take_host_census()`` when host growth is suspected; some steps later
``explain_host_growth(before)`` takes the second census, finds the containers that grew (dicts,
lists, sets, deques), names their holders from stable roots with the tensor census's machinery
(:class:`~memcallbacks.leaks.roots.Roots`, :class:`~memcallbacks.leaks.search.ReferenceSearch`,
:func:`~memcallbacks.leaks.paths.render_chain`) and returns one sentence per holder::

    module __main__: global cache (dict) grew by 81,920 Spec objects / 37.0 MiB

A census walks ``gc.get_objects()`` once (C speed for the list, ~0.1-0.3 µs an object for the
type and ``sys.getsizeof``): ~0.1-0.5 s on a heap of a million objects, stopped at
``time_budget_s`` or ``max_objects`` (the result says so: ``truncated``). The holder search is
bounded by its own deadline. Each result carries its cost in seconds. A census holds no reference
to the heap's objects between the two points (ids and lengths only).

:class:`TracemallocWindow` is the optional third part: ``tracemalloc`` on for a few steps, once,
then the allocating lines (``leak.py:42: +236.0 KiB in 4,352 blocks``) and its cost.
"""

from __future__ import annotations

import collections
import gc
import itertools
import sys
import time
import tracemalloc
import warnings
from dataclasses import dataclass, field
from typing import Any, Iterable

from memcallbacks._base.findings import Finding
from memcallbacks._base.units import format_bytes
from memcallbacks.host.holders import deep_size, holder_paths, new_entries
from memcallbacks.leaks.roots import PACKAGE_DIR, Roots

__all__ = ["HolderGrowth", "HostCensus", "HostExplanation", "TracemallocWindow", "explain_host_growth", "take_host_census"]

_CONTAINERS = (dict, list, set, collections.deque, collections.OrderedDict, collections.defaultdict)
_CONTAINER_SET = frozenset(_CONTAINERS)
_CHUNK = 1 << 16


def _type_name(tp: type) -> str:
    module = getattr(tp, "__module__", "") or ""
    name = getattr(tp, "__qualname__", tp.__name__)
    return name if module in ("builtins", "") else f"{module}.{name}"


def _short(name: str) -> str:
    return name.rsplit(".", 1)[-1]


@dataclass
class HostCensus:
    """Python objects tracked by the garbage collector, by type; and the large containers."""

    by_type: dict[str, tuple[int, int]]
    """``{"module.Qualname": (count, bytes)}``; bytes are ``sys.getsizeof`` (shallow)."""
    containers: dict[int, tuple[str, int]]
    """``{id: (type name, len)}`` of dicts, lists, sets and deques with ``min_container_len`` entries
    or more (ids only: the census keeps no object alive)."""
    objects: int
    seconds: float
    truncated: bool
    """True when ``time_budget_s`` or ``max_objects`` stopped the walk (counts are partial)."""
    step: int | None = None

    def diff(self, before: HostCensus, *, top: int = 5) -> list[tuple[str, int, int]]:
        """``[(type name, count change, bytes change)]`` of the types that grew most, by bytes."""
        out = []
        for name, (count, nbytes) in self.by_type.items():
            c0, b0 = before.by_type.get(name, (0, 0))
            if count > c0:
                out.append((name, count - c0, nbytes - b0))
        out.sort(key=lambda t: (-t[2], -t[1]))
        return out[:top]


def _scan(objs: list[Any], deadline: float, min_len: int, keep: dict[int, Any] | None) -> tuple[dict[str, list[int]], dict[int, tuple[str, int]], int, bool]:
    """Walk ``objs`` by chunks: per-type counts and bytes, and the large containers."""
    is_container = _CONTAINER_SET.__contains__
    totals: dict[type, list[int]] = {}
    containers: dict[int, tuple[str, int]] = {}
    done = 0
    truncated = False
    for start in range(0, len(objs), _CHUNK):
        chunk = objs[start:start + _CHUNK]
        types = list(map(type, chunk))
        for tp, nbytes in zip(types, map(sys.getsizeof, chunk, itertools.repeat(0))):
            entry = totals.get(tp)
            if entry is None:
                entry = totals[tp] = [0, 0]
            entry[0] += 1
            entry[1] += nbytes
        for obj in itertools.compress(chunk, map(is_container, types)):
            n = len(obj)
            if n >= min_len and obj is not objs:  # the census's own list of the heap
                containers[id(obj)] = (_type_name(type(obj)), n)
                if keep is not None:
                    keep[id(obj)] = obj
        done += len(chunk)
        if time.thread_time() > deadline:  # CPU time: a walk preempted on a busy machine is not cut short
            truncated = done < len(objs)
            break
    by_type: dict[str, list[int]] = {}
    for tp, (count, size) in totals.items():
        entry = by_type.setdefault(_type_name(tp), [0, 0])
        entry[0] += count
        entry[1] += size
    return by_type, containers, done, truncated


def _census(max_objects: int, time_budget_s: float, min_container_len: int, keep: dict[int, Any] | None, step: int | None) -> HostCensus:
    t0, cpu0 = time.perf_counter(), time.thread_time()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        # the heap first: a list made before gc.get_objects() would be listed in itself, a cycle that
        # keeps every object of the heap (tensors too) alive until the next collection
        objs = gc.get_objects()
        # containers gc does not track (a dict of floats, a list of ints) are found where users keep them
        roots = Roots()  # made after the heap list: its id sets are not counted as the heap's containers
        objs += [v for v in itertools.chain(roots.phases[0], roots.phases[1]) if type(v) in _CONTAINER_SET and not gc.is_tracked(v)]
        roots.release()
        del roots
        truncated = len(objs) > max_objects
        del objs[max_objects:]
        by_type, containers, done, cut = _scan(objs, cpu0 + time_budget_s, min_container_len, keep)
        del objs
    return HostCensus(
        by_type={k: (v[0], v[1]) for k, v in by_type.items()},
        containers=containers,
        objects=done,
        seconds=time.perf_counter() - t0,
        truncated=truncated or cut,
        step=step,
    )


def _check(name: str, value: Any, ok: bool, fix: str) -> None:
    if not ok:
        raise ValueError(f"{name}={value!r} is invalid; {fix}.")


def take_host_census(
    *, step: int | None = None, max_objects: int = 5_000_000, time_budget_s: float = 2.0, min_container_len: int = 64
) -> HostCensus:
    """Count the heap's Python objects by type and note its large containers (the first point)."""
    _check("take_host_census(max_objects)", max_objects, max_objects >= 1, "use a positive count, e.g. 5_000_000")
    _check("take_host_census(time_budget_s)", time_budget_s, time_budget_s > 0, "use a positive number of seconds, e.g. 2.0")
    _check("take_host_census(min_container_len)", min_container_len, min_container_len >= 1, "use 1 or more, e.g. 64")
    return _census(max_objects, time_budget_s, min_container_len, None, step)


@dataclass
class HolderGrowth:
    """One container that grew between the two censuses, and its holder path from a stable root."""

    path: str
    """``"module __main__: global cache"``, ``"train() local history (train.py:40)"``, ``"LitModel.records"``."""
    container: str
    """The container's type: ``"dict"``, ``"list"``, ``"collections.deque"``."""
    grown_by: int
    """Entries added between the two points."""
    value_type: str
    """The type most of the added entries are (``"Spec"``)."""
    value_count: int
    """Added entries of that type."""
    nbytes: int
    """Bytes the added entries hold (measured deep on a sample of them, excluding shared objects)."""
    was_small: bool = False
    """The first census did not list the container (it had fewer entries than ``min_container_len``,
    or did not exist): ``grown_by`` counts all its entries now."""
    contents: list[tuple[str, int, int]] = field(default_factory=list)
    """``[(type name, count, bytes)]`` of the objects the added entries hold (themselves included),
    largest first, scaled from the sample: ``[("dict", 16, 430000), ("float", 12000, 288000)]``."""

    def __str__(self) -> str:
        text = (f"{self.path} ({_short(self.container)}) grew by {self.value_count:,} {_short(self.value_type)} objects / "
                f"{format_bytes(self.nbytes)}")
        return text + " (small or absent at the first census)" if self.was_small else text


@dataclass
class HostExplanation:
    """Result of :func:`explain_host_growth`: what grew on the host, who holds it, what it cost."""

    before: HostCensus
    after: HostCensus
    types: list[tuple[str, int, int]]
    """``[(type name, count change, shallow bytes change)]``, largest first."""
    holders: list[HolderGrowth]
    seconds: float
    """The second census, the holder search and the sizes (the first census's cost is ``before.seconds``)."""
    truncated: bool
    lines: list[str] = field(default_factory=list)
    """Allocating lines from a :class:`TracemallocWindow`, when one was run."""

    def finding(self, step: int, *, key: str = "host_growth") -> Finding:
        """One ``host_growth`` finding naming the types and holders (merged into the growth finding of the same key)."""
        between = f"between step {self.before.step} and step {self.after.step}" if self.before.step is not None else "between the two censuses"
        grew = "; ".join(str(h) for h in self.holders[:3]) or "no container that grew could be named (the objects may be held outside Python, or in many small containers)"
        held = self.holders[0].contents if self.holders and self.holders[0].contents else None
        # what the named container's new entries hold (floats, strings: objects gc.get_objects() does not list),
        # else the census's per-type change
        types = ", ".join(f"{_short(n)} +{c:,} ({format_bytes(b)})" for n, c, b in held) if held else \
            ", ".join(f"{_short(n)} +{c:,}" for n, c, _ in self.types[:5])
        message = (f"Host census {between}: {grew}. Python objects that grew: {types or 'none counted'}. "
                   "Keep summaries instead of objects, bound the container (`deque(maxlen=...)`, `lru_cache(maxsize=...)`) "
                   "or clear it every epoch.")
        if self.lines:
            message += " Allocating lines: " + "; ".join(self.lines[:3]) + "."
        return Finding(
            kind="host_growth",
            step=step,
            key=key,
            bytes=sum(h.nbytes for h in self.holders) or None,
            message=message,
            holders=[str(h) for h in self.holders],
            details={
                "census_cost_s": round(self.before.seconds + self.seconds, 4),
                "census_truncated": self.truncated,
                "types": [{"type": n, "count": c, "bytes": b} for n, c, b in self.types],
                "held_types": [{"type": n, "count": c, "bytes": b} for n, c, b in (held or [])],
                "tracemalloc_lines": list(self.lines),
            },
        )


def _grown_containers(before: HostCensus, after: HostCensus, min_entries: int) -> list[tuple[bool, int, int]]:
    """``(listed at the first census, entries gained, id)`` of the containers that gained ``min_entries``
    or more: those the first census listed first (a container made in between, or under
    ``min_container_len`` then, has all its entries counted as growth), largest gain first."""
    own = {id(before.by_type), id(before.containers)}
    grown = []
    for i, (name, n) in after.containers.items():
        n0 = before.containers.get(i)
        known = n0 is not None and n0[0] == name
        if n - (n0[1] if known else 0) >= min_entries and i not in own:
            grown.append((known, n - (n0[1] if known else 0), i))
    grown.sort(reverse=True)
    return grown


def _holder_growth(obj: Any, n: int, known: bool, path: str | None) -> HolderGrowth:
    """One container that gained ``n`` entries: the type most of them are, and their deep size."""
    new = new_entries(obj, n)
    kinds = collections.Counter(map(type, new))
    tp, count = kinds.most_common(1)[0] if kinds else (object, 0)
    sample = new[-256:]
    by_type: dict[type, list[int]] = {}
    per_entry = deep_size(sample, by_type=by_type) / max(1, len(sample))
    own_bytes = sys.getsizeof(obj, 0) * n / max(1, len(obj))
    scale = n / max(1, len(sample))
    contents = sorted(((_type_name(t), int(c * scale), int(b * scale)) for t, (c, b) in by_type.items()), key=lambda x: -x[2])
    return HolderGrowth(
        contents=contents[:5],
        path=path or f"(no root: a {type(obj).__name__} held outside Python's roots)",
        container=_type_name(type(obj)),
        grown_by=n,
        value_type=_type_name(tp),
        value_count=int(count * n / max(1, len(new))),
        nbytes=int(per_entry * n + own_bytes),
        was_small=not known,
    )


def explain_host_growth(
    before: HostCensus,
    *,
    step: int | None = None,
    top: int = 3,
    min_entries: int = 64,
    time_budget_s: float = 2.0,
    ignore: Iterable[Any] = (),
    lines: list[str] | None = None,
) -> HostExplanation:
    """Take the second census and explain what grew since ``before``: types, and the ``top``
    containers that gained ``min_entries`` entries or more, with holder paths from stable roots.

    ``ignore``: objects not to search through (the monitor). ``lines``: a tracemalloc window's lines."""
    _check("explain_host_growth(top)", top, top >= 1, "use 1 or more, e.g. 3")
    _check("explain_host_growth(min_entries)", min_entries, min_entries >= 1, "use 1 or more, e.g. 64")
    _check("explain_host_growth(time_budget_s)", time_budget_s, time_budget_s > 0, "use a positive number of seconds, e.g. 2.0")
    t0 = time.perf_counter()
    keep: dict[int, Any] = {}
    min_len = min(min_entries, min(before.containers.values(), key=lambda v: v[1])[1]) if before.containers else min_entries
    after = _census(5_000_000, time_budget_s, max(1, min_len), keep, step)
    # a wide pool: a leak of one large entry a step (a dict of 650 floats) gains as few entries as a framework's
    # list of small tuples, and by entries alone it lost the tie; the holders are ranked by bytes below
    grown = _grown_containers(before, after, min_entries)[: 8 * top]
    targets = [keep[i] for _, _, i in grown]
    keep.clear()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        paths, own = holder_paths(targets, ignore, time.thread_time() + time_budget_s)
    # a container no stable root reaches (the census's own, a framework's internals) says nothing;
    # one reached through the monitor's own objects (its history rows) is never named
    pairs = [(g, t) for g, t in zip(grown, targets) if g[2] not in own]
    picked = [(g, t) for g, t in pairs if g[2] in paths] or pairs
    holders = [_holder_growth(obj, n, known, paths.get(i)) for (known, n, i), obj in picked]  # sized from <= 256 entries each
    holders.sort(key=lambda h: (h.was_small, -h.nbytes))
    del holders[top:]
    del targets, picked  # no reference to the heap's containers outlives the call
    return HostExplanation(
        before=before,
        after=after,
        types=after.diff(before),
        holders=holders,
        seconds=time.perf_counter() - t0,
        truncated=after.truncated or before.truncated,
        lines=list(lines or []),
    )


class TracemallocWindow:
    """A short ``tracemalloc`` window, once: :meth:`start`, a few steps, :meth:`stop` -> allocating lines.

    Tracing slows every Python allocation (about 2x on allocation-heavy code) while on: keep the
    window short (a few steps) and run it once, after suspicion. A window started while the user
    traces already uses their tracing and leaves it on. ``seconds`` is the cost of the snapshots
    and the comparison; the slowdown of the traced steps is the caller's to time."""

    def __init__(self, *, frames: int = 1, top: int = 5) -> None:
        _check("TracemallocWindow(frames)", frames, frames >= 1, "use 1 or more, e.g. 1")
        _check("TracemallocWindow(top)", top, top >= 1, "use 1 or more, e.g. 5")
        self.frames = frames
        self.top = top
        self.seconds = 0.0
        self._own = False
        self._before: tracemalloc.Snapshot | None = None

    @property
    def running(self) -> bool:
        return self._before is not None

    def start(self) -> None:
        if self._before is not None:
            return
        t0 = time.perf_counter()
        self._own = not tracemalloc.is_tracing()
        if self._own:
            tracemalloc.start(self.frames)
        self._before = tracemalloc.take_snapshot()
        self.seconds += time.perf_counter() - t0

    def stop(self) -> list[str]:
        """Stop (if this window started tracing) and return ``"file.py:42: +236.0 KiB in 4,352 blocks"`` lines."""
        if self._before is None:
            return []
        t0 = time.perf_counter()
        try:
            after = tracemalloc.take_snapshot()
        finally:
            if self._own:
                tracemalloc.stop()
        keep = [tracemalloc.Filter(False, tracemalloc.__file__), tracemalloc.Filter(False, PACKAGE_DIR + "/*")]
        stats = after.filter_traces(keep).compare_to(self._before.filter_traces(keep), "lineno")
        self._before = None
        out = []
        for stat in stats:
            if stat.size_diff <= 0:
                continue
            frame = stat.traceback[0]
            out.append(f"{frame.filename}:{frame.lineno}: +{format_bytes(stat.size_diff)} in {stat.count_diff:,} blocks")
            if len(out) >= self.top:
                break
        self.seconds += time.perf_counter() - t0
        return out
