"""The session every adapter drives: one run's start, its steps, evaluation loops and end.

Adapters (Lightning, Accelerate, Transformers, the plain-loop ``Monitor``) own one
:class:`Session` and only translate their framework's events into its calls. A step reads top to
bottom here: :meth:`Session.begin_step`, :meth:`Session.boundary`, :meth:`Session.end_step`.
Nothing here imports a framework.
"""

from __future__ import annotations

import json
import logging
import os
import time
from pathlib import Path
from typing import Any, Callable

from memcallbacks._base.config import MonitorConfig
from memcallbacks._base.distributed import rank_and_world
from memcallbacks._base.columns import ALLOCATED, E_STAGE, MONITOR_TIME_S, OPTIMIZER, PEAK_RESERVED, RESERVED
from memcallbacks._base.findings import Finding
from memcallbacks._base.cpu import own_time
from memcallbacks._files.outputs import check_writable
from memcallbacks._runtime.auto_snapshot import AutoSnapshot
from memcallbacks._runtime.checks import StepChecks
from memcallbacks._runtime.finding_sink import FindingSink
from memcallbacks._runtime.guard import log_internal_error
from memcallbacks._runtime.lifecycle import claim_folder, output_folder, release_folder, unwatch_uncaught, watch_uncaught
from memcallbacks._runtime.run_end import RunEnd, is_oom
from memcallbacks._runtime.sampling import MemoryEngine
from memcallbacks._runtime.schedule import LINGERING_EVERY_STEP_UNTIL, TRIP_MASK, Schedule, StepKind
from memcallbacks.trackers import Dashboard, Trackers

log = logging.getLogger(__name__)

__all__ = ["Session", "LogFn", "is_oom"]

LogFn = Callable[[dict[str, float], int], None]


_KEEP: Any = object()  # attach(): a part not given keeps its current value


