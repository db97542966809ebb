"""What every adapter shares: the engine plus step bookkeeping, logging decisions, findings, files and failures.

Adapters (Lightning, Accelerate, Transformers, the plain-loop ``Monitor``) own one
:class:`MonitorCore` and only translate their framework's events into its calls. Nothing here
imports a framework.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Any, Callable

import torch

from memcallbacks import _distributed
from memcallbacks._config import MonitorConfig
from memcallbacks._engine import OPTIMIZER, OTHER, MemoryEngine
from memcallbacks._outputs import check_writable, write_json, write_outputs

log = logging.getLogger(__name__)

__all__ = ["MonitorCore", "is_oom"]

LogFn = Callable[[dict[str, float], int], None]


def is_oom(exc: BaseException) -> bool:
    """True for torch's OutOfMemoryError, host MemoryError, and RuntimeErrors that say "out of memory"."""
    oom_type = getattr(torch, "OutOfMemoryError", None)
    if oom_type is not None and isinstance(exc, oom_type):
        return True
    if isinstance(exc, MemoryError):
        return True
    return isinstance(exc, RuntimeError) and "out of memory" in str(exc).lower()


class MonitorCore:
    """One process's monitor state. Every method is safe to call when disabled."""

    def __getstate__(self) -> dict[str, Any]:
        state = dict(self.__dict__)
        state["log_fn"] = None  # adapters set it again when they start
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
        self.findings: list[Any] = []
        self.title = ""
        self._warned: set[str] = set()
        self.sample_every = 1
        self.log_every = 50
        self.step_open = False
        self.log_this_step = False
        self.current_step = 0

    # ------------------------------------------------------------------ lifecycle
    def reset(self) -> None:
        self.engine.reset()
        self.files = {}
        self.events = []
        self.findings = []
        self.step_open = False

    def start(
        self,
        device: Any,
        *,
        rank: int | None = None,
        world_size: int | None = None,
        default_output_dir: str | os.PathLike[str] | None = None,
        framework_log_every: int | None = None,
    ) -> None:
        """Choose the device backend, the output folder and the sampling/logging intervals.

        Raises ``PermissionError`` for an unwritable output folder: environment problems must stop
        the run before training, not during it.
        """
        config = self.config
        if config.write_files:
            folder = config.output_dir or default_output_dir or os.path.join(os.getcwd(), "memcallbacks")
            self.output_dir = check_writable(folder, self.owner)
        self.engine.start(device, rank=rank, world_size=world_size)
        self.log_every = config.log_every_n_steps or max(int(framework_log_every or 50), 1)
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
    def begin_step(self, step: int, epoch: int = 0, batch_idx: int = 0, *, log: bool | None = None, count: int | None = None) -> None:
        """Open a step (or, if one is open, count a further micro-batch).

        ``count`` is the number of steps before this one for the logging/sampling cadence (default
        ``step``; Lightning passes batches-that-stepped, which differs from ``global_step`` when
        several optimizers step per batch). ``log=None``: every ``log_every`` steps."""
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
        # decided even when disabled, so that every rank agrees on which steps join a collective
        n = step if count is None else count
        if log is None:
            log = (n + 1) % self.log_every == 0
        self.log_this_step = log
        if engine.enabled:
            try:
                engine.begin_step(step, epoch, batch_idx, log or (n + 1) % self.sample_every == 0)
            except Exception as exc:
                engine.fail(exc, "step start")

    def boundary(self, closing: int) -> None:
        engine = self.engine
        if engine.enabled:
            try:
                engine.boundary(closing)
            except Exception as exc:
                engine.fail(exc, "phase boundary")

    def end_step(self, closing: int = OPTIMIZER, *, log_step: int | None = None) -> list[Any] | None:
        """Close the step, append its row and, on logged steps, emit its metrics through ``log_fn``."""
        engine = self.engine
        row = None
        if engine.enabled:
            try:
                row = engine.end_step(closing)
            except Exception as exc:
                engine.fail(exc, "step end")
        self.step_open = False
        if self.log_this_step and (row is not None or engine.world_size > 1):
            try:
                metrics = engine.log_values(row)
                self.emit(metrics, self.current_step if log_step is None else log_step)
            except Exception as exc:
                engine.fail(exc, "logging")
        return row

    def emit(self, metrics: dict[str, float], step: int) -> None:
        if metrics and self.log_fn is not None and self.engine.rank == 0:
            self.log_fn(metrics, step)

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
        stage = row[0] if row is not None else "validate"
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
            "version": 1,
            "memcallbacks_version": __version__,
            "framework": self.framework,
            "config": self.config.to_dict(),
            "summary": self.engine.summary(),
            "findings": [f.to_dict() if hasattr(f, "to_dict") else f for f in self.findings],
            "events": list(self.events),
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
            report = self.report()
            distributed = engine.world_size > 1 and _distributed.is_distributed()
            summaries = _distributed.gather_objects(report["summary"]) if gather and distributed else None
            if not (self.config.write_files and self.output_dir is not None):
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
        except Exception as exc:
            engine.fail(exc, "writing outputs")
        return self.files

    def stop(self) -> None:
        self.engine.stop()

    def format_report(self) -> str:
        from memcallbacks._report import format_report

        return format_report(self.report(), self.engine.history_frame())

    # ------------------------------------------------------------------ checkpointing
    def state_dict(self) -> dict[str, Any]:
        state = self.engine.state_dict()
        state["events"] = list(self.events)
        state["findings"] = [f.to_dict() if hasattr(f, "to_dict") else f for f in self.findings]
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.engine.load_state_dict(state)
        self.events = list(state.get("events", []))
