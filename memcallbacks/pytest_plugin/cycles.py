"""Reference cycles in a ``train_memory`` test: gc.collect() at the censuses, what only it freed.

The monitor finds cycles only with ``gc_every_n_steps`` (a collection costs time in training).
A test can pay for it. Around each census of a probe:

- at warm-up, a plain collection frees what set-up and earlier tests left (not reported); then
  automatic collection is turned off and the heap is frozen (``gc.freeze()``), so the next
  collection looks only at objects made after warm-up;
- at an end census, a collection that looks at its garbage
  (:class:`~memcallbacks.leaks.cycles.GarbageCollector`, ``inspect="always"``) reports the
  tensors held only by cycles made after warm-up, with the types on each cycle; then the heap is
  thawed for the census (``gc.get_objects()`` does not list frozen objects).

With automatic collection off in between, whether a cycle is found does not depend on when
Python's generational collector happened to run, and the end census counts no cyclic garbage.
Freezing makes the end collection cheap: with Lightning, Accelerate and Transformers imported a
full collection walks some 400k objects. A process that froze objects itself is left alone (no
freeze, full collections).
"""

from __future__ import annotations

import gc
import logging
import time

from memcallbacks._base.findings import Finding
from memcallbacks.leaks.cycles import GarbageCollector, GcResult

log = logging.getLogger(__name__)

__all__ = ["CycleCheck", "thaw"]

_frozen_by_us = False


def thaw() -> None:
    """Unfreeze what a :class:`CycleCheck` froze (before anything lists the heap); safe to call twice."""
    global _frozen_by_us
    if _frozen_by_us:
        _frozen_by_us = False
        gc.unfreeze()


def _freeze() -> None:
    global _frozen_by_us
    if not _frozen_by_us and gc.get_freeze_count() == 0:
        gc.freeze()
        _frozen_by_us = True


class CycleCheck:
    """Collections at one probe's census points; :attr:`findings` holds the cycles over ``max_leak`` bytes."""

    def __init__(self, max_leak: int) -> None:
        self.max_leak = max_leak
        self._gc = GarbageCollector(disable_automatic=True, inspect="always")
        self.findings: list[Finding] = []
        self.seconds = 0.0
        self._armed = False  # a baseline collection ran: later garbage was made during training
        self.keep_thawed = False
        """Set once the host channel suspects Python-object growth: a host census lists the heap with
        ``gc.get_objects()``, which leaves a frozen heap out, so the heap stays thawed from then on
        (the end collection walks all of it: slower, and only in a test that is failing)."""

    def baseline(self) -> None:
        """Before the warm-up census: free the garbage so far, without reporting it."""
        thaw()
        t0 = time.perf_counter()
        gc.collect()
        self.seconds += time.perf_counter() - t0
        self._armed = True

    def check(self, step: int) -> None:
        """Before an end census: collect and report tensors held only by cycles; the heap is thawed after."""
        if not self._armed:
            return
        try:
            result: GcResult | None = self._gc.collect(step)  # the frozen heap is not walked
        except Exception:
            log.warning("train_memory: gc.collect() at step %d failed; cycles are not checked.", step, exc_info=True)
            result = None
        thaw()
        if result is None:
            return
        self.seconds += result.seconds
        finding = result.to_finding(min_bytes=self.max_leak + 1)
        if finding is not None and all(f.key != finding.key for f in self.findings):
            self.findings.append(finding)

    def hold(self) -> None:
        """After a census, until the next check: automatic gc off, the heap frozen."""
        if self._armed:
            self._gc.start()
            if not self.keep_thawed:
                _freeze()

    def release(self) -> None:
        """Automatic gc back as it was, the heap thawed; safe to call twice."""
        thaw()
        self._gc.stop()

