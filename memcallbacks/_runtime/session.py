"""The session every adapter drives: one run's step protocol (begin_step, boundary, end_step), orchestrating the plan, the engine, the watch and the files.

Adapters (Lightning, Accelerate, Transformers, the plain-loop ``Monitor``) own one
:class:`Session` and only translate their framework's events into its calls. Nothing here
imports a framework.
"""

from __future__ import annotations

import logging
import os
import time
from pathlib import Path
from typing import Any, Callable

from memcallbacks._base.config import MonitorConfig
from memcallbacks._runtime.cadence import LINGERING_EVERY_STEP_UNTIL, Cadence
from memcallbacks._base.columns import E_STAGE, MONITOR_TIME_S, OPTIMIZER, PEAK_RESERVED
from memcallbacks._runtime.extras import extra_metrics
from memcallbacks._runtime.finding_sink import FindingSink
from memcallbacks._runtime.plan import StepPlan
from memcallbacks._runtime.sampling import MemoryEngine
from memcallbacks._base.findings import Finding
from memcallbacks._files.outputs import check_writable
from memcallbacks._runtime.lifecycle import claim_folder, release_folder
from memcallbacks._runtime.preflight_check import PreflightCheck
from memcallbacks._runtime.run_end import RunEnd, is_oom
from memcallbacks._runtime.auto_snapshot import AutoSnapshot
from memcallbacks._runtime.state_check import StateCheck
from memcallbacks.leaks.census import format_top_holders
from memcallbacks._runtime.leak_watch import LeakWatch
from memcallbacks.host.channel import HostChannel
from memcallbacks.leaks.search_failure import search_or_note
from memcallbacks.trackers import Dashboard, Trackers

log = logging.getLogger(__name__)

__all__ = ["Session", "LogFn", "is_oom", "LINGERING_EVERY_STEP_UNTIL"]

LogFn = Callable[[dict[str, float], int], None]


_KEEP: Any = object()  # attach(): a part not given keeps its current value


