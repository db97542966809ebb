"""One running ``track()`` loop per monitor: a ``track()`` inside it is ignored, with one warning.

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

__all__ = ["TrackGuard"]


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
