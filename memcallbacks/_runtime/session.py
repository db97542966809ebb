"""What every adapter shares: the engine plus step bookkeeping, logging decisions, findings, files and failures.

Adapters (Lightning, Accelerate, Transformers, the plain-loop ``Monitor``) own one
:class:`Session` and only translate their framework's events into its calls. Nothing here
imports a framework.
"""

from __future__ import annotations

import logging
import math
import os
import time
from pathlib import Path
from typing import Any, Callable

from memcallbacks._config import MonitorConfig
from memcallbacks._runtime.cadence import (
    COLD_FACTOR,
    LINGERING_EVERY_STEP_UNTIL,
    MARK_EVERY_SAMPLES,
    QUIET_FROM,
    TRIP_MASK,
    Cadence,
    rss_tripwire,
    watch_reader,
)
from memcallbacks._runtime.columns import E_STAGE, MONITOR_TIME_S, OPTIMIZER, PEAK_RESERVED
from memcallbacks._runtime.extras import extra_metrics, load_session_state, session_state
from memcallbacks._runtime.sampling import MemoryEngine
from memcallbacks._findings import Finding, FindingLog, announce
from memcallbacks._runtime.outputs import check_writable
from memcallbacks._runtime.lifecycle import claim_folder, release_folder
from memcallbacks._runtime.preflight_check import PreflightCheck
from memcallbacks._runtime.run_end import RunEnd, is_oom
from memcallbacks.snapshot.auto import AutoSnapshot
from memcallbacks.estimate.check import StateCheck
from memcallbacks.leaks.census import format_top_holders
from memcallbacks.leaks.watch import LeakWatch
from memcallbacks.trackers import Dashboard, Trackers

log = logging.getLogger(__name__)

__all__ = ["Session", "LogFn", "is_oom", "LINGERING_EVERY_STEP_UNTIL"]

LogFn = Callable[[dict[str, float], int], None]


