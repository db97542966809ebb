"""The monitor's own-time clock: what its code costs the step, not what a busy machine does to it."""

from __future__ import annotations

import gc
import time

from memcallbacks._base import cpu as own_clock


def _busy(seconds: float) -> None:
    end = time.thread_time() + seconds
    while time.thread_time() < end:
        pass


def test_waiting_is_not_own_time_and_work_is():
    """A thread that is not running (a time slice another process got) costs the monitor nothing."""
    t0 = own_clock.own_time()
    time.sleep(0.2)
    assert own_clock.own_time() - t0 < 0.05
    t0 = own_clock.own_time()
    _busy(0.05)
    assert 0.04 < own_clock.own_time() - t0 < 0.5


def test_an_automatic_collection_is_left_out_and_the_monitors_own_is_counted():
    heap = [[i] for i in range(300_000)]  # a heap whose full collection takes a while
    watched_before = own_clock._on_collection in gc.callbacks  # an earlier test's monitor may still be open
    own_clock.watch_collections()
    try:
        cost = time.thread_time()
        gc.collect()
        cost = time.thread_time() - cost
        # gc.collect() starts its callbacks like an automatic collection: what this test calls "automatic"
        t0 = own_clock.own_time()
        gc.collect()
        left_out = own_clock.own_time() - t0
        t0 = own_clock.own_time()
        with own_clock.counted_collection():
            gc.collect()
        counted = own_clock.own_time() - t0
    finally:
        own_clock.unwatch_collections()
    assert cost > 0.002, cost
    assert left_out < 0.25 * cost and counted > 0.5 * cost, (cost, left_out, counted)
    assert (own_clock._on_collection in gc.callbacks) == watched_before  # the run's end takes its watch back
    del heap
