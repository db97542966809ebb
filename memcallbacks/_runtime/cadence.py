"""Which steps are watched, sampled and logged, and the intervals the overhead budget allows.

Three cadences, each with its own job:

* **watch** (every step): the lingering check (every step for the first
  :data:`LINGERING_EVERY_STEP_UNTIL` steps, then after every :data:`MARK_EVERY_SAMPLES`-th sampled
  step) and the memory read that feeds
  growth detection and the snapshot triggers. The read is the caching allocator's
  ``memory_allocated`` on accelerators (~1 µs, taken every step) and glibc's in-use heap
  (``mallinfo2``) on CPU, which walks every free chunk: 20-150 µs after a step's compute has
  evicted the heap from the caches. On CPU it is therefore taken every step for the first
  :data:`DENSE_READ_STEPS` steps (a leak in the training code shows from the first step) and then
  every ``read_every`` steps, an interval the budget chooses. Between those reads a *tripwire*
  watches the resident set (``/proc/self/statm``, ~1-2 µs, on every :data:`TRIP_EVERY`-th quiet
  step): a step that finds it risen by a quarter of the burst threshold since the last read takes
  a read at once, so a leak that begins late is not left until the next scheduled read. The watch
  runs whether or not anything is logged.
* **sample**: per-phase peaks and a history row (its baseline is a read too, and feeds growth
  detection on the steps it is taken).
* **log**: a logger write, every ``log_every_n_steps`` (the framework's setting by default). Logged
  steps are always sampled.

The read and sampling intervals are chosen from measured costs and the measured step time so that
the monitor's own time stays within ``overhead_budget`` (``sample_every_n_steps`` overrides the
sampling interval). After the first :data:`QUIET_FROM` steps, a step that is not logged, not
sampled and takes no read is *quiet*: the monitor only counts it (``Session.begin_step``).
"""

from __future__ import annotations

import collections
import math
import time
from typing import Any

from memcallbacks._base.config import MonitorConfig
from memcallbacks._runtime.intervals import (  # the constants are re-exported: they are the cadence's
    LINGERING_EVERY_STEP_UNTIL,
    MARK_EVERY_SAMPLES,
    MEASURE_STEPS,
    DENSE_READ_STEPS,
    CONFIRM_STEPS,
    TRIP_EVERY,
    TRIP_MASK,
    QUIET_FROM,
    CHOOSE_EVERY,
    MAX_INTERVAL,
    MAX_READ_INTERVAL,
    READ_SHARE,
    COLD_FACTOR,
    aligned_reads,
    aligned_samples,
    median,
)
from memcallbacks._runtime.ledger import LINGERING_SHARE, PARTS, BudgetGuard, Ledger

__all__ = ["Cadence", "TRIP_MASK", "TRIP_EVERY", "COLD_FACTOR", "LINGERING_EVERY_STEP_UNTIL", "MARK_EVERY_SAMPLES", "DENSE_READ_STEPS", "QUIET_FROM"]


