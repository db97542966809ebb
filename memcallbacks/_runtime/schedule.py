"""The step schedule: what each step is (quiet, watched, sampled, logged) and the monitor's own time.

One :class:`Schedule` per session decides, from step counts only so that every rank agrees, the
:class:`StepKind` of each step (:meth:`Schedule.step_kind`, once per step). It chooses the read and
sampling intervals that keep the monitor's own time within ``overhead_budget``, and it holds the
one record of that own time: every part of the monitor books its seconds here (docs/benchmarks.md
has the measurements behind the constants).
"""

from __future__ import annotations

import collections
import enum
import math
import os
import time
from statistics import median_high
from typing import Any, Callable

from memcallbacks._base.config import MonitorConfig
from memcallbacks._base.cpu import (
    CLOCK_READS, IMPORTS, BudgetGuard, Tripwire, heap_in_use_bytes, own_time, rss_tripwire, unwatch_collections, watch_collections,
)
from memcallbacks._base.devices import watch_reader
from memcallbacks._base.hidden_costs import HookMeter, unwatch_imports, watch_imports
from memcallbacks._files.journal import TICK_BYTES, TICK_MASK, Journal

__all__ = [
    "StepKind", "Schedule", "HookMeter", "aligned_reads", "aligned_samples", "median", "LINGERING_EVERY_STEP_UNTIL", "MARK_EVERY_SAMPLES",
    "MEASURE_STEPS", "DENSE_READ_STEPS", "DENSE_READ_MAX", "CONFIRM_STEPS", "TRIP_EVERY", "TRIP_MASK", "QUIET_FROM", "CHOOSE_EVERY",
    "MAX_INTERVAL", "MAX_READ_INTERVAL", "READ_SHARE", "COLD_FACTOR", "CHEAP_HEAP_S", "LINGERING_SHARE", "PARTS", "APART", "MAX_DIAGNOSES"]

# Lingering references are checked after every one of the first steps, then after every
# MARK_EVERY_SAMPLES-th sampled step (a loop that keeps its previous batch keeps it at every step).
LINGERING_EVERY_STEP_UNTIL = 10
MARK_EVERY_SAMPLES = 4
# Steps sampled at the start, before the budget has measurements to choose from.
MEASURE_STEPS = 4
# The watch reads memory at every one of a run's first steps, whatever it costs: a leak in the training code
# leaks from step 0, and growth confirms 4 and 1 MiB/step within these (at step 9) and 256 KiB/step at step 27; a floor
# risen in their second half (a slower leak, not confirmed yet), or the host's Python objects risen so (a Python-object
# leak, not in the heap), keeps the reads dense up to DENSE_READ_MAX. (32 before: each of these steps costs a CPU run
# 200-300 µs of cold caches, and the README example's first steps broke its budget. 16 kept it with a margin, but a
# Python-object leak of 28 KiB/step on 1 ms Lightning steps was then found later or not within its 300-step target.)
DENSE_READ_STEPS = 24
DENSE_READ_MAX = 48
# A read that finds the floor risen makes the watch read every step for this many steps.
CONFIRM_STEPS = 24
# The RSS tripwire is checked on the quiet steps whose count is a multiple of this (a power of two).
TRIP_EVERY = 4
TRIP_MASK = TRIP_EVERY - 1
# Steps before this count are never quiet: they are measured, read and checked.
QUIET_FROM = max(LINGERING_EVERY_STEP_UNTIL, DENSE_READ_STEPS, MEASURE_STEPS)
# The intervals are chosen again every this many steps, from the latest measurements.
CHOOSE_EVERY = 16
MAX_INTERVAL = 1024
# At most this many steps between two reads, whatever a read costs.
MAX_READ_INTERVAL = 32
# The share of the budget that the reads may take; the logged steps and sampling get the rest.
READ_SHARE = 0.5
# A step the monitor works in slows the training step by about twice the monitor's measured time
# (cold caches): the budget counts twice what it measures.
COLD_FACTOR = 2.0
# A sampled step's ``allocated`` read costing at most this is taken at every sampled step.
CHEAP_HEAP_S = 5e-6
# The share of the budget the lingering check may take.
LINGERING_SHARE = 0.25
# what each part of the monitor's own time is called in report.json (summary.cadence.own_time_by_part_s)
PARTS = ("read", "sample", "watch", "lingering", "tripwire", "journal", "gc", "findings", "hooks", "imports", "dispatch", "end")
# the parts reported apart from the share of step time: the one-off diagnoses (censuses and holder
# searches for findings) and the end of the run (its report, its files)
APART = ("findings", "end")
# The one-off diagnoses kept in report.json, each with its step and time (later ones add to the last).
MAX_DIAGNOSES = 32
# Finding work under this at a step of its own is no diagnosis of its own: it joins the last one listed (a growth
# finding's update at each step while it is open), or waits for the next (a clean run's end: no entry of 0.00 s).
MIN_DIAGNOSIS_S = 1e-3


