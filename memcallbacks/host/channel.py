"""The host channel in one object, for an adapter to call on the steps its watch reads.

``on_read(step)`` at step start: the host read and growth test; on the first open ``host_growth``
the first host census, and ``census_gap`` steps later (at the first read from then on) the second,
whose finding names the types and holders and merges into the growth finding (same key); the
DataLoader workers' page faults, and their USS when the faults ask for it or the time budget allows.
``finish()`` at run end names a growth still waiting for its second census. Nothing here may break
a run: an error is logged at debug level and turns the channel off.
"""

from __future__ import annotations

import logging
import time
from typing import Any, Callable

from memcallbacks._base.findings import Finding
from memcallbacks.host.census import HostCensus, explain_host_growth, take_host_census
from memcallbacks.host.growth import HostGrowth
from memcallbacks.host.readers import HostReader
from memcallbacks.host.workers import WorkerWatch

log = logging.getLogger(__name__)

__all__ = ["HostChannel"]

_MIN_ENTRIES = 8
"""A container that gained this many entries between the two censuses (16 steps apart) is a candidate:
a per-step record of one large dict gains 16."""


class HostChannel:
    def __init__(self, *, device_is_host: bool, census_gap: int = 16, census_time_budget_s: float = 2.0,
                 device_growth: Callable[[], Finding | None] | None = None) -> None:
        """``device_growth``: the device growth test's latest finding, so that on a CPU run a climb of
        private memory that the device finding explains is not reported a second time."""
        if census_gap < 1:
            raise ValueError(f"HostChannel(census_gap={census_gap}) must be at least 1 step, e.g. 16.")
        self.reader = HostReader()
        self.growth = HostGrowth(device_is_host=device_is_host, device_growth=device_growth)
        self.workers = WorkerWatch()
        self.census_gap = census_gap
        self.census_time_budget_s = census_time_budget_s
        self.enabled = True
        self.seconds = 0.0
        """Time in reads, the growth test and the worker reads (the per-step cost; the worker reads their
        faults asked for outside the budget are finding work, :attr:`finding_seconds`)."""
        self.census_seconds = 0.0
        """Time in censuses (after suspicion only)."""
        self.finding_seconds = 0.0
        """Work after suspicion, apart from the per-step cost: censuses, and the worker reads their page
        faults asked for outside the budget (kept at each read)."""
        self._before: HostCensus | None = None
        self._due: int | None = None
        self._named = False
        self._last_step = 0

    def on_read(self, step: int) -> list[Finding]:
        if not self.enabled:
            return []
        try:
            t0 = time.perf_counter()
            self._last_step = step
            out: list[Finding] = []
            finding = self.growth.update(self.reader.read(step))
            watch, workers, now, confirm = self.workers, None, time.monotonic(), self.workers.finding_seconds
            # the workers' own test of whether an update would do anything, read here: no call then
            if now >= watch.next_update_s or step - (watch.last_step or 0) >= watch.max_gap_steps:
                workers = watch.update(step, now=now)
            self.seconds += time.perf_counter() - t0 - (watch.finding_seconds - confirm)
            if finding is not None:
                out.append(finding)
                if finding.key == "host_growth" and finding.details.get("open") and self._before is None and not self._named:
                    t1 = time.perf_counter()
                    self._before = take_host_census(step=step, time_budget_s=self.census_time_budget_s, min_container_len=_MIN_ENTRIES)
                    self.census_seconds += time.perf_counter() - t1
                    self._due = step + self.census_gap
            if self._due is not None and step >= self._due:
                out += self._name(step)
            if workers is not None:
                out.append(workers)
            self.finding_seconds = self.census_seconds + watch.finding_seconds
            return out
        except Exception:
            log.debug("the host channel failed; it is off for the rest of the run", exc_info=True)
            self.enabled = False
            return []

    def _name(self, step: int) -> list[Finding]:
        before, self._before, self._due = self._before, None, None
        if before is None:
            return []
        self._named = True
        t0 = time.perf_counter()
        # a run that ends fewer than _MIN_ENTRIES steps after the first census: a record a step gained one entry a step
        gap = step - before.step if before.step is not None else _MIN_ENTRIES
        result = explain_host_growth(before, step=step, time_budget_s=self.census_time_budget_s,
                                     min_entries=min(_MIN_ENTRIES, max(1, gap)))
        self.census_seconds += time.perf_counter() - t0
        self.finding_seconds = self.census_seconds + self.workers.finding_seconds
        finding = result.finding(step)
        growth = self.growth.findings.get(finding.key)
        if growth is not None:
            finding.state = growth.state  # the census names the holders; it does not re-open a settled growth
        return [finding]

    def finish(self) -> list[Finding]:
        """At the run's end: the Python-object figures measured once more, and a growth still waiting
        for its second census named."""
        if not self.enabled:
            return []
        try:
            # the census pair first: the first census, kept until it is named (its table of the heap's containers,
            # ~3 MiB on a Lightning heap), is the monitor's own memory, not the run's Python objects
            named = self._name(self._last_step) if self._before is not None else []
            t0 = time.perf_counter()
            if self.growth.baseline is not None:
                self.growth.measure_python(self._last_step)
            self.seconds += time.perf_counter() - t0
            return named
        except Exception:
            log.debug("the host channel's last census failed", exc_info=True)
            return []

    def summary(self) -> dict[str, Any]:
        """What report.json keeps of the host channel: its reads, its costs and the workers."""
        return {
            "enabled": self.enabled,
            "reads": self.reader.calls,
            "seconds": self.seconds,
            "census_seconds": self.census_seconds,
            "workers": self.workers.summary(),
        }

    def close(self) -> None:
        self.reader.close()
        self.workers.close()
