"""What every adapter shares: the engine plus step bookkeeping, logging decisions, findings, files and failures.

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

import torch

from memcallbacks._runtime import distributed as _distributed
from memcallbacks._config import MonitorConfig
from memcallbacks._runtime.columns import ALLOCATED, E_STAGE, MONITOR_TIME_S, OPTIMIZER
from memcallbacks._runtime.sampling import GIB, MemoryEngine
from memcallbacks._findings import Finding, FindingLog
from memcallbacks._runtime.outputs import REPORT_VERSION, check_writable, write_json, write_outputs
from memcallbacks.snapshot.auto import AutoSnapshot
from memcallbacks.estimate.check import StateCheck
from memcallbacks.leaks.census import format_top_holders
from memcallbacks.leaks.watch import LeakWatch
from memcallbacks.trackers import Dashboard, RunOutputs, Trackers
from memcallbacks.trackers.ranks import receive_snapshots, snapshot_payload

log = logging.getLogger(__name__)

__all__ = ["Session", "LogFn", "is_oom"]

LogFn = Callable[[dict[str, float], int], None]

# Lingering references are checked after every one of the first steps, then on sampled steps only.
LINGERING_EVERY_STEP_UNTIL = 20


def is_oom(exc: BaseException) -> bool:
    """True for torch's OutOfMemoryError, host MemoryError, and RuntimeErrors that say "out of memory"."""
    oom_type = getattr(torch, "OutOfMemoryError", None)
    if oom_type is not None and isinstance(exc, oom_type):
        return True
    if isinstance(exc, MemoryError):
        return True
    return isinstance(exc, RuntimeError) and "out of memory" in str(exc).lower()