class Session(RunEnd):
    """One process's monitor state: what a step does (the plan), the measurements (the engine),
    the leak watch, the findings and the files. Every method is safe to call when disabled.

    Adapters configure it with :meth:`attach` and drive it with the step protocol:
    ``begin_step`` → ``boundary`` (per phase) → ``end_step``, ``begin_eval``/``eval_batch``/
    ``end_eval``, then ``finish`` and ``stop``. :attr:`plan` answers which steps are quiet."""

    def __getstate__(self) -> dict[str, Any]:
        state = dict(self.__dict__)
        state["log_fn"] = None  # adapters attach it again when they start
        state["watch"] = None  # detectors hold weak references; start() builds new ones
        state["snap"] = None
        state["host"] = None
        state["trackers"] = None
        state["_observers"] = []
        return state

    def __init__(self, config: MonitorConfig, framework: str, owner: str, logger: logging.Logger | None = None) -> None:
        self.config = config
        self.log = logger or log  # the adapter's logger, so users filter warnings by adapter
        self.framework = framework
        self.owner = owner  # the public class name, for messages
        self.engine = MemoryEngine(config)
        self.plan = StepPlan(config)
        self.log_fn: LogFn | None = None  # adapters pass their own methods through weak_method (lifecycle.py)
        self.live = False  # between start() and stop(): owns its output folder
        self.output_dir: Path | None = None
        self.files: dict[str, str] = {}
        self.events: list[dict[str, Any]] = []
        self.sink = FindingSink(owner, self.log, self._rank)
        self.watch: LeakWatch | None = None
        self.host: HostChannel | None = None  # the host channel: Python objects, private memory, DataLoader workers
        self.state = StateCheck(config)
        # preflight=True: the first batch's step predicted, then compared
        self.preflight = PreflightCheck(config, self.engine, owner, self.log, self.sink.add, self._current_step)
        self.snap: AutoSnapshot | None = None
        self.trackers: Trackers | None = None  # rank zero's trackers (TensorBoard, W&B, MLflow)
        self._observers: list[Any] = []
        self._lingering_due = False
        self.title = ""
        self._warned: set[str] = set()
        self._fast_s: float | None = None  # an unsampled step's own time so far (None: sampled, or not open)
        self._fast_typical = True
        self._marks = False  # this step's end leaves marks for the lingering check
        self._samples_unmarked = 0
        self.quiet_step = False
        """The open step is quiet: adapters may skip its other hooks (end_step and boundary do nothing)."""
        self.step_open = False
        self.log_this_step = False
        self.current_step = 0
        """The open step's number as the adapter gave it: the step of findings, rows and logs."""
        self.current_count = 0
        """Steps before the open one, for the cadence (Lightning: batches that stepped)."""

    def _rank(self) -> int:  # methods, not lambdas: the session pickles (DDP spawn)
        return self.engine.rank

    def _current_step(self) -> int:
        return self.current_step

    # ------------------------------------------------------------------ configuration
    def attach(
        self, *, log_fn: LogFn | None = _KEEP, trackers: Trackers | None = _KEEP, title: str | None = _KEEP,
        model: Any = _KEEP, optimizer: Any = None, precision: str | None = None, strategy: str | None = None,
        world_size: int | None = None,
    ) -> None:
        """Everything an adapter tells the session about its run, in one call: where logged metrics
        go (``log_fn(metrics, step)``), rank zero's trackers, the report's title, and the model and
        optimizer the census and the theory check look at (with ``precision``, ``strategy`` and
        ``world_size`` in :func:`memcallbacks.estimate.estimate`'s names). A part not given is kept;
        ``model`` is one part with ``optimizer``, ``precision``, ``strategy`` and ``world_size``
        (given together: those left out are None)."""
        if log_fn is not _KEEP:
            self.log_fn = log_fn
        if trackers is not _KEEP:
            self.trackers = trackers
        if title is not _KEEP and title is not None:
            self.title = title
        if model is not _KEEP:
            self.set_training_objects(model, optimizer, precision=precision, strategy=strategy, world_size=world_size)

    def observe(self, observer: Any) -> None:
        """Call ``observer`` at the step protocol's points (the pytest plugin's probe): its
        ``step_beginning(micro_batch)``, ``phase_closed(phase)``, ``step_ended(batch, loss)`` and
        ``run_finishing()``, each before or after the session's own work as its name says."""
        self._observers.append(observer)

    def _notify(self, event: str, *args: Any) -> None:
        for observer in self._observers:
            getattr(observer, event)(*args)

    def reset(self) -> None:
        self.engine.reset()
        self.files = {}
        self.events = []
        self.sink.reset()
        self.state = StateCheck(self.config)
        self.preflight.reset()
        self.step_open = self.quiet_step = False
        self.plan.quiet_until = 0

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

    def fail(self, exc: BaseException, where: str) -> None:
        """An internal error in an adapter's hook: logged once, and the monitor turns itself off."""
        self.engine.fail(exc, where)

    def _state_finding(self, step: int, baseline: int, batch: Any) -> Finding | None:
        """The theory check, isolated: an estimate that cannot be made is logged, never fatal."""
        try:
            finding = self.state.check(step, baseline, self.engine.start_allocated, self.engine.backend.kind, batch)  # type: ignore[union-attr]
        except Exception as exc:
            self.state.done = True
            self.log.info("%s: no model-state estimate for this run (%s: %s); the rest of the monitor goes on.", self.owner, type(exc).__name__, exc)
            return None
        watch = self.watch
        census = search_or_note(finding, lambda: watch.census(batch), None) if finding is not None and watch is not None else None
        if census is not None:  # a census that fails costs the holders only (the finding says why)
            finding.holders = format_top_holders(census, 5)  # type: ignore[union-attr]
            finding.details["census"] = {k: int(v) for k, v in census.bytes_by_category.items()}  # type: ignore[union-attr]
        return finding

    def check_lingering(self, batch: Any = None) -> None:
        """Run the lingering check deferred by ``begin_step(defer_lingering=True)`` (once per step)."""
        if not self._lingering_due:
            return
        self._lingering_due = False
        if self.watch is not None and self.engine.enabled:
            t0 = time.perf_counter()
            try:
                for finding in self.watch.check_lingering(self.current_step, batch):
                    self.add_finding(finding)
            except Exception as exc:
                self.engine.fail(exc, "lingering check")
            self.cadence.charge_other(time.perf_counter() - t0, "lingering")  # outside the step's timed parts

    def set_training_objects(
        self, model: Any, optimizer: Any, *, precision: str | None = None, strategy: str | None = None, world_size: int | None = None
    ) -> None:
        """What the census and the theory check look at (see :meth:`attach`)."""
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
        now = self.plan.allocated_now()
        if now is not None or self.plan.read is not None:
            return now
        backend = self.engine.backend
        return backend.current()[0] if backend is not None else None

    # ------------------------------------------------------------------ start
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
            folder = output_folder(config.output_dir, default_output_dir)
            claim_folder(folder, self, self.owner)
            self.output_dir = check_writable(folder, self.owner)
            if config.auto_snapshot:
                check_writable(os.path.join(folder, "snapshots"), "auto_snapshot")
        self.live = True
        # the plan first: even a monitor whose start fails below must agree with the other ranks on logged steps
        log_every = config.log_every_n_steps or max(int(framework_log_every or 50), 1)
        # a later stage of the same run (fit, then test) keeps the training cadence
        self.plan.configure(log_every=log_every, logs=logs, log_first_step=log_first_step, keep=self.engine.seen_steps > 0)
        try:
            self._start_parts(device, rank, world_size)
        except Exception as exc:  # backend selection, the first reads, the leak watch: never fatal
            self.engine.fail(exc, "monitor start")

    def _start_parts(self, device: Any, rank: int | None, world_size: int | None) -> None:
        config = self.config
        self.engine.start(device, rank=rank, world_size=world_size)
        if self.watch is not None:
            self.watch.stop()
        self.plan.arm(self.engine.backend)
        self.cadence.announce = (self.log, self.owner) if self.engine.rank == 0 else None  # the budget's back-off, said once
        self.watch = LeakWatch(config, self._allocated_now, ignore=[self], charge=self.cadence.charge_other, wake=self.plan.wake,
                               ledger=self.cadence.ledger)
        self.watch.start()
        if self.host is not None:
            self.host.close()
        self.host = HostChannel(device_is_host=self.device_kind == "cpu") if config.watch_host else None
        if self.snap is not None:
            self.snap.stop()
            self.snap = None
        if config.auto_snapshot and self.output_dir is not None and self.engine.backend is not None:
            engine = self.engine
            self.snap = AutoSnapshot.for_backend(config, engine.backend, self.output_dir, engine.rank, engine.world_size, self.log)
            self.snap.start()

    # ------------------------------------------------------------------ what adapters read
    @property
    def cadence(self) -> Cadence:
        return self.plan.cadence

    @property
    def log_every(self) -> int:
        return self.plan.cadence.log_every

    @property
    def sample_every(self) -> int:
        return self.plan.cadence.sample_every

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
        return self.engine.sampling or self._marks or self.lingering_wants_mark

    @property
    def lingering_due(self) -> bool:
        """A step opened with ``defer_lingering=True`` still owes its lingering check."""
        return self._lingering_due

    @property
    def lingering_wants_mark(self) -> bool:
        """The last lingering check could not tell yet: the open step leaves marks for the next one."""
        lingering = self.watch.lingering if self.watch is not None else None
        return lingering is not None and lingering.wants_mark

    @property
    def lingering_pending(self) -> bool:
        """The previous step left marks (batch references, a marked graph) for the lingering check."""
        lingering = self.watch.lingering if self.watch is not None else None
        return lingering is not None and lingering.pending

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
        """``preflight=True`` and the prediction has not run yet in this fit."""
        return self.preflight.due

    def run_preflight(self, batch: Any, **kwargs: Any) -> None:
        """Predict this batch's step on fake tensors before it runs (:meth:`PreflightCheck.run`)."""
        self.preflight.run(batch, **kwargs)

    def watch_first_forward(self, model: Any) -> None:
        """Plain loops: the pre-flight predicts the step at ``model``'s first training forward."""
        self.preflight.watch_first_forward(model)

    @property
    def rows(self) -> list[list[Any]]:
        """The history rows so far (columns.py's layout)."""
        return self.engine.rows

    def will_log(self, count: int) -> bool:
        """Whether the step after ``count`` steps is logged: every ``log_every`` steps (the monitor's
        ``log_every_n_steps``, else the framework's), plus the first step where the framework logs
        it; never when the run has nowhere to log. From counts only, so every rank agrees."""
        return self.plan.will_log(count)

    def wants_sample(self, count: int, log: bool) -> bool:
        """Whether the step after ``count`` steps is measured in full: logged steps, every
        ``sample_every``-th step (see :class:`Cadence`), and the step where the theory check is due."""
        return self.plan.wants_sample(count, log) or (self.state.wanted and self.engine.optimizer_steps_total > 0)

    # ------------------------------------------------------------------ steps
    def begin_step(
        self, step: int, epoch: int = 0, batch_idx: int = 0, *, log: bool | None = None, count: int | None = None,
        batch: Any = None, sample: bool | None = None, defer_lingering: bool = False,
    ) -> None:
        """Open a step (or, if one is open, count a further micro-batch).

        ``count``: steps before this one, for the plan (default ``step``; Lightning passes batches
        that stepped). ``log=None``: :meth:`will_log`; ``sample=None``: :meth:`wants_sample`.
        ``batch`` is only looked at (leak detection), never kept. ``defer_lingering``: the caller
        runs :meth:`check_lingering` later in the step (plain loops, whose loop variable still holds
        the previous batch when the step begins). A step the plan calls quiet is only counted; its
        ``boundary``/``end_step`` calls do nothing. Otherwise a step is *watched* (the leak watch
        only) or *sampled* (per-phase peaks and a history row)."""
        if self._observers:
            self._notify("step_beginning", self.step_open)
        if self.step_open:
            self._micro_batch()
            return
        n = step if count is None else count
        self.current_step, self.current_count = step, n
        if not log and not sample and self.plan.quiet(n):
            self._begin_quiet(step)
            return
        self.quiet_step = False
        self.step_open = True
        self._lingering_due = defer_lingering
        self._marks = n < LINGERING_EVERY_STEP_UNTIL
        # decided even when disabled, so that every rank agrees on which steps join a collective
        self.log_this_step = log = self.will_log(n) if log is None else log
        engine = self.engine
        if not engine.enabled:
            return
        if self.snap is not None:
            self.snap.step = step
            if self.snap.busy:  # a capture or a deferred dump counts steps
                self.snap.on_step_start(step)
        try:
            self.cadence.step_started(n)
            self.plan.read_s = 0.0
            if self.wants_sample(n, log) if sample is None else sample:
                self._begin_sampled(step, epoch, batch_idx, batch, defer_lingering)
            else:
                self._begin_watched(step, epoch, batch_idx, batch, defer_lingering)
        except Exception as exc:
            engine.fail(exc, "step start")

    def _micro_batch(self) -> None:
        if self.engine.enabled:
            try:
                self.engine.micro_batch()
            except Exception as exc:
                self.engine.fail(exc, "micro-batch boundary")

    def _begin_quiet(self, step: int) -> None:
        """Open a quiet step, for the adapters' bookkeeping: nothing is measured."""
        self.quiet_step = self.step_open = True
        self.log_this_step = self._lingering_due = False
        self.engine.quiet_step()
        if self.snap is not None:
            self.snap.step = step

    def _begin_watched(self, step: int, epoch: int, batch_idx: int, batch: Any, defer_lingering: bool) -> None:
        """An unsampled step: the leak watch only (the lingering check, a memory read on some steps)."""
        t0 = time.perf_counter()
        found: list[Finding] = []
        if self.watch is not None:
            found = self.watch.before_baseline(step, batch, lingering=not defer_lingering)
            found += self._watch(batch)
        found += self._host_read(step)
        self.engine.begin_step(step, epoch, batch_idx, False)
        self._fast_s = time.perf_counter() - t0 - self.plan.read_s  # charged at step end, with the end's own time
        self._fast_typical = not found
        for finding in found:
            self.add_finding(finding)

    def _begin_sampled(self, step: int, epoch: int, batch_idx: int, batch: Any, defer_lingering: bool) -> None:
        """A sampled step: the watch, then the baseline (which is also the watch's read), then the theory check."""
        engine, watch = self.engine, self.watch
        self._fast_s = None
        self._marks = self._marks or self._samples_unmarked + 1 >= self.cadence.mark_every
        t0 = time.perf_counter()
        found = watch.before_baseline(step, batch, lingering=not defer_lingering) if watch is not None else []
        check_state = self.state.wanted and engine.optimizer_steps_total > 0
        spent = time.perf_counter() - t0
        engine.begin_step(step, epoch, batch_idx, True)
        t1 = time.perf_counter()
        baseline = engine.step_baseline
        found += self._watch(batch, baseline)
        found += self._host_read(step)
        if check_state and baseline is not None:
            finding = self._state_finding(step, baseline, batch)
            if finding is not None:
                found.append(finding)
        for finding in found:
            self.add_finding(finding)
        engine.add_own_time(spent + time.perf_counter() - t1)

    def _watch(self, batch: Any, value: int | None = None) -> list[Finding]:
        """Growth detection fed with ``value`` (a sampled step's baseline) or, on the steps the plan
        reads memory, with the watch's own read."""
        count = self.current_count
        if self.watch is None or self.plan.read is None:
            return []
        if value is None:
            value = self.plan.take_read(count)
            if value is None:
                return []
        self.plan.after_read(count, value)
        return self.watch.after_baseline(count, value, batch)

    def _host_read(self, step: int) -> list[Finding]:
        """The host channel at a step that is not quiet (docs/host.md): its read is part of the
        step's own time; a census after suspicion is reported apart, with the other censuses."""
        host = self.host
        if host is None:
            return []
        census_s = host.census_seconds
        found = host.on_read(step)
        self.cadence.ledger.finding(host.census_seconds - census_s)  # split out of the step's charge, as the watch's censuses
        return found

    def count_quiet(self, steps: int) -> None:
        """``steps`` quiet steps an adapter skipped without calling :meth:`begin_step` (Lightning)."""
        if steps > 0:
            self.engine.quiet_step(steps)

    def wake(self) -> None:
        """Something needs the next step: it is not quiet."""
        self.plan.wake()

    def boundary(self, closing: int) -> None:
        """Phase ``closing`` ended (a :class:`~memcallbacks._base.columns.Phase`); the next one begins."""
        engine = self.engine
        if engine.enabled:  # engine.boundary returns at once on unsampled steps
            try:
                engine.boundary(closing)
            except Exception as exc:
                engine.fail(exc, "phase boundary")
        if self._observers:
            self._notify("phase_closed", closing)

    def end_step(
        self, closing: int = OPTIMIZER, *, log_step: int | None = None, batch: Any = None, loss: Any = None, outputs: Any = None
    ) -> list[Any] | None:
        """Close the step, append its row and, on logged steps, emit its metrics through ``log_fn``.

        ``batch``, ``loss`` (the step's last) and ``outputs`` (the model's outputs the adapter saw)
        are handed to leak detection as weak references."""
        if not self._observers:
            return self._end_step(closing, log_step, batch, loss, outputs)
        was_open = self.step_open
        if was_open:
            self._notify("phase_closed", closing)
        row = self._end_step(closing, log_step, batch, loss, outputs)
        if was_open:
            self._notify("step_ended", batch, loss)
        return row

    def _end_step(self, closing: int, log_step: int | None, batch: Any, loss: Any, outputs: Any) -> list[Any] | None:
        if self.quiet_step:
            self.quiet_step = self.step_open = False
            return None
        engine = self.engine
        row = None
        if self._lingering_due:
            self.check_lingering(batch)  # charged on its own (charge_other), so timed before t_end
        t_end = time.perf_counter()
        if engine.enabled:
            try:
                row = self._close_row(closing, t_end, batch, loss, outputs)
            except Exception as exc:
                engine.fail(exc, "step end")
        self.step_open = False
        self._plan_quiet()
        if self.log_this_step and (row is not None or engine.world_size > 1):
            try:
                metrics = engine.log_values(row, self._extra_metrics(row))
                self.emit(metrics, self.current_step if log_step is None else log_step)
            except Exception as exc:
                engine.fail(exc, "logging")
        return row

    def _close_row(self, closing: int, t_end: float, batch: Any, loss: Any, outputs: Any) -> list[Any] | None:
        """The engine's row, the lingering marks, the tripwire, the pre-flight comparison, the budget, snapshots."""
        engine = self.engine
        sampled = engine.sampling
        row = engine.end_step(closing)
        # lingering references: every step at first (leaky loops leak from step 1), then after every
        # cadence.mark_every-th sampled step (weak references and graph marks, ~2-45 µs, and a check
        # at the next step start, which then is not quiet)
        if self.watch is not None and (self._marks or self.lingering_wants_mark):
            t0 = time.perf_counter()
            self.watch.end_step(self.current_step, batch, loss, outputs)
            if row is not None:
                row[MONITOR_TIME_S] += time.perf_counter() - t0
            self._samples_unmarked = 0
        elif sampled:
            self._samples_unmarked += 1
        self._marks = False
        if row is not None:
            if self.plan.rebase(row[PEAK_RESERVED], pinned=not getattr(engine.backend, "resets_hwm", False)):
                self.log.debug("memcallbacks: the resident-set high-water mark is pinned above the resident set; the RSS tripwire reads statm")
            self.preflight.compare(row)
            self.cadence.charge(row[MONITOR_TIME_S], sampled=True)
        elif self._fast_s is not None:  # an unsampled step: its start and its end, as one cost
            self.cadence.charge(self._fast_s + time.perf_counter() - t_end, sampled=False, typical=self._fast_typical)
        self._fast_s = None
        if self.snap is not None and (row is not None or self.sink.new):
            new = self.sink.take_new()
            if row is not None:
                self.snap.after_row(self.current_step, row, new)
            else:  # a watched step found something: the finding triggers, not the row
                self.snap.after_findings(self.current_step, new)
        return row

    def _plan_quiet(self) -> None:
        """After a step: the quiet stretch that follows, unless something needs the next step."""
        watch = self.watch
        busy = (
            not self.engine.enabled or self._lingering_due or self.lingering_pending or self.state.wanted or self.preflight.due
            or (self.snap is not None and self.snap.busy)
            or (watch is not None and watch.collections is not None and watch.collections.due)
        )
        self.plan.plan_after(self.current_count, busy=busy, reads=watch is not None)

    def _extra_metrics(self, row: list[Any] | None) -> dict[str, float]:
        dashboard = self.dashboard
        return extra_metrics(
            self.config, row, findings=self.sink.problems(), overhead=self.cadence.overhead, preflight=self.preflight,
            capacity=self.engine.capacity if dashboard.capacity else None, state=self.state, snap=self.snap,
            last_gc=self.watch.last_gc if self.watch is not None else None,
            host={**self.host.growth.figures(), **self.host.workers.figures()} if self.host is not None else None,
        )

    @property
    def dashboard(self) -> Dashboard:
        """What the trackers' charts show; a capacity line where the device has one (not host RAM on CPU)."""
        return Dashboard(self.config.prefix, capacity=self.device_kind != "cpu" and bool(self.engine.capacity))

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
        if self.host is not None:
            try:
                self.host.close()
            except Exception:
                self.log.exception("%s: could not close its host channel; continuing.", self.owner)
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
        from memcallbacks._files.report import format_report

        return format_report(self.report(), self.history_frame())

    def history_frame(self) -> Any:
        """The engine's history, with the pre-flight's predicted columns when there is a prediction."""
        return self.preflight.add_columns(self.engine.history_frame())

    # ------------------------------------------------------------------ checkpointing
    def state_dict(self) -> dict[str, Any]:
        """The engine's checkpointed state plus the run's events and findings."""
        state = self.engine.state_dict()
        state["events"] = list(self.events)
        state["findings"] = self.sink.to_list()
        return state

    def load_state_dict(self, state: dict[str, Any], key: str = "state_dict") -> None:
        """Restore a checkpointed state; a bad one raises one ``ValueError`` naming ``key`` (see saved_state.py)."""
        read = self.engine.load_state_dict(state, key)
        if read is None:
            return
        self.events = read["events"]
        self.sink.restore(read["findings"])


def output_folder(output_dir: Any, default: Any) -> str:
    """The one rule for where a run's files go: ``output_dir``, else the adapter's default (the
    framework's log folder), else ``memcallbacks_output`` in the working directory (not
    ``./memcallbacks``: run from a source checkout, that is the package itself). Absolute and
    with links resolved, once, at start: a later ``chdir`` must not move the files."""
    return os.path.realpath(output_dir or default or os.path.join(os.getcwd(), "memcallbacks_output"))
