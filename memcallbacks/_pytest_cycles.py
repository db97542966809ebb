"""Reference cycles in a ``train_memory`` test: ``gc.collect()`` at the census points, and the tensors only it freed.

The monitor finds cycles only with ``gc_every_n_steps`` (a collection costs time in training).
A test can pay for it: at the warm-up census the garbage left by set-up and earlier tests is
collected (not reported), automatic collection is turned off, and at the end census a collection
that looks at its garbage (:class:`~memcallbacks.leaks.cycles.GarbageCollector`,
``inspect="always"``) reports the tensors held only by cycles created after warm-up, with the
types on each cycle. With automatic collection off in between, whether a cycle is found does not
depend on when Python's generational collector happened to run, and the end census does not count
cyclic garbage that a collection would have freed.
"""

from __future__ import annotations

import logging

from memcallbacks._findings import Finding
from memcallbacks.leaks.cycles import GarbageCollector, GcResult

log = logging.getLogger(__name__)

__all__ = ["CycleCheck"]


class CycleCheck:
    """Collections at one probe's census points; :attr:`findings` holds the cycles over ``max_leak`` bytes."""

    def __init__(self, max_leak: int) -> None:
        self.max_leak = max_leak
        self._gc = GarbageCollector(disable_automatic=True, inspect="always")
        self.results: list[GcResult] = []
        self.findings: list[Finding] = []
        self.seconds = 0.0

    def baseline(self, step: int) -> None:
        """At the warm-up census: free the garbage so far without reporting it; automatic gc off from here."""
        self._collect(step)
        self._gc.start()

    def check(self, step: int, *, last: bool = True) -> None:
        """At an end census: collect, report tensors held by cycles; ``last`` turns automatic gc back on."""
        if not self.results:
            return  # no baseline: what a collection frees now may predate the test
        result = self._collect(step)
        if last:
            self._gc.stop()
        if result is None:
            return
        finding = result.to_finding(min_bytes=self.max_leak + 1)
        if finding is not None and all(f.key != finding.key for f in self.findings):
            self.findings.append(finding)

    def stop(self) -> None:
        """Turn automatic gc back on if a check did not; safe to call twice."""
        self._gc.stop()

    def _collect(self, step: int) -> GcResult | None:
        try:
            result = self._gc.collect(step)
        except Exception:
            log.warning("train_memory: gc.collect() at step %d failed; cycles are not checked.", step, exc_info=True)
            return None
        self.results.append(result)
        self.seconds += result.seconds
        return result

