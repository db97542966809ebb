"""``track()``'s bookkeeping: one running loop per monitor (a ``track()`` inside it is ignored, with one warning), and the gradient-accumulation window.

A nested ``for x in monitor.track(inner):`` inside ``for batch in monitor.track(outer):`` used to
record every inner item as a training row of its own. The loop running is the ``track()``
generator that has started and not finished; one that was broken out of is closed by CPython
when it is dropped, so a later ``track()`` (the next epoch) is not nested.
"""

from __future__ import annotations

import inspect
import logging
import weakref
from typing import Any, Iterator

log = logging.getLogger("memcallbacks.monitor")

__all__ = ["TrackGuard", "AccumulationWindow"]


class TrackGuard:
    def __init__(self, owner: str) -> None:
        self.owner = owner
        self._running: weakref.ref[Any] | None = None
        self._warned = False

    def nested(self) -> bool:
        """Is a ``track()`` loop running? Then the new one is ignored (one warning per monitor)."""
        running = self._running() if self._running is not None else None
        if running is None or inspect.getgeneratorstate(running) != inspect.GEN_SUSPENDED:
            return False
        if not self._warned:
            self._warned = True
            log.warning("%s.track() was called inside a loop over another %s.track(): the inner loop is not tracked (its "
                        "items are part of the outer loop's step, not rows of their own). Call track() on the one loop whose "
                        "items are training steps.", self.owner, self.owner)
        return True

    def started(self, items: Iterator[Any]) -> Iterator[Any]:
        self._running = weakref.ref(items)
        return items


class AccumulationWindow:
    """``track()``'s gradient-accumulation window: the batches since the last row that ended with an
    optimizer step, and whether a batch without one continues the open step."""

    def __init__(self, accumulates: bool) -> None:
        # True when a batch that ends without an optimizer step is gradient accumulation (the next
        # batch continues the open step): an optimizer is known, given to the monitor or seen stepping
        # by the global hooks. False again after a window overflowed (see Monitor.max_micro_batches)
        # until the next optimizer step. The Accelerate adapter sets it too.
        self.accumulates = accumulates
        self.size = 0  # track()ed batches since the last row that ended with an optimizer step
        self.longest = 0  # the most batches seen between two optimizer steps (Monitor._end updates both)

    def overflows(self, limit: int) -> bool:
        """This many batches without an optimizer step is not accumulation (the optimizer is idle): the
        open step ends, and each item is a row of its own until an optimizer step is seen again."""
        if self.size >= limit and self.size >= 2 * self.longest:
            self.accumulates = False
            return True
        return False
