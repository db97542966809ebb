"""The host channel in one object, for an adapter to call on the steps its watch reads.

``on_read(step)`` at step start: the host read (:class:`HostReader`, here since the channel takes
it at every read; the rarer reads are in :mod:`~memcallbacks.host.readers`) and the growth test; on
the first open ``host_growth`` the first host census, and ``census_gap`` steps later (at the first
read from then on) the second, whose finding names the types and holders and merges into the
growth finding (same key); the DataLoader workers' page faults, and their USS when the faults ask
for it or the time budget allows.
``finish()`` at run end names a growth still waiting for its second census. Nothing here may break
a run: an error is logged at debug level and turns the channel off.
"""

from __future__ import annotations

import logging
import math
import multiprocessing
import sys
import time
from dataclasses import dataclass
from typing import Any, Callable

from memcallbacks._base.cpu import StatmReader
from memcallbacks._base.findings import Finding
from memcallbacks.host.census import HostCensus, explain_host_growth, take_host_census
from memcallbacks.host.growth import HostGrowth, HostReading
from memcallbacks.host.workers import WorkerWatch

log = logging.getLogger(__name__)

__all__ = ["HostChannel", "HostReader"]

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
            # the workers' own test of whether an update would do anything, read here: no call then; and
            # none while no child process lives and no worker is tracked (every DataLoader worker is a child)
            if (now >= watch.next_update_s or step - (watch.last_step or 0) >= watch.max_gap_steps) and (
                    watch.tracks or multiprocessing.active_children()):
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


@dataclass
class HostReader:
    """The host read at step start: ``statm`` every call, the Python block count on a stride.

    ``read(step)`` costs ~1-3 µs plus, on every ``blocks_every``-th call, ``sys.getallocatedblocks()``
    (40 µs warm, 1-3 ms after a training step has evicted the pool headers from the caches, on a
    0.5 M-block heap: it touches every 16 KiB pool).
    The stride is chosen from that call's measured cost so that it averages at most
    ``blocks_budget_us`` per step, and it is at most ``max_blocks_every`` (the growth test tolerates
    a thinned series: its blocks span steps, not reads). ``seconds`` totals the time spent in reads.
    """

    blocks_budget_us: float = 5.0
    """Average cost per step allowed for the Python block count."""
    max_blocks_every: int = 256
    """The block count is read at least every this many calls (at ~2 ms a cold read on a 0.5 M-block
    heap that is ~8 µs a step; on a small heap it is read every step)."""
    max_blocks_gap_steps: int = 16
    """...and at least every this many steps: the calls follow the watch's cadence (every step for the
    first 48, then its read steps), so a stride in calls alone can leave hundreds of steps between
    two block counts. The calls themselves are on the budget's cadence, so this bounds steps, not time."""

    def __post_init__(self) -> None:
        if not (self.blocks_budget_us > 0 and math.isfinite(self.blocks_budget_us)):
            raise ValueError(f"HostReader(blocks_budget_us={self.blocks_budget_us!r}) must be a positive number of "
                             "microseconds, e.g. 5.0.")
        if not (isinstance(self.max_blocks_every, int) and self.max_blocks_every >= 1):
            raise ValueError(f"HostReader(max_blocks_every={self.max_blocks_every!r}) must be an integer >= 1, e.g. 256.")
        if not (isinstance(self.max_blocks_gap_steps, int) and self.max_blocks_gap_steps >= 1):
            raise ValueError(f"HostReader(max_blocks_gap_steps={self.max_blocks_gap_steps!r}) must be an integer >= 1, e.g. 16.")
        self._statm = StatmReader()
        self._blocks_step: int | None = None
        self.blocks_now = False  # the next read counts the blocks whatever the stride (both ends of the dense reads' second half)
        self.blocks_every = 1
        self.blocks_cost_us = 0.0
        self.calls = 0
        self.seconds = 0.0

    def read(self, step: int) -> HostReading:
        t0 = time.perf_counter()
        rss, private = self._statm.read()
        blocks: int | None = None
        last = self._blocks_step
        # at least every max_blocks_gap_steps steps, unless the count is so dear (1-3 ms on a large heap
        # after a step) that it would cost more than twice its budget per step: then as rarely as that allows
        gap = max(self.max_blocks_gap_steps, math.ceil(self.blocks_cost_us / (2 * self.blocks_budget_us)))
        if self.calls % self.blocks_every == 0 or last is None or step - last >= gap or self.blocks_now:
            self.blocks_now = False
            self._blocks_step = step
            t1 = time.thread_time()  # CPU time: a read preempted on a shared machine is not a slow read
            blocks = sys.getallocatedblocks()
            cost = (time.thread_time() - t1) * 1e6
            # a slow moving average: one read evicted from the cache must not thin the series
            self.blocks_cost_us = cost if self.calls == 0 else 0.8 * self.blocks_cost_us + 0.2 * cost
            self.blocks_every = max(1, min(self.max_blocks_every, math.ceil(self.blocks_cost_us / self.blocks_budget_us)))
        self.calls += 1
        self.seconds += time.perf_counter() - t0
        return HostReading(step, rss, private, blocks)

    def close(self) -> None:
        self._statm.close()
