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
import logging
import math
import time
from statistics import median_high
from typing import Any, Callable

from memcallbacks._base.config import MonitorConfig
from memcallbacks._base.cpu import Tripwire, heap_in_use_bytes, own_time, rss_tripwire, unwatch_collections, watch_collections

__all__ = [
    "StepKind", "Schedule", "BudgetGuard", "HookMeter", "watch_reader", "aligned_reads",
    "aligned_samples", "median", "LINGERING_EVERY_STEP_UNTIL", "MARK_EVERY_SAMPLES", "MEASURE_STEPS", "DENSE_READ_STEPS",
    "CONFIRM_STEPS", "TRIP_EVERY", "TRIP_MASK", "QUIET_FROM", "CHOOSE_EVERY", "MAX_INTERVAL", "MAX_READ_INTERVAL",
    "READ_SHARE", "COLD_FACTOR", "CHEAP_HEAP_S", "LINGERING_SHARE", "CONTROL_STEPS", "CONTROL_S", "MAX_BACKOFF", "PARTS",
]

# Lingering references are checked after every one of the first steps, then after every
# MARK_EVERY_SAMPLES-th sampled step (a loop that keeps its previous batch keeps it at every step).
LINGERING_EVERY_STEP_UNTIL = 20
MARK_EVERY_SAMPLES = 4
# Steps sampled at the start, before the budget has measurements to choose from.
MEASURE_STEPS = 8
# The watch reads memory at every one of a run's first steps, whatever it costs: a leak in the
# training code leaks from step 0, and growth detection needs about this many steps to confirm one.
DENSE_READ_STEPS = 48
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
# The budget's guard: own time over windows of at least this many steps after the first QUIET_FROM.
CONTROL_STEPS = 32
# ... and of at least this much step time: over a few tens of milliseconds (32 steps of 1.6 ms), one
# read's cost or one time slice on a busy machine decides the rate, and a back-off is never undone.
CONTROL_S = 0.25
MAX_BACKOFF = 1024
# what each part of the monitor's own time is called in report.json (summary.cadence.own_time_by_part_s)
PARTS = ("read", "sample", "watch", "lingering", "tripwire", "gc", "findings", "hooks")
# the parts whose interval the guard widens, as its log line names them
PART_NAMES = {"lingering": "the lingering check", "read": "the memory reads", "sample": "sampled steps"}


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


def watch_reader(backend: Any) -> Callable[[], int | None]:
    """The read that sees a tensor leak step over step: glibc's in-use heap on CPU (it sees a leak
    that refills freed heap, which RSS does not), the caching allocator's counter elsewhere."""
    if backend.kind == "cpu":
        return heap_in_use_bytes if heap_in_use_bytes() is not None else (lambda: backend.current()[0])
    return lambda: backend.current()[0]