class Session(RunEnd):
    """One process's monitor state. Every method is safe to call when disabled."""

    def __getstate__(self) -> dict[str, Any]:
        state = dict(self.__dict__)
        state["log_fn"] = None  # adapters set it again when they start
        state["watch"] = None  # detectors hold weak references; start() builds new ones
        state["snap"] = None
        state["trackers"] = None
        state["_watch_read"] = state["_trip"] = None
        return state

    def __init__(self, config: MonitorConfig, framework: str, owner: str, logger: logging.Logger | None = None) -> None:
        self.config = config
        self.log = logger or log  # the adapter's logger, so users filter warnings by adapter
        self.framework = framework
        self.owner = owner  # the public class name, for messages
        self.engine = MemoryEngine(config)
        self.log_fn: LogFn | None = None  # adapters pass their own methods through weak_method (lifecycle.py)
        self.live = False  # between start() and stop(): owns its output folder
        self.output_dir: Path | None = None
        self.files: dict[str, str] = {}
        self.events: list[dict[str, Any]] = []
        self._findings = FindingLog()
        self.watch: LeakWatch | None = None
        self.state = StateCheck(config)
        self.preflight = PreflightCheck(self)  # preflight=True: the first batch's step predicted, then compared
        self.snap: AutoSnapshot | None = None
        self.trackers: Trackers | None = None  # rank zero's trackers (TensorBoard, W&B, MLflow); adapters set it
        self._new_findings: list[Finding] = []
        self._holders_logged: set[str] = set()
        self._lingering_due = False
        self.title = ""
        self._warned: set[str] = set()
        self.cadence = Cadence(config)
        self._watch_read: Callable[[], int | None] | None = None
        self._trip: Callable[[], int] | None = None  # the RSS tripwire between costly reads (Cadence)
        self.trip_at: float = math.inf
        """A quiet step whose resident set is at or above this reads memory (see :func:`rss_tripwire`)."""
        self._read_s = 0.0  # the open step's watch read, charged apart from the every-step cost
        self._fast_s: float | None = None  # an unsampled step's own time so far (None: sampled, or not open)
        self._fast_typical = True
        self.quiet_until = 0
        """Steps whose count is below this are quiet (see :meth:`begin_step`); planned at each step's end."""
        self._marks = False  # this step's end leaves marks for the lingering check
        self._samples_unmarked = 0
        self.quiet_step = False
        """The open step is quiet: adapters may skip its other hooks (end_step and boundary do nothing)."""
        self.step_open = False
        self.log_this_step = False
        self.current_step = 0
        self.current_count = 0

    # ------------------------------------------------------------------ lifecycle
    def reset(self) -> None:
        self.engine.reset()
        self.files = {}
        self.events = []
        self._findings = FindingLog()
        self._new_findings = []
        self.state = StateCheck(self.config)
        self.preflight.reset()
        self.step_open = self.quiet_step = False
        self.quiet_until = 0

    @property
    def findings(self) -> list[Finding]:
        return self._findings.findings

    def add_finding(self, finding: Finding) -> None:
        """Keep one finding per cause; log a new cause once, as a warning, on rank zero."""
        if self._findings.add(finding):
            self._new_findings.append(finding)
            if self.engine.rank == 0:
                announce(self.log, self.owner, finding)
            if finding.holders:
                self._holders_logged.add(finding.key)
        elif self._findings.changed is not None and self.engine.rank == 0:
            announce(self.log, self.owner, self._findings.changed, changed=True)
        elif finding.holders and finding.key not in self._holders_logged:
            # growth: the holders come from a second census some steps after the first warning
            self._holders_logged.add(finding.key)
            if self.engine.rank == 0:
                self.log.warning("%s: what grew (%s finding of step %d):\n%s", self.owner, finding.kind, finding.first_step or finding.step,
                                 "\n".join(f"    {h}" for h in finding.holders))

    def _check_state(self, step: int, baseline: int, batch: Any) -> Finding | None:
        """The theory check, isolated: an estimate that cannot be made is logged, never fatal."""
        try:
            return self.state.check(step, baseline, self.engine.start_allocated, self.engine.backend.kind, batch)  # type: ignore[union-attr]
        except Exception as exc:
            self.state.done = True
            self.log.info("%s: no model-state estimate for this run (%s: %s); the rest of the monitor goes on.", self.owner, type(exc).__name__, exc)
            return None

    def check_lingering(self, batch: Any = None) -> None:
        """Run the lingering check deferred by ``begin_step(defer_lingering=True)`` (once per step)."""
        if not self._lingering_due:
            return
        self._lingering_due = False
        if self.watch is not None and self.engine.enabled:
            try:
                for finding in self.watch.check_lingering(self.current_step, batch):
                    self.add_finding(finding)
            except Exception as exc:
                self.engine.fail(exc, "lingering check")

    def set_training_objects(
        self, model: Any, optimizer: Any, *, precision: str | None = None, strategy: str | None = None, world_size: int | None = None
    ) -> None:
        """What the census and the theory check look at (adapters call this at train start)."""
        if self.watch is not None:
            self.watch.model, self.watch.optimizer = model, optimizer
        self.preflight.set_objects(model, optimizer, precision=precision, strategy=strategy, world_size=world_size)
        try:
            self.state.set_objects(
                model, optimizer, precision=precision, strategy=strategy, world_size=world_size, allocated_now=self._allocated_now
            )
        except Exception as exc:
            self.log.info("%s: model-state estimate unavailable (%s)", self.owner, exc)
            self.state.model = None

    def explain(self, batch: Any = None) -> Any:
        """Take a census now: live tensors by category, and who holds the suspicious ones."""
        watch = self.watch or LeakWatch(self.config, lambda: None, ignore=[self])
        return watch.census(batch)

    def _allocated_now(self) -> int | None:
        # the watch's read where there is one: the same number as backend.current()[0], without the
        # RSS read that comes with it on CPU
        read = self._watch_read
        if read is not None:
            return read()
        backend = self.engine.backend
        return backend.current()[0] if backend is not None else None

    def start(
        self,
        device: Any,
        *,
        rank: int | None = None,
        world_size: int | None = None,
        default_output_dir: str | os.PathLike[str] | None = None,
        framework_log_every: int | None = None,
        logs: bool = True,
        log_first_step: bool = False,
        expected_steps: int | None = None,
    ) -> None:
        """Choose the device backend, the output folder and the sampling/logging intervals.

        Raises ``PermissionError`` for an unwritable output folder, or one another live monitor
        writes to: environment problems must stop the run before training, not during it. Any
        other fault here is contained (logged once; the monitor disables itself).
        ``expected_steps``: the run's length when the framework knows it (``max_steps``); the
        cadence samples the first steps of every run, so a short one (``fast_dev_run``) still has rows.
        """
        config = self.config
        if config.write_files:
            # not "./memcallbacks": run from a source checkout, that is the package itself.
            # Resolved once, here: a later chdir must not move the files.
            folder = os.path.abspath(config.output_dir or default_output_dir or os.path.join(os.getcwd(), "memcallbacks_output"))
            claim_folder(folder, self, self.owner)
            self.output_dir = check_writable(folder, self.owner)
            if config.auto_snapshot:
                check_writable(os.path.join(folder, "snapshots"), "auto_snapshot")
        self.live = True
        # the cadence first: even a monitor whose start fails below must agree with the other ranks on logged steps
        self.cadence = Cadence(config)
        self.quiet_until = 0
        log_every = config.log_every_n_steps or max(int(framework_log_every or 50), 1)
        self.cadence.configure(log_every=log_every, logs=logs, log_first_step=log_first_step)
        try:
            self._start_parts(device, rank, world_size, expected_steps)
        except Exception as exc:  # backend selection, the first reads, the leak watch: never fatal
            self.engine.fail(exc, "monitor start")

    def _start_parts(self, device: Any, rank: int | None, world_size: int | None, expected_steps: int | None) -> None:
        config = self.config
        self.engine.start(device, rank=rank, world_size=world_size)
        if self.watch is not None:
            self.watch.stop()
        backend = self.engine.backend
        self._watch_read = watch_reader(backend) if backend is not None else None
        self._trip = rss_tripwire(self._watch_read, hwm_resets=bool(getattr(backend, "resets_hwm", False)))
        self.cadence.tripwire = self._trip.source if self._trip is not None else None
        self.trip_at = math.inf
        if self._trip is not None:  # quiet steps are not timed: their checks are charged at this cost
            t0 = time.perf_counter()
            for _ in range(4):
                self._trip()
            self.cadence.trip_cost_s = COLD_FACTOR * (time.perf_counter() - t0) / 4
        self.watch = LeakWatch(config, self._allocated_now, ignore=[self], charge=self.cadence.charge_other, wake=self.wake)
        self.watch.start()
        if self.snap is not None:
            self.snap.stop()
            self.snap = None
        if config.auto_snapshot and self.output_dir is not None and self.engine.backend is not None:
            engine = self.engine
            self.snap = AutoSnapshot.for_backend(config, engine.backend, self.output_dir, engine.rank, engine.world_size, self.log)
            self.snap.start()

    @property
    def log_every(self) -> int:
        return self.cadence.log_every

    @property
    def sample_every(self) -> int:
        return self.cadence.sample_every

    def warn_once(self, key: str, message: str) -> None:
        if key not in self._warned:
            self._warned.add(key)
            self.log.warning(message)

    @property
    def enabled(self) -> bool:
        return self.engine.enabled

    # ------------------------------------------------------------------ steps
    @property
    def detailed_step(self) -> bool:
        """True when the open step is sampled or lingering references are checked after it:
        adapters skip their per-step extras (output hooks, loss capture) otherwise."""
        return self.engine.sampling or self._marks

    @property
    def lingering_due(self) -> bool:
        """A step opened with ``defer_lingering=True`` still owes its lingering check."""
        return self._lingering_due

    def will_log(self, count: int) -> bool:
        """Whether the step after ``count`` steps is logged: the one place every adapter asks.

        Every ``log_every`` steps (the monitor's ``log_every_n_steps``, else the framework's),
        plus the first step where the framework logs it; never when the run has nowhere to log.
        Decided from counts only, so every rank agrees (logged steps join a collective)."""
        return self.cadence.will_log(count)

    @property
    def lingering_pending(self) -> bool:
        """The previous step left marks (batch references, a marked graph) for the lingering check."""
        lingering = self.watch.lingering if self.watch is not None else None
        return lingering is not None and lingering.pending

    def wants_sample(self, count: int, log: bool) -> bool:
        """Whether the step after ``count`` steps is measured in full: logged steps, every
        ``sample_every``-th step (see :class:`Cadence`), and the step where the theory check is due."""
        return self.cadence.wants_sample(count, log) or (self.state.wanted and self.engine.optimizer_steps_total > 0)

    def begin_step(
        self,
        step: int,
        epoch: int = 0,
        batch_idx: int = 0,
        *,
        log: bool | None = None,
        count: int | None = None,
        batch: Any = None,
        sample: bool | None = None,
        defer_lingering: bool = False,
    ) -> None:
        """Open a step (or, if one is open, count a further micro-batch).

        ``count`` is the number of steps before this one for the logging/sampling cadence (default
        ``step``; Lightning passes batches-that-stepped, which differs from ``global_step`` when
        several optimizers step per batch). ``log=None``: every ``log_every`` steps. ``sample=None``:
        :meth:`wants_sample`. ``batch`` is only looked at (leak detection), never kept.
        ``defer_lingering``: the caller runs :meth:`check_lingering` later in the step (plain loops,
        where the caller's loop variable still holds the previous batch when the step begins).

        A *quiet* step (after the first :data:`QUIET_FROM` steps: one that is not logged, not
        sampled, takes no memory read and has no check pending, as planned at the end of the step
        before) is only counted, at the cost of a comparison: :attr:`quiet_step` is set and the
        step's ``boundary``/``end_step`` calls do nothing."""
        engine = self.engine
        if self.step_open:
            if engine.enabled:
                try:
                    engine.micro_batch()
                except Exception as exc:
                    engine.fail(exc, "micro-batch boundary")
            return
        n = step if count is None else count
        self.current_step = step
        self.current_count = n
        if n < self.quiet_until and not log and not sample:
            if n & TRIP_MASK or self._trip is None or self._trip() < self.trip_at:
                self.quiet_step = self.step_open = True  # open, for the adapters' bookkeeping; nothing is measured
                self.log_this_step = self._lingering_due = False
                engine.quiet_step()
                if self.snap is not None:
                    self.snap.step = step
                return
            self.cadence.trip(n)  # the tripwire went off: this step reads
        self.quiet_step = False
        self.step_open = True
        self._lingering_due = defer_lingering
        self._marks = n < LINGERING_EVERY_STEP_UNTIL
        # decided even when disabled, so that every rank agrees on which steps join a collective
        if log is None:
            log = self.will_log(n)
        self.log_this_step = log
        if not engine.enabled:
            return
        snap = self.snap
        if snap is not None:
            snap.step = step
            if snap.busy:  # a capture or a deferred dump counts steps
                snap.on_step_start(step)
        try:
            self.cadence.step_started(n)
            watch = self.watch
            if sample is None:
                sample = self.wants_sample(n, log)
            self._read_s = 0.0
            if not sample:  # the fast path: the watch only (a memory read on some steps, the lingering check)
                t0 = time.perf_counter()
                found = []
                if watch is not None:
                    found = watch.before_baseline(step, batch, lingering=not defer_lingering)
                    found += self._watch(n, batch)
                engine.begin_step(step, epoch, batch_idx, False)
                self._fast_s = time.perf_counter() - t0 - self._read_s  # charged at step end, with the end's own time
                self._fast_typical = not found
                for finding in found:
                    self.add_finding(finding)
                return
            self._fast_s = None
            self._marks = self._marks or self._samples_unmarked + 1 >= MARK_EVERY_SAMPLES
            t0 = time.perf_counter()
            found = watch.before_baseline(step, batch, lingering=not defer_lingering) if watch is not None else []
            check_state = self.state.wanted and engine.optimizer_steps_total > 0
            spent = time.perf_counter() - t0
            engine.begin_step(step, epoch, batch_idx, True)
            t1 = time.perf_counter()
            # the sampled baseline is the watch's read (allocated bytes): growth detection gets it at no extra cost
            found += self._watch(n, batch, engine.step_baseline)
            baseline = engine.step_baseline
            if check_state and baseline is not None:
                finding = self._check_state(step, baseline, batch)
                if finding is not None and watch is not None:
                    census = watch.census(batch)
                    finding.holders = format_top_holders(census, 5)
                    finding.details["census"] = {k: int(v) for k, v in census.bytes_by_category.items()}
                if finding is not None:
                    found.append(finding)
            for finding in found:
                self.add_finding(finding)
            engine.add_own_time(spent + time.perf_counter() - t1)
        except Exception as exc:
            engine.fail(exc, "step start")

    def _watch(self, count: int, batch: Any, value: int | None = None) -> list[Finding]:
        """The watch cadence: growth detection fed with ``value`` (a sampled step's baseline) or, on
        the steps :meth:`Cadence.wants_read` names, with the watch's own memory read."""
        if self.watch is None or self._watch_read is None:
            return []
        if value is None:
            if not self.cadence.wants_read(count):
                return []
            t0 = time.perf_counter()
            value = self._watch_read()
            self._read_s = time.perf_counter() - t0
            self.cadence.charge_read(self._read_s)
            if value is None:
                return []
        if self._trip is not None:  # the tripwire measures the rise since this read
            self.trip_at = self._trip() + self.cadence.trip_bytes
        self.cadence.after_read(count, value)
        return self.watch.after_baseline(count, value, batch)

    def _rebase_tripwire(self, row: list[Any]) -> None:
        """After a sampled step, whose phase boundaries reset the resident set's high-water mark that
        the tripwire reads: the steps that follow raise the mark to their own peak, so the tripwire
        goes off at this step's measured peak plus the threshold, not at the resident set now.

        Right after the reset the mark equals the resident set. Well above it, it is pinned: a
        process started by ``exec`` inherits the mark of the address space it replaced (a launcher's,
        a test runner's) and ``getrusage`` reports the larger, which comes into view once the run's
        own resident set falls below it. The CPU backend checks for that at every sampled step's
        baseline (:attr:`CpuBackend.resets_hwm`); once it has, the tripwire reads ``statm`` for the
        rest of the run."""
        if not getattr(self.engine.backend, "resets_hwm", False):
            self._trip = rss_tripwire(self._watch_read)
            self.cadence.tripwire = self._trip.source if self._trip is not None else None
            self.trip_at = (self._trip() if self._trip is not None else 0) + self.cadence.trip_bytes
            self.log.debug("memcallbacks: the resident-set high-water mark is pinned above the resident set; the RSS tripwire reads statm")
            return
        now = self._trip()  # type: ignore[misc]
        peak = row[PEAK_RESERVED]
        self.trip_at = (max(now, peak) if peak > 0 else now) + self.cadence.trip_bytes

    def _plan_quiet(self) -> None:
        """After a step: up to which count the steps that follow may be quiet (see :meth:`begin_step`)."""
        nxt = self.current_count + 1
        self.quiet_until = nxt
        if nxt < QUIET_FROM or not self.engine.enabled or self.config.gc_every_n_steps:
            return
        watch = self.watch
        if self._lingering_due or self.lingering_pending or self.state.wanted or self.preflight.due:
            return
        if (self.snap is not None and self.snap.busy) or (watch is not None and watch.collections is not None and watch.collections.due):
            return
        self.quiet_until = self.cadence.next_busy(nxt, reads=watch is not None and self._watch_read is not None)

    def count_quiet(self, steps: int) -> None:
        """``steps`` quiet steps an adapter skipped without calling :meth:`begin_step` (Lightning)."""
        if steps > 0:
            self.engine.quiet_step(steps)

    def wake(self) -> None:
        """Something needs the next step (a large automatic collection to inspect): it is not quiet."""
        self.quiet_until = 0

    def boundary(self, closing: int) -> None:
        engine = self.engine
        if engine.enabled:  # engine.boundary returns at once on unsampled steps
            try:
                engine.boundary(closing)
            except Exception as exc:
                engine.fail(exc, "phase boundary")

    def end_step(
        self, closing: int = OPTIMIZER, *, log_step: int | None = None, batch: Any = None, loss: Any = None, outputs: Any = None
    ) -> list[Any] | None:
        """Close the step, append its row and, on logged steps, emit its metrics through ``log_fn``.

        ``batch``, ``loss`` (the step's last) and ``outputs`` (the model's outputs the adapter saw)
        are handed to leak detection as weak references."""
        if self.quiet_step:
            self.quiet_step = self.step_open = False
            return None
        engine = self.engine
        row = None
        t_end = time.perf_counter()
        if self._lingering_due:
            self.check_lingering(batch)
        if engine.enabled:
            try:
                sampled = engine.sampling
                row = engine.end_step(closing)
                # lingering references: every step at first (leaky loops leak from step 1), then after
                # every MARK_EVERY_SAMPLES-th sampled step (weak references and graph marks, ~2-45 µs,
                # and a check at the next step start, which then is not quiet)
                if self.watch is not None and self._marks:
                    t0 = time.perf_counter()
                    self.watch.end_step(self.current_step, batch, loss, outputs)
                    if row is not None:
                        row[MONITOR_TIME_S] += time.perf_counter() - t0
                    self._samples_unmarked = 0
                elif sampled:
                    self._samples_unmarked += 1
                self._marks = False
                if row is not None:
                    if self._trip is not None and self._trip.source == "hwm":
                        self._rebase_tripwire(row)
                    self.preflight.compare(row)
                    self.cadence.charge(row[MONITOR_TIME_S], sampled=True)
                elif self._fast_s is not None:  # an unsampled step: its start and its end, as one cost
                    self.cadence.charge(self._fast_s + time.perf_counter() - t_end, sampled=False, typical=self._fast_typical)
                self._fast_s = None
                if self.snap is not None and (row is not None or self._new_findings):
                    new, self._new_findings = self._new_findings, []
                    if row is not None:
                        self.snap.after_row(self.current_step, row, new)
                    else:  # a watched step found something: the finding triggers, not the row
                        self.snap.after_findings(self.current_step, new)
            except Exception as exc:
                engine.fail(exc, "step end")
        self.step_open = False
        self._plan_quiet()
        if self.log_this_step and (row is not None or engine.world_size > 1):
            try:
                metrics = engine.log_values(row, extra_metrics(self, row))
                self.emit(metrics, self.current_step if log_step is None else log_step)
            except Exception as exc:
                engine.fail(exc, "logging")
        return row

    @property
    def dashboard(self) -> Dashboard:
        """What the trackers' charts show; a capacity line where the device has one (not host RAM on CPU)."""
        backend = self.engine.backend
        kind = backend.kind if backend is not None else self.engine.device_info.get("kind", "cpu")
        return Dashboard(self.config.prefix, capacity=kind != "cpu" and bool(self.engine.capacity))

    def emit(self, metrics: dict[str, float], step: int) -> None:
        if metrics and self.log_fn is not None and self.engine.rank == 0:
            self.log_fn(metrics, step)
            if self.trackers is not None and self.config.log_to_trackers:
                self.trackers.on_log(self.findings, self.dashboard)

    # ------------------------------------------------------------------ evaluation
    def begin_eval(self, stage: str, step: int, epoch: int = 0) -> None:
        engine = self.engine
        if self.config.log_validation and engine.enabled:
            try:
                engine.begin_eval(stage, step, epoch)
            except Exception as exc:
                engine.fail(exc, f"{stage} start")

    def eval_batch(self) -> None:
        if self.engine.enabled:
            try:
                self.engine.eval_batch()
            except Exception as exc:
                self.engine.fail(exc, "evaluation batch")

    def end_eval(self, *, log_step: int, emit: bool = True) -> list[Any] | None:
        engine = self.engine
        if not self.config.log_validation:
            return None
        row = None
        if engine.enabled:
            try:
                row = engine.end_eval()
            except Exception as exc:
                engine.fail(exc, "evaluation end")
        stage = row[E_STAGE] if row is not None else "validate"
        if not emit or stage == "sanity_check" or (row is None and engine.world_size <= 1):
            return row
        try:
            self.emit(engine.eval_log_values(row, stage), log_step)
        except Exception as exc:
            engine.fail(exc, "evaluation logging")
        return row

    def stop(self) -> None:
        """Undo everything the session changed in the process; each part on its own, safe to call twice."""
        self.live = False
        release_folder(self.output_dir, self)
        parts: list[tuple[str, Any]] = [("snapshots", self.snap), ("leak watch", self.watch)]
        for what, part in parts:
            if part is None:
                continue
            try:
                part.stop()
            except Exception:
                self.log.exception("%s: could not stop its %s; continuing.", self.owner, what)
        if self.watch is not None:
            self.watch.model = self.watch.optimizer = None
        self.state.model = self.state.optimizer = None
        try:
            self.preflight.release()
        except Exception:
            self.log.exception("%s: could not release the pre-flight model copy; continuing.", self.owner)
        try:
            self.engine.stop()
        except Exception:
            self.log.exception("%s: could not close its device backend; continuing.", self.owner)
            self.engine.backend = None

    def format_report(self) -> str:
        from memcallbacks._runtime.report import format_report

        return format_report(self.report(), self.history_frame())

    def history_frame(self) -> Any:
        """The engine's history, with the pre-flight's predicted columns when there is a prediction."""
        return self.preflight.add_columns(self.engine.history_frame())

    # ------------------------------------------------------------------ checkpointing
    def state_dict(self) -> dict[str, Any]:
        return session_state(self)

    def load_state_dict(self, state: dict[str, Any], key: str = "state_dict") -> None:
        """Restore a checkpointed state; a bad one raises one ``ValueError`` naming ``key`` (see saved_state.py)."""
        load_session_state(self, state, key)