_wall = time.perf_counter  # the quiet steps' clock: no system call


class StepKind(enum.Enum):
    """What a step is, decided once when it begins (:meth:`Schedule.step_kind`)."""

    QUIET = "quiet"  # only counted: no hook does anything
    WATCHED = "watched"  # the leak watch: the lingering check, a memory read on some steps
    SAMPLED = "sampled"  # per-phase peaks and a history row
    LOGGED = "logged"  # sampled, and its keys go to the loggers


def aligned_reads(every: int, log_every: int) -> int:
    """The read interval that puts reads on logged steps: the smallest divisor of ``log_every`` at or
    above ``every``, or the largest multiple of ``log_every`` at or below a longer ``every``. Not
    aligned past ``2 * MAX_READ_INTERVAL``."""
    if log_every > 2 * MAX_READ_INTERVAL:
        return every
    return every // log_every * log_every if every >= log_every else _divisor_from(every, log_every)


def _divisor_from(every: int, log_every: int) -> int:
    """The smallest divisor of ``log_every`` at or above ``every`` (at most ``log_every`` itself)."""
    divisor = every
    while log_every % divisor:  # a loop, not a generator: no extra frame when the intervals are chosen
        divisor += 1
    return divisor


def aligned_samples(every: int, log_every: int) -> int:
    """The sampling interval at or above ``every`` that puts samples on logged steps (a multiple or a
    divisor of ``log_every``), unless that leaves no sample between logged steps where the budget
    allows two or more (a prime logging interval: the budget's own interval, out of phase)."""
    if every >= log_every:
        return -(-every // log_every) * log_every
    divisor = _divisor_from(every, log_every)
    return every if divisor == log_every and 2 * every <= log_every else divisor


def _ceil(x: float) -> int:
    """``math.ceil``, blind to a last-digit rounding of the measurements (300.0000000001 is 300)."""
    return math.ceil(x * (1 - 1e-9))


def median(values: Any) -> float:
    """The upper of the two middle values (NaN for none)."""
    return float(median_high(values)) if values else math.nan


class Schedule:
    """What each step is, the intervals the budget allows, and the monitor's own time.

    Own time, one record: :attr:`own_s` (every second the monitor spent), :attr:`parts` (the same
    seconds by part), :attr:`timed_s` (the wall time of the :attr:`steps` steps timed start to
    start), :attr:`step_s` (the step time the intervals are chosen from). The leak
    watch books its lingering checks and finding work (:meth:`book_lingering`, :meth:`book_finding`)
    and the step's charge is split by them. The object lives as long as its session."""

    def __init__(self, config: MonitorConfig) -> None:
        self.config = config
        self.budget = config.overhead_budget
        self.read: Callable[[], int | None] | None = None  # the watch's memory read (None: no backend)
        self.trip: Tripwire | None = None
        self.backend: Any = None  # whose heap_cost_s prices a sampled step's allocated read (heap_due)
        self.clock: Callable[[], float] = time.perf_counter  # the step clock (a test may drive its own)
        self.watching = False  # own time leaves Python's automatic collections out (the CPU clock in _base/cpu.py)
        self.meters: list[HookMeter] = []  # the adapter's hook meters: their calls are the dispatch estimate's
        self.journal = Journal()  # the session's (its start opens it): step_kind writes its ticks
        self.new_run()

    def new_run(self) -> None:
        """Forget every measurement and interval: a new run."""
        config = self.config
        self.explicit = config.sample_every_n_steps is not None
        self.sample_every = config.sample_every_n_steps or 1
        self.read_every = 1
        self.log_every = 50
        self.logs = True  # False: the run has nowhere to log, so no step is a logged step
        self.shares = False  # a distributed run: every log_every-th step, the ranks' findings reach rank zero
        self.log_first_step = False
        self.quiet_until = 0  # steps whose count is below it are quiet (planned at each busy step's end)
        self.sample_next = False  # the next step is sampled whatever the intervals (the theory check)
        self.trip_at: float = math.inf  # a quiet step whose resident set is at or above this reads memory
        self.step_read_s = 0.0  # the open step's read, charged apart from the every-step cost
        self.heap_at = -1  # the count of the last step that read the heap
        self.last_read: tuple[int, int] | None = None  # (count, bytes): the watch's latest read, at that step's start
        self._trip_peak = 0  # the last sampled step's peak, where the high-water-mark tripwire's threshold starts
        self.heap_rss = math.inf  # the resident set at the last sampled step that read it (heap_skipped)
        self._anchor: tuple[int, float] | None = None  # (count, time) of the last step start timed
        self._paused_at, self._pauses = None, []  # an open pause's start; (start, end) of those since the anchor
        self._next_choice = MEASURE_STEPS
        self.dense_until = 0  # reads every step below this count (a burst after a suspicious read)
        self._window_min = math.inf  # the lowest read in the second half of the dense reads
        self.bursts = self.trips = 0  # read bursts; reads the RSS tripwire asked for between the scheduled ones
        self.trip_checks = 0  # quiet steps that checked the tripwire
        self._trip_s = self._tick_s = 0.0  # the tripwire's checks and the journal's ticks (wall clock), booked by _fold
        self.tripwire: str | None = self.trip.source if self.trip is not None else None
        self._forced = -1  # the count whose step reads because the tripwire asked
        self._burst_bytes = config.growth_min_total_bytes
        self.trip_bytes = self._burst_bytes // 4
        """The heap's rise that a read the tripwire asked for needs to start a burst: a quarter of a burst's."""
        self.trip_rise = self.trip_bytes  # the RSS rise that sets the tripwire off (after_read widens it)
        self._recent_reads: collections.deque[int] = collections.deque(maxlen=4)
        self._step_times: collections.deque[float] = collections.deque(maxlen=64)
        self._watch_costs: collections.deque[float] = collections.deque(maxlen=64)
        self._read_costs: collections.deque[float] = collections.deque(maxlen=32)
        self._sample_costs: collections.deque[float] = collections.deque(maxlen=32)
        self._log_costs: collections.deque[float] = collections.deque(maxlen=16)  # a logged step's keys and writes
        self._check_costs: collections.deque[float] = collections.deque(maxlen=16)  # the lingering checks'
        self.own_s, self.parts = 0.0, dict.fromkeys(PARTS, 0.0)
        self.count_now = 0  # the count of the last step whose start was timed (the step a diagnosis is booked at)
        self.diagnoses: list[dict[str, Any]] = []  # one-off finding work: {"step", "seconds"}, apart from the share
        self._undiagnosed_s = 0.0  # finding work under MIN_DIAGNOSIS_S with no diagnosis to join yet
        self._imports_at: tuple[float, int] | None = None  # import_seconds() when the run's first step began
        self.imports = [0, 0]  # modules the monitor's code imported since then: during the steps, at the run's end
        self._calls_at = sum(meter.calls for meter in getattr(self, "meters", ()))  # hook calls already estimated
        self._calls_run0, self._hooks_at = self._calls_at, 0.0  # ... when this run began; the hooks' part estimated
        self._end_at: tuple[float, float] | None = None  # (own_time(), own_s) while the run's end is being timed
        self.timed_s, self.steps = 0.0, 0  # the step clock: seconds and steps timed (stop_clock)
        self.step_s = 0.0  # the lower quartile of the recent step times (0 until measured)
        self.booked_lingering_s = self.booked_finding_s = 0.0  # booked by the leak watch, split off the charges that include it
        self._booked_seen = (0.0, 0.0)  # (lingering, finding) already split off a charge
        self.lingering_checks = 0
        self.heap_scans = 0  # lingering checks that scanned the heap for a graph's root
        self.mark_every = MARK_EVERY_SAMPLES  # sampled steps between two lingering marks
        self.guard = BudgetGuard(self.budget, QUIET_FROM, MAX_INTERVAL)
        self._started: tuple[float, float, float] | None = None  # (own, timed_s, hooks) once the dense reads are done
        self.started_at = DENSE_READ_STEPS  # the count the steady part began at (later when the dense reads went on)

    def __getstate__(self) -> dict[str, Any]:
        state = dict(self.__dict__)
        state["read"] = state["trip"] = state["backend"] = None  # rebuilt by arm() when a run starts
        state["watching"] = False
        state["_end_at"] = None
        return state

    # ------------------------------------------------------------------ set-up
    def configure(self, *, log_every: int, logs: bool, log_first_step: bool, keep: bool = False) -> None:
        """A new run at the run's logging interval, nothing quiet yet. ``keep``: a later stage of the
        same run (fit, then test) keeps the training intervals and measurements."""
        if not keep:
            self.new_run()
        self.log_every = log_every
        self.logs = bool(logs)
        self.log_first_step = bool(log_first_step)
        self.quiet_until = 0

    def arm(self, backend: Any) -> None:
        """The watch's read and the tripwire for ``backend`` (None: neither); each quiet step's tripwire check is
        timed where it runs (:meth:`step_kind`)."""
        if not self.watching:  # a collection Python starts by itself costs the heap, not the monitor
            self.watching = watch_collections() and watch_imports()  # the imports it starts: their own part
        self.read = watch_reader(backend) if backend is not None else None
        self.backend, self.heap_at, self.heap_rss = backend, -1, math.inf
        self.trip = rss_tripwire(self.read, hwm_resets=bool(getattr(backend, "resets_hwm", False)))
        self.tripwire = self.trip.source if self.trip is not None else None
        self.trip_at = math.inf

    def release(self) -> None:
        """The run's end: stop leaving collections out of own time, close the journal (safe to call twice)."""
        self.journal.close()
        if self.watching:
            self.watching = unwatch_collections() or unwatch_imports()

    # ------------------------------------------------------------------ what a step is
    def step_kind(self, count: int) -> StepKind:
        """What the step after ``count`` steps is. A planned quiet step checks the tripwire every
        :data:`TRIP_EVERY`-th step: a tripped one reads memory and ends the quiet stretch. Cannot
        raise (:class:`~memcallbacks._base.cpu.Tripwire` reads 0 when the kernel stops answering)."""
        level = 0
        if count < self.quiet_until:
            if count & TRIP_MASK:
                return StepKind.QUIET
            trip = self.trip
            if trip is not None:  # timed: after a step's compute a check costs 10-15 µs of cold caches, not its warm 1 µs
                t0 = _wall()
                level = trip()
                self._trip_s += _wall() - t0
                CLOCK_READS[0] += 1  # timed here: a hook meter around this call charges its frames only
        journal = self.journal
        if not count & TICK_MASK and journal.fd >= 0:  # the journal's tick, inline: the last step reached (RSS then, if read)
            t0 = _wall()
            tick = (b'{"t":"tick","step":%d,"time":%.3f,"rss":%d}' % (count, time.time(), level) if level
                    else b'{"t":"tick","step":%d,"time":%.3f}' % (count, time.time()))
            try:
                if journal.slot is not None:  # a store into the tick file's map (a write after a step's compute: 20-50 µs)
                    journal.slot[:] = tick.ljust(TICK_BYTES - 1) + b"\n"
                else:
                    journal.bytes += os.write(journal.fd, tick + b"\n")
            except (OSError, ValueError) as exc:
                journal.failed(exc)
            if journal.bytes > journal.cap:  # past its cap: rewritten from the session's state (the journal's callback)
                journal.compact()
            self._tick_s += _wall() - t0
            CLOCK_READS[0] += 1
        if self._paused_at is not None:  # a checkpoint's pause ended by now (the quiet steps since it were short ones)
            self.resume()
        if count < self.quiet_until:
            if self.trip is None or level < self.trip_at:
                return StepKind.QUIET
            self._tripped(count)
            self.quiet_until = 0
        if self.will_log(count):
            return StepKind.LOGGED
        if self.sample_next or (count + 1) % self.sample_every == 0 or (not self.explicit and count < MEASURE_STEPS):
            return StepKind.SAMPLED
        return StepKind.WATCHED

    def will_log(self, count: int) -> bool:
        """Whether the step after ``count`` steps is logged (from counts only: every rank agrees)."""
        if not self.logs:
            return False
        return (count + 1) % self.log_every == 0 or (self.log_first_step and count == 0)

    def share_due(self, count: int) -> bool:
        """Whether the ranks share their findings after step ``count`` (a collective: from counts only)."""
        return self.shares and (count + 1) % self.log_every == 0

    def wants_read(self, count: int) -> bool:
        """Whether the watch reads memory at the start of the step after ``count`` steps."""
        return count < DENSE_READ_STEPS or count < self.dense_until or (count + 1) % self.read_every == 0 or count == self._forced

    def plan_after(self, count: int, *, busy: bool, reads: bool, sample_next: bool = False) -> None:
        """After the step at ``count``: up to which count the steps that follow are quiet. ``busy``:
        something needs the next step; ``reads``: the watch takes scheduled reads; ``sample_next``:
        the next step is sampled (the theory check is due)."""
        nxt = count + 1
        self.quiet_until = nxt
        self.sample_next = sample_next
        if nxt < QUIET_FROM or busy or sample_next or self.config.gc_every_n_steps:
            return
        self.quiet_until = self.next_busy(nxt, reads=reads and self.read is not None)

    def next_busy(self, count: int, reads: bool) -> int:
        """The first count at or after ``count`` whose step is logged, sampled or reads: the steps before it are quiet."""
        if count < self.dense_until:
            return count
        busy = count + (-(count + 1)) % self.sample_every
        if self.logs or self.shares:
            busy = min(busy, count + (-(count + 1)) % self.log_every)
        if reads:
            busy = min(busy, count + (-(count + 1)) % self.read_every)
        return busy

    def wake(self) -> None:
        """Something needs the next step (a large automatic collection to inspect): it is not quiet."""
        self.quiet_until = 0

    # ------------------------------------------------------------------ the watch's read and the tripwire
    def take_read(self, count: int) -> int | None:
        """The watch's memory read, on the steps :meth:`wants_read` names (None otherwise)."""
        if self.read is None or not self.wants_read(count):
            return None
        t0 = own_time()
        value = self.read()
        read_s = own_time() - t0
        if value is not None:
            self.last_read = (count, value)  # an OOM's explanation reads the floor from here (run_end)
        trip = self.trip
        if trip is not None and trip.source == "hwm" and count >= DENSE_READ_STEPS and self.backend.hwm_pinned():
            self.rebase(0, pinned=True)  # a mark pinned since the last sampled step: the tripwire reads statm
        self.step_read_s = own_time() - t0
        self.charge_read(self.step_read_s)
        self.heap_at = count
        if self.read is heap_in_use_bytes and hasattr(self.backend, "observe_heap_cost"):
            self.backend.observe_heap_cost(read_s)  # the same figure as the backend's: one estimate
        return value

    def heap_due(self, count: int, wanted: bool = False) -> bool:
        """Whether the sampled step after ``count`` steps reads ``allocated``: where the read is cheap,
        where the watch's read is due, where ``wanted`` (the theory check), and otherwise when its
        cost spread over the steps since the last heap read fits the budget (docs/benchmarks.md)."""
        cost = self.backend.heap_cost_s if self.backend is not None else 0.0
        if cost <= CHEAP_HEAP_S:
            return True
        if not (wanted or self.wants_read(count)) and cost > (count - self.heap_at) * self.budget * self.step_s:
            return False
        self.heap_at = count
        self._read_costs.append(cost)  # what choose() spaces the watch's reads by
        return True

    def heap_skipped(self, count: int, rss: float) -> bool:
        """A sampled step left the heap unread: True when its resident set ``rss`` stands the
        tripwire's rise above that of the last sampled step that read it; the step then takes the
        watch's read after all, as a tripped quiet step does (every step sampled: no quiet steps)."""
        if not rss - self.heap_rss >= self.trip_rise:
            return False
        self._tripped(count)
        self.heap_rss = rss
        return True

    def _tripped(self, count: int) -> None:
        """The RSS tripwire went off before the step after ``count`` steps: that step reads memory."""
        self._forced = count
        self.trips += 1

    def after_read(self, count: int, allocated: int) -> None:
        """A read was taken: the tripwire measures the rise from here, and a floor risen by the growth
        test's minimum since the last few scheduled reads (a quarter of it on a read the tripwire
        asked for) starts a burst of reads at every step. The dense reads' last one extends them to
        :data:`DENSE_READ_MAX` when the floor rose by the tripwire's rise over their second half."""
        if self.trip is not None:  # a high-water mark reset at this read (the pin check) starts from the last sampled peak
            self.trip_at = max(self.trip(), self._trip_peak if self.trip.source == "hwm" else 0) + self.trip_rise
        if count < DENSE_READ_STEPS:
            self._window_min = min(self._window_min, allocated) if count >= DENSE_READ_STEPS // 2 else math.inf
            if count == DENSE_READ_STEPS - 1:
                self.extend_dense(allocated - self._window_min)
            return
        if count < self.dense_until:
            return
        recent = self._recent_reads
        need = self.trip_bytes if count == self._forced else self._burst_bytes
        if recent and allocated - min(recent) >= need:
            self.dense_until = count + 1 + CONFIRM_STEPS
            self.bursts += 1
            self._burst_bytes *= 2  # a clean run's one-off rises cannot keep it busy
            self.trip_bytes = self.trip_rise = self._burst_bytes // 4
            recent.clear()
            return
        # a read the tripwire asked for found the heap floor unchanged: the resident set rose without it (a clean run's
        # creeping as glibc's heap warms up asked for 10-17 reads in 150 steps, a user check): twice the rise from here
        if count == self._forced and self.trip_rise < self._burst_bytes:
            self.trip_at += self.trip_rise
            self.trip_rise *= 2
        recent.append(allocated)

    def extend_dense(self, rise: int) -> None:
        """At the dense reads' last step: a series (the heap floor, :meth:`after_read`; the host's Python
        objects) rose by ``rise`` bytes over their second half; by the tripwire's rise or more, the reads
        stay dense to :data:`DENSE_READ_MAX`."""
        if rise >= self.trip_bytes:
            self.dense_until = max(self.dense_until, DENSE_READ_MAX)

    def rebase(self, peak: int, pinned: bool) -> bool:
        """After a sampled step, whose phase boundaries reset the high-water mark the tripwire reads:
        it goes off at this step's ``peak`` plus the threshold. A mark ``pinned`` above the resident
        set (inherited through ``exec``) switches the tripwire to ``statm``; returns True then."""
        if self.trip is None or self.trip.source != "hwm":
            return False
        if pinned:
            self.trip = rss_tripwire(self.read)
            self.tripwire = self.trip.source if self.trip is not None else None
            self.trip_at = (self.trip() if self.trip is not None else 0) + self.trip_rise
            return True
        now = self.trip()
        self._trip_peak = peak
        self.trip_at = (max(now, peak) if peak > 0 else now) + self.trip_rise
        return False

    # ------------------------------------------------------------------ the step clock
    def step_started(self, count: int) -> None:
        """Time the steps since the last timed start (quiet ones give their mean), and choose the
        intervals again every :data:`CHOOSE_EVERY` steps."""
        now = self.clock()
        if self._paused_at is not None:  # a pause whose end was not said (a checkpoint) ends here at the latest
            self.resume()
        anchor = self._anchor
        if anchor is not None and self.trip is not None and count > anchor[0] + 1:  # the quiet steps between that checked the tripwire
            self.trip_checks += (count - 1) // TRIP_EVERY - anchor[0] // TRIP_EVERY
        self.stop_clock(count, now)
        self._anchor = (count, now)
        self.count_now = count
        if self._imports_at is None:  # the run's first step: what was imported before is the monitor's build
            self._imports_at = (IMPORTS[0], IMPORTS[1])
        # the steady part begins after the first steps' dense reads, and after their extension on a risen floor
        # (a suspicion read every step by design: not what the budget's guard is to thin)
        if self._started is None and self.steps >= QUIET_FROM and count >= self.dense_until:
            own = self.own_s - self.parts["findings"]  # finding work excepted (finding_s)
            self._started = (own, self.timed_s, self.parts["hooks"])
            self.started_at = count
            self.guard.window = (self.steps, own, self.timed_s, dict(self.parts))
        if count >= self._next_choice:
            self._next_choice = count + CHOOSE_EVERY
            self.choose()

    def pause(self, at: float | None = None) -> None:
        """Evaluation or a checkpoint between steps, from ``at`` (default: now), to :meth:`resume` (an evaluation's
        end) or the next step begun or checking the tripwire: cut out of the stretch of steps around it, still timed."""
        if self._paused_at is None:
            self._paused_at = self.clock() if at is None else at

    def resume(self) -> None:
        """The pause ended (an evaluation's end, or the first step after it that the schedule sees)."""
        if self._paused_at is not None:
            self._pauses.append((self._paused_at, max(self._paused_at, self.clock())))
            self._paused_at = None

    def stop_clock(self, count: int | None, at: float | None = None) -> None:
        """The steps since the last timed start, ``count`` those done in all, timed to ``at`` (the last one's end;
        default: a pause said before, or now) less the pauses before it: at each start, and at the run's end."""
        anchor, end = self._anchor, self._paused_at if self._paused_at is not None else (self.clock() if at is None else at)
        if anchor is not None and count is not None and count > anchor[0] and end > anchor[1]:
            elapsed = end - anchor[1]
            for start, stop in self._pauses:  # those before the end (a loop: no frame at every start)
                elapsed -= max(0.0, min(stop, end) - start)
            self._step_times.append(elapsed / (count - anchor[0]))
            self.timed_s += elapsed
            self.steps += count - anchor[0]
        self._anchor, self._paused_at = None, None
        self._pauses.clear()

    # ------------------------------------------------------------------ own time
    def book_lingering(self, seconds: float) -> None:
        """One lingering check that found something alive, its holder searches excepted."""
        self.booked_lingering_s += seconds
        self.lingering_checks += 1
        self._check_costs.append(seconds)

    def book_finding(self, seconds: float) -> None:
        """A census or a holder search for a finding (split off the charge that includes it)."""
        self.booked_finding_s += seconds

    def affords(self, seconds: float, steps: int) -> bool:
        """Whether ``seconds`` spread over ``steps`` steps fits the lingering check's share of the budget."""
        return self.step_s > 0 and seconds <= steps * self.step_s * self.budget * LINGERING_SHARE

    @property
    def finding_s(self) -> float:
        """Censuses and holder searches: part of :attr:`own_s`, left out of the budget's guard."""
        return self.parts["findings"]

    def _split(self, seconds: float) -> float:
        """Book the lingering checks and finding work inside ``seconds`` of own time; the rest."""
        seen_l, seen_f = self._booked_seen
        # what is booked beyond ``seconds`` was spent in a step charged later: it stays pending
        lingering = min(max(0.0, self.booked_lingering_s - seen_l), seconds)
        finding = min(max(0.0, self.booked_finding_s - seen_f), seconds - lingering)
        self._booked_seen = (seen_l + lingering, seen_f + finding)
        self.parts["lingering"] += lingering
        if finding > 0:
            self.parts["findings"] += finding
            self._diagnosed(finding)
        return seconds - lingering - finding

    def _diagnosed(self, seconds: float) -> None:
        """One-off finding work at the current step: a diagnosis of its own in report.json."""
        entries = self.diagnoses
        small = seconds + self._undiagnosed_s < MIN_DIAGNOSIS_S
        if entries and (small or entries[-1]["step"] == self.count_now or len(entries) >= MAX_DIAGNOSES):
            entries[-1]["seconds"] += seconds
        elif small:
            self._undiagnosed_s += seconds
        else:
            entries.append({"step": self.count_now, "seconds": seconds + self._undiagnosed_s})
            self._undiagnosed_s = 0.0

    def charge(self, seconds: float, sampled: bool, typical: bool = True, logging: bool = False) -> None:
        """One step's own time, its watch read excepted. ``typical=False`` (the step found
        something) keeps the step out of the costs that choose the intervals; ``logging``: a logged
        step's keys and loggers' writes, a cost of its own there."""
        self.own_s += seconds
        rest = self._split(seconds)
        self.parts["sample" if sampled else "watch"] += rest
        if logging:
            self._log_costs.append(rest)
        elif typical:
            (self._sample_costs if sampled else self._watch_costs).append(rest)

    def charge_read(self, seconds: float) -> None:
        """One memory read of the watch, booked apart from its step's charge (its cost spaces the reads)."""
        self.own_s += seconds
        self.parts["read"] += seconds
        self._read_costs.append(seconds)

    def charge_other(self, seconds: float, part: str = "gc") -> None:
        """Own time outside a step's timed parts: the gc callback's reads (``"gc"``), a deferred
        lingering check (``"lingering"``), the leak watch's work at the run's end (``"findings"``)."""
        self.own_s += seconds
        if part == "gc":
            self.parts[part] += seconds  # no split: a collection may run in the middle of a step
            return
        rest = self._split(seconds)  # first: _split adds to parts["findings"], which part may be
        self.parts[part] += rest
        if part == "findings" and rest > 0:
            self._diagnosed(rest)

    def charge_hooks(self, seconds: float) -> None:
        """A hook call's time its inner timers did not see (:class:`HookMeter`)."""
        self.own_s += seconds
        self.parts["hooks"] += seconds

    def _fold(self) -> None:
        """Book what no timer sees: the imports the monitor's code started (left out of every other part), and
        the dispatch estimate (docs/findings.md: each gate call at the cost measured once, and the hooks' time again)."""
        trip_s, tick_s = self._trip_s, self._tick_s  # the quiet steps' tripwire checks and the journal's ticks
        if trip_s or tick_s:
            self._trip_s = self._tick_s = 0.0
            self.own_s += trip_s + tick_s
            self.parts["tripwire"] += trip_s
            self.parts["journal"] += tick_s
        seconds, count = IMPORTS
        if self._imports_at is None:  # no step yet
            self._imports_at = (seconds, count)
        elif seconds > self._imports_at[0]:
            new = seconds - self._imports_at[0]
            ending = self._end_at is not None
            self.imports[ending] += count - self._imports_at[1]
            self._imports_at = (seconds, count)
            self.own_s += new
            self.parts["end" if ending else "imports"] += new
        meters = self.meters
        calls = sum(meter.calls for meter in meters) if meters else 0  # at the choice of intervals only: not every step
        if calls > self._calls_at or self.parts["hooks"] > self._hooks_at:
            new = (calls - self._calls_at) * meters[0].call_cost_s * COLD_FACTOR if meters else 0.0
            new += (COLD_FACTOR - 1) * (self.parts["hooks"] - self._hooks_at)
            self._calls_at, self._hooks_at = calls, self.parts["hooks"]
            self.own_s += new
            self.parts["dispatch"] += new

    # ------------------------------------------------------------------ the run's end
    def end_started(self) -> None:
        """The run's end begins (``Session.finish``): its time is the ``end`` part, apart from the share."""
        self._fold()
        self._end_at = (own_time(), self.own_s)

    def end_finished(self, done: bool = False) -> None:
        """Book the run's end so far (at every summary while it runs: report.json has it up to the report);
        ``done``: the end is over, its clock stopped."""
        at = self._end_at
        if at is None:
            return
        now = own_time()
        seconds = max(0.0, now - at[0] - (self.own_s - at[1]))  # the censuses inside are booked as findings
        self.own_s += seconds
        self.parts["end"] += seconds
        self._fold()
        self._end_at = None if done else (now, self.own_s)

    # ------------------------------------------------------------------ the intervals
    def choose(self) -> None:
        """Pick the read and sample intervals that keep the monitor within the budget: the reads may
        take :data:`READ_SHARE` of it, the logged steps what they cost, sampling what is left, less what the
        steps so far took past the budget."""
        # the lower quartile of the step times: noise only makes steps slower, and the steps a busy
        # machine slowed do not buy more reads
        self._fold()  # imports and the dispatch estimate: in the guard's windows too
        times = sorted(self._step_times)
        step = times[(len(times) - 1) // 4] if times else math.nan
        if not step > 0:
            return
        self.step_s = step
        if self._started is not None:
            self.guard.check(self)
        # first what no interval lowers: hooks, dispatch, tripwire, journal ticks, gc, imports a step, the logged steps' keys and writes
        parts = self.parts
        floor = (parts["hooks"] + parts["dispatch"] + parts["tripwire"] + parts["journal"] + parts["gc"] + parts["imports"]) / max(1, self.steps)
        if self.logs and self._log_costs:
            floor += COLD_FACTOR * median(self._log_costs) / self.log_every
        least = 1e-3 * self.budget * step  # what is left when the floor takes the budget: the rest as rare as can be
        allowed = max(self.budget * step - floor, least)
        costs = self._check_costs
        if costs:  # a lingering check every mark_every sampled steps, at its mean cost, within its share
            check = COLD_FACTOR * sum(costs) / len(costs)
            every = max(MARK_EVERY_SAMPLES, _ceil(check / (allowed * LINGERING_SHARE) / max(1, self.sample_every)))
            self.mark_every = min(MAX_INTERVAL, every * self.guard.backoff["lingering"])
            allowed = max(allowed - check / (self.mark_every * max(1, self.sample_every)), least)
        watches, reads, samples = self._watch_costs, self._read_costs, self._sample_costs
        watch = median(watches) if watches else 0.0
        if reads:
            read = COLD_FACTOR * (median(reads) + watch)
            every = max(1, min(MAX_READ_INTERVAL, _ceil(read / (allowed * READ_SHARE))))
            every = min(MAX_INTERVAL, every * self.guard.backoff["read"])
            if self.logs:  # reads in phase with the logged steps, whose baseline is a read
                every = aligned_reads(every, self.log_every)
                allowed -= read * (1 / every - 1 / self.log_every) if every <= self.log_every else read / every
            else:
                allowed -= read / every
            self.read_every = every
        if self.explicit or not samples:
            return
        sample = COLD_FACTOR * median(samples)
        if self.logs:
            allowed -= sample / self.log_every
        # what the steps so far took past the budget (the first steps' dense reads, most often) is paid back from
        # sampling over the next choice's steps: the share the report gives is the run's, not the next steps'
        allowed -= max(0.0, self.steady_s - self.budget * self.timed_s) / CHOOSE_EVERY
        every = max(1, min(MAX_INTERVAL, MAX_INTERVAL if allowed <= 0 else _ceil(sample / allowed)))
        every = min(MAX_INTERVAL, every * self.guard.backoff["sample"])
        if self.logs:  # samples in phase with the logged steps, as the reads
            every = aligned_samples(every, self.log_every)
        self.sample_every = every

    # ------------------------------------------------------------------ what it says about itself
    @property
    def step_time_median_s(self) -> float:
        """The median of the recent step times (NaN before two timed steps): what "in about T" counts in."""
        return median(self._step_times)

    @property
    def steady_s(self) -> float:
        """Own time during the steps: every part but the one-off diagnoses and the run's end (:data:`APART`)."""
        parts = self.parts
        return self.own_s - parts["findings"] - parts["end"]

    @property
    def overhead(self) -> float:
        """The monitor's own time during the steps (:attr:`steady_s`) as a fraction of the step time
        the pauses leave (NaN before two steps)."""
        return self.steady_s / self.timed_s if self.timed_s > 0 else math.nan

    @property
    def overhead_after_start(self) -> float:
        """Own time over step time after the first :data:`QUIET_FROM` steps (after :attr:`started_at`, where
        the dense reads went on), finding work excepted: what the budget's intervals and guard hold (NaN before then)."""
        if self._started is None:
            return math.nan
        own0, step0, _ = self._started
        step = self.timed_s - step0
        return (self.own_s - self.finding_s - self.parts["end"] - own0) / step if step > 0 else math.nan

    def summary(self) -> dict[str, Any]:
        """What report.json says of the cadence and the own time (``summary.cadence``): the run's end so far included."""
        from memcallbacks._runtime.readout import cadence_summary  # loaded with the engine (sampling.py)
        self.end_finished()  # the run's end so far (a summary while it runs: report.json's)
        self._fold()
        return cadence_summary(self, step_times=self._step_times, costs=(self._watch_costs, self._read_costs, self._sample_costs),
                               started=self._started,
                               hooked_calls=self._calls_at - self._calls_run0 if self.meters else None,
                               constants={"dense_read_steps": self.started_at, "apart": APART, "cold_factor": COLD_FACTOR})
