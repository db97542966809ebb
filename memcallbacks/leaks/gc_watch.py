"""Cycles at default settings: what Python's automatic collections free, seen through gc.callbacks.

Reference counting cannot free a reference cycle; tensors in one live until the cyclic garbage
collector runs. :class:`CollectionWatch` puts a callback in ``gc.callbacks`` that reads the
allocated bytes (the watch's own read) when a collection starts and when it stops: a drop of
``min_bytes`` or more across an automatic collection means cycles held that much. It costs
nothing between collections and two reads per measured collection: every collection of the older
generations, and a young one when the one before it collected something (a Lightning loop runs
about one young collection per 1-10 steps, and most collect nothing; cycles made every step are
collected, and so measured, by every one).

A collection that freed that much makes the next step boundary look at the garbage itself
(``gc.collect`` with ``DEBUG_SAVEALL``, as the periodic collector of
:mod:`memcallbacks.leaks.cycles` does after a large collection): the types in the cycles and the
tensors they hold, named the same way. A cycle created every step is then still waiting in the
garbage; an inspection that finds no tensor is retried at most :data:`MAX_INSPECTIONS` times.
"""

from __future__ import annotations

import gc
import logging
import time
from typing import Any, Callable

from memcallbacks._base.findings import Finding
from memcallbacks._base.units import MiB, format_bytes
from memcallbacks.leaks.cycles import GarbageCollector

log = logging.getLogger(__name__)

__all__ = ["CollectionWatch", "MAX_INSPECTIONS"]

MAX_INSPECTIONS = 3
"""Inspections (full collections at a step boundary) a run may spend after large automatic collections."""


class CollectionWatch:
    """Measures every automatic collection through ``gc.callbacks``; ``start``/``stop`` are idempotent."""

    def __init__(
        self,
        allocated_bytes: Callable[[], int | None],
        *,
        min_bytes: int = 1 * MiB,
        charge: Callable[[float], None] | None = None,
        wake: Callable[[], None] | None = None,
    ) -> None:
        """``charge``: told the seconds each measured collection's two reads took (the monitor's own
        time); ``wake``: called when a large collection makes the next step boundary inspect the garbage."""
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
        self.measured = 0
        """Collections whose freed bytes were read (see :meth:`_callback`)."""
        self.charge = charge
        self.wake = wake
        self._armed = True
        self._before: int | None = None
        self._read_s = 0.0
        self.due = False  # a large automatic collection happened: the next step boundary inspects the garbage
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
        # runs inside the collector, in any thread: never raises, never allocates much.
        # Two reads of the heap per measured collection (on CPU each walks malloc's free chunks): a
        # collection is measured when it can free much, i.e. an older generation's, or a young one
        # after one that collected something. A clean training loop's young collections mostly
        # collect nothing; cycles made every step are collected by every young collection.
        if self.own or self.reported:
            return
        try:
            if phase == "start":
                if info.get("generation", 0) == 0 and not self._armed:
                    self._before = None
                    return
                t0 = time.perf_counter()
                self._before = self.allocated_bytes()
                self._read_s = time.perf_counter() - t0
                return
            self.collections += 1
            collected = int(info.get("collected", 0))
            self._armed = collected > 0
            before, self._before = self._before, None
            if before is None:
                return
            t0 = time.perf_counter()
            after = self.allocated_bytes()
            if self.charge is not None:
                self.charge(self._read_s + time.perf_counter() - t0)
            self.measured += 1
            if after is None:
                return
            freed = before - after
            if freed > 0:
                self.freed_bytes += freed
            if freed >= self.min_bytes and collected > 0:
                self.large.append({"generation": int(info.get("generation", -1)), "collected": collected, "bytes_freed": int(freed)})
                del self.large[:-20]
                self.due = self.inspections < MAX_INSPECTIONS
                if self.due and self.wake is not None:
                    self.wake()
        except Exception:
            pass

    def inspect(self, step: int) -> Finding | None:
        """Collect once, looking at the garbage; a ``cycle`` finding when cycles held tensors."""
        self.due = False
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

