"""The step plan: which steps are quiet, which read memory, and the RSS tripwire between reads.

One :class:`StepPlan` per session decides, from step counts only, what each step does: quiet
(only counted), watched (the leak watch's memory read) or sampled (per-phase peaks, a history
row). The intervals themselves come from :class:`~memcallbacks._runtime.cadence.Cadence` (the
overhead budget); the plan adds the quiet stretch planned at each busy step's end and the
tripwire that may cut it short. Every adapter asks :meth:`StepPlan.quiet` and nothing else:
the Lightning callback's step hooks call it before anything else (its quiet gate), the session's
``begin_step`` calls it for the other adapters.
"""

from __future__ import annotations

import math
import time
from typing import Any, Callable

from memcallbacks._base.config import MonitorConfig
from memcallbacks._base.devices import HwmReader, StatmReader, heap_in_use_bytes, host_rss_reader
from memcallbacks._runtime.cadence import COLD_FACTOR, QUIET_FROM, TRIP_MASK, Cadence

__all__ = ["StepPlan", "Tripwire", "watch_reader", "rss_tripwire", "CHEAP_HEAP_S"]

CHEAP_HEAP_S = 5e-6
"""A sampled step's ``allocated`` read costing at most this is taken at every sampled step: an
allocator's counter (cost 0), or glibc's heap read in a small process (~1 µs)."""


def watch_reader(backend: Any) -> Callable[[], int | None]:
    """The read that sees a tensor leak step over step (docs/benchmarks.md, "Which read"): glibc's
    in-use heap on CPU (``mallinfo2``: it sees a leak that fills heap freed earlier, which RSS
    does not see until that space is used up), the caching allocator's own counter elsewhere."""
    if backend.kind == "cpu":
        return heap_in_use_bytes if heap_in_use_bytes() is not None else (lambda: backend.current()[0])
    return lambda: backend.current()[0]


def rss_tripwire(read: Callable[[], int | None] | None, *, hwm_resets: bool = False) -> Tripwire | None:
    """The cheap read checked at the steps between the watch's reads, where that read is costly
    (glibc's heap on CPU): the resident set. A leak that takes fresh pages raises it at once; one
    that refills heap freed earlier raises it once that space is used up (the scheduled reads see
    it before then). ``None`` where the watch's read is cheap enough to take at every step the
    budget allows (an allocator's counter, or RSS itself).

    ``hwm_resets`` (the CPU backend resets the kernel's resident-set high-water mark at every phase
    boundary, :attr:`CpuBackend.resets_hwm`): the tripwire reads that mark through ``getrusage``
    (source ``"hwm"``), whose system call costs the next step a quarter of what a ``statm`` read's
    does; the session rebases it after every sampled step and falls back to ``statm`` (source
    ``"rss"``) when the mark is pinned above the resident set (:meth:`StepPlan.rebase`)."""
    if read is not heap_in_use_bytes:
        return None
    try:
        rss = host_rss_reader()
        rss()
    except Exception:
        return None
    if not isinstance(rss, StatmReader):
        return None  # psutil's read is too slow for it
    if hwm_resets:
        try:
            hwm = HwmReader()
            if hwm() > 0:
                return Tripwire(hwm, "hwm")
        except Exception:
            pass
    return Tripwire(rss, "rss")


class Tripwire:
    """The resident set (``source`` ``"rss"``) or its high-water mark (``"hwm"``), or 0 if the
    kernel stops answering (which never trips, and never fails a step: the Lightning gate calls it
    with no guard frame). Picklable, like the reader inside."""

    __slots__ = ("_rss", "source")

    def __init__(self, rss: Callable[[], int], source: str = "rss") -> None:
        self._rss = rss
        self.source = source

    def __call__(self) -> int:
        try:
            return self._rss()
        except Exception:
            return 0

    def __getstate__(self) -> tuple[Callable[[], int], str]:
        return self._rss, self.source

    def __setstate__(self, state: tuple[Callable[[], int], str]) -> None:
        self._rss, self.source = state


