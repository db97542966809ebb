"""The clock the monitor's own time is read on: its thread's CPU time, less Python's own collections.

Wall time charged the monitor for what a busy machine did to it: a time slice given to another
process, or a collection of the whole heap, landing inside a 50 µs hook. On a loaded 2-core machine
that made one short run's own time 69% of its steps. The CPU time of the training thread is what the
monitor costs the step. A collection Python starts by itself is the heap's cost wherever it lands;
one the monitor runs (``gc_every_n_steps``) is its own and stays counted (:func:`counted_collection`).
"""

from __future__ import annotations

import contextlib
import gc
import threading
import time
from typing import Any, Iterator

__all__ = ["own_time", "counted_collection", "watch_collections", "unwatch_collections"]

_thread_time = time.thread_time
_ident = threading.get_ident
_gc_s: dict[int, float] = {}  # thread -> CPU seconds in the older generations' automatic collections
_gc_start: dict[int, float] = {}
_counting = 0  # > 0 inside counted_collection(): that collection is the monitor's own work
_watchers = 0


def _on_collection(phase: str, info: dict[str, Any]) -> None:
    # the young generation's collections are short and frequent: not worth two clock reads each
    if _counting or info.get("generation", 2) == 0:
        return
    thread = _ident()
    if phase == "start":
        _gc_start[thread] = _thread_time()
    else:
        start = _gc_start.pop(thread, None)
        if start is not None:
            _gc_s[thread] = _gc_s.get(thread, 0.0) + _thread_time() - start


def own_time() -> float:
    """Seconds on the monitor's clock; the difference of two reads on one thread is what the code between cost."""
    return _thread_time() - _gc_s.get(_ident(), 0.0)


def watch_collections() -> bool:
    """From now on, leave Python's automatic collections out of :func:`own_time` (a run's start). True."""
    global _watchers
    _watchers += 1
    if _on_collection not in gc.callbacks:
        gc.callbacks.append(_on_collection)
    return True


def unwatch_collections() -> bool:
    """Undo one :func:`watch_collections` (a run's end); the callback goes with the last one. False."""
    global _watchers
    _watchers = max(0, _watchers - 1)
    if not _watchers and _on_collection in gc.callbacks:
        gc.callbacks.remove(_on_collection)
    return False


@contextlib.contextmanager
def counted_collection() -> Iterator[None]:
    """Collections inside the block are the monitor's own work and stay in :func:`own_time`."""
    global _counting
    _counting += 1
    try:
        yield
    finally:
        _counting -= 1
