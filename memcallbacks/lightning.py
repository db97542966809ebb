"""Lightning adapter: ``MemoryMonitor``, a callback translating Lightning's hooks into engine calls.

Works with both package names, ``lightning.pytorch`` and ``pytorch_lightning``: the class derives
from the ``Callback`` of every one that is installed, so either ``Trainer`` (and LightningCLI's
``class_path: memcallbacks.MemoryMonitor``) accepts it.

Logged keys (``prefix`` defaults to ``memory``; GiB = 2**30 bytes; full table in docs/metrics.md):

==============================  ==========================================================
key                             meaning
==============================  ==========================================================
memory/allocated(GiB)           allocated at step start (the step's baseline)
memory/reserved(GiB)            reserved at step start (CPU: process RSS)
memory/peak_forward(GiB)        peak during forward (training_step up to the loss)
memory/peak_backward(GiB)       peak during backward
memory/peak_optimizer(GiB)      peak from the optimizer step's start (clipping included) to step end
memory/peak_step(GiB)           peak over the whole step
memory/peak_reserved(GiB)       reserved peak over the step (CPU: RSS high-water mark)
memory/max_allocated(GiB)       peak since fit start
memory/host_rss(GiB)            host resident set size at step start
memory/monitor_time(ms)         the monitor's own time in this step
memory/alloc_retries, ooms,     cumulative allocator counters (CUDA/XPU only)
memory/inactive_split(GiB)
memory/val/...(GiB)             validation (test/..., predict/...) allocated at start and peak
==============================  ==========================================================
"""

from __future__ import annotations

import importlib
import importlib.util
import logging
import os
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from memcallbacks import __version__
from memcallbacks._config import MonitorConfig, resolve_config
from memcallbacks._engine import BACKWARD, FORWARD, OPTIMIZER, OTHER, MemoryEngine
from memcallbacks._outputs import check_writable, write_json, write_outputs
from memcallbacks import _distributed

if TYPE_CHECKING:  # pragma: no cover
    import lightning.pytorch as pl

log = logging.getLogger(__name__)

__all__ = ["MemoryMonitor"]


def _callback_bases() -> tuple[type, ...]:
    bases = []
    for package in ("lightning.pytorch", "pytorch_lightning"):
        root = package.split(".")[0]
        if importlib.util.find_spec(root) is None:
            continue
        try:
            bases.append(importlib.import_module(package).Callback)
        except ImportError:  # pragma: no cover - broken install
            log.debug("could not import %s", package, exc_info=True)
    if not bases:
        raise ImportError(
            "memcallbacks.MemoryMonitor is a Lightning callback but neither `lightning` nor `pytorch_lightning` "
            "is installed. Install one: pip install 'memcallbacks[lightning]'."
        )
    return tuple(bases)


def _is_oom(exc: BaseException) -> bool:
    oom_type = getattr(torch, "OutOfMemoryError", None)
    if oom_type is not None and isinstance(exc, oom_type):
        return True
    return isinstance(exc, (RuntimeError, MemoryError)) and ("out of memory" in str(exc).lower() or isinstance(exc, MemoryError))


