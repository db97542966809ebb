"""The session every adapter drives: one run's step protocol (begin_step, boundary, end_step), orchestrating the plan, the engine, the checks and the run's end.

Adapters (Lightning, Accelerate, Transformers, the plain-loop ``Monitor``) own one
:class:`Session` and only translate their framework's events into its calls. Nothing here
imports a framework.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import Any, Callable

from memcallbacks._base.config import MonitorConfig
from memcallbacks._base.columns import OPTIMIZER
from memcallbacks._base.findings import Finding
from memcallbacks._runtime.auto_snapshot import AutoSnapshot
from memcallbacks._runtime.cadence import LINGERING_EVERY_STEP_UNTIL, Cadence
from memcallbacks._runtime.checks import StepChecks
from memcallbacks._runtime.finding_sink import FindingSink
from memcallbacks._runtime.evaluation import begin_eval, end_eval, eval_batch
from memcallbacks._runtime.plan import StepPlan
from memcallbacks._runtime.run_end import RunEnd, is_oom
from memcallbacks._runtime.run_start import reset_run, restore_state, saved_state, start_run, stop_run
from memcallbacks._runtime.sampling import MemoryEngine
from memcallbacks._runtime.step_begin import begin_quiet, begin_sampled, begin_watched, micro_batch
from memcallbacks._runtime.step_end import close_step
from memcallbacks.trackers import Dashboard, Trackers

log = logging.getLogger(__name__)

__all__ = ["Session", "LogFn", "is_oom", "LINGERING_EVERY_STEP_UNTIL"]

LogFn = Callable[[dict[str, float], int], None]


_KEEP: Any = object()  # attach(): a part not given keeps its current value


class Session:
    """One process's monitor state: what a step does (the plan), the measurements (the engine),
    the checks (leak watch, host, theory, pre-flight: :attr:`checks`), the findings, and the
    run's end (:attr:`ending`). Every method is safe to call when disabled.

    Adapters configure it with :meth:`attach` and drive it with the step protocol:
    ``begin_step`` → ``boundary`` (per phase) → ``end_step``, ``begin_eval``/``eval_batch``/
    ``end_eval``, then ``finish`` and ``stop``. :attr:`plan` answers which steps are quiet."""

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
        self.plan = StepPlan(config)
        self.log_fn: LogFn | None = None  # adapters pass their own methods through weak_method (lifecycle.py)
        self.live = False  # between start() and stop(): owns its output folder
        self.output_dir: Path | None = None
        self.files: dict[str, str] = {}
        self.events: list[dict[str, Any]] = []
        self.sink = FindingSink(owner, self.log, self._rank)
        self.checks = StepChecks(config, self.engine, self.plan, owner, self.log, self.sink.add, self._current_step)
        self.ending = RunEnd(self)
        self.snap: AutoSnapshot | None = None
        self.trackers: Trackers | None = None  # rank zero's trackers (TensorBoard, W&B, MLflow)
        self._observers: list[Any] = []
        self.lingering_due = False
        """A step opened with ``defer_lingering=True`` still owes its lingering check."""
        self.title = ""
        self._warned: set[str] = set()
        # read and set by step_begin.py and step_end.py:
        self.fast_s: float | None = None  # an unsampled step's own time so far (None: sampled, or not open)
        self.fast_typical = True  # the unsampled step found nothing (its cost chooses the intervals)
        self.marks = False  # this step's end leaves marks for the lingering check
        self.samples_unmarked = 0
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
        """A new fit: no rows, events, findings or open step (run_start.py)."""
        reset_run(self)

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

    def check_lingering(self, batch: Any = None) -> None:
        """Run the lingering check deferred by ``begin_step(defer_lingering=True)`` (once per step)."""
        if not self.lingering_due:
            return
        self.lingering_due = False
        watch = self.checks.watch
        if watch is not None and self.engine.enabled:
            t0 = time.perf_counter()
            try:
                for finding in watch.check_lingering(self.current_step, batch):
                    self.add_finding(finding)
            except Exception as exc:
                self.engine.fail(exc, "lingering check")
            self.cadence.charge_other(time.perf_counter() - t0, "lingering")  # outside the step's timed parts

    def explain(self, batch: Any = None) -> Any:
        """Take a census now: live tensors by category, and who holds the suspicious ones."""
        return self.checks.explain(batch, ignore=[self])

    # ------------------------------------------------------------------ start and stop (run_start.py)
    def start(self, device: Any, **options: Any) -> None:
        """Choose the device backend, the output folder and the intervals: :func:`~memcallbacks._runtime.run_start.start_run`
        (its keyword options; ``PermissionError`` for a folder the run cannot write or must not share)."""
        start_run(self, device, **options)

    def stop(self) -> None:
        """Undo everything the session changed in the process; each part on its own, safe to call twice."""
        stop_run(self)

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
        return self.engine.sampling or self.marks or self.checks.lingering_wants_mark

    @property
    def lingering_pending(self) -> bool:
        """The previous step left marks (batch references, a marked graph) for the lingering check."""
        watch = self.checks.watch  # not checks.lingering_pending: no extra call on the plain loop's step path
        lingering = watch.lingering if watch is not None else None
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
        return self.checks.preflight.due

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

    def will_log(self, count: int) -> bool:
        """Whether the step after ``count`` steps is logged: every ``log_every`` steps (the monitor's
        ``log_every_n_steps``, else the framework's), plus the first step where the framework logs
        it; never when the run has nowhere to log. From counts only, so every rank agrees."""
        return self.plan.will_log(count)

    def wants_sample(self, count: int, log: bool) -> bool:
        """Whether the step after ``count`` steps is measured in full: logged steps, every
        ``sample_every``-th step (see :class:`Cadence`), and the step where the theory check is due."""
        return self.plan.wants_sample(count, log) or (self.checks.state.wanted and self.engine.optimizer_steps_total > 0)

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
            micro_batch(self)
            return
        n = step if count is None else count
        self.current_step, self.current_count = step, n
        if not log and not sample and self.plan.quiet(n):
            begin_quiet(self, step)
            return
        self.quiet_step = False
        self.step_open = True
        self.lingering_due = defer_lingering
        self.marks = n < LINGERING_EVERY_STEP_UNTIL
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
                begin_sampled(self, step, epoch, batch_idx, batch, defer_lingering)
            else:
                begin_watched(self, step, epoch, batch_idx, batch, defer_lingering)
        except Exception as exc:
            engine.fail(exc, "step start")

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
            return close_step(self, closing, log_step, batch, loss, outputs)
        was_open = self.step_open
        if was_open:
            self._notify("phase_closed", closing)
        row = close_step(self, closing, log_step, batch, loss, outputs)
        if was_open:
            self._notify("step_ended", batch, loss)
        return row

    @property
    def dashboard(self) -> Dashboard:
        """What the trackers' charts show; a capacity line where the device has one (not host RAM on CPU)."""
        return Dashboard(self.config.prefix, capacity=self.device_kind != "cpu" and bool(self.engine.capacity), keys=self.config.logged_keys)

    def emit(self, metrics: dict[str, float], step: int) -> None:
        if self.log_fn is not None and self.engine.rank == 0 and (shown := self.config.logged(metrics)):
            self.log_fn(shown, step)
            if self.trackers is not None and self.config.log_to_trackers:
                self.trackers.on_log(self.findings, self.dashboard)

    # ------------------------------------------------------------------ evaluation (evaluation.py)
    def begin_eval(self, stage: str, step: int, epoch: int = 0) -> None:
        begin_eval(self, stage, step, epoch)

    def eval_batch(self) -> None:
        eval_batch(self)

    def end_eval(self, *, log_step: int, emit: bool = True) -> list[Any] | None:
        return end_eval(self, log_step, emit)

    # ------------------------------------------------------------------ results
    def format_report(self) -> str:
        from memcallbacks._files.report import format_report

        return format_report(self.report(), self.history_frame())

    def history_frame(self) -> Any:
        """The engine's history, with the pre-flight's predicted columns when there is a prediction."""
        return self.checks.preflight.add_columns(self.engine.history_frame())

    # ------------------------------------------------------------------ the run's end (run_end.py)
    def record_exception(self, exc: BaseException, step: int) -> None:
        """Note an exception that is ending the run as an event (``"oom"`` or ``"exception"``); never raises."""
        self.ending.record_exception(exc, step)

    def finish(self, *, gather: bool) -> dict[str, str]:
        """Close any open step and write this rank's files. ``gather`` (a collective: every rank must
        call it) also puts every rank's summary into rank zero's ``report.json``.

        A run that recorded nothing (a second ``fit`` that had no step left to run) writes no
        files: the folder keeps the previous run's set rather than an empty history."""
        if self._observers:
            self._notify("run_finishing")
        return self.ending.finish(gather)

    def report(self) -> dict[str, Any]:
        """What ``report.json`` holds: version, config, summary, findings, events and files."""
        return self.ending.report()

    # ------------------------------------------------------------------ checkpointing (run_start.py)
    def state_dict(self) -> dict[str, Any]:
        """The engine's checkpointed state plus the run's events and findings."""
        return saved_state(self)

    def load_state_dict(self, state: dict[str, Any], key: str = "state_dict") -> None:
        """Restore a checkpointed state; a bad one raises one ``ValueError`` naming ``key`` (see saved_state.py)."""
        restore_state(self, state, key)