class HookMeter:
    """Times a hook call whole and books what the step's own timers inside it did not see as the
    ``hooks`` part: the call's frames, the guard and the cold caches they run in. Right over the
    run, not call by call: a step timed in one call and charged in a later one makes the later
    call's difference negative by what the earlier one counted twice."""

    __slots__ = ("schedule",)

    def __init__(self, schedule: Schedule) -> None:
        self.schedule = schedule

    def call(self, fn: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        schedule = self.schedule
        before = schedule.own_s
        t0 = own_time()
        try:
            return fn(*args, **kwargs)
        finally:
            schedule.charge_hooks(own_time() - t0 - (schedule.own_s - before))


class BudgetGuard:
    """Over windows of at least :data:`CONTROL_STEPS` steps and :data:`CONTROL_S` seconds of step time
    after the first ``QUIET_FROM``, the own
    time measured (finding work excepted) against the budget; over it, the costliest part that has
    an interval (the lingering check, sampling, the reads) backs off: its interval doubles. Said
    once in the log; every back-off is in report.json. Picklable."""

    def __init__(self, budget: float, first: int, max_interval: int) -> None:
        self.budget = budget
        self.max_interval = max_interval  # an interval at this is not widened further
        self.backoff = {"read": 1, "sample": 1, "lingering": 1}  # the multipliers of the intervals
        self.backoffs: list[dict[str, Any]] = []  # each time the guard widened an interval
        self.over_budget_windows = 0
        self.said: set[str] = set()  # what the guard has said in the log (each once)
        self.announce: tuple[logging.Logger, str] | None = None  # (logger, owner): where the back-off is said
        self.window: tuple[int, float, float, dict[str, float]] = (first, 0.0, 0.0, {})

    def check(self, schedule: Schedule) -> None:
        """One window's check: reads ``schedule``'s totals and widens its intervals."""
        start, own0, step0, parts0 = self.window
        steps = schedule.steps
        elapsed = schedule.timed_s - step0
        if steps < start + CONTROL_STEPS or elapsed < CONTROL_S:
            return
        parts = schedule.parts
        own = schedule.own_s - parts["findings"]  # finding work excepted (finding_s)
        self.window = (steps, own, schedule.timed_s, dict(parts))
        rate = (own - own0) / elapsed
        if rate <= self.budget:
            return
        spent = {}
        for key, seconds in parts.items():
            spent[key] = seconds - parts0.get(key, 0.0)
        # the parts whose interval the guard can widen (logged steps are sampled whatever the interval)
        controllable = {"lingering": spent["lingering"]}
        if schedule.read_every < self.max_interval:
            controllable["read"] = spent["read"]
        if not schedule.explicit and (not schedule.logs or schedule.sample_every < schedule.log_every):
            controllable["sample"] = spent["sample"]
        part = max(controllable, key=lambda k: controllable[k])
        self.over_budget_windows += 1
        if controllable[part] <= 0 or self.backoff[part] >= MAX_BACKOFF:
            if self.say("floor"):  # what is left is the logged steps and the tripwire
                logger, owner = self.announce  # type: ignore[misc]
                logger.info(
                    "%s: its own time was %.2f%% of step time over the last %d steps, above overhead_budget=%g, "
                    "and nothing it can sample less often is left: the rest is the logged steps (every %s), which "
                    "log_every_n_steps sets, and its hooks' calls (%.3g s of %.3g s), which every step makes.",
                    owner, 100 * rate, steps - start, self.budget, schedule.log_every if schedule.logs else "-",
                    spent.get("hooks", 0.0), own - own0,
                )
            return
        self.backoff[part] *= 2
        self.backoffs.append({"step": steps, "part": part, "own_time": round(rate, 5), "factor": self.backoff[part]})
        if len(self.backoffs) > 64:
            del self.backoffs[:32]
        if self.say("backoff"):
            logger, owner = self.announce  # type: ignore[misc]
            logger.info(
                "%s: its own time was %.2f%% of step time over the last %d steps, above overhead_budget=%g; "
                "the costliest part (%s: %.3g s of %.3g s) now runs half as often. Later back-offs are listed "
                "in report.json (summary.cadence.backoffs).",
                owner, 100 * rate, steps - start, self.budget, PART_NAMES[part], spent[part], own - own0,
            )

    def say(self, what: str) -> bool:
        """Whether to say ``what`` now: once per run, on rank zero (where :attr:`announce` is set)."""
        if self.announce is None or what in self.said:
            return False
        self.said.add(what)
        return True


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
        self.trip_cost_s = 0.0  # one tripwire check, as measured when the run starts (0: no tripwire)
        self.clock: Callable[[], float] = time.perf_counter  # the step clock (a test may drive its own)
        self.watching = False  # own time leaves Python's automatic collections out (the CPU clock in _base/cpu.py)
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
        self.heap_rss = math.inf  # the resident set at the last sampled step that read it (heap_skipped)
        self._anchor: tuple[int, float] | None = None  # (count, time) of the last step start timed
        self._next_choice = MEASURE_STEPS
        self.dense_until = 0  # reads every step below this count (a burst after a suspicious read)
        self.bursts = 0
        self.trips = 0  # reads the RSS tripwire asked for between the scheduled ones
        self.trip_checks = 0  # quiet steps that checked the tripwire (counted, not timed one by one)
        self.tripwire: str | None = self.trip.source if self.trip is not None else None
        self._forced = -1  # the count whose step reads because the tripwire asked
        self._burst_bytes = config.growth_min_total_bytes
        self.trip_bytes = self._burst_bytes // 4
        """The rise since the last read that sets the tripwire off: a quarter of a burst's."""
        self._recent_reads: collections.deque[int] = collections.deque(maxlen=4)
        self._step_times: collections.deque[float] = collections.deque(maxlen=64)
        self._watch_costs: collections.deque[float] = collections.deque(maxlen=64)
        self._read_costs: collections.deque[float] = collections.deque(maxlen=32)
        self._sample_costs: collections.deque[float] = collections.deque(maxlen=32)
        self._check_costs: collections.deque[float] = collections.deque(maxlen=16)  # the lingering checks'
        self.own_s = 0.0
        self.parts: dict[str, float] = dict.fromkeys(PARTS, 0.0)
        self.timed_s = 0.0
        self.steps = 0
        self.step_s = 0.0  # the lower quartile of the recent step times (0 until measured)
        self.booked_lingering_s = 0.0  # booked by the leak watch, split off the charges that include it
        self.booked_finding_s = 0.0
        self._booked_seen = (0.0, 0.0)  # (lingering, finding) already split off a charge
        self.lingering_checks = 0
        self.heap_scans = 0  # lingering checks that scanned the heap for a graph's root
        self.mark_every = MARK_EVERY_SAMPLES  # sampled steps between two lingering marks
        self.guard = BudgetGuard(self.budget, QUIET_FROM, MAX_INTERVAL)
        self._started: tuple[float, float, float] | None = None  # (own, timed_s, hooks) once QUIET_FROM steps are done

    def __getstate__(self) -> dict[str, Any]:
        state = dict(self.__dict__)
        state["read"] = state["trip"] = state["backend"] = None  # rebuilt by arm() when a run starts
        state["watching"] = False
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
        """The watch's read and the tripwire for ``backend`` (None: neither); a tripwire check is
        charged at the cost measured here (quiet steps are not timed one by one)."""
        if not self.watching:  # a collection Python starts by itself costs the heap, not the monitor
            self.watching = watch_collections()
        self.read = watch_reader(backend) if backend is not None else None
        self.backend, self.heap_at, self.heap_rss = backend, -1, math.inf
        self.trip = rss_tripwire(self.read, hwm_resets=bool(getattr(backend, "resets_hwm", False)))
        self.tripwire = self.trip.source if self.trip is not None else None
        self.trip_at = math.inf
        if self.trip is not None:
            t0 = own_time()
            for _ in range(4):
                self.trip()
            self.trip_cost_s = COLD_FACTOR * (own_time() - t0) / 4

    def release(self) -> None:
        """The run's end: stop leaving collections out of own time (safe to call twice)."""
        if self.watching:
            self.watching = unwatch_collections()

    # ------------------------------------------------------------------ what a step is
    def step_kind(self, count: int) -> StepKind:
        """What the step after ``count`` steps is. A planned quiet step checks the tripwire every
        :data:`TRIP_EVERY`-th step: a tripped one reads memory and ends the quiet stretch. Cannot
        raise (:class:`~memcallbacks._base.cpu.Tripwire` reads 0 when the kernel stops answering)."""
        if count < self.quiet_until:
            trip = self.trip
            if count & TRIP_MASK or trip is None or trip() < self.trip_at:
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
        self.step_read_s = own_time() - t0
        self.charge_read(self.step_read_s)
        self.heap_at = count
        if self.read is heap_in_use_bytes and hasattr(self.backend, "observe_heap_cost"):
            self.backend.observe_heap_cost(self.step_read_s)  # the same figure as the backend's: one estimate
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
        if not rss - self.heap_rss >= self.trip_bytes:
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
        asked for) starts a burst of reads at every step."""
        if self.trip is not None:
            self.trip_at = self.trip() + self.trip_bytes
        if count < DENSE_READ_STEPS or count < self.dense_until:
            return
        recent = self._recent_reads
        need = self.trip_bytes if count == self._forced else self._burst_bytes
        if recent and allocated - min(recent) >= need:
            self.dense_until = count + 1 + CONFIRM_STEPS
            self.bursts += 1
            self._burst_bytes *= 2  # a clean run's one-off rises cannot keep it busy
            self.trip_bytes = self._burst_bytes // 4
            recent.clear()
            return
        recent.append(allocated)

    def rebase(self, peak: int, pinned: bool) -> bool:
        """After a sampled step, whose phase boundaries reset the high-water mark the tripwire reads:
        it goes off at this step's ``peak`` plus the threshold. A mark ``pinned`` above the resident
        set (inherited through ``exec``) switches the tripwire to ``statm``; returns True then."""
        if self.trip is None or self.trip.source != "hwm":
            return False
        if pinned:
            self.trip = rss_tripwire(self.read)
            self.tripwire = self.trip.source if self.trip is not None else None
            self.trip_at = (self.trip() if self.trip is not None else 0) + self.trip_bytes
            return True
        now = self.trip()
        self.trip_at = (max(now, peak) if peak > 0 else now) + self.trip_bytes
        return False

    # ------------------------------------------------------------------ the step clock
    def step_started(self, count: int) -> None:
        """Time the steps since the last timed start (quiet ones give their mean), and choose the
        intervals again every :data:`CHOOSE_EVERY` steps."""
        now = self.clock()
        anchor = self._anchor
        if anchor is not None and count > anchor[0]:
            self._time_steps(count - anchor[0], now - anchor[1])  # quiet steps between give their mean
            if self.trip_cost_s and count > anchor[0] + 1:  # the quiet steps between that checked the tripwire
                checks = (count - 1) // TRIP_EVERY - anchor[0] // TRIP_EVERY
                self.trip_checks += checks
                self.own_s += checks * self.trip_cost_s
                self.parts["tripwire"] += checks * self.trip_cost_s
        self._anchor = (count, now)
        if self._started is None and self.steps >= QUIET_FROM:
            own = self.own_s - self.parts["findings"]  # finding work excepted (finding_s)
            self._started = (own, self.timed_s, self.parts["hooks"])
            self.guard.window = (self.steps, own, self.timed_s, dict(self.parts))
        if count >= self._next_choice:
            self._next_choice = count + CHOOSE_EVERY
            self.choose()

    def pause(self, count: int | None = None, at: float | None = None) -> None:
        """Evaluation or a checkpoint between steps: the time to the next step's start is not step
        time. ``count``: the steps done by now, timed from the last start to ``at`` (default: now)."""
        anchor = self._anchor
        if anchor is not None and count is not None and count > anchor[0]:
            end = self.clock() if at is None else at
            if end > anchor[1]:
                self._time_steps(count - anchor[0], end - anchor[1])
        self._anchor = None

    def _time_steps(self, steps: int, elapsed: float) -> None:
        self._step_times.append(elapsed / steps)
        self.timed_s += elapsed
        self.steps += steps

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
        self.parts["findings"] += finding
        return seconds - lingering - finding

    def charge(self, seconds: float, sampled: bool, typical: bool = True) -> None:
        """One step's own time, its watch read excepted. ``typical=False`` (the step found
        something) keeps the step out of the costs that choose the intervals."""
        self.own_s += seconds
        rest = self._split(seconds)
        self.parts["sample" if sampled else "watch"] += rest
        if typical:
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

    def charge_hooks(self, seconds: float) -> None:
        """A hook call's time its inner timers did not see (:class:`HookMeter`)."""
        self.own_s += seconds
        self.parts["hooks"] += seconds

    # ------------------------------------------------------------------ the intervals
    def choose(self) -> None:
        """Pick the read and sample intervals that keep the monitor within the budget: the reads may
        take :data:`READ_SHARE` of it, the logged steps what they cost, sampling what is left."""
        # the lower quartile of the step times: noise only makes steps slower, and the steps a busy
        # machine slowed do not buy more reads
        times = sorted(self._step_times)
        step = times[(len(times) - 1) // 4] if times else math.nan
        if not step > 0:
            return
        self.step_s = step
        if self._started is not None:
            self.guard.check(self)
        allowed = self.budget * step
        costs = self._check_costs
        if costs:  # a lingering check every mark_every sampled steps, at its mean cost, within its share
            check = COLD_FACTOR * sum(costs) / len(costs)
            every = max(MARK_EVERY_SAMPLES, _ceil(check / (allowed * LINGERING_SHARE) / max(1, self.sample_every)))
            self.mark_every = min(MAX_INTERVAL, every * self.guard.backoff["lingering"])
            allowed -= check / (self.mark_every * max(1, self.sample_every))
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
        every = max(1, min(MAX_INTERVAL, MAX_INTERVAL if allowed <= 0 else _ceil(sample / allowed)))
        every = min(MAX_INTERVAL, every * self.guard.backoff["sample"])
        if self.logs:  # samples in phase with the logged steps, as the reads
            every = aligned_samples(every, self.log_every)
        self.sample_every = every

    # ------------------------------------------------------------------ what it says about itself
    @property
    def overhead(self) -> float:
        """The monitor's own time as a fraction of the step time (NaN before two steps)."""
        return self.own_s / self.timed_s if self.timed_s > 0 else math.nan

    @property
    def overhead_after_start(self) -> float:
        """Own time over step time after the first :data:`QUIET_FROM` steps, finding work excepted:
        what the budget's intervals and guard hold (NaN before then)."""
        if self._started is None:
            return math.nan
        own0, step0, _ = self._started
        step = self.timed_s - step0
        return (self.own_s - self.finding_s - own0) / step if step > 0 else math.nan

    def summary(self) -> dict[str, Any]:
        step = median(self._step_times)
        after = self.overhead_after_start

        def us(values: Any) -> float | None:
            return round(median(values) * 1e6, 2) if values else None

        hooks = None if math.isnan(after) else round((self.parts["hooks"] - self._started[2]) / (self.timed_s - self._started[1]), 5)  # type: ignore[index]
        return {
            "overhead_budget": self.budget,
            "overhead": None if math.isnan(self.overhead) else round(self.overhead, 5),
            "overhead_after_start": None if math.isnan(after) else round(after, 5),
            "hooks_after_start": hooks,  # the hooks' part of overhead_after_start (a floor no interval lowers)
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
            "step_time_budgeted_s": self.step_s or None,  # the lower quartile the intervals were chosen from
            "watch_cost_median_us": us(self._watch_costs),
            "read_cost_median_us": us(self._read_costs),
            "sample_cost_median_us": us(self._sample_costs),
            "lingering_every_n_samples": self.mark_every,
            "lingering_checks": self.lingering_checks,
            "lingering_heap_scans": self.heap_scans,
            "own_time_s": round(self.own_s, 4),
            "own_time_by_part_s": {k: round(v, 4) for k, v in self.parts.items()},
            "backoffs": list(self.guard.backoffs),
            "over_budget_windows": self.guard.over_budget_windows,
        }
