"""Reference cycles that hold tensors: garbage collection at step boundaries, and what it freed."""

from __future__ import annotations

import collections
import gc
import logging
import time
from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from memcallbacks._base.cpu import counted_collection
from memcallbacks._base.findings import Finding, cycle_types
from memcallbacks._base.storage import storage_keys
from memcallbacks._base.units import MiB, format_bytes
from memcallbacks.leaks.paths import edge_fragment
from memcallbacks.leaks.tensors import describe_tensor, graph_tensors, is_parameter

log = logging.getLogger(__name__)

__all__ = ["GarbageCollector", "GcResult", "cycle_fix"]


def cycle_fix(cycles: list[str]) -> str:
    """The fix for the cycles described (``"Foo -> LambdaLR -> list -> function -> Foo holds ..."``): for a kept
    exception, for a scheduler's function that refers back to its owner, or the general one."""
    types = {t for c in cycles for t in c.removeprefix("cyclic garbage: ").split(" holds ")[0].split(" -> ")}
    if "traceback" in types:  # pytorch#10348: `err = e` keeps the frame of the step, and every local of it
        return ("Fix: do not keep the exception (`err = e`: its traceback holds the frame it was caught in, and every "
                "local of that step, batch and loss included): keep `str(e)` or `repr(e)`, or `del err` once it is used.")
    if any(t.endswith("LR") or "Scheduler" in t for t in types):  # pytorch#47589: a LambdaLR whose lambda refers to its owner
        return ("Fix: the scheduler's function refers back to the object that holds the scheduler (`lambda s: self.lr`): "
                "give it what it needs by value (`lr = self.lr; lambda s: lr`) or a module-level function, or `del` the "
                "scheduler and optimizer when done; until then each one keeps its optimizer's state alive.")
    return ("Fix: break the cycle: keep back-references as `weakref.ref(obj)`, clear the attribute when done "
            "(`node.buf = None`), or do not store tensors on objects that reference each other.")


@dataclass
class GcResult:
    """What one collection did."""

    step: int
    seconds: float
    collected: int
    """Unreachable objects found (``gc.collect()``'s return value)."""
    bytes_freed: int | None
    """Drop of ``allocated_bytes()`` across the collection; ``None`` without that callable."""
    inspected: bool = False
    """True when the garbage was looked at before being freed (types and cycles are known)."""
    tensors: int = 0
    """Tensors found in the garbage (inspected collections only)."""
    tensor_bytes: int = 0
    """Bytes of the storages of those tensors (including what their autograd graphs held)."""
    types: dict[str, int] = field(default_factory=dict)
    """Most common object types in the garbage."""
    cycles: list[str] = field(default_factory=list)
    """Cycles that held tensors, e.g. ``"Node -> Node -> Node holds Node.buf (Tensor 256x512 float32)"``."""

    def to_finding(self, *, min_bytes: int = 1 * MiB) -> Finding | None:
        """A "cycle" finding when an inspected collection freed tensors of ``min_bytes`` or more."""
        held = self.bytes_freed if self.bytes_freed is not None and self.bytes_freed > 0 else self.tensor_bytes
        if not self.inspected or not self.tensors or max(held, self.tensor_bytes) < min_bytes:
            return None
        names = "; ".join(self.cycles[:3]) or ", ".join(self.types)
        key = "cycle:" + (self.cycles[0].split(" holds ")[0] if self.cycles else ",".join(sorted(self.types)[:3]))
        return Finding(
            kind="cycle",
            step=self.step,
            key=key,
            bytes=int(max(held, self.tensor_bytes)),
            message=(
                f"Reference cycles kept {self.tensors} tensor{'s' if self.tensors != 1 else ''} "
                f"({format_bytes(self.tensor_bytes)}) alive until the garbage collector ran at step "
                f"{self.step}: {names}. Reference counting cannot free a cycle, so these tensors live "
                "until the next full collection (never, if gc is disabled). " + cycle_fix(self.cycles)
            ),
            holders=list(self.cycles),
            details={
                "collected": self.collected,
                "tensors": self.tensors,
                "tensor_bytes": self.tensor_bytes,
                "bytes_freed": self.bytes_freed,
                "types": dict(self.types),
                "gc_seconds": round(self.seconds, 6),
                "cycles": [cycle_types(c) for c in self.cycles],  # what ties a lingering step or a growth to this cycle
            },
        )