class MemoryMonitor(*_callback_bases()):  # type: ignore[misc]
    """Per-phase memory peaks on every training step, logged through the trainer's loggers.

    Args:
        config: a :class:`~memcallbacks.MonitorConfig`, a dict of its fields, or None.
        **kwargs: any :class:`~memcallbacks.MonitorConfig` field, overriding ``config``.

    Example::

        monitor = MemoryMonitor(log_every_n_steps=10)
        trainer = L.Trainer(callbacks=[monitor], logger=TensorBoardLogger("runs"))
        trainer.fit(model, datamodule)
        monitor.history          # one row per optimizer step (pandas.DataFrame)

    After fit, ``output_dir`` holds ``history.csv``, ``report.json`` and ``memory.png``
    (``.rank{r}`` in the names under distributed training; rank zero's ``report.json`` also
    summarises every rank).
    """

    def __init__(self, config: MonitorConfig | dict[str, Any] | None = None, **kwargs: Any) -> None:
        self.config = resolve_config(config, kwargs, "MemoryMonitor")
        self._engine = MemoryEngine(self.config)
        self._stepped = False
        self._automatic = True
        self._optimizer_hooks: list[Any] = []
        self._warned: set[str] = set()
        self._sample_every = 1
        self._log_this_step = False
        self._step_open = False
        self._started_for: int | None = None
        self.output_dir: Path | None = None
        self.files: dict[str, str] = {}
        self.events: list[dict[str, Any]] = []
        self.findings: list[Any] = []

    # ------------------------------------------------------------------ public results
    @property
    def history(self) -> Any:
        """One row per optimizer step (pandas.DataFrame); columns are documented in docs/metrics.md."""
        return self._engine.history_frame()

    @property
    def eval_history(self) -> Any:
        """One row per validation/test/predict run (pandas.DataFrame)."""
        return self._engine.eval_frame()

    @property
    def max_allocated(self) -> int:
        """Peak allocated bytes since fit start (the monitor resets the device's own peak counter)."""
        return self._engine.max_allocated

    @property
    def max_reserved(self) -> int:
        return self._engine.max_reserved

    @property
    def enabled(self) -> bool:
        return self._engine.enabled

    def summary(self) -> dict[str, Any]:
        return self._engine.summary()

    def report(self) -> dict[str, Any]:
        """What ``report.json`` holds: version, config, summary, findings, events and files."""
        return {
            "version": 1,
            "memcallbacks_version": __version__,
            "framework": "lightning",
            "config": self.config.to_dict(),
            "summary": self._engine.summary(),
            "findings": [f.to_dict() if hasattr(f, "to_dict") else f for f in self.findings],
            "events": list(self.events),
            "files": dict(self.files),
        }

    def format_report(self) -> str:
        """The report as text (what ``memcallbacks report OUTPUT_DIR`` prints)."""
        from memcallbacks._report import format_report

        return format_report(self.report(), self.history)

    # ------------------------------------------------------------------ helpers
    def _warn_once(self, key: str, message: str) -> None:
        if key not in self._warned:
            self._warned.add(key)
            log.warning(message)

    def _resolve_output_dir(self, trainer: "pl.Trainer") -> Path:
        if self.config.output_dir is not None:
            return Path(self.config.output_dir)
        base = None
        try:
            base = trainer.log_dir
        except Exception:
            base = None
        return Path(base or trainer.default_root_dir or os.getcwd()) / "memcallbacks"

    def _will_log(self, trainer: "pl.Trainer") -> bool:
        """Decided when a step starts (Lightning counts the step about to run, as its own callbacks do)."""
        if not trainer.loggers:
            return False
        if self.config.log_every_n_steps is not None:
            return (trainer.global_step + 1) % self.config.log_every_n_steps == 0
        try:
            return bool(trainer._logger_connector.should_update_logs)
        except Exception:
            return (trainer.global_step + 1) % max(trainer.log_every_n_steps, 1) == 0

    @staticmethod
    def _log_step(trainer: "pl.Trainer") -> int:
        try:
            return int(trainer.fit_loop.epoch_loop._batches_that_stepped)
        except Exception:
            return int(trainer.global_step)

    @staticmethod
    def _emit(trainer: "pl.Trainer", metrics: dict[str, float], step: int) -> None:
        if metrics and trainer.is_global_zero:
            for logger in trainer.loggers:
                logger.log_metrics(metrics, step=step)

    def _start(self, trainer: "pl.Trainer") -> None:
        if self._started_for == id(trainer) and self._engine.backend is not None:
            return
        self._started_for = id(trainer)
        if self.config.write_files:
            self.output_dir = check_writable(self._resolve_output_dir(trainer), "MemoryMonitor")
        if not trainer.loggers:
            self._warn_once(
                "no-logger",
                "MemoryMonitor: the Trainer has no logger (logger=False); memory metrics are not logged, but "
                "`monitor.history` and the files in output_dir are still kept.",
            )
        self._engine.start(trainer.strategy.root_device, rank=trainer.global_rank, world_size=trainer.world_size)
        backend = self._engine.backend
        if self.config.sample_every_n_steps is not None:
            self._sample_every = self.config.sample_every_n_steps
        elif backend is not None and backend.kind == "cpu":
            self._sample_every = self.config.log_every_n_steps or max(int(trainer.log_every_n_steps or 1), 1)
        else:
            self._sample_every = 1

    # ------------------------------------------------------------------ lifecycle hooks
    def setup(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule", stage: str) -> None:
        if stage == "fit":
            self._engine.reset()
            self._started_for = None
            self.events = []
            self.findings = []
            self.files = {}
        # environment problems (an unwritable output_dir) propagate: they must stop the run before training
        self._start(trainer)

    def on_train_start(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule") -> None:
        self._automatic = bool(pl_module.automatic_optimization)
        self._stepped = self._step_open = False
        if not self._automatic and self._engine.enabled and not self._optimizer_hooks:
            # manual optimization: the optimizer's own hooks bound the optimizer phase exactly
            from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook

            self._optimizer_hooks = [
                register_optimizer_step_pre_hook(self._optimizer_pre_hook),
                register_optimizer_step_post_hook(self._optimizer_post_hook),
            ]

    def _remove_optimizer_hooks(self) -> None:
        for handle in self._optimizer_hooks:
            handle.remove()
        self._optimizer_hooks = []

    def _optimizer_pre_hook(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        engine = self._engine
        if engine.enabled and engine.in_step:
            try:
                engine.boundary(OTHER)
            except Exception as exc:
                engine.fail(exc, "optimizer pre-step hook")

    def _optimizer_post_hook(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        engine = self._engine
        if engine.enabled and engine.in_step:
            try:
                engine.boundary(OPTIMIZER)
            except Exception as exc:
                engine.fail(exc, "optimizer post-step hook")

    def on_train_batch_start(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule", batch: Any, batch_idx: int) -> None:
        engine = self._engine
        if self._step_open:  # a further micro-batch of the same optimizer step (gradient accumulation)
            if engine.enabled:
                try:
                    engine.micro_batch()
                except Exception as exc:
                    engine.fail(exc, "on_train_batch_start")
            return
        self._step_open = True
        # decided on every rank even when disabled, so ranks agree on which steps join a collective
        self._log_this_step = log = self._will_log(trainer)
        if engine.enabled:
            try:
                step = trainer.global_step
                engine.begin_step(step, trainer.current_epoch, batch_idx, log or (step + 1) % self._sample_every == 0)
            except Exception as exc:
                engine.fail(exc, "on_train_batch_start")

    def on_before_backward(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule", loss: torch.Tensor) -> None:
        engine = self._engine
        if engine.enabled:
            try:
                engine.boundary(FORWARD)
            except Exception as exc:
                engine.fail(exc, "on_before_backward")

    def on_after_backward(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule") -> None:
        engine = self._engine
        if engine.enabled:
            try:
                engine.boundary(BACKWARD)
            except Exception as exc:
                engine.fail(exc, "on_after_backward")

    def on_before_optimizer_step(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule", optimizer: Any) -> None:
        # automatic optimization: from here to batch end is the optimizer phase (clipping included)
        self._stepped = True

    def on_train_batch_end(
        self, trainer: "pl.Trainer", pl_module: "pl.LightningModule", outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        engine = self._engine
        step_ended = self._stepped or not self._automatic
        row = None
        if engine.enabled:
            try:
                if step_ended:
                    row = engine.end_step(OPTIMIZER if self._automatic else OTHER)
                else:  # accumulating gradients: the step goes on with the next batch
                    engine.boundary(OTHER)
            except Exception as exc:
                engine.fail(exc, "on_train_batch_end")
        self._stepped = False
        if step_ended:
            self._step_open = False
        if step_ended and self._log_this_step and (row is not None or engine.world_size > 1):
            try:
                self._emit(trainer, engine.log_values(row), self._log_step(trainer))
            except Exception as exc:
                engine.fail(exc, "logging")

    # ------------------------------------------------------------------ evaluation loops
    def _eval_start(self, trainer: "pl.Trainer", stage: str) -> None:
        engine = self._engine
        if self.config.log_validation and engine.enabled:
            try:
                if trainer.sanity_checking:
                    stage = "sanity_check"
                engine.begin_eval(stage, trainer.global_step, trainer.current_epoch)
            except Exception as exc:
                engine.fail(exc, f"on_{stage}_start")

    def _eval_batch(self) -> None:
        if self._engine.enabled:
            self._engine.eval_batch()

    def _eval_end(self, trainer: "pl.Trainer") -> None:
        engine = self._engine
        if not self.config.log_validation:
            return
        row, stage = None, None
        if engine.enabled:
            try:
                row = engine.end_eval()
                stage = row[0] if row is not None else None
            except Exception as exc:
                engine.fail(exc, "evaluation end")
        if trainer.sanity_checking or stage == "sanity_check" or not trainer.loggers:
            return
        if row is None and engine.world_size <= 1:
            return
        stage = stage or str(getattr(trainer.state.stage, "value", "validate"))
        try:
            self._emit(trainer, engine.eval_log_values(row, stage), self._log_step(trainer))
        except Exception as exc:
            engine.fail(exc, "evaluation logging")

    def on_validation_start(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule") -> None:
        self._eval_start(trainer, "validate")

    def on_validation_batch_end(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule", outputs: Any, batch: Any, batch_idx: int, dataloader_idx: int = 0) -> None:
        self._eval_batch()

    def on_validation_end(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule") -> None:
        self._eval_end(trainer)

    def on_test_start(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule") -> None:
        self._eval_start(trainer, "test")

    def on_test_batch_end(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule", outputs: Any, batch: Any, batch_idx: int, dataloader_idx: int = 0) -> None:
        self._eval_batch()

    def on_test_end(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule") -> None:
        self._eval_end(trainer)

    def on_predict_start(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule") -> None:
        self._eval_start(trainer, "predict")

    def on_predict_batch_end(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule", outputs: Any, batch: Any, batch_idx: int, dataloader_idx: int = 0) -> None:
        self._eval_batch()

    def on_predict_end(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule") -> None:
        self._eval_end(trainer)

    # ------------------------------------------------------------------ end of fit, failures
    def on_train_end(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule") -> None:
        self._remove_optimizer_hooks()
        self._step_open = False
        engine = self._engine
        if engine.enabled and engine.in_step:  # a step cut short (max_steps mid-accumulation, manual loops)
            try:
                engine.end_step()
            except Exception as exc:
                engine.fail(exc, "on_train_end")

    def on_fit_end(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule") -> None:
        self._finish(trainer, gather=True)

    def on_exception(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule", exception: BaseException) -> None:
        self._remove_optimizer_hooks()
        engine = self._engine
        if _is_oom(exception):
            event: dict[str, Any] = {
                "kind": "oom",
                "step": int(trainer.global_step),
                "rank": engine.rank,
                "error": f"{type(exception).__name__}: {str(exception)[:2000]}",
                "max_allocated_bytes": engine.max_allocated,
                "max_reserved_bytes": engine.max_reserved,
            }
            self.events.append(event)
            log.error("MemoryMonitor: out of memory at step %d on rank %d; writing the memory report before the error propagates.", event["step"], engine.rank)
        # no collectives here: other ranks may not be failing
        self._finish(trainer, gather=False)

    def teardown(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule", stage: str) -> None:
        self._remove_optimizer_hooks()
        if stage == "fit":
            self._engine.stop()

    def _finish(self, trainer: "pl.Trainer", *, gather: bool) -> None:
        engine = self._engine
        try:
            if engine.in_step:
                engine.end_step()
            report = self.report()
            summaries = _distributed.gather_objects(report["summary"]) if gather and engine.world_size > 1 and _distributed.is_distributed() else None
            if not (self.config.write_files and self.output_dir is not None):
                return
            if summaries is not None and engine.rank == 0:
                report["ranks"] = summaries
            title = f"{type(trainer.lightning_module).__name__} on {report['summary'].get('device', {}).get('device', '?')}"
            if engine.world_size > 1:
                title += f", rank {engine.rank}"
            self.files = write_outputs(
                self.output_dir,
                rank=engine.rank,
                world_size=engine.world_size,
                history=self.history,
                eval_history=self.eval_history,
                report=report,
                plot=self.config.plot,
                title=title,
            )
            if summaries is not None and engine.rank == 0:
                combined = dict(report, files=self.files)
                write_json(self.output_dir / "report.json", combined)
                self.files["combined_report"] = str(self.output_dir / "report.json")
        except Exception as exc:
            engine.fail(exc, "writing outputs")

    # ------------------------------------------------------------------ checkpointing
    def state_dict(self) -> dict[str, Any]:
        state = self._engine.state_dict()
        state["events"] = list(self.events)
        return state

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self._engine.load_state_dict(state_dict)
        self.events = list(state_dict.get("events", []))