class Cadence:
    """Step intervals for watching, reading, sampling and logging, and the monitor's measured cost."""

    def __init__(self, config: MonitorConfig) -> None:
        self.config = config
        self.budget = config.overhead_budget
        self.explicit = config.sample_every_n_steps is not None
        self.sample_every = config.sample_every_n_steps or 1
        self.read_every = 1
        self.log_every = 50
        self.logs = True  # False: the run has nowhere to log (no logger), so no step is a logged step
        self.log_first_step = False
        self._anchor: tuple[int, float] | None = None  # (count, time) of the last step start timed
        self._next_choice = MEASURE_STEPS
        self.dense_until = 0  # reads every step below this count (a burst after a suspicious read)
        self.bursts = 0
        self.trips = 0  # reads the RSS tripwire asked for between the scheduled ones
        self.trip_checks = 0  # quiet steps that checked the tripwire (counted, not timed one by one)
        self.trip_cost_s = 0.0  # one check, as measured when the run starts (0: no tripwire)
        self.tripwire: str | None = None  # what the tripwire reads: "hwm", "rss" or None (none)
        self._forced = -1  # the count whose step reads because the tripwire asked
        self._burst_bytes = config.growth_min_total_bytes
        self._recent_reads: collections.deque[int] = collections.deque(maxlen=4)
        self._step_times: collections.deque[float] = collections.deque(maxlen=64)
        self._watch_costs: collections.deque[float] = collections.deque(maxlen=64)
        self._read_costs: collections.deque[float] = collections.deque(maxlen=32)
        self._sample_costs: collections.deque[float] = collections.deque(maxlen=32)
        self.own_s = 0.0
        self.finding_s = 0.0  # censuses and holder searches for findings: part of own_s, not of the medians
        self.step_s = 0.0
        self.steps = 0
        self.ledger = Ledger(self.budget)  # the leak watch's lingering checks and finding work
        self._ledger_seen = (0.0, 0.0)  # (lingering_s, finding_s) already split off a charge
        self.parts: dict[str, float] = dict.fromkeys(PARTS, 0.0)
        self.mark_every = MARK_EVERY_SAMPLES  # sampled steps between two lingering marks
        self.guard = BudgetGuard(self.budget, QUIET_FROM, MAX_INTERVAL)  # backs off the costliest part over the budget
        self._started: tuple[float, float, float] | None = None  # (own_s, step_s, hooks) once QUIET_FROM steps are done

    def configure(self, *, log_every: int, logs: bool, log_first_step: bool) -> None:
        self.log_every = log_every
        self.logs = bool(logs)
        self.log_first_step = bool(log_first_step)

    # ------------------------------------------------------------------ decisions (counts only)
    def will_log(self, count: int) -> bool:
        if not self.logs:
            return False
        return (count + 1) % self.log_every == 0 or (self.log_first_step and count == 0)

    def wants_sample(self, count: int, log: bool) -> bool:
        if log or (count + 1) % self.sample_every == 0:
            return True
        return not self.explicit and count < MEASURE_STEPS

    def wants_read(self, count: int) -> bool:
        """Whether the watch reads memory at the start of the step after ``count`` steps."""
        return (
            count < DENSE_READ_STEPS
            or count < self.dense_until
            or (count + 1) % self.read_every == 0  # in phase with the logged steps
            or count == self._forced
        )

    def trip(self, count: int) -> None:
        """The RSS tripwire went off before the step after ``count`` steps: that step reads memory."""
        self._forced = count
        self.trips += 1

    @property
    def trip_bytes(self) -> int:
        """The tripwire goes off when the resident set has risen by this much since the last read:
        a quarter of the rise of the floor that starts a burst of reads (which doubles after each
        burst), and as much as a read the tripwire asked for needs to start one."""
        return self._burst_bytes // 4

    def after_read(self, count: int, allocated: int) -> None:
        """A read at the start of the step after ``count`` steps: start a burst of reads at every step
        when the floor has risen by the growth test's minimum since the last few scheduled reads, or
        by a quarter of it on a read the RSS tripwire asked for (a leak that began after the first
        steps is then confirmed within a few steps, not reads)."""
        if count < DENSE_READ_STEPS or count < self.dense_until:
            return
        recent = self._recent_reads
        # a read the tripwire asked for has the resident set's rise behind it: a quarter of the rise will do
        need = self.trip_bytes if count == self._forced else self._burst_bytes
        if recent and allocated - min(recent) >= need:
            self.dense_until = count + 1 + CONFIRM_STEPS
            self.bursts += 1
            self._burst_bytes *= 2  # a clean run's one-off rises (a bigger batch, a cache) cannot keep it busy
            recent.clear()
            return
        recent.append(allocated)

    # ------------------------------------------------------------------ measurements
    def next_busy(self, count: int, reads: bool) -> int:
        """The first step count at or after ``count`` whose step is logged, sampled or (``reads``)
        reads memory: the steps before it are quiet."""
        if count < self.dense_until:
            return count
        busy = count + (-(count + 1)) % self.sample_every
        if self.logs:
            busy = min(busy, count + (-(count + 1)) % self.log_every)
        if reads:
            busy = min(busy, count + (-(count + 1)) % self.read_every)
        return busy

    # ------------------------------------------------------------------ measurements
    def step_started(self, count: int) -> None:
        """Time the steps since the last timed start (the monitor's own time included). Quiet steps
        are not timed one by one: a start after some of them gives their mean."""
        now = time.perf_counter()
        anchor = self._anchor
        if anchor is not None and count > anchor[0]:
            elapsed = now - anchor[1]
            self._step_times.append(elapsed / (count - anchor[0]))
            self.step_s += elapsed
            self.steps += count - anchor[0]
            if self.trip_cost_s and count > anchor[0] + 1:
                # the quiet steps in between that checked the tripwire: their cost, as measured at start
                checks = (count - 1) // TRIP_EVERY - anchor[0] // TRIP_EVERY
                self.trip_checks += checks
                self.own_s += checks * self.trip_cost_s
                self.parts["tripwire"] += checks * self.trip_cost_s
        self._anchor = (count, now)
        if self._started is None and self.steps >= QUIET_FROM:
            self._started = (self.own_s - self.finding_s, self.step_s, self.parts["hooks"])
            self.guard.window = (self.steps, self.own_s - self.finding_s, self.step_s, dict(self.parts))  # its first window
        if count >= self._next_choice:
            self._next_choice = count + CHOOSE_EVERY
            self.choose()  # first as soon as the measured steps are over, then every CHOOSE_EVERY

    def pause(self) -> None:
        """Evaluation or a checkpoint between steps: the next start-to-start gap is not a step."""
        self._anchor = None

    def _split(self, seconds: float) -> tuple[float, float, float]:
        """``seconds`` of own time as (lingering checks, finding work, the rest), from the ledger."""
        led = self.ledger
        seen_l, seen_f = self._ledger_seen
        # what the ledger holds beyond ``seconds`` was spent in a step charged later: it stays pending
        lingering = min(max(0.0, led.lingering_s - seen_l), seconds)
        finding = min(max(0.0, led.finding_s - seen_f), seconds - lingering)
        self._ledger_seen = (seen_l + lingering, seen_f + finding)
        self.parts["lingering"] += lingering
        self.parts["findings"] += finding
        self.finding_s += finding
        return lingering, finding, seconds - lingering - finding

    def charge(self, seconds: float, sampled: bool, typical: bool = True) -> None:
        """Add the monitor's own time for one step, its watch read excepted (:meth:`charge_read`).
        Every second counts in ``own_s``. The lingering check's time and the finding work (censuses,
        holder searches) are split off by the ledger; the rest is the step's sampling or watch cost.
        ``typical=False`` (a step that found something) keeps the step out of the costs that choose
        the intervals."""
        self.own_s += seconds
        _, _, rest = self._split(seconds)
        self.parts["sample" if sampled else "watch"] += rest
        if typical:
            (self._sample_costs if sampled else self._watch_costs).append(rest)

    def charge_read(self, seconds: float) -> None:
        """One memory read of the watch on an unsampled step."""
        self.own_s += seconds
        self.parts["read"] += seconds
        self._read_costs.append(seconds)

    def note_read_cost(self, seconds: float) -> None:
        """A sampled step's baseline reads the heap at about this cost (charged with the step): at a
        small logging interval every step is sampled and no watched step times a read for :meth:`choose`."""
        self._read_costs.append(seconds)

    def charge_other(self, seconds: float, part: str = "gc") -> None:
        """Own time outside the timed part of a step: the garbage-collection callback's reads
        (``"gc"``), a lingering check deferred into the step (``"lingering"``: plain loops under
        ``track()``), the leak watch's work when the run ends (``"findings"``). The last two are split
        by the ledger (their holder searches and censuses are finding work)."""
        self.own_s += seconds
        if part == "gc":
            self.parts[part] += seconds  # no split: a collection may run in the middle of a step
            return
        _, _, rest = self._split(seconds)
        self.parts[part] += rest
        if part == "findings":
            self.finding_s += rest

    def choose(self) -> None:
        """Pick the read and sample intervals that keep the monitor within the budget.

        After the first :data:`QUIET_FROM` steps the monitor spends time only on the steps that read
        memory (the read plus the watch around it), on sampled steps and on logged steps (always
        sampled); the other steps are quiet. The reads may take :data:`READ_SHARE` of the budget,
        the logged steps take what they cost, and sampling gets what is left."""
        step = median(self._step_times)
        if not step > 0:
            return
        self.ledger.step_s = step
        if self._started is not None:
            self.guard.check(self)
        allowed = self.budget * step
        costs = self.ledger.check_costs
        if costs:
            # a lingering check every mark_every sampled steps: its mean cost (a check is costly at every
            # check, or only at some: the mean, not the median) within its share of the budget
            check = COLD_FACTOR * sum(costs) / len(costs)
            steps = check / (allowed * LINGERING_SHARE)
            every = max(MARK_EVERY_SAMPLES, math.ceil(steps / max(1, self.sample_every)))
            self.mark_every = min(MAX_INTERVAL, every * self.guard.backoff["lingering"])
            allowed -= check / (self.mark_every * max(1, self.sample_every))
        watch = median(self._watch_costs) if self._watch_costs else 0.0
        if self._read_costs:
            read = COLD_FACTOR * (median(self._read_costs) + watch)
            every = max(1, min(MAX_READ_INTERVAL, math.ceil(read / (allowed * READ_SHARE))))
            every = min(MAX_INTERVAL, every * self.guard.backoff["read"])
            if self.logs:
                # logged steps are sampled, and a sampled step's baseline is a read: reads in phase
                # with them, at an interval that divides the logging interval, cost nothing on them
                every = aligned_reads(every, self.log_every)
                allowed -= read * (1 / every - 1 / self.log_every) if every <= self.log_every else read / every
            else:
                allowed -= read / every
            self.read_every = every
        if self.explicit or not self._sample_costs:
            return
        sample = COLD_FACTOR * median(self._sample_costs)
        if self.logs:
            allowed -= sample / self.log_every
        every = max(1, min(MAX_INTERVAL, MAX_INTERVAL if allowed <= 0 else math.ceil(sample / allowed)))
        every = min(MAX_INTERVAL, every * self.guard.backoff["sample"])
        if self.logs:
            # a sample a few steps from a logged one adds a busy step and little history: the budget
            # is a ceiling, and its samples go in phase with the logged steps (as the reads do)
            every = aligned_samples(every, self.log_every)
        self.sample_every = every

    # ------------------------------------------------------------------ what it says about itself
    @property
    def overhead(self) -> float:
        """The monitor's measured own time as a fraction of the step time (NaN before two steps)."""
        return self.own_s / self.step_s if self.step_s > 0 else math.nan

    @property
    def overhead_after_start(self) -> float:
        """Own time over step time after the first :data:`QUIET_FROM` steps (which watch every step
        whatever it costs), finding work excepted: what the budget's intervals and guard hold (NaN
        before then)."""
        if self._started is None:
            return math.nan
        own0, step0, _ = self._started
        step = self.step_s - step0
        return (self.own_s - self.finding_s - own0) / step if step > 0 else math.nan

    def summary(self) -> dict[str, Any]:
        step = median(self._step_times)
        after = self.overhead_after_start

        def us(values: Any) -> float | None:
            return round(median(values) * 1e6, 2) if values else None

        return {
            "overhead_budget": self.budget,
            "overhead": None if math.isnan(self.overhead) else round(self.overhead, 5),
            "overhead_after_start": None if math.isnan(after) else round(after, 5),
            # the hooks' part of overhead_after_start (a floor no interval lowers: docs/findings.md)
            "hooks_after_start": None if math.isnan(after) else round((self.parts["hooks"] - self._started[2]) / (self.step_s - self._started[1]), 5),
            "finding_time_s": round(self.finding_s, 4),
            "read_every_n_steps": self.read_every,
            "dense_read_steps": DENSE_READ_STEPS,
            "read_bursts": self.bursts,
            "rss_trips": self.trips,
            "rss_checks": self.trip_checks,
            "rss_tripwire": self.tripwire,
            "sample_every_n_steps": self.sample_every,
            "sample_interval_source": "config" if self.explicit else "overhead_budget",
            "log_every_n_steps": self.log_every if self.logs else None,
            "step_time_median_s": None if math.isnan(step) else step,
            "watch_cost_median_us": us(self._watch_costs),
            "read_cost_median_us": us(self._read_costs),
            "sample_cost_median_us": us(self._sample_costs),
            "lingering_every_n_samples": self.mark_every,
            "lingering_checks": self.ledger.checks,
            "lingering_heap_scans": self.ledger.heap_scans,
            "own_time_s": round(self.own_s, 4),
            "own_time_by_part_s": {k: round(v, 4) for k, v in self.parts.items()},
            "backoffs": list(self.guard.backoffs),
            "over_budget_windows": self.guard.over_budget_windows,
        }