class GarbageCollector:
    """Periodic ``gc.collect()`` at step boundaries, timed, with what each collection freed.

    ``disable_automatic=True`` turns automatic collection off between ``start()`` and ``stop()``
    (as torchtitan does) so collections happen only at step boundaries; ``stop()`` restores the
    previous state exactly and is safe to call twice.

    ``inspect``: ``"auto"`` looks at the garbage (types, cycles holding tensors) in the collection
    after one that freed ``min_cycle_bytes`` or more; without ``allocated_bytes`` every collection
    is inspected. ``"always"`` inspects every collection, ``"never"`` none. An inspected
    collection runs gc twice (once keeping the garbage in ``gc.garbage`` to look at it, once to
    free it).
    """

    def __init__(
        self,
        *,
        every_n_steps: int = 0,
        disable_automatic: bool = False,
        generation: int = 2,
        allocated_bytes: Callable[[], int | None] | None = None,
        inspect: str = "auto",
        min_cycle_bytes: int = 1 * MiB,
    ) -> None:
        if every_n_steps < 0:
            raise ValueError(f"GarbageCollector(every_n_steps={every_n_steps}) must be 0 (off) or more; try 100.")
        if generation not in (0, 1, 2):
            raise ValueError(f"GarbageCollector(generation={generation}) must be 0, 1 or 2.")
        if inspect not in ("auto", "always", "never"):
            raise ValueError(f"GarbageCollector(inspect={inspect!r}) must be 'auto', 'always' or 'never'.")
        if min_cycle_bytes < 0:
            raise ValueError(f"GarbageCollector(min_cycle_bytes={min_cycle_bytes}) must be 0 or more.")
        self.every_n_steps = every_n_steps
        self.disable_automatic = disable_automatic
        self.generation = generation
        self.allocated_bytes = allocated_bytes
        self.inspect = inspect
        self.min_cycle_bytes = min_cycle_bytes
        self._started = False
        self._was_enabled: bool | None = None
        self._inspect_next = False
        self.results: collections.deque[GcResult] = collections.deque(maxlen=100)

    def start(self) -> None:
        """Begin managing gc (idempotent)."""
        if self._started:
            return
        self._started = True
        if self.disable_automatic:
            self._was_enabled = gc.isenabled()
            gc.disable()

    def stop(self) -> None:
        """Restore the gc state found at ``start()``; safe to call twice."""
        if not self._started:
            return
        self._started = False
        if self._was_enabled:
            gc.enable()
        self._was_enabled = None

    def __enter__(self) -> GarbageCollector:
        self.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.stop()

    def maybe_collect(self, step: int) -> GcResult | None:
        """Collect when ``every_n_steps`` divides ``step`` (and it is positive)."""
        if self.every_n_steps and step > 0 and step % self.every_n_steps == 0:
            return self.collect(step)
        return None

    def collect(self, step: int) -> GcResult:
        """Collect now; return timing, objects found, bytes freed and, if inspected, what was freed."""
        inspect = self.inspect == "always" or (
            self.inspect == "auto" and (self._inspect_next or self.allocated_bytes is None)
        )
        with counted_collection():  # the monitor's own collection: its time is own time
            result = self._collect_inspecting(step) if inspect else self._collect_plain(step)
        if self.inspect == "auto":
            freed = result.bytes_freed or 0
            self._inspect_next = not result.inspected and freed >= self.min_cycle_bytes
        self.results.append(result)
        return result

    def _allocated(self) -> int | None:
        if self.allocated_bytes is None:
            return None
        return self.allocated_bytes()

    def _collect_plain(self, step: int) -> GcResult:
        before = self._allocated()
        t0 = time.perf_counter()
        collected = gc.collect(self.generation)
        seconds = time.perf_counter() - t0
        after = self._allocated()
        freed = before - after if before is not None and after is not None else None
        return GcResult(step=step, seconds=seconds, collected=collected, bytes_freed=freed)

    def _collect_inspecting(self, step: int) -> GcResult:
        t0 = time.perf_counter()
        flags = gc.get_debug()
        n0 = len(gc.garbage)
        gc.set_debug(flags | gc.DEBUG_SAVEALL)
        try:
            collected = gc.collect(self.generation)
        finally:
            gc.set_debug(flags)
        garbage = gc.garbage[n0:]
        del gc.garbage[n0:]
        try:
            summary = _describe_garbage(garbage)
        except Exception:
            log.debug("could not describe the garbage", exc_info=True)
            summary = (0, 0, {}, [])
        finally:
            garbage.clear()
        del garbage
        before = self._allocated()
        gc.collect(self.generation)  # now really free it
        after = self._allocated()
        seconds = time.perf_counter() - t0
        freed = before - after if before is not None and after is not None else None
        tensors, tensor_bytes, types, cycles = summary
        return GcResult(
            step=step,
            seconds=seconds,
            collected=collected,
            bytes_freed=freed,
            inspected=True,
            tensors=tensors,
            tensor_bytes=tensor_bytes,
            types=types,
            cycles=cycles,
        )