class StepPlan:
    """What the next steps do, decided from counts so that every rank agrees.

    ``quiet_until``: steps whose count is below it are quiet, planned at each busy step's end
    (:meth:`plan_after`); ``trip``/``trip_at``: the RSS tripwire and the level at which a quiet
    step takes a read after all. The plan object lives as long as its session (adapters may keep
    a reference to it or to its :meth:`quiet` method)."""

    def __init__(self, config: MonitorConfig) -> None:
        self.config = config
        self.cadence = Cadence(config)
        self.quiet_until = 0
        self.read: Callable[[], int | None] | None = None  # the watch's memory read (None: no backend)
        self.trip: Tripwire | None = None
        self.trip_at: float = math.inf
        """A quiet step whose resident set is at or above this reads memory (see :func:`rss_tripwire`)."""
        self.read_s = 0.0  # the open step's read, charged apart from the every-step cost
        self.backend: Any = None  # whose heap_cost_s prices a sampled step's allocated read (heap_due)
        self.heap_at = -1  # the count of the last step that read the heap (a baseline or the watch's read)
        self.heap_rss = math.inf  # the resident set at the last sampled step that read it (heap_skipped)

    def __getstate__(self) -> dict[str, Any]:
        state = dict(self.__dict__)
        state["read"] = state["trip"] = state["backend"] = None  # rebuilt by arm() when a run starts
        return state

    # ------------------------------------------------------------------ set-up
    def configure(self, *, log_every: int, logs: bool, log_first_step: bool, keep: bool = False) -> None:
        """A new run: a fresh cadence at the run's logging interval, nothing quiet yet. ``keep``: a
        later stage of the same run (fit, then test) keeps the training cadence and its measurements."""
        if not keep:
            self.cadence = Cadence(self.config)
        self.cadence.configure(log_every=log_every, logs=logs, log_first_step=log_first_step)
        self.quiet_until = 0

    def arm(self, backend: Any) -> None:
        """The watch's read and the tripwire for ``backend`` (None: neither); quiet steps are not
        timed one by one, so a tripwire check is charged at the cost measured here."""
        self.read = watch_reader(backend) if backend is not None else None
        self.backend, self.heap_at, self.heap_rss = backend, -1, math.inf
        self.trip = rss_tripwire(self.read, hwm_resets=bool(getattr(backend, "resets_hwm", False)))
        self.cadence.tripwire = self.trip.source if self.trip is not None else None
        self.trip_at = math.inf
        if self.trip is not None:
            t0 = time.perf_counter()
            for _ in range(4):
                self.trip()
            self.cadence.trip_cost_s = COLD_FACTOR * (time.perf_counter() - t0) / 4

    # ------------------------------------------------------------------ decisions
    def quiet(self, count: int) -> bool:
        """Whether the step after ``count`` steps is quiet: planned so, and (every
        :data:`~memcallbacks._runtime.cadence.TRIP_EVERY`-th step, where there is a tripwire) the
        resident set has not risen to :attr:`trip_at`. A tripped wire makes this step read memory
        and ends the quiet stretch. Cannot raise (the tripwire reads 0 when the kernel stops answering)."""
        if count >= self.quiet_until:
            return False
        trip = self.trip
        if count & TRIP_MASK or trip is None or trip() < self.trip_at:
            return True
        self.cadence.trip(count)
        self.quiet_until = 0
        return False

    def will_log(self, count: int) -> bool:
        return self.cadence.will_log(count)

    def wants_sample(self, count: int, log: bool) -> bool:
        return self.cadence.wants_sample(count, log)

    # ------------------------------------------------------------------ the watch's read
    def take_read(self, count: int) -> int | None:
        """The watch's memory read, on the steps :meth:`Cadence.wants_read` names (None otherwise)."""
        if self.read is None or not self.cadence.wants_read(count):
            return None
        t0 = time.perf_counter()
        value = self.read()
        self.read_s = time.perf_counter() - t0
        self.cadence.charge_read(self.read_s)
        self.heap_at = count
        if self.read is heap_in_use_bytes and hasattr(self.backend, "observe_heap_cost"):
            self.backend.observe_heap_cost(self.read_s)  # the same figure as the backend's: one estimate
        return value

    # ------------------------------------------------------------------ a sampled step's allocated read
    def heap_due(self, count: int, wanted: bool = False) -> bool:
        """Whether the sampled step after ``count`` steps reads ``allocated`` (``baseline(allocated=...)``).

        Yes where the read is cheap (:data:`CHEAP_HEAP_S`; the backend's measured
        ``heap_cost_s``), where the watch's read is due (:meth:`Cadence.wants_read`: the baseline
        is that read, and nothing is read twice), and where ``wanted`` (the theory check compares
        this step's baseline). Otherwise (glibc's heap on CPU, which walks every free chunk: 100-300
        µs in a real fit) when its cost spread over the steps since the last heap read fits
        ``overhead_budget x median step time``. The whole budget's worth per step, not the reads'
        share with cold caches counted (:meth:`Cadence.choose`): the watch's reads, which detection
        needs, are budgeted there and come first; this one only fills in the logged figure, and a
        figure that costs on average no more than the budget per step keeps the series as dense as
        that allows. Measured time only, as the ledger's allowance for heap scans. At
        ``log_every_n_steps=50`` on a 1.3 ms step a 300 µs read spreads to 6 µs/step of 13: every
        logged step has it; at 1, every ~23rd step. Before the first median (``ledger.step_s``
        0) only the first three rules apply: the watch reads every one of the first steps anyway."""
        cost = self.backend.heap_cost_s if self.backend is not None else 0.0
        cadence = self.cadence
        if cost <= CHEAP_HEAP_S:
            return True
        if not (wanted or cadence.wants_read(count)) and cost > (count - self.heap_at) * cadence.budget * cadence.ledger.step_s:
            return False
        self.heap_at = count
        cadence.note_read_cost(cost)  # the running estimate: what choose() spaces the watch's reads by
        return True

    def heap_skipped(self, count: int, rss: float) -> bool:
        """A sampled step left the heap unread: True when its resident set ``rss`` stands the
        tripwire's rise (:attr:`Cadence.trip_bytes`) above that of the last sampled step that read
        it; the step then takes the watch's read after all (:meth:`take_read`), as a tripped quiet
        step does. At a small logging interval every step is sampled and none is quiet, so the
        tripwire of :meth:`quiet` never runs: without this a leak that begins late would wait for
        the next read the plan names. The resident set is read on every sampled step anyway."""
        if not rss - self.heap_rss >= self.cadence.trip_bytes:
            return False
        self.cadence.trip(count)
        self.heap_rss = rss
        return True

    def after_read(self, count: int, value: int) -> None:
        """A read was taken (scheduled, or a sampled step's baseline): the tripwire measures the rise from here."""
        if self.trip is not None:
            self.trip_at = self.trip() + self.cadence.trip_bytes
        self.cadence.after_read(count, value)

    def allocated_now(self) -> int | None:
        return self.read() if self.read is not None else None

    def rebase(self, peak: int, pinned: bool) -> bool:
        """After a sampled step, whose phase boundaries reset the resident set's high-water mark that
        the tripwire reads: the steps that follow raise the mark to their own peak, so the tripwire
        goes off at this step's measured ``peak`` plus the threshold, not at the resident set now.

        Right after the reset the mark equals the resident set. Well above it, it is ``pinned``: a
        process started by ``exec`` inherits the mark of the address space it replaced (a launcher's,
        a test runner's) and ``getrusage`` reports the larger, which comes into view once the run's
        own resident set falls below it. The CPU backend checks for that at every sampled step's
        baseline (:attr:`CpuBackend.resets_hwm`); once it has, the tripwire reads ``statm`` for the
        rest of the run. Returns True when it switched."""
        if self.trip is None or self.trip.source != "hwm":
            return False
        if pinned:
            self.trip = rss_tripwire(self.read)
            self.cadence.tripwire = self.trip.source if self.trip is not None else None
            self.trip_at = (self.trip() if self.trip is not None else 0) + self.cadence.trip_bytes
            return True
        now = self.trip()
        self.trip_at = (max(now, peak) if peak > 0 else now) + self.cadence.trip_bytes
        return False

    # ------------------------------------------------------------------ the quiet stretch
    def plan_after(self, count: int, *, busy: bool, reads: bool) -> None:
        """After the step at ``count``: up to which count the steps that follow are quiet. ``busy``:
        something needs the next step (a check pending, a capture running); ``reads``: the watch
        takes scheduled reads (their steps are not quiet)."""
        nxt = count + 1
        self.quiet_until = nxt
        if nxt < QUIET_FROM or busy or self.config.gc_every_n_steps:
            return
        self.quiet_until = self.cadence.next_busy(nxt, reads=reads and self.read is not None)

    def wake(self) -> None:
        """Something needs the next step (a large automatic collection to inspect): it is not quiet."""
        self.quiet_until = 0