class Session:
    """One process's monitor state: the schedule and own time (:attr:`schedule`), the measurements
    (:attr:`engine`), the checks (:attr:`checks`), the findings and the run's end (:attr:`ending`).
    Every method is safe to call when disabled. Adapters call :meth:`attach`, then ``begin_step`` →
    ``boundary`` (per phase) → ``end_step``, ``begin_eval``/``eval_batch``/``end_eval``, ``finish``, ``stop``."""

    def __getstate__(self) -> dict[str, Any]:
        state = dict(self.__dict__)
        state["log_fn"] = None  # adapters attach it again when they start
        state["snap"] = None  # the checks drop their leak watch and host channel the same way
        state["trackers"] = None
        state["_observers"] = []
        return state

    def __init__(self, config: MonitorConfig, framework: str, owner: str, logger: logging.Logger | None = None) -> None:
        self.config = config
        self.log = logger or log  # the adapter's logger, so users filter warnings by adapter
        self.framework = framework
        self.owner = owner  # the public class name, for messages
        self.engine = MemoryEngine(config)
        self.schedule = Schedule(config)
        self.log_fn: LogFn | None = None
        self.live = False  # between start() and stop(): owns its output folder
        self.output_dir: Path | None = None
        self.files: dict[str, str] = {}
        self.events: list[dict[str, Any]] = []
        self.sink = FindingSink(owner, self.log, self._rank)
        self.checks = StepChecks(config, self.engine, self.schedule, owner=owner, logger=self.log, add_finding=self.sink.add,
                                 current_step=self._current_step)
        self.ending = RunEnd(self)
        self.snap: AutoSnapshot | None = None
        self.trackers: Trackers | None = None  # rank zero's trackers (TensorBoard, W&B, MLflow)
        self._observers: list[Any] = []
        self.failed = False  # an internal error turned the monitor off (fail())
        self.lingering_due = False  # a step opened with defer_lingering=True still owes its lingering check
        self.title = ""
        self._warned: set[str] = set()
        self.kind: StepKind | None = None  # what the open step is (None: none is open), decided once when it begins
        self.watched_s = 0.0  # a watched step's own time at its start, charged at its end with the end's
        self.watched_typical = True  # the watched step found nothing (its cost chooses the intervals)
        self.leaves_marks = False  # this step's end leaves marks for the lingering check
        self.samples_unmarked = 0
        self.step_ended_at = 0.0  # when the last step ended (time.perf_counter), for a pause said after the fact
        self.current_step = 0  # the open step's number as the adapter gave it: the step of findings, rows and logs
        self.current_count = 0  # steps before the open one, for the schedule (Lightning: batches that stepped)
        self.next_count: int | None = None  # the next step's count, when no quiet step is skipped (None: a new fit)
        self.dashboard = self._dashboard()  # what the trackers' charts show (made again when the backend starts)

    def _rank(self) -> int:  # methods, not lambdas: the session pickles (DDP spawn)
        return self.engine.rank

    def _current_step(self) -> int:
        return self.current_step

    # ------------------------------------------------------------------ configuration
    def attach(self, *, log_fn: LogFn | None = _KEEP, trackers: Trackers | None = _KEEP, title: str | None = _KEEP, model: Any = _KEEP,
               optimizer: Any = None, precision: str | None = None, strategy: str | None = None, world_size: int | None = None) -> None:
        """What an adapter tells the session: ``log_fn(metrics, step)``, rank zero's trackers, the title, and the
        model with its optimizer, precision, strategy and world size (given together). A part not given is kept."""
        if log_fn is not _KEEP:
            self.log_fn = log_fn
        if trackers is not _KEEP:
            self.trackers = trackers
            if trackers is not None and self.live:  # after the start (Accelerate, Transformers); Lightning's: start()
                trackers.look(self.sink.kept.version)
        if title is not _KEEP and title is not None:
            self.title = title
        if model is not _KEEP:  # what the census and the theory check look at
            self.checks.set_objects(model, optimizer, precision=precision, strategy=strategy, world_size=world_size)

    def observe(self, observer: Any) -> None:
        """Call ``observer`` at the step protocol's points (the pytest plugin's probe): its ``step_beginning(micro_batch)``,
        ``phase_closed(phase)``, ``step_ended(batch, loss)``, ``run_finishing()``, before or after the session's work as named."""
        self._observers.append(observer)

    @property
    def observed(self) -> bool:  # an observer watches the steps: every hook's call is wanted
        return bool(self._observers)

    def _notify(self, event: str, *args: Any) -> None:
        for observer in self._observers:
            getattr(observer, event)(*args)

    def reset(self) -> None:
        """A new fit: no rows, events, findings or open step; nothing quiet yet."""
        self.engine.reset()
        self.files = {}
        self.events = []
        self.sink.reset()
        self.checks.reset()
        self.kind = None
        self.next_count = None
        self.schedule.quiet_until = 0
        self.schedule.sample_next = False

    # ------------------------------------------------------------------ findings
    @property
    def findings(self) -> list[Finding]:
        return self.sink.findings

    def add_finding(self, finding: Finding) -> None:
        self.sink.add(finding)

    def warn_once(self, key: str, message: str) -> None:
        if key not in self._warned:
            self._warned.add(key)
            self.log.warning(message)

    def fail(self, exc: BaseException, where: str, *, unwinding: bool = False) -> None:
        """The one containment path for an internal error (the guard's, each step part's): logged once, the monitor off (strict: raised)."""
        if self.config.strict:
            raise exc
        if not self.failed:  # ``unwinding``: the run's own exception is ending it (said so, without it as the context)
            log_internal_error(log, where, exc, unwinding=unwinding)
        self.failed = True
        self.engine.enabled = False

    def summary(self) -> dict[str, Any]:
        """The engine's summary, with whether the monitor turned itself off after an internal error."""
        return self.engine.summary(disabled_after_error=self.failed)

    def check_lingering(self, batch: Any = None) -> None:
        """Run the lingering check deferred by ``begin_step(defer_lingering=True)`` (once per step)."""
        if not self.lingering_due:
            return
        self.lingering_due = False
        watch = self.checks.watch
        if watch is not None and self.engine.enabled:
            t0 = own_time()
            try:
                for finding in watch.check_lingering(self.current_step, batch):
                    self.add_finding(finding)
            except Exception as exc:
                self.fail(exc, "lingering check")
            self.schedule.charge_other(own_time() - t0, "lingering")  # outside the step's timed parts

    def explain(self, batch: Any = None) -> Any:
        """Take a census now: live tensors by category, and who holds the suspicious ones."""
        return self.checks.explain(batch, ignore=[self])

    # ------------------------------------------------------------------ start and stop
    def start(self, device: Any, *, rank: int | None = None, world_size: int | None = None, default_output_dir: str | os.PathLike[str] | None = None,
              framework_log_every: int | None = None, logs: bool = True, log_first_step: bool = False) -> None:
        """Choose the device backend, the output folder (its journal opens) and the sampling/logging intervals. Raises
        ``PermissionError`` for an unwritable output folder, or one another live monitor writes to; any other fault is contained."""
        config = self.config
        if config.write_files:
            folder = output_folder(config.output_dir, default_output_dir)
            claim_folder(folder, self, self.owner)
            self.output_dir = check_writable(folder, self.owner)
            if config.auto_snapshot:
                check_writable(os.path.join(folder, "snapshots"), "auto_snapshot")
        self.live = True
        watch_uncaught(self, self.ending.on_uncaught)  # an exception nobody catches ends this run too (lifecycle.ExceptHook)
        # the schedule first: even a monitor whose start fails below must agree with the other ranks on logged steps
        log_every = config.log_every_n_steps or max(int(framework_log_every or 50), 1)
        # a later stage of the same run (fit, then test) keeps the training cadence
        self.schedule.configure(log_every=log_every, logs=logs, log_first_step=log_first_step, keep=self.engine.seen_steps > 0)
        self.schedule.shares = config.reduce_across_ranks and rank_and_world()[1] > 1  # the same on every rank
        try:
            self._start_parts(device, rank, world_size)
        except Exception as exc:  # backend selection, the first reads, the leak watch: never fatal
            self.fail(exc, "monitor start")
        self.ending.open_journal()  # the record that streams (journal.py)
        if self.trackers is not None:
            self.trackers.look(self.sink.kept.version)

    def _start_parts(self, device: Any, rank: int | None, world_size: int | None) -> None:
        config, engine = self.config, self.engine
        engine.start(device, rank=rank, world_size=world_size)
        engine.enabled = not self.failed  # a monitor that failed stays off for every later stage
        self.dashboard = self._dashboard()
        self.schedule.arm(engine.backend)
        self.schedule.guard.announce = (self.log, self.owner) if engine.rank == 0 else None  # the budget's back-off, said once
        self.checks.start(ignore=[self], device_is_host=self.device_kind == "cpu", keep_host=engine.seen_steps > 0)
        if self.snap is not None:
            self.snap.stop()
            self.snap = None
        if config.auto_snapshot and self.output_dir is not None and engine.backend is not None:
            self.snap = AutoSnapshot.for_backend(config, engine.backend, self.output_dir, engine.rank, engine.world_size, self.log)
            self.snap.start()
        self.checks.forecast.snap = self.snap  # a snapshot before memory runs out

    def stop(self) -> None:
        """Undo everything the session changed in the process; each part on its own, safe to call twice."""
        self.live = False
        unwatch_uncaught(self)
        self.schedule.release()  # its journal closed, not removed: a run that did not finish leaves it (journal.py)
        release_folder(self.output_dir, self)
        self.checks.stop(self.snap)  # the host channel, the snapshots, the leak watch, the model copies
        try:
            self.engine.stop()
        except Exception:
            self.log.exception("%s: could not close its device backend; continuing.", self.owner)
            self.engine.backend = None

    # ------------------------------------------------------------------ what adapters read
    @property
    def step_open(self) -> bool:
        return self.kind is not None

    @property
    def quiet_step(self) -> bool:
        """The open step is quiet: adapters may skip its other hooks (end_step and boundary do nothing)."""
        return self.kind is StepKind.QUIET

    @property
    def log_this_step(self) -> bool:
        return self.kind is StepKind.LOGGED

    @property
    def enabled(self) -> bool:
        return self.engine.enabled

    @property
    def sampling(self) -> bool:
        """The open step is sampled (its phases are measured): adapters add backward boundaries then."""
        return self.engine.sampling

    @property
    def detailed_step(self) -> bool:
        """True when the open step is sampled or lingering references are checked after it:
        adapters skip their per-step extras (output hooks, loss capture) otherwise."""
        return self.engine.sampling or self.leaves_marks or self.checks.lingering_wants_mark

    @property
    def lingering_pending(self) -> bool:
        """The previous step left marks (batch references, a marked graph) for the lingering check."""
        watch = self.checks.watch
        return watch is not None and watch.lingering is not None and watch.lingering.pending

    @property
    def device_kind(self) -> str:
        """``"cuda"``, ``"cpu"``, ...: the measured device (also after :meth:`stop`)."""
        backend = self.engine.backend
        return backend.kind if backend is not None else str(self.engine.device_info.get("kind", "cpu"))

    @property
    def started(self) -> bool:
        """A device backend is measuring (between :meth:`start` and :meth:`stop`)."""
        return self.engine.backend is not None

    @property
    def preflight_due(self) -> bool:
        """``preflight=True`` and the prediction has not run yet in this fit (``PreflightCheck.due``'s two fields)."""
        return self.checks.preflight.status == "waiting" and self.engine.enabled

    def run_preflight(self, batch: Any, **kwargs: Any) -> None:
        """Predict this batch's step on fake tensors before it runs (:meth:`PreflightCheck.run`)."""
        self.checks.preflight.run(batch, **kwargs)

    def watch_first_forward(self, model: Any) -> None:
        """Plain loops: the pre-flight predicts the step at ``model``'s first training forward."""
        self.checks.preflight.watch_first_forward(model)

    @property
    def rows(self) -> list[list[Any]]:
        """The history rows so far (columns.py's layout)."""
        return self.engine.rows

    # ------------------------------------------------------------------ steps
    def begin_step(self, step: int, epoch: int = 0, batch_idx: int = 0, *, count: int | None = None, kind: StepKind | None = None,
                   batch: Any = None, defer_lingering: bool = False) -> None:
        """Open a step (with one open: a further micro-batch). ``count``: steps before this one (default
        ``step``; Lightning: batches that stepped). ``kind``: the schedule's answer where the adapter asked
        (once per step). ``batch`` is looked at, never kept. ``defer_lingering``: the caller runs
        :meth:`check_lingering` later (plain loops). A quiet step is only counted."""
        if self.kind is not None:
            return self.micro_batch()
        if self._observers:
            self._notify("step_beginning", False)
        n = step if count is None else count
        self.skip_to(n)  # quiet steps the adapter skipped (Lightning's gate)
        self.current_step, self.current_count, self.next_count = step, n, n + 1
        # decided even when disabled, so that every rank agrees on which steps join a collective
        self.kind = kind = self.schedule.step_kind(n) if kind is None else kind
        if kind is StepKind.QUIET:  # only counted: nothing is measured
            self.lingering_due = False
            self.engine.quiet_step()
            if self.snap is not None:
                self.snap.step = step
            return
        self.lingering_due = defer_lingering
        self.leaves_marks = n < LINGERING_EVERY_STEP_UNTIL
        engine = self.engine
        if not engine.enabled:
            return
        if self.snap is not None:
            self.snap.step = step
            if self.snap.busy:  # a capture or a deferred dump counts steps
                self.snap.on_step_start(step)
        try:
            self.schedule.step_started(n)
            self.schedule.step_read_s = 0.0
            if kind is StepKind.WATCHED:
                self._begin_watched(step, epoch, batch_idx, batch, defer_lingering)
            else:
                self._begin_sampled(step, epoch, batch_idx, batch, defer_lingering)
        except Exception as exc:
            self.fail(exc, "step start")

    def quiet_next(self, n: int) -> bool:
        """A plain loop's open quiet step ends; True where step ``n`` is quiet in the planned stretch, begun here (counted
        only). Every 4th, the tripwire's check (and the journal's tick) decides; a step it trips is begun in full."""
        schedule = self.schedule  # asked again there, it no longer checks: the trip ended the stretch (a tick repeats)
        if (self.kind is not StepKind.QUIET or n != self.next_count or self._observers or n >= schedule.quiet_until
                or not n & TRIP_MASK and schedule.step_kind(n) is not StepKind.QUIET):
            return False
        self.step_ended_at, self.current_step, self.current_count, self.next_count = time.perf_counter(), n, n, n + 1
        self.engine.quiet_step()
        if self.snap is not None:
            self.snap.step = n
        return True

    def micro_batch(self) -> None:
        """A further micro-batch of the open step (gradient accumulation)."""
        if self._observers:
            self._notify("step_beginning", True)
        if self.engine.enabled:
            try:
                self.engine.micro_batch()
            except Exception as exc:
                self.fail(exc, "micro-batch boundary")

    def _begin_watched(self, step: int, epoch: int, batch_idx: int, batch: Any, defer_lingering: bool) -> None:
        """An unsampled step: the leak watch only (the lingering check, a memory read on some steps)."""
        t0 = own_time()
        checks = self.checks
        found: list[Finding] = []
        if checks.watch is not None:
            found = checks.watch.before_baseline(step, batch, lingering=not defer_lingering)
            found += checks.detect_growth(self.current_count, batch)
        found += checks.host_read(step, self.current_count)
        self.engine.begin_step(step, epoch, batch_idx, False)
        self.watched_s = own_time() - t0 - self.schedule.step_read_s  # charged at step end, with the end's
        self.watched_typical = not found
        for finding in found:
            self.add_finding(finding)

    def _begin_sampled(self, step: int, epoch: int, batch_idx: int, batch: Any, defer_lingering: bool) -> None:
        """A sampled step: the watch, the baseline (also the watch's read), then the theory check. The
        baseline reads ``allocated`` where :meth:`Schedule.heap_due` says, or when the tripwire's rise is seen."""
        engine, checks, schedule = self.engine, self.checks, self.schedule
        watch = checks.watch
        count = self.current_count
        self.leaves_marks = self.leaves_marks or self.samples_unmarked + 1 >= schedule.mark_every
        t0 = own_time()
        found = watch.before_baseline(step, batch, lingering=not defer_lingering) if watch is not None else []
        check_state = checks.state.wanted and engine.optimizer_steps_total > 0
        heap = schedule.heap_due(count, check_state)
        spent = own_time() - t0
        row = engine.begin_step(step, epoch, batch_idx, True, heap)
        t1 = own_time()
        allocated, reserved = row[ALLOCATED], row[RESERVED]  # type: ignore[index]
        baseline = int(allocated) if allocated == allocated else None  # NaN: the heap was not read
        if heap:
            schedule.heap_rss = reserved
        elif baseline is None and schedule.heap_skipped(count, reserved):
            baseline = engine.fill_baseline(schedule.take_read(count))  # charged as a read (step_read_s)
        found += checks.detect_growth(count, batch, baseline)
        found += checks.host_read(step, self.current_count)
        if check_state and baseline is not None:
            finding = checks.state_finding(step, baseline, batch)
            if finding is not None:
                found.append(finding)
        for finding in found:
            self.add_finding(finding)
        row[MONITOR_TIME_S] += spent + own_time() - t1 - schedule.step_read_s  # the detection's time, in the step's row

    def skip_to(self, count: int) -> None:
        """The steps before ``count`` that an adapter skipped as quiet, without calling :meth:`begin_step`
        (Lightning's gate): counted when the next step begins, and at the end of training."""
        if self.next_count is not None and count > self.next_count:
            self.engine.quiet_step(count - self.next_count)
            self.next_count = count

    def boundary(self, closing: int) -> None:
        """Phase ``closing`` ended (a :class:`~memcallbacks._base.columns.Phase`); the next one begins."""
        engine = self.engine
        if engine.enabled:  # engine.boundary returns at once on unsampled steps
            try:
                engine.boundary(closing)
            except Exception as exc:
                self.fail(exc, "phase boundary")
        if self._observers:
            self._notify("phase_closed", closing)

    def end_step(self, closing: int = OPTIMIZER, *, log_step: int | None = None, batch: Any = None, loss: Any = None,
                 outputs: Any = None) -> list[Any] | None:
        """Close the step: its row, its quiet stretch, a logged step's metrics; ``batch``, ``loss``, ``outputs``: leak detection's (weakly)."""
        kind = self.kind
        if kind is StepKind.QUIET:
            self.kind = None
            self.step_ended_at = time.perf_counter()
            return None
        observed = self._observers and kind is not None
        if observed:
            self._notify("phase_closed", closing)
        engine = self.engine
        row = None
        if self.lingering_due:
            self.check_lingering(batch)  # charged on its own (charge_other), so timed before t_end
        t_end = own_time()
        if engine.enabled:
            try:
                row = self._close_row(kind, closing, t_end, batch=batch, loss=loss, outputs=outputs)
            except Exception as exc:
                self.fail(exc, "step end")
        self.kind = None
        self._plan_quiet()
        if self.schedule.journal.fd >= 0 and self.schedule.journal.version != self.sink.kept.version:  # findings raised or
            self.schedule.journal.note_findings(self.sink.kept.findings, self.sink.kept.version)  # changed: journaled once a step
        if kind is StepKind.LOGGED and (row is not None or engine.world_size > 1):
            t_log = own_time()  # the keys and the loggers' writes: the logged step's own time too
            try:
                capacity = engine.capacity if self.dashboard.capacity else None  # the capacity line the charts show
                extra = self.checks.logged_keys(row, findings=self.sink.kept.open_problems, capacity=capacity, snap=self.snap)
                metrics = engine.log_values(row, extra)
                self.emit(metrics, self.current_step if log_step is None else log_step)
            except Exception as exc:
                self.fail(exc, "logging")
            self.schedule.charge(own_time() - t_log, sampled=True, logging=True)
        if self.schedule.shares and self.schedule.share_due(self.current_count):  # a collective: each rank's news reach rank zero
            t0 = own_time()
            try:
                self.sink.share_with_rank_zero(self.engine.rank, self.engine.device, self.current_step)
            except Exception as exc:
                self.fail(exc, "sharing findings with rank zero")
            self.schedule.charge_other(own_time() - t0, "watch")
        if observed:
            self._notify("step_ended", batch, loss)
        self.step_ended_at = time.perf_counter()
        return row

    def _close_row(self, kind: StepKind | None, closing: int, t_end: float, *, batch: Any, loss: Any, outputs: Any) -> list[Any] | None:
        """The engine's row, the lingering marks, the tripwire, the pre-flight comparison, the budget, snapshots."""
        engine, checks = self.engine, self.checks
        sampled = engine.sampling
        row = engine.end_step(closing)
        # lingering references: every step at first (leaky loops leak from step 1), then after every
        # mark_every-th sampled step (a check costs the next step its quietness)
        watch = checks.watch
        if watch is not None and (self.leaves_marks or checks.lingering_wants_mark):
            t0 = own_time()
            if watch.lingering is not None:
                watch.lingering.end_step(self.current_step, batch, loss, outputs)
            if row is not None:
                row[MONITOR_TIME_S] += own_time() - t0
            self.samples_unmarked = 0
        elif sampled:
            self.samples_unmarked += 1
        self.leaves_marks = False
        if row is not None:
            if self.schedule.rebase(row[PEAK_RESERVED], pinned=not getattr(engine.backend, "resets_hwm", False)):
                self.log.debug("memcallbacks: the resident-set high-water mark is pinned above the resident set; the RSS tripwire reads statm")
            if checks.preflight.prediction is not None:  # preflight=True, and it predicted this run's steps
                checks.preflight.compare(row)
            journal, t0 = self.schedule.journal, own_time()
            if journal.fd >= 0 and engine.kept is row:  # a kept row, whole, into the journal (journal.py)
                try:
                    journal.bytes += os.write(journal.fd, b'{"t":"row","time":%.3f,"r":%b}\n' % (time.time(), json.dumps(row).encode()))
                except Exception as exc:  # a full disk: the journal stops, the run goes on
                    journal.failed(exc)
            self.schedule.charge(row[MONITOR_TIME_S] + own_time() - t0, sampled=True)  # its write is own time, not the row's
        elif kind is StepKind.WATCHED:  # its start and its end, as one cost
            self.schedule.charge(self.watched_s + own_time() - t_end, sampled=False, typical=self.watched_typical)
        if self.snap is not None and (row is not None or self.sink.new):
            new = self.sink.take_new()
            if row is not None:
                self.snap.after_row(self.current_step, row, new)
            else:  # a watched step found something: the finding triggers, not the row
                self.snap.after_findings(self.current_step, new)
        return row

    def _plan_quiet(self) -> None:
        """After a step: the quiet stretch that follows, unless something needs the next step."""
        checks = self.checks
        watch = checks.watch
        theory_pending = checks.state.wanted
        busy = (not self.engine.enabled or self.lingering_due or theory_pending or checks.preflight.status == "waiting"
                or (self.snap is not None and self.snap.busy) or (watch is not None and (
                    watch.lingering is not None and watch.lingering.pending or watch.collections is not None and watch.collections.due)))
        theory = theory_pending and self.engine.optimizer_steps_total > 0  # the theory check samples the next step
        checks.plan_after(self.schedule, self.current_count, busy=busy, reads=watch is not None, sample_next=theory)

    def _dashboard(self) -> Dashboard:
        """What the trackers' charts show; a capacity line where the device has one (not host RAM on CPU)."""
        cpu, config = self.device_kind == "cpu", self.config  # on CPU the default list has the phases' rises
        return Dashboard(config.prefix, capacity=not cpu and bool(self.engine.capacity), keys=config.logged_keys_cpu if cpu else config.logged_keys)

    def emit(self, metrics: dict[str, float], step: int) -> None:
        """Hand the ``log_keys`` part of ``metrics`` to the loggers (rank zero); every rank reduced all of them."""
        if self.log_fn is None or self.engine.rank != 0:
            return
        keep, shown = self.dashboard.keys, metrics  # the device's (_dashboard)
        if keep is not None:  # a loop, not a comprehension: no frame per logged step
            shown = {}
            for key in metrics:
                if key in keep:
                    shown[key] = metrics[key]
        if shown:
            self.log_fn(shown, step)
            trackers, kept = self.trackers, self.sink.kept
            if trackers is not None and self.config.log_to_trackers and trackers.has_news(kept.version):
                trackers.on_log(kept.findings, self.dashboard, version=kept.version)

    # ------------------------------------------------------------------ evaluation loops
    def pause(self, *, now: bool = False) -> None:
        """Evaluation or a checkpoint between steps: its time is not step time (the own-time share). Said between
        steps it began at the last one's end (an adapter that hears of it only after it), unless ``now`` (Lightning's
        hooks, said as it begins: the steps its gate skipped since the last one begun ended later)."""
        self.schedule.pause(at=self.step_ended_at if self.kind is None and not now else None)

    def begin_eval(self, stage: str, step: int, epoch: int = 0) -> None:
        """An evaluation loop starts: the step clock pauses (to :meth:`end_eval`), and its memory is recorded apart
        from training rows."""
        self.schedule.pause()
        engine = self.engine
        if self.config.log_validation and engine.enabled:
            try:
                engine.begin_eval(stage, step, epoch)
            except Exception as exc:
                self.fail(exc, f"{stage} start")

    def eval_batch(self) -> None:
        if self.engine.enabled:
            try:
                self.engine.eval_batch()
            except Exception as exc:
                self.fail(exc, "evaluation batch")

    def end_eval(self, *, log_step: int, emit: bool = True, keep_empty: bool = True) -> list[Any] | None:
        """Close the evaluation loop's row and, unless ``emit`` is False or it is the sanity check, log it.
        ``keep_empty=False``: a loop that counted no batch leaves no row and logs nothing (on every rank)."""
        self.schedule.resume()
        engine = self.engine
        if not self.config.log_validation:
            return None
        row = None
        if engine.enabled:
            try:
                row = engine.end_eval(keep_empty)
            except Exception as exc:
                self.fail(exc, "evaluation end")
            self.schedule.journal.eval_row(row)
        stage = row[E_STAGE] if row is not None else "validate"
        if not emit or stage == "sanity_check" or (row is None and (engine.world_size <= 1 or not keep_empty)):
            return row
        try:
            self.emit(engine.eval_log_values(row, stage), log_step)
        except Exception as exc:
            self.fail(exc, "evaluation logging")
        return row

    # ------------------------------------------------------------------ results
    def history_frame(self) -> Any:
        """The engine's history, with the pre-flight's predicted columns when there is a prediction."""
        return self.checks.preflight.add_columns(self.engine.history_frame())

    def eval_history_frame(self) -> Any:  # one row per evaluation loop (validate, test, predict)
        return self.engine.eval_frame()

    # ------------------------------------------------------------------ the run's end (run_end.py)
    def record_exception(self, exc: BaseException, step: int) -> None:
        """Note an exception that is ending the run as an event (``"oom"`` or ``"exception"``); never raises."""
        self.ending.record_exception(exc, step)

    def finish(self, *, gather: bool) -> dict[str, str]:
        """Close any open step and write this rank's files (run_end.py); ``gather`` (a collective: every rank calls it)
        puts every rank's summary into rank zero's ``report.json``. A run that recorded nothing writes none."""
        if self._observers:
            self._notify("run_finishing")
        self.kind = None  # an open step ends with the run: the run's end closes the engine's row
        # the steps since the last timed start, to the last one's end (a stretch of Lightning's quiet steps: now); what
        # follows (the files, a test() stage) is not step time
        last = self.next_count == self.current_count + 1
        self.schedule.stop_clock(self.next_count, at=self.step_ended_at if last else None)
        return self.ending.finish(gather)

    def report(self) -> dict[str, Any]:
        """What ``report.json`` holds: version, config, summary, findings, events and files."""
        return self.ending.report()

    # ------------------------------------------------------------------ checkpointing
    def state_dict(self) -> dict[str, Any]:
        """The engine's checkpointed state plus the run's events and findings (a checkpoint: the step clock pauses)."""
        self.pause()
        state = self.engine.state_dict()
        state["events"] = list(self.events)
        state["findings"] = self.sink.to_list()
        return state

    def load_state_dict(self, state: dict[str, Any], key: str = "state_dict") -> None:
        """Restore a checkpointed state; a bad one raises one ``ValueError`` naming ``key``."""
        read = self.engine.load_state_dict(state, key)
        if read is None:
            return
        self.events = read["events"]
        self.sink.restore(read["findings"])
        self.schedule.journal.rows_exact = False  # the rows are the saved ones now: the end record carries them
