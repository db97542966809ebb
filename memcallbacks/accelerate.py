"""Accelerate adapter: ``AccelerateMemoryMonitor``, the plain-loop ``Monitor`` bound to an Accelerator.

Accelerate has no callback system, so the monitor sees the loop through hooks: module hooks on
the prepared model(s) (forward, and the start of backward through a hook on the output), the
call to ``accelerator.backward`` (start and end of backward), and torch's global optimizer-step
hooks (the ``AcceleratedOptimizer`` only steps the inner optimizer on gradient-sync steps, so
under ``accelerator.accumulate`` those hooks see real optimizer steps only).

Logged keys are those of every adapter (docs/metrics.md), through ``accelerator.log(values,
step=...)`` on the main process, to whatever trackers ``accelerator.init_trackers`` set up.
"""

from __future__ import annotations

import logging
import weakref
from pathlib import Path
from typing import TYPE_CHECKING, Any, Iterable, Iterator, Sequence

import torch
from torch import nn

from memcallbacks._base.config import MonitorConfig, given_fields
from memcallbacks._base.options import AdvancedOptions, LeakOptions, SnapshotOptions
from memcallbacks._base.columns import BACKWARD, FORWARD
from memcallbacks._runtime.adapter_support import accelerate_strategy, precision_name, rank_zero_trackers
from memcallbacks._runtime.guard import entry_point
from memcallbacks._runtime.lifecycle import weak_method
from memcallbacks._runtime.session import LogFn
from memcallbacks.monitor import Monitor

if TYPE_CHECKING:  # pragma: no cover
    from accelerate import Accelerator

log = logging.getLogger(__name__)

__all__ = ["AccelerateMemoryMonitor"]