class Session:
    """One process's monitor state. Every method is safe to call when disabled."""

    def __getstate__(self) -> dict[str, Any]:
        state = dict(self.__dict__)
        state["log_fn"] = None  # adapters set it again when they start
        state["watch"] = None  # detectors hold weak references; start() builds new ones
        state["snap"] = None
        state["trackers"] = None
        return state

    def __init__(self, config: MonitorConfig, framework: str, owner: str, logger: logging.Logger | None = None) -> None:
        self.config = config
        self.log = logger or log  # the adapter's logger, so users filter warnings by adapter
        self.framework = framework
        self.owner = owner  # the public class name, for messages
        self.engine = MemoryEngine(config)
        self.log_fn: LogFn | None = None
        self.output_dir: Path | None = None
        self.files: dict[str, str] = {}
        self.events: list[dict[str, Any]] = []
        self._findings = FindingLog()
        self.watch: LeakWatch | None = None
        self.state = StateCheck(config)
        self.snap: AutoSnapshot | None = None
        self.trackers: Trackers | None = None  # rank zero's trackers (TensorBoard, W&B, MLflow); adapters set it
        self._new_findings: list[Finding] = []
        self._holders_logged: set[str] = set()
        self._lingering_due = False
        self.title = ""
        self._warned: set[str] = set()
        self.sample_every = 1
        self.log_every = 50
        self.logs = True  # False: the run has nowhere to log (no logger), so no step is a logged step
        self.log_first_step = False
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
        self.step_open = False

    @property
    def findings(self) -> list[Finding]:
        return self._findings.findings

    def add_finding(self, finding: Finding) -> None:
        """Keep one finding per cause; log a new cause once, as a warning, on rank zero."""
        if self._findings.add(finding):
            self._new_findings.append(finding)
            if self.engine.rank == 0:
                self.log.warning("%s found a memory problem: %s", self.owner, finding)
            if finding.holders:
                self._holders_logged.add(finding.key)
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
    ) -> None:
        """Choose the device backend, the output folder and the sampling/logging intervals.

        Raises ``PermissionError`` for an unwritable output folder: environment problems must stop
        the run before training, not during it.
        """
        config = self.config
        if config.write_files:
            # not "./memcallbacks": run from a source checkout, that is the package itself
            folder = config.output_dir or default_output_dir or os.path.join(os.getcwd(), "memcallbacks_output")
            self.output_dir = check_writable(folder, self.owner)
        self.engine.start(device, rank=rank, world_size=world_size)
        if self.watch is not None:
            self.watch.stop()
        self.watch = LeakWatch(config, self._allocated_now, ignore=[self])
        self.watch.start()
        if self.snap is not None:
            self.snap.stop()
            self.snap = None
        if config.auto_snapshot and self.output_dir is not None and self.engine.backend is not None:
            backend = self.engine.backend
            self.snap = AutoSnapshot(
                config,
                device_kind=backend.kind,
                capacity=backend.capacity(),
                output_dir=self.output_dir,
                rank=self.engine.rank,
                world_size=self.engine.world_size,
                alloc_retries_at_start=backend.counters().get("alloc_retries", 0),
                logger=self.log,
            )
            self.snap.start()
        self.log_every = config.log_every_n_steps or max(int(framework_log_every or 50), 1)
        self.logs = bool(logs)
        self.log_first_step = bool(log_first_step)
        backend = self.engine.backend
        if config.sample_every_n_steps is not None:
            self.sample_every = config.sample_every_n_steps
        elif backend is not None and backend.kind == "cpu":
            self.sample_every = self.log_every
        else:
            self.sample_every = 1

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
        return self.engine.sampling or self.current_count < LINGERING_EVERY_STEP_UNTIL

    @property
    def lingering_due(self) -> bool:
        """A step opened with ``defer_lingering=True`` still owes its lingering check."""
        return self._lingering_due

    def will_log(self, count: int) -> bool:
        """Whether the step after ``count`` steps is logged: the one place every adapter asks.

        Every ``log_every`` steps (the monitor's ``log_every_n_steps``, else the framework's),
        plus the first step where the framework logs it; never when the run has nowhere to log.
        Decided from counts only, so every rank agrees (logged steps join a collective)."""
        if not self.logs:
            return False
        return (count + 1) % self.log_every == 0 or (self.log_first_step and count == 0)

    @property
    def lingering_pending(self) -> bool:
        """The previous step left marks (batch references, a marked graph) for the lingering check."""
        lingering = self.watch.lingering if self.watch is not None else None
        return lingering is not None and lingering.pending

    def wants_sample(self, count: int, log: bool) -> bool:
        """Whether the step after ``count`` steps is measured in full: logged steps, every
        ``sample_every``-th step, and the step where the theory check is due."""
        return log or (count + 1) % self.sample_every == 0 or (self.state.wanted and self.engine.optimizer_steps_total > 0)

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
        where the caller's loop variable still holds the previous batch when the step begins)."""
        engine = self.engine
        if self.step_open:
            if engine.enabled:
                try:
                    engine.micro_batch()
                except Exception as exc:
                    engine.fail(exc, "micro-batch boundary")
            return
        self.step_open = True
        self.current_step = step
        self._lingering_due = defer_lingering
        n = step if count is None else count
        self.current_count = n
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
            watch = self.watch
            if sample is None:
                sample = self.wants_sample(n, log)
            if not sample:  # the fast path: nothing but the (cheap when healthy) lingering check
                if watch is not None:
                    for finding in watch.before_baseline(step, batch, lingering=not defer_lingering):
                        self.add_finding(finding)
                engine.begin_step(step, epoch, batch_idx, False)
                return
            t0 = time.perf_counter()
            found = watch.before_baseline(step, batch, lingering=not defer_lingering) if watch is not None else []
            check_state = self.state.wanted and engine.optimizer_steps_total > 0
            spent = time.perf_counter() - t0
            engine.begin_step(step, epoch, batch_idx, True)
            t1 = time.perf_counter()
            baseline = engine.step_baseline
            if baseline is not None and watch is not None:
                found += watch.after_baseline(step, baseline, batch)
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

    def boundary(self, closing: int) -> None:
        engine = self.engine
        if engine.enabled:  # engine.boundary returns at once on unsampled steps
            try:
                engine.boundary(closing)
            except Exception as exc:
                engine.fail(exc, "phase boundary")

    def end_step(self, closing: int = OPTIMIZER, *, log_step: int | None = None, batch: Any = None, loss: Any = None) -> list[Any] | None:
        """Close the step, append its row and, on logged steps, emit its metrics through ``log_fn``.

        ``batch`` and ``loss`` (the step's last) are handed to leak detection as weak references."""
        engine = self.engine
        row = None
        if self._lingering_due:
            self.check_lingering(batch)
        if engine.enabled:
            try:
                sampled = engine.sampling
                row = engine.end_step(closing)
                # lingering references: every step at first (leaky loops leak from step 1), then on
                # sampled steps, where the weak references and graph marks (~2-30 µs) are affordable
                if self.watch is not None and (sampled or self.current_count < LINGERING_EVERY_STEP_UNTIL):
                    t0 = time.perf_counter()
                    self.watch.end_step(self.current_step, batch, loss)
                    if row is not None:
                        row[MONITOR_TIME_S] += time.perf_counter() - t0
                if row is not None and self.snap is not None:
                    new, self._new_findings = self._new_findings, []
                    self.snap.after_row(self.current_step, row, new)
            except Exception as exc:
                engine.fail(exc, "step end")
        self.step_open = False
        if self.log_this_step and (row is not None or engine.world_size > 1):
            try:
                metrics = engine.log_values(row, self._extra_metrics(row))
                self.emit(metrics, self.current_step if log_step is None else log_step)
            except Exception as exc:
                engine.fail(exc, "logging")
        return row

    def _extra_metrics(self, row: list[Any] | None) -> dict[str, float]:
        """Findings count, theory check and gc, with the same keys on every rank and every logged step."""
        p = self.config.prefix
        nan = float("nan")
        extra = {f"{p}/findings": float(len(self._findings))}
        if self.dashboard.capacity:
            extra[f"{p}/capacity_GiB"] = float(self.engine.capacity or 0) / GIB
        if self.config.estimate_model_states:
            unexplained = self.state.unexplained(float(row[ALLOCATED])) if row is not None else None
            extra[f"{p}/expected_GiB"] = self.state.expected_states / GIB if self.state.expected_level is not None else nan
            extra[f"{p}/unexplained_GiB"] = unexplained / GIB if unexplained is not None else nan
        if self.snap is not None or self.config.auto_snapshot:
            extra[f"{p}/snapshots"] = float(len(self.snap.records)) if self.snap is not None else nan
        if self.config.gc_every_n_steps:
            last = self.watch.last_gc if self.watch is not None else None
            extra[f"{p}/gc_time_ms"] = last["seconds"] * 1e3 if last else nan
            extra[f"{p}/gc_collected"] = float(last["collected"]) if last else nan
            extra[f"{p}/gc_freed_GiB"] = (last["bytes_freed"] or 0) / GIB if last else nan
        return extra

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
            self.engine.eval_batch()

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

    # ------------------------------------------------------------------ failures and the end
    def record_exception(self, exc: BaseException, step: int) -> None:
        """Note an exception that is ending the run (an OOM becomes an event); never raises."""
        if not is_oom(exc):
            return
        engine = self.engine
        event = {
            "kind": "oom",
            "step": int(step),
            "rank": engine.rank,
            "error": f"{type(exc).__name__}: {str(exc)[:2000]}",
            "max_allocated_bytes": engine.max_allocated,
            "max_reserved_bytes": engine.max_reserved,
        }
        self.events.append(event)
        if self.snap is not None:
            self.snap.on_exception(exc, step)
        self.log.error(
            "%s: out of memory at step %d on rank %d; writing the memory report before the error propagates.",
            self.owner,
            event["step"],
            engine.rank,
        )

    def report(self) -> dict[str, Any]:
        """What ``report.json`` holds: version, config, summary, findings, events and files."""
        from memcallbacks import __version__

        return {
            "version": REPORT_VERSION,
            "memcallbacks_version": __version__,
            "framework": self.framework,
            "config": self.config.to_dict(),
            "summary": self.engine.summary(),
            "findings": self._findings.to_list(),
            "events": list(self.events),
            "model_states": dict(self.state.info),
            "gc": list(self.watch.gc_results) if self.watch is not None else [],
            "snapshots": list(self.snap.records) if self.snap is not None else [],
            "files": dict(self.files),
        }

    def finish(self, *, gather: bool) -> dict[str, str]:
        """Close any open step and write this rank's files. ``gather`` (a collective: every rank must
        call it) also puts every rank's summary into rank zero's ``report.json``."""
        engine = self.engine
        try:
            if engine.in_step and engine.enabled:
                engine.end_step()
            self.step_open = False
            if self.snap is not None:
                self.snap.stop()  # writes a capture cut short by the end of training
            report = self.report()
            distributed = engine.world_size > 1 and _distributed.is_distributed()
            # one collective: every rank's summary, and its snapshot files for rank zero's trackers
            payload = snapshot_payload(report["snapshots"], engine.rank) if self.config.log_to_trackers and engine.rank > 0 else None
            gathered = _distributed.gather_objects((report["summary"], payload)) if gather and distributed else None
            summaries = [g[0] for g in gathered] if gathered is not None else None
            if not (self.config.write_files and self.output_dir is not None):
                self._to_trackers(report, gathered)
                return {}
            title = self.title or f"{self.framework} on {report['summary'].get('device', {}).get('device', '?')}"
            if engine.world_size > 1:
                title += f", rank {engine.rank}"
            self.files = write_outputs(
                self.output_dir,
                rank=engine.rank,
                world_size=engine.world_size,
                history=engine.history_frame(),
                eval_history=engine.eval_frame(),
                report=report,
                plot=self.config.plot,
                title=title,
            )
            if summaries is not None and engine.rank == 0:
                combined = dict(report, files=self.files, ranks=summaries)
                write_json(self.output_dir / "report.json", combined)
                self.files["combined_report"] = str(self.output_dir / "report.json")
                report = combined
            self._to_trackers(report, gathered)
        except Exception as exc:
            engine.fail(exc, "writing outputs")
        return self.files

    def _to_trackers(self, report: dict[str, Any], gathered: list[Any] | None) -> None:
        """Rank zero, after the files are written: the report, plot and every rank's snapshots to the trackers."""
        if self.trackers is None or not self.config.log_to_trackers or self.engine.rank != 0:
            return
        snapshots = [dict(r, rank=0) for r in report.get("snapshots", [])]
        snapshots += receive_snapshots([g[1] for g in gathered or []], self.output_dir)
        outputs = RunOutputs(
            self.config.prefix, report, dict(self.files), snapshots, list(self.findings), self.format_report()
        )
        self.trackers.finish(outputs, self.dashboard)

    def stop(self) -> None:
        if self.snap is not None:
            self.snap.stop()
        if self.watch is not None:
            self.watch.stop()
            self.watch.model = self.watch.optimizer = None
        self.state.model = self.state.optimizer = None
        self.engine.stop()

    def format_report(self) -> str:
        from memcallbacks._runtime.report import format_report

        return format_report(self.report(), self.engine.history_frame())

    # ------------------------------------------------------------------ checkpointing
    def state_dict(self) -> dict[str, Any]:
        state = self.engine.state_dict()
        state["events"] = list(self.events)
        state["findings"] = self._findings.to_list()
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.engine.load_state_dict(state)
        self.events = list(state.get("events", []))
        fields = set(Finding.__dataclass_fields__)
        for item in state.get("findings", []):
            try:
                self._findings.add(Finding(**{k: v for k, v in item.items() if k in fields}))
            except (TypeError, ValueError):
                log.debug("dropping unreadable finding from checkpoint: %r", item)