_MAX_DESCRIBED = 200_000


def _describe_garbage(garbage: list[Any]) -> tuple[int, int, dict[str, int], list[str]]:
    """(tensors, tensor bytes, top types, cycle descriptions) of a gc.garbage slice."""
    types = collections.Counter(type(o).__name__ for o in garbage)
    top = dict(types.most_common(8))
    tensors = [o for o in garbage if isinstance(o, torch.Tensor)]
    if not tensors:
        return 0, 0, top, []
    held: dict[Any, int] = {}
    for t in tensors:
        for key, nbytes in storage_keys(t):
            held.setdefault(key, nbytes)
    for t, _how in graph_tensors([t for t in tensors if t.grad_fn is not None]):
        if not is_parameter(t):
            for key, nbytes in storage_keys(t):
                held.setdefault(key, nbytes)
    tensor_bytes = sum(held.values())
    if len(garbage) > _MAX_DESCRIBED:
        return len(tensors), tensor_bytes, top, []

    ids = {id(o): o for o in garbage}
    children: dict[int, list[Any]] = {}
    parents: dict[int, list[Any]] = collections.defaultdict(list)
    for o in garbage:
        kids = [c for c in gc.get_referents(o) if id(c) in ids]
        children[id(o)] = kids
        for c in kids:
            parents[id(c)].append(o)

    cycles: list[str] = []
    seen_sigs: set[str] = set()
    for t in sorted(tensors, key=lambda x: -sum(n for _, n in storage_keys(x)))[:20]:
        desc = cycle_for(t, children, parents)
        if desc is None:
            continue
        sig = desc.split(" holds ")[0]
        if sig in seen_sigs:
            continue
        seen_sigs.add(sig)
        cycles.append(desc)
        if len(cycles) >= 3:
            break
    return len(tensors), tensor_bytes, top, cycles


def cycle_for(t: Any, children: dict[int, list[Any]], parents: dict[int, list[Any]]) -> str | None:
    """``"A -> B -> A holds A.x.buf (Tensor 4x4 float32)"`` for the nearest cycle above ``t``."""
    # Walk up from the tensor (BFS over referrers inside the garbage) to the nearest object on a cycle.
    prev: dict[int, Any] = {id(t): None}
    queue = collections.deque([t])
    while queue:
        obj = queue.popleft()
        loop = _shortest_cycle(obj, children) if obj is not t else None
        if loop is not None:
            hold = [obj]
            cur = obj
            while cur is not t:
                cur = prev[id(cur)]
                hold.append(cur)
            cycle_str = " -> ".join(type(o).__name__ for o in loop + [loop[0]])
            path = type(obj).__name__
            attr = False
            for a, b in zip(hold, hold[1:]):
                frag, attr = edge_fragment(a, b, attr)
                path += frag
            return f"{cycle_str} holds {path} (Tensor {describe_tensor(t)})"
        for p in parents.get(id(obj), ()):
            if id(p) not in prev:
                prev[id(p)] = obj
                queue.append(p)
    return None


def _shortest_cycle(start: Any, children: dict[int, list[Any]], limit: int = 10_000) -> list[Any] | None:
    """Objects on the shortest cycle through ``start`` (start first), or None."""
    prev: dict[int, Any] = {id(start): None}
    queue = collections.deque([start])
    steps = 0
    while queue and steps < limit:
        obj = queue.popleft()
        steps += 1
        for c in children.get(id(obj), ()):
            if c is start:
                path = [obj]
                while path[-1] is not start:
                    path.append(prev[id(path[-1])])
                path.reverse()
                return path
            if id(c) not in prev:
                prev[id(c)] = obj
                queue.append(c)
    return None
