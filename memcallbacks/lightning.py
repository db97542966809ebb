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

from memcallbacks._config import MonitorConfig, check_config_names, resolve_config
from memcallbacks._core import CoreResults, MonitorCore
from memcallbacks._engine import BACKWARD, FORWARD, OPTIMIZER, OTHER
from memcallbacks._watch import strategy_name

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


class MemoryMonitor(CoreResults, *_callback_bases()):  # type: ignore[misc]
    """Per-phase memory peaks on every training step, logged through the trainer's loggers.

    Args:
        config: a :class:`~memcallbacks.MonitorConfig`, a dict of its fields, or None.
        **kwargs: any :class:`~memcallbacks.MonitorConfig` field, overriding ``config``.

    Example::

        monitor = MemoryMonitor(log_every_n_steps=10)
        trainer = L.Trainer(callbacks=[monitor], logger=TensorBoardLogger("runs"))
        trainer.fit(model, datamodule)
        monitor.history          # one row per (sampled) optimizer step (pandas.DataFrame)

    After fit, ``output_dir`` holds ``history.csv``, ``report.json`` and ``memory.png``
    (``.rank{r}`` in the names under distributed training; rank zero's ``report.json`` also
    summarises every rank).
    """

    def __init__(self, config: MonitorConfig | dict[str, Any] | None = None, **kwargs: Any) -> None:
        if config is None:
            check_config_names(kwargs, "MemoryMonitor")
            # a literal MonitorConfig(**kwargs) lets LightningCLI/jsonargparse see every field as an init arg
            self.config = MonitorConfig(**kwargs)
        else:
            self.config = resolve_config(config, kwargs, "MemoryMonitor")
        self._core = MonitorCore(self.config, "lightning", "MemoryMonitor", log)
        self._stepped = False
        self._automatic = True
        self._optimizer_hooks: list[Any] = []
        self._started_for: int | None = None
        self._trainer: Any = None
        self._loss: Any = None  # this step's loss, held only until the step ends
        self._has_loggers = False

    # ------------------------------------------------------------------ helpers
    def _will_log(self, count: int) -> bool:
        """Whether the step after ``count`` batches-that-stepped is logged: every ``log_every_n_steps``
        (the monitor's, else the Trainer's), as Lightning's own callbacks decide."""
        return self._has_loggers and (count + 1) % self._core.log_every == 0

    @staticmethod
    def _log_step(trainer: "pl.Trainer") -> int:
        """Batches that stepped so far: Lightning's own logging axis (``global_step`` counts every
        optimizer's steps, so it moves by 2 per batch with two optimizers)."""
        try:
            return int(trainer.fit_loop.epoch_loop._batches_that_stepped)
        except Exception:
            return int(trainer.global_step)

    def _emit(self, metrics: dict[str, float], step: int) -> None:
        trainer = self._trainer
        if trainer is not None and trainer.is_global_zero:
            for logger in trainer.loggers:
                logger.log_metrics(metrics, step=step)

    def _start(self, trainer: "pl.Trainer") -> None:
        core = self._core
        self._trainer = trainer
        if self._started_for == id(trainer) and core.engine.backend is not None:
            return
        self._started_for = id(trainer)
        default_dir = None
        if self.config.write_files and self.config.output_dir is None:
            try:
                base = trainer.log_dir
            except Exception:
                base = None
            default_dir = Path(base or trainer.default_root_dir or os.getcwd()) / "memcallbacks"
        if not trainer.loggers:
            core.warn_once(
                "no-logger",
                "MemoryMonitor: the Trainer has no logger (logger=False); memory metrics are not logged, but "
                "`monitor.history` and the files in output_dir are still kept.",
            )
        core.log_fn = self._emit
        self._has_loggers = bool(trainer.loggers) and int(trainer.log_every_n_steps or 0) > 0
        core.start(
            trainer.strategy.root_device,
            rank=trainer.global_rank,
            world_size=trainer.world_size,
            default_output_dir=default_dir,
            framework_log_every=trainer.log_every_n_steps,
        )

    # ------------------------------------------------------------------ lifecycle hooks
    def setup(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule", stage: str) -> None:
        if stage == "fit":
            self._core.reset()
            self._started_for = None
        # environment problems (an unwritable output_dir) propagate: they must stop the run before training
        self._start(trainer)

    def on_train_start(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule") -> None:
        self._automatic = bool(pl_module.automatic_optimization)
        self._stepped = False
        self._core.step_open = False
        self._core.title = f"{type(pl_module).__name__}"
        optimizers = list(trainer.optimizers)
        self._core.set_training_objects(
            trainer.strategy.model or pl_module,
            optimizers[0] if len(optimizers) == 1 else None,
            precision=str(getattr(trainer, "precision", "")) or None,
            strategy=strategy_name(trainer.strategy),
            world_size=trainer.world_size,
        )
        if not self._automatic and self._core.enabled and not self._optimizer_hooks:
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
        if self._core.step_open:
            self._core.boundary(OTHER)

    def _optimizer_post_hook(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        if self._core.step_open:
            self._core.boundary(OPTIMIZER)

    def on_train_batch_start(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule", batch: Any, batch_idx: int) -> None:
        core = self._core
        if core.step_open:  # a further micro-batch of the open step (gradient accumulation)
            core.begin_step(0)
            return
        count = self._log_step(trainer)
        log_now = self._will_log(count)
        if core.enabled and core.wants_sample(count, log_now):
            core.begin_step(trainer.global_step, trainer.current_epoch, batch_idx, log=log_now, count=count, batch=batch, sample=True)
        else:  # unsampled: skip reading Lightning's (comparatively slow) step/epoch properties
            core.begin_step(count, 0, batch_idx, log=log_now, count=count, batch=batch, sample=False)

    def on_before_backward(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule", loss: torch.Tensor) -> None:
        self._core.boundary(FORWARD)
        self._loss = loss

    def on_after_backward(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule") -> None:
        self._core.boundary(BACKWARD)

    def on_before_optimizer_step(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule", optimizer: Any) -> None:
        # automatic optimization: from here to batch end is the optimizer phase (clipping included)
        self._stepped = True

    def on_train_batch_end(
        self, trainer: "pl.Trainer", pl_module: "pl.LightningModule", outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        core = self._core
        loss, self._loss = self._loss, None
        if self._stepped or not self._automatic:
            log_step = self._log_step(trainer) if core.log_this_step else None
            core.end_step(OPTIMIZER if self._automatic else OTHER, log_step=log_step, batch=batch, loss=loss)
        else:  # accumulating gradients: the step goes on with the next batch
            core.boundary(OTHER)
        self._stepped = False

    # ------------------------------------------------------------------ evaluation loops
    def _eval_start(self, trainer: "pl.Trainer", stage: str) -> None:
        self._core.begin_eval("sanity_check" if trainer.sanity_checking else stage, trainer.global_step, trainer.current_epoch)

    def _eval_end(self, trainer: "pl.Trainer") -> None:
        self._core.end_eval(log_step=self._log_step(trainer), emit=bool(trainer.loggers) and not trainer.sanity_checking)

    def on_validation_start(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule") -> None:
        self._eval_start(trainer, "validate")

    def on_validation_batch_end(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule", outputs: Any, batch: Any, batch_idx: int, dataloader_idx: int = 0) -> None:
        self._core.eval_batch()

    def on_validation_end(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule") -> None:
        self._eval_end(trainer)

    def on_test_start(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule") -> None:
        self._eval_start(trainer, "test")

    def on_test_batch_end(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule", outputs: Any, batch: Any, batch_idx: int, dataloader_idx: int = 0) -> None:
        self._core.eval_batch()

    def on_test_end(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule") -> None:
        self._eval_end(trainer)

    def on_predict_start(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule") -> None:
        self._eval_start(trainer, "predict")

    def on_predict_batch_end(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule", outputs: Any, batch: Any, batch_idx: int, dataloader_idx: int = 0) -> None:
        self._core.eval_batch()

    def on_predict_end(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule") -> None:
        self._eval_end(trainer)

    # ------------------------------------------------------------------ end of fit, failures
    def on_train_end(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule") -> None:
        self._remove_optimizer_hooks()
        core = self._core
        if core.step_open:  # a step cut short (max_steps mid-accumulation)
            core.end_step(OTHER, log_step=self._log_step(trainer))

    def on_fit_end(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule") -> None:
        self._core.finish(gather=True)

    def on_exception(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule", exception: BaseException) -> None:
        self._remove_optimizer_hooks()
        self._loss = None
        self._core.record_exception(exception, trainer.global_step)
        # no collectives here: other ranks may not be failing
        self._core.finish(gather=False)

    def teardown(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule", stage: str) -> None:
        self._remove_optimizer_hooks()
        if stage == "fit":
            self._core.stop()

    # ------------------------------------------------------------------ checkpointing
    def state_dict(self) -> dict[str, Any]:
        return self._core.state_dict()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self._core.load_state_dict(state_dict)
