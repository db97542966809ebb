"""Cycles at default settings: what Python's own (automatic) collections free, seen through ``gc.callbacks``.

Reference counting cannot free a reference cycle; tensors in one live until the cyclic garbage
collector runs. :class:`CollectionWatch` puts a callback in ``gc.callbacks`` that reads the
allocated bytes (the watch's own read) when a collection starts and when it stops: a drop of
``min_bytes`` or more across an automatic collection means cycles held that much. It costs
nothing between collections (a training loop triggers a few per hundred steps) and two reads
per collection.

A collection that freed that much makes the next step boundary look at the garbage itself
(``gc.collect`` with ``DEBUG_SAVEALL``, as the periodic collector of
:mod:`memcallbacks.leaks.cycles` does after a large collection): the types in the cycles and the
tensors they hold, named the same way. A cycle created every step is then still waiting in the
garbage; an inspection that finds no tensor is retried at most :data:`MAX_INSPECTIONS` times.
"""

from __future__ import annotations

import gc
import logging
from typing import Any, Callable

from memcallbacks._findings import Finding
from memcallbacks._units import MiB, format_bytes
from memcallbacks.leaks.cycles import GarbageCollector

log = logging.getLogger(__name__)

__all__ = ["CollectionWatch", "MAX_INSPECTIONS"]

MAX_INSPECTIONS = 3
"""Inspections (full collections at a step boundary) a run may spend after large automatic collections."""


class CollectionWatch:
    """Measures every automatic collection through ``gc.callbacks``; ``start``/``stop`` are idempotent."""

    def __init__(self, allocated_bytes: Callable[[], int | None], *, min_bytes: int = 1 * MiB) -> None:
        if min_bytes < 0:
            raise ValueError(f"CollectionWatch(min_bytes={min_bytes}) must be 0 or more; try 1048576.")
        self.allocated_bytes = allocated_bytes
        self.min_bytes = min_bytes
        self.collections = 0
        """Automatic collections seen."""
        self.freed_bytes = 0
        """Bytes the automatic collections freed, in all (drops of the allocated bytes)."""
        self.large: list[dict[str, int]] = []
        """The collections that freed ``min_bytes`` or more (generation, collected, bytes_freed), the last 20."""
        self.inspections = 0
        self.reported = False
        self.own = False
        """True while memcallbacks collects itself: those collections are not Python's automatic ones."""
        self._before: int | None = None
        self._due = False
        self._started = False

    def start(self) -> None:
        if not self._started:
            self._started = True
            gc.callbacks.append(self._callback)

    def stop(self) -> None:
        """Remove the callback; safe to call twice."""
        if self._started:
            self._started = False
            try:
                gc.callbacks.remove(self._callback)
            except ValueError:
                pass

    def _callback(self, phase: str, info: dict[str, Any]) -> None:
        # runs inside the collector, in any thread: never raises, never allocates much
        if self.own or self.reported:
            return
        try:
            if phase == "start":
                self._before = self.allocated_bytes()
                return
            before, self._before = self._before, None
            if before is None:
                return
            after = self.allocated_bytes()
            self.collections += 1
            if after is None:
                return
            freed = before - after
            if freed > 0:
                self.freed_bytes += freed
            if freed >= self.min_bytes and info.get("collected", 0) > 0:
                self.large.append({"generation": int(info.get("generation", -1)), "collected": int(info["collected"]), "bytes_freed": int(freed)})
                del self.large[:-20]
                self._due = self.inspections < MAX_INSPECTIONS
        except Exception:
            pass

    @property
    def due(self) -> bool:
        """A large automatic collection happened: the next step boundary inspects the garbage."""
        return self._due

    def inspect(self, step: int) -> Finding | None:
        """Collect once, looking at the garbage; a ``cycle`` finding when cycles held tensors."""
        self._due = False
        self.inspections += 1
        collector = GarbageCollector(inspect="always", allocated_bytes=self.allocated_bytes, min_cycle_bytes=self.min_bytes)
        self.own = True
        try:
            result = collector.collect(step)
        finally:
            self.own = False
        # the inspection's own tensors decide: a heap drop across an automatic collection can come from
        # anything freed meanwhile (other threads, non-tensor objects), so it alone is no evidence
        if result.tensor_bytes < self.min_bytes:
            return None
        finding = result.to_finding(min_bytes=self.min_bytes)
        if finding is None:
            return None
        self.reported = True
        last = self.large[-1] if self.large else {}
        finding.bytes = max(int(finding.bytes or 0), int(last.get("bytes_freed", 0)))
        finding.message = (
            f"Python's automatic garbage collection freed {len(self.large)} time(s) {format_bytes(int(last.get('bytes_freed', 0)))} "
            "or more at once; " + finding.message[0].lower() + finding.message[1:]
        )
        finding.details.update(
            evidence="automatic_gc",
            automatic_collections=self.collections,
            automatic_freed_bytes=int(self.freed_bytes),
            large_collections=list(self.large),
        )
        return finding