class AccelerateMemoryMonitor(Monitor):
    """Per-phase memory of an Accelerate training loop, logged through ``accelerator.log``.

    Args:
        accelerator: the ``accelerate.Accelerator`` of the run; the device, rank and world size
            come from it.
        model: the model to hook. ``None``: every model passed through ``accelerator.prepare``
            (as ``accelerator._models`` keeps it: the bare module under DDP, the wrapper under
            FSDP), looked up now and again at the first ``track()``/``step()``, so the monitor may
            be built before ``prepare``.
        optimizer: optional; the optimizer phase is bounded by torch's optimizer-step hooks either way.
        log_fn: ``log_fn(metrics, step)``; default ``accelerator.log(metrics, step=step)`` (rank zero only).
        config: a :class:`~memcallbacks.MonitorConfig` (or a dict of its fields); the keywords you
            write win over it. The other keywords are its fields (docs/configuration.md).
            ``output_dir`` defaults to ``<project_dir or logging_dir>/memcallbacks`` when the
            accelerator has one, else ``./memcallbacks``.

    Example::

        accelerator = Accelerator(log_with="tensorboard", project_dir="runs")
        accelerator.init_trackers("exp")
        model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
        monitor = AccelerateMemoryMonitor(accelerator)
        for batch in monitor.track(loader):          # marks step boundaries
            with accelerator.accumulate(model):
                loss = model(**batch).loss
                accelerator.backward(loss)
                optimizer.step(); optimizer.zero_grad()
        monitor.close()                                # every rank; writes history.csv, report.json
        accelerator.end_training()
    """

    framework = "accelerate"

    def __init__(
        self,
        accelerator: "Accelerator",
        model: nn.Module | None = None,
        optimizer: torch.optim.Optimizer | None = None,
        log_fn: LogFn | None = None,
        *,
        config: MonitorConfig | dict[str, Any] | None = None,
        log_every_n_steps: int | None = None, sample_every_n_steps: int | None = None, log_keys: str | Sequence[str] = "default",
        output_dir: str | None = None, write_files: bool = True, plot: bool = True, console_summary: bool = True,
        detect_leaks: bool = True, watch_host: bool = True,
        preflight: bool = False, capacity_bytes: int | str | None = None, auto_snapshot: bool = False, leaks: LeakOptions = LeakOptions(),
        snapshot: SnapshotOptions = SnapshotOptions(), advanced: AdvancedOptions = AdvancedOptions(),
    ) -> None:
        if not all(hasattr(accelerator, name) for name in ("device", "process_index", "num_processes", "log", "backward")):
            raise TypeError(
                f"AccelerateMemoryMonitor(accelerator={type(accelerator).__name__}) must be an accelerate.Accelerator; "
                "pass the Accelerator your loop uses."
            )
        self._accelerator = accelerator
        self._discover = model is None  # hook what accelerator.prepare has seen
        self._warned_no_tracker = False
        # the session holds the adapter's own method weakly (a dropped monitor is cleaned up, lifecycle.py)
        super().__init__(model, optimizer, log_fn or weak_method(self._log_to_trackers), device=accelerator.device, config=config,
                         **given_fields(locals(), self._keywords))
        self._optimizer = optimizer
        if model is not None:  # hooked by Monitor.__init__
            self._session.attach(title=type(model).__name__)
            self._set_training_objects()
        else:
            self.watch_prepared_models()
        self._install_backward_wrapper()

    # ------------------------------------------------------------------ setup
    def _start(self, device: torch.device) -> None:
        accelerator = self._accelerator
        base = accelerator.project_dir or accelerator.logging_dir
        self._session.start(
            device,
            rank=int(accelerator.process_index),
            world_size=int(accelerator.num_processes),
            default_output_dir=Path(base) / "memcallbacks" if base else None,
        )
        # the main process's trackers (accelerator.init_trackers), looked up again on each logged step
        trackers = rank_zero_trackers(bool(accelerator.is_main_process), lambda: accelerator.trackers, "AccelerateMemoryMonitor", log)
        self._session.attach(trackers=trackers)

    @entry_point("hooking the prepared models")
    def watch_prepared_models(self) -> None:
        """Hook the models ``accelerator.prepare`` has seen that are not hooked yet."""
        if self._closed or not self._discover:
            return
        found = False
        for model in getattr(self._accelerator, "_models", []):
            if isinstance(model, nn.Module) and not any(model is m for m in self._model_hooks.models):
                found = True
                self._hook_model(model)
                if not self._session.title:
                    self._session.attach(title=type(getattr(model, "module", model)).__name__)
        if found:
            self._set_training_objects()

    def _set_training_objects(self) -> None:
        """Tell the core what the model-state estimate and the census look at (one model, one optimizer)."""
        accelerator = self._accelerator
        optimizer = self._optimizer
        if optimizer is None and len(getattr(accelerator, "_optimizers", [])) == 1:
            optimizer = accelerator._optimizers[0]
        optimizer = getattr(optimizer, "optimizer", optimizer)  # the AcceleratedOptimizer's inner one
        model = self._model_hooks.models[0] if len(self._model_hooks.models) == 1 else None
        strategy = accelerate_strategy(accelerator)
        world_size = int(accelerator.num_processes) if strategy is not None else None
        self._session.attach(model=model, optimizer=optimizer, precision=precision_name(accelerator.mixed_precision),
                             strategy=strategy, world_size=world_size)

    def _install_backward_wrapper(self) -> None:
        # the instance attribute shadows Accelerator.backward; close() (or the cleanup of a monitor
        # dropped without close()) deletes it again. It holds the monitor weakly, and the user's
        # backward runs outside the guard: its exceptions are the user's own and propagate unchanged.
        accelerator = self._accelerator
        original = accelerator.backward
        monitor_ref = weakref.ref(self)

        def backward(loss: Any, **kwargs: Any) -> Any:
            monitor = monitor_ref()
            if monitor is None or not monitor._backward_starts(loss):
                return original(loss, **kwargs)
            try:
                return original(loss, **kwargs)
            finally:
                monitor._backward_ends()

        self._backward = backward
        accelerator.backward = backward
        self._cleanup.add("restore accelerator.backward", lambda: _unwrap_backward(accelerator, backward))

    @entry_point("accelerator.backward wrapper")
    def _backward_starts(self, loss: Any) -> bool:
        session = self._session
        hooks = self._model_hooks
        if self._closed or not session.step_open or hooks.backward_open:
            return False
        hooks.backward_open = True  # the output-tensor hook then leaves this backward alone (no engine callback)
        if isinstance(loss, torch.Tensor) and loss.grad_fn is not None:
            # leak detection marks the user's own loss rather than the model's output: a loop
            # variable `loss` alive at the next step is then found directly, without the heap
            # scan that finding it from the output's graph needs
            hooks.output = loss
        session.boundary(FORWARD)
        return True

    @entry_point("accelerator.backward wrapper")
    def _backward_ends(self) -> None:
        self._model_hooks.backward_open = False
        self._session.boundary(BACKWARD)

    def _log_to_trackers(self, metrics: dict[str, float], step: int) -> None:
        accelerator = self._accelerator
        if not accelerator.trackers and not self._warned_no_tracker:
            self._warned_no_tracker = True
            log.warning(
                "AccelerateMemoryMonitor: the Accelerator has no trackers, so memory metrics are not logged. "
                "Create it with Accelerator(log_with=...) and call accelerator.init_trackers(...), or pass log_fn=; "
                "`monitor.history` and the files in output_dir are kept either way."
            )
        accelerator.log(metrics, step=step)

    # ------------------------------------------------------------------ steps
    @entry_point("accumulation window check")
    def _step_complete(self) -> bool:
        """Does the open step end before the next batch? Yes after an optimizer step; under
        ``accelerator.accumulate`` also on a gradient-sync batch whose step was skipped (fp16 overflow)."""
        if self._stepped or self._optimizer_hooks.stepped:  # the latter: noted by a quiet step's post-hook
            return True
        accelerator = self._accelerator
        if not accelerator.sync_gradients:
            return False  # inside an accumulation window
        if not self._window.accumulates or accelerator.gradient_accumulation_steps > 1:
            return True
        return accelerator.scaler is not None and bool(accelerator.optimizer_step_was_skipped)

    def track(self, iterable: Iterable[Any]) -> Iterator[Any]:
        """Yield from ``iterable``, marking a step boundary before each item (see :meth:`Monitor.track`).

        Rows are per optimizer step: under ``accelerator.accumulate(model)`` the batches of one
        accumulation window form one row (``micro_batches`` = gradient_accumulation_steps), the
        first window included.
        """
        self.watch_prepared_models()
        if self._track_guard.nested():  # before _sync_aware: an inner loop must not end the outer step
            return iter(iterable)
        return super().track(self._sync_aware(iterable))

    def _sync_aware(self, iterable: Iterable[Any]) -> Iterator[Any]:
        # Runs after the previous batch's body, right before Monitor.track decides whether the open
        # step ends (it ends when ``_stepped``, or while no optimizer step has ever been seen): the
        # accelerator knows better whether an accumulation window is still open.
        for item in iterable:
            if self._session.step_open and not (self._stepped or self._optimizer_hooks.stepped):
                if self._step_complete():
                    self._stepped = True  # a gradient-sync batch whose optimizer step was skipped
                else:
                    self._window.accumulates = True  # inside an accumulation window: not a loop without optimizer
            yield item

    def step(self) -> Any:
        """``with monitor.step(): ...`` — one row for exactly this block (see :meth:`Monitor.step`)."""
        self.watch_prepared_models()
        return super().step()

    @entry_point("close()")
    def close(self, gather: bool = True) -> None:
        """End the open step, remove every hook and the ``accelerator.backward`` wrapper, write the
        files. Every process must call it (rank summaries are gathered), unless ``gather=False``
        (only this rank is failing). Safe to call twice."""
        if self._closed:
            return
        _unwrap_backward(self._accelerator, self._backward)
        super().close(gather)

    @property
    def accelerator(self) -> "Accelerator":
        return self._accelerator


def _unwrap_backward(accelerator: Any, wrapper: Any) -> None:
    if accelerator.__dict__.get("backward") is wrapper:
        del accelerator.__dict__["backward"]
