"""Lightning adapter: ``MemoryMonitor``, a callback translating Lightning's hooks into session calls.

Works with both package names, ``lightning.pytorch`` and ``pytorch_lightning``: the class derives
from the ``Callback`` of every one that is installed, so either ``Trainer`` (and LightningCLI's
``class_path: memcallbacks.MemoryMonitor``) accepts it.

Logged keys (``memory/peak_forward_GiB``, ``memory/allocated_GiB``, ...): docs/metrics.md has the table.
"""

from __future__ import annotations

import copy
import functools
import importlib
import importlib.util
import logging
import operator
from typing import TYPE_CHECKING, Any, Sequence

import torch

from memcallbacks._base.config import MonitorConfig, given_fields, resolve_config, settings_of
from memcallbacks._base.options import AdvancedOptions, KeywordCheck, LeakOptions, SnapshotOptions
from memcallbacks._base.columns import BACKWARD, FORWARD, OPTIMIZER, OTHER
from memcallbacks._runtime.guard import contain, entry_point, self_guarded
from memcallbacks._runtime.results import SessionResults
from memcallbacks._runtime.lightning_support import (
    ManualOptimizerHooks, add_eval_hooks, attach_fit, check_siblings, checkpoint_state, predict_step, start_session,
)
from memcallbacks._runtime.schedule import StepKind
from memcallbacks._runtime.session import Session

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


_BATCHES_THAT_STEPPED = operator.attrgetter("fit_loop.epoch_loop._batches_that_stepped")
_GLOBAL_STEP = operator.attrgetter("global_step")


class MemoryMonitor(KeywordCheck, SessionResults, *_callback_bases()):  # type: ignore[misc]
    """Per-phase memory peaks on every training step, logged through the trainer's loggers.

    Args:
        config: a :class:`~memcallbacks.MonitorConfig`, a dict of its fields, or None. The keywords
            are its fields (docs/configuration.md); those you write win over ``config``.

    Example::

        monitor = MemoryMonitor(log_every_n_steps=10)
        trainer = L.Trainer(callbacks=[monitor], logger=TensorBoardLogger("runs"))
        trainer.fit(model, datamodule)
        monitor.history          # one row per (sampled) optimizer step (pandas.DataFrame)

    After fit, ``output_dir`` holds ``history.csv``, ``report.json`` and ``memory.png``
    (``.rank{r}`` in the names under distributed training; rank zero's ``report.json`` also
    summarises every rank).

    Several monitors may share a Trainer when each has its own ``prefix`` (its logged keys and
    its checkpoint :attr:`state_key`) and, when they write files, its own ``output_dir``.
    """

    def __init__(self, config: MonitorConfig | dict[str, Any] | None = None, *,  # MonitorConfig's fields, by name:
        log_every_n_steps: int | None = None, sample_every_n_steps: int | None = None, log_keys: str | Sequence[str] = "default",
        output_dir: str | None = None, write_files: bool = True, plot: bool = True, console_summary: bool = True,
        detect_leaks: bool = True, watch_host: bool = True, preflight: bool = False, capacity_bytes: int | str | None = None,
        auto_snapshot: bool = False, leaks: LeakOptions = LeakOptions(), snapshot: SnapshotOptions = SnapshotOptions(),
        advanced: AdvancedOptions = AdvancedOptions(),
    ) -> None:
        self.config = resolve_config(config, given_fields(locals(), self._keywords), "MemoryMonitor")
        self._session = Session(settings_of(self.config), "lightning", "MemoryMonitor", log)
        self._step_kind = self._session.schedule.step_kind  # asked once per step, by the step hooks' gate
        self._stepped = False
        self._automatic = True
        self._optimizer_hooks = ManualOptimizerHooks(self._session)  # manual optimization only: installed at train start
        self._started_for: int | None = None
        self._trainer: Any = None
        self._loss: Any = None  # this step's loss, held only until the step ends
        self._batches = _BATCHES_THAT_STEPPED  # _log_step's counter: a C getter, read on every quiet step

    # ------------------------------------------------------------------ helpers
    def _log_step(self, trainer: "pl.Trainer") -> int:
        """Batches that stepped so far: Lightning's own logging axis (``global_step`` counts every
        optimizer's steps, so it moves by 2 per batch with two optimizers). A Lightning without the
        counter gets ``global_step`` from then on, in the quiet steps' gate too (:attr:`_batches`)."""
        try:
            return int(self._batches(trainer))
        except AttributeError:
            self._batches = _GLOBAL_STEP
        except Exception:
            pass
        return int(trainer.global_step)

    def _emit(self, metrics: dict[str, float], step: int) -> None:
        trainer = self._trainer
        if trainer is not None and trainer.is_global_zero:
            for logger in trainer.loggers:
                separator = getattr(logger, "group_separator", "/")  # the logger's own grouping of keys
                shown = metrics if separator == "/" else {key.replace("/", separator): value for key, value in metrics.items()}
                logger.log_metrics(shown, step=step)

    # ------------------------------------------------------------------ lifecycle hooks
    @entry_point("setup")
    def setup(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule", stage: str) -> None:
        if stage == "fit":
            self._session.reset()
            self._started_for = None
        # environment problems (an unwritable output_dir, two monitors on one folder) propagate:
        # they must stop the run before training
        check_siblings(self, trainer, MemoryMonitor)
        self._trainer = trainer
        if self._started_for != id(trainer) or not self._session.started:
            self._started_for = id(trainer)
            start_session(self._session, trainer, self._emit, "MemoryMonitor", log)

    @entry_point("on_train_start")
    def on_train_start(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule") -> None:
        self._automatic = bool(pl_module.automatic_optimization)
        self._stepped = False
        self._log_step(trainer)  # picks the quiet steps' counter (_batches)
        attach_fit(self._session, trainer, pl_module)
        if not self._automatic and self._session.enabled:  # manual optimization: the optimizer's hooks bound its phase
            self._optimizer_hooks.install()

    # The five step hooks, read top to bottom: each contains its own faults (one try block, no
    # wrapper frame) and, on a quiet step, returns after reading that no step is open.
    @self_guarded("on_train_batch_start")
    def on_train_batch_start(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule", batch: Any, batch_idx: int) -> None:
        session = self._session
        try:
            if session.kind is not None:  # a step is open: a further micro-batch of it (gradient accumulation)
                session.micro_batch()
                return
            count = self._batches(trainer)  # _log_step's count (a C getter: this runs on every quiet step)
            kind = self._step_kind(count)  # what the step is, decided once
            if kind is StepKind.QUIET:  # most steps of a long run: skipped by every hook, counted by the next begin_step
                return
            # preflight=True: this batch's step predicted on fake tensors, before it starts (the setting read first: no
            # property call at every step of a run without it)
            if session.config.preflight and session.preflight_due:
                predict_step(session, batch, pl_module, batch_idx, self._automatic)
            # one meaning of "step" in rows and findings: global_step
            session.begin_step(trainer.global_step, trainer.current_epoch, batch_idx, count=count, kind=kind, batch=batch)
        except Exception as exc:
            contain(self, exc, "on_train_batch_start")

    @self_guarded("on_before_backward")
    def on_before_backward(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule", loss: torch.Tensor) -> None:
        if self._session.kind is not None:
            try:
                self._session.boundary(FORWARD)
                self._loss = loss
            except Exception as exc:
                contain(self, exc, "on_before_backward")

    @self_guarded("on_after_backward")
    def on_after_backward(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule") -> None:
        if self._session.kind is not None:
            try:
                self._session.boundary(BACKWARD)
            except Exception as exc:
                contain(self, exc, "on_after_backward")

    @self_guarded("on_before_optimizer_step")
    def on_before_optimizer_step(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule", optimizer: Any) -> None:
        # automatic optimization: from here to batch end is the optimizer phase (clipping included)
        if self._session.kind is not None:
            self._stepped = True

    @self_guarded("on_train_batch_end")
    def on_train_batch_end(
        self, trainer: "pl.Trainer", pl_module: "pl.LightningModule", outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        session = self._session
        if session.kind is None:
            return
        try:
            loss, self._loss = self._loss, None
            if self._stepped or not self._automatic:
                # _log_step's counter, which on_train_start made one that works (a C getter, no call of ours)
                log_step = int(self._batches(trainer)) if session.kind is StepKind.LOGGED else None
                session.end_step(OPTIMIZER if self._automatic else OTHER, log_step=log_step, batch=batch, loss=loss, outputs=outputs)
            else:  # accumulating gradients: the step goes on with the next batch
                session.boundary(OTHER)
            self._stepped = False
        except Exception as exc:
            contain(self, exc, "on_train_batch_end")

    # ------------------------------------------------------------------ evaluation loops
    # validate/test/predict hooks (Lightning dispatches by name): made by add_eval_hooks below the class
    def _eval_start(self, trainer: "pl.Trainer", stage: str) -> None:
        stage = "sanity_check" if trainer.sanity_checking else stage
        self._session.begin_eval(stage, trainer.global_step, trainer.current_epoch)

    def _eval_batch(self) -> None:
        self._session.eval_batch()

    def _eval_end(self, trainer: "pl.Trainer") -> None:
        self._session.end_eval(log_step=self._log_step(trainer), emit=bool(trainer.loggers) and not trainer.sanity_checking)

    # ------------------------------------------------------------------ end of fit, failures
    @entry_point("on_train_end")
    def on_train_end(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule") -> None:
        self._optimizer_hooks.remove()
        session = self._session
        if session.step_open:  # a step cut short (max_steps mid-accumulation)
            session.end_step(OTHER, log_step=self._log_step(trainer))
        session.skip_to(self._log_step(trainer))  # the quiet steps since the last other one

    @entry_point("on_fit_end")
    def on_fit_end(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule") -> None:
        self._session.finish(gather=True)

    @entry_point("on_exception", unwinding=True)
    def on_exception(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule", exception: BaseException) -> None:
        # Lightning calls no teardown() after an exception: everything is undone here, each part on
        # its own, and nothing escapes (the guard), so the user's exception is the one that propagates
        self._optimizer_hooks.remove()
        self._loss = None
        try:
            self._session.record_exception(exception, trainer.global_step)
            # no collectives here: other ranks may not be failing
            self._session.finish(gather=False)
        finally:
            self._session.stop()

    @entry_point("teardown", unwinding=True)
    def teardown(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule", stage: str) -> None:
        self._optimizer_hooks.remove()
        try:
            if stage != "fit" and self._session.live:
                # validate/test/predict alone: their rows are files too (fit writes at on_fit_end)
                self._session.finish(gather=True)
        finally:
            self._session.stop()

    # ------------------------------------------------------------------ checkpointing
    @functools.cached_property  # Lightning reads it at every hook call (its profiler's name): computed once
    def state_key(self) -> str:
        """Where this monitor's state goes in ``checkpoint["callbacks"]``: one key per ``prefix``.

        With the default prefix it is the class name, the key every monitor had before, so
        checkpoints with a default monitor load either way; another prefix gives
        ``MemoryMonitor{'prefix': 'gpu_mem'}`` (Lightning's ``_generate_state_key``), so monitors
        with different prefixes keep apart in one Trainer and in its checkpoints. ``output_dir``
        is not part of the key: a run resumed into a new folder still restores its history.
        """
        if self.config.advanced.prefix == AdvancedOptions.prefix:
            return type(self).__qualname__
        return self._generate_state_key(prefix=self.config.advanced.prefix)

    def state_dict(self) -> dict[str, Any]:
        return self._state_dict() or {}  # an internal fault saves an empty state, never fails the checkpoint

    @entry_point("state_dict")
    def _state_dict(self) -> dict[str, Any]:
        if self._trainer is not None:  # a checkpoint is being saved: its time is not step time
            self._session.pause(now=True)
        return self._session.state_dict()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self._session.load_state_dict(state_dict, self.state_key)

    def on_load_checkpoint(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule", checkpoint: dict[str, Any]) -> None:
        """Restore a state saved under another key, when which one is ours is unambiguous.

        Lightning calls ``load_state_dict`` with ``checkpoint["callbacks"][self.state_key]`` right
        after this hook. A checkpoint saved when every monitor was keyed by the class name, or
        before ``prefix`` was changed, has the state under another key: with one monitor in the
        Trainer and one monitor state in the checkpoint, that state is this monitor's.
        """
        state = checkpoint_state(self, trainer, checkpoint, MemoryMonitor, log)
        if state is not None:
            self.load_state_dict(copy.deepcopy(state))


add_eval_hooks(MemoryMonitor, MemoryMonitor._eval_start, MemoryMonitor._eval_batch, MemoryMonitor._eval_end)
