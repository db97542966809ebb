"""Transformers adapter: ``MemoryMonitorCallback``, whose metrics join the Trainer's own logs.

Step boundaries come from the Trainer's events (``on_step_begin``, ``on_substep_end`` between
micro-batches, ``on_pre_optimizer_step``/``on_optimizer_step`` around the optimizer step,
``on_step_end``); forward and backward are told apart by the plain-loop monitor's hooks on the
model. On logged steps the metrics are merged into the ``logs`` of the Trainer's own ``on_log``
event, so every ``report_to`` integration (TensorBoard, W&B, MLflow, ...) and
``trainer.state.log_history`` receive them, under the Trainer's naming (TensorBoard shows
``train/memory/peak_step_GiB``).
"""

from __future__ import annotations

import logging
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any, Sequence

import torch
from torch import nn

try:
    from transformers import TrainerCallback
except ImportError as exc:  # pragma: no cover - depends on the environment
    raise ImportError(
        "memcallbacks.transformers.MemoryMonitorCallback is a transformers TrainerCallback but transformers is not "
        "installed. Install it: pip install 'memcallbacks[transformers]'."
    ) from exc

from memcallbacks._base.config import MonitorConfig, given_fields, resolve_config
from memcallbacks._base.options import AdvancedOptions, KeywordCheck, LeakOptions, SnapshotOptions
from memcallbacks._base.columns import OPTIMIZER, OTHER
from memcallbacks._runtime.adapter_support import precision_name, rank_zero_trackers
from memcallbacks._runtime.guard import entry_point
from memcallbacks._runtime.lifecycle import weak_method
from memcallbacks._runtime.results import SessionResults
from memcallbacks.monitor import Monitor

if TYPE_CHECKING:  # pragma: no cover
    from transformers import TrainerControl, TrainerState, TrainingArguments

log = logging.getLogger(__name__)

__all__ = ["MemoryMonitorCallback"]


class _TrainerMonitor(Monitor):
    """The plain-loop monitor with the model hooks only: the Trainer's events bound steps and the optimizer phase."""

    framework = "transformers"
    _public_name = "MemoryMonitorCallback"  # users never see this class: messages name the callback

    def __init__(self, model: nn.Module | None, *, start: dict[str, Any], config: MonitorConfig) -> None:
        self._start_kwargs = start
        super().__init__(model, None, None, device=start.pop("device"), config=config)
        self._explicit = True  # the forward pre-hook never opens steps: on_step_begin does

    def _start(self, device: torch.device) -> None:
        self._session.start(device, **self._start_kwargs)

    def _install_hooks(self, model: nn.Module | None) -> None:
        if model is not None:
            self._hook_model(model)

    def abandon(self) -> None:
        """Remove the hooks and release the device handles without a collective (an exception is unwinding)."""
        if self._closed:
            return
        self._restore()


class MemoryMonitorCallback(KeywordCheck, SessionResults, TrainerCallback):
    """Per-phase memory peaks of a ``transformers.Trainer`` run, logged through the Trainer's own logs.

    Args:
        config: a :class:`~memcallbacks.MonitorConfig`, a dict of its fields, or None; the
            keywords you write win over it.
        The keywords are :class:`~memcallbacks.MonitorConfig`'s fields (docs/configuration.md).
            ``log_every_n_steps=None`` follows ``TrainingArguments(logging_steps=...)`` (with
            ``logging_strategy="steps"``; other strategies log no memory metrics unless
            ``log_every_n_steps`` is set, which also makes the Trainer log on those steps).
            ``output_dir`` defaults to ``<TrainingArguments.output_dir>/memcallbacks``.

    Example::

        monitor = MemoryMonitorCallback()
        trainer = Trainer(model=model, args=TrainingArguments(..., report_to=["tensorboard"]),
                          train_dataset=data, callbacks=[monitor])
        trainer.train()
        print(monitor.format_report())

    The callback moves itself to the front of the Trainer's callback list (right after the Trainer's
    ``DefaultFlowCallback``) when the Trainer initialises (or when training begins, for
    ``trainer.add_callback``), so that the ``report_to`` integrations, which come first by default,
    see the merged metrics.
    """

    def __init__(
        self,
        config: MonitorConfig | dict[str, Any] | None = None,
        *,
        log_every_n_steps: int | None = None, sample_every_n_steps: int | None = None, log_keys: str | Sequence[str] = "default",
        output_dir: str | None = None, write_files: bool = True, plot: bool = True, console_summary: bool = True,
        detect_leaks: bool = True, watch_host: bool = True,
        preflight: bool = False, capacity_bytes: int | str | None = None, auto_snapshot: bool = False, leaks: LeakOptions = LeakOptions(),
        snapshot: SnapshotOptions = SnapshotOptions(), advanced: AdvancedOptions = AdvancedOptions(),
    ) -> None:
        self.config = resolve_config(config, given_fields(locals(), self._keywords), "MemoryMonitorCallback")
        self._monitor: _TrainerMonitor | None = None
        self._pending: tuple[int, dict[str, float]] | None = None
        self._first = False  # known to be at the front of the Trainer's callback list
        self._warned_order = False
        self._batches = 0
        self._handler: Any = None  # the Trainer's CallbackHandler: its report_to callbacks are the trackers

    # ------------------------------------------------------------------ placement in the callback list
    def _move_to_front(self) -> bool:
        """Find the ``CallbackHandler`` dispatching the current event and put this callback at the front
        of it: right after the Trainer's ``DefaultFlowCallback`` (which decides at a step's end whether
        the Trainer logs and evaluates next: the evaluation's row begins there), ahead of every other.

        Callbacks get no reference to the Trainer, so the handler is read from the caller's frame
        (``CallbackHandler.call_event``). A new list is assigned, so the loop dispatching the
        current event is not disturbed.
        """
        from transformers.trainer_callback import CallbackHandler, DefaultFlowCallback

        frame = sys._getframe(1)
        for _ in range(6):
            frame = frame.f_back  # type: ignore[assignment]
            if frame is None:
                break
            handler = frame.f_locals.get("self")
            if isinstance(handler, CallbackHandler) and any(cb is self for cb in handler.callbacks):
                others = [cb for cb in handler.callbacks if cb is not self]
                at = next((i + 1 for i, cb in enumerate(others) if isinstance(cb, DefaultFlowCallback)), 0)
                if handler.callbacks[at] is not self:
                    handler.callbacks = others[:at] + [self] + others[at:]
                self._first = True
                self._handler = handler
                return True
        return False

    @entry_point("on_init_end")
    def on_init_end(self, args: "TrainingArguments", state: "TrainerState", control: "TrainerControl", **kwargs: Any) -> None:
        self._move_to_front()

    # ------------------------------------------------------------------ training
    @entry_point("on_train_begin")
    def on_train_begin(
        self,
        args: "TrainingArguments",
        state: "TrainerState",
        control: "TrainerControl",
        model: nn.Module | None = None,
        optimizer: Any = None,
        **kwargs: Any,
    ) -> None:
        if not self._move_to_front() and not self._first and not self._warned_order:
            self._warned_order = True
            log.warning(
                "MemoryMonitorCallback could not move itself to the front of the Trainer's callbacks, so `report_to` "
                "integrations listed before it do not receive the memory metrics. Put it right after the Trainer's "
                "DefaultFlowCallback: trainer.callback_handler.callbacks.insert(1, trainer.pop_callback(monitor))."
            )
        if self._monitor is not None:
            self._monitor.abandon()
        strategy = str(getattr(args.logging_strategy, "value", args.logging_strategy))
        framework_log_every = int(state.logging_steps) if strategy == "steps" and state.logging_steps else None
        # the Trainer logs every logging_steps (and step 1 with logging_first_step) under the
        # "steps" strategy only; the monitor's own log_every_n_steps logs whatever the strategy
        logs = self.config.log_every_n_steps is not None or framework_log_every is not None
        first = self.config.log_every_n_steps is None and logs and bool(getattr(args, "logging_first_step", False))
        default_dir = Path(args.output_dir) / "memcallbacks" if getattr(args, "output_dir", None) else None
        self._monitor = _TrainerMonitor(
            model,
            start=dict(
                device=args.device,
                rank=int(args.process_index),
                world_size=int(args.world_size),
                default_output_dir=default_dir,
                framework_log_every=framework_log_every,
                logs=logs,
                log_first_step=first,
            ),
            config=self.config,
        )
        monitor = self._monitor
        handler = self._handler
        # the TensorBoard/W&B/MLflow callbacks of report_to
        trackers = rank_zero_trackers(handler is not None and state.is_world_process_zero, lambda: handler.callbacks, "MemoryMonitorCallback", log)
        monitor.attach(log_fn=weak_method(self._stash), title=type(model).__name__ if model is not None else "Trainer", trackers=trackers)
        precision = precision_name("bf16" if getattr(args, "bf16", False) else "fp16" if getattr(args, "fp16", False) else None)
        # the Trainer passes the bare model: name plain data parallelism here, let the estimate detect the rest
        ddp = int(args.world_size) > 1 and not getattr(args, "fsdp", None) and not getattr(args, "deepspeed", None)
        monitor.set_training_objects(
            model,
            getattr(optimizer, "optimizer", optimizer),
            precision=precision,
            strategy="ddp" if ddp else None,
            world_size=int(args.world_size) if ddp else None,
        )
        self._pending = None
        self._batches = 0

    @entry_point("on_step_begin")
    def on_step_begin(self, args: "TrainingArguments", state: "TrainerState", control: "TrainerControl", **kwargs: Any) -> None:
        monitor = self._monitor
        if monitor is None:
            return
        # decided when the step starts, identically on every rank (logged steps join a collective)
        monitor.open_step(state.global_step, int(state.epoch or 0), self._batches)
        self._batches += 1

    @entry_point("on_substep_end")
    def on_substep_end(self, args: "TrainingArguments", state: "TrainerState", control: "TrainerControl", **kwargs: Any) -> None:
        # a micro-batch ended without an optimizer step: the next one belongs to the same row
        monitor = self._monitor
        if monitor is not None and monitor.step_open:
            monitor.open_step(state.global_step)
            self._batches += 1

    @entry_point("on_pre_optimizer_step")
    def on_pre_optimizer_step(self, args: "TrainingArguments", state: "TrainerState", control: "TrainerControl", **kwargs: Any) -> None:
        if self._monitor is not None:
            self._monitor.end_phase(OTHER)  # gradient clipping lands in peak_other

    @entry_point("on_optimizer_step")
    def on_optimizer_step(self, args: "TrainingArguments", state: "TrainerState", control: "TrainerControl", **kwargs: Any) -> None:
        if self._monitor is not None:
            self._monitor.end_phase(OPTIMIZER)

    @entry_point("on_step_end")
    def on_step_end(self, args: "TrainingArguments", state: "TrainerState", control: "TrainerControl", **kwargs: Any) -> None:
        monitor = self._monitor
        if monitor is None:
            return
        if monitor.close_step(log_step=state.global_step):
            control.should_log = True  # every rank: the Trainer's logging gathers the loss across ranks
        if control.should_evaluate:  # the Trainer evaluates next (DefaultFlowCallback, just before us, said so)
            monitor.begin_evaluation("validate", state.global_step)

    @entry_point("on_epoch_end")
    def on_epoch_end(self, args: "TrainingArguments", state: "TrainerState", control: "TrainerControl", **kwargs: Any) -> None:
        if self._monitor is not None and control.should_evaluate:  # eval_strategy="epoch"
            self._monitor.begin_evaluation("validate", state.global_step)

    @entry_point("on_prediction_step")
    def on_prediction_step(self, args: "TrainingArguments", state: "TrainerState", control: "TrainerControl", **kwargs: Any) -> None:
        monitor = self._monitor  # an evaluation nothing announced (``trainer.evaluate()`` in a callback): from its second batch
        if monitor is not None and not monitor.closed and not monitor.evaluating:
            monitor.begin_evaluation("validate", state.global_step)

    # the Trainer says so only after them: the step clock stops at the last step's end
    @entry_point("on_evaluate")
    def on_evaluate(self, args: "TrainingArguments", state: "TrainerState", control: "TrainerControl", metrics: Any = None, **kwargs: Any) -> None:
        monitor = self._monitor
        if monitor is not None:
            monitor.end_evaluation(log_step=state.global_step)  # where no eval log closed it (nothing to log then)
            monitor.pause()  # evaluation is not step time
            # one of a dict of eval datasets (eval_<name>_...): the next one's loop has no event before its first batch
            if not monitor.closed and any(k.startswith("eval_") and k.endswith("_runtime") and k != "eval_runtime" for k in metrics or ()):
                monitor.begin_evaluation("validate", state.global_step, tentative=True)  # no forward: no row

    @entry_point("on_save")
    def on_save(self, args: "TrainingArguments", state: "TrainerState", control: "TrainerControl", **kwargs: Any) -> None:
        if self._monitor is not None:
            self._monitor.pause()  # nor is a checkpoint

    def _stash(self, metrics: dict[str, float], step: int) -> None:
        self._pending = (step, metrics)

    @entry_point("on_log")
    def on_log(self, args: "TrainingArguments", state: "TrainerState", control: "TrainerControl", logs: dict[str, Any] | None = None, **kwargs: Any) -> None:
        monitor = self._monitor
        if monitor is not None and monitor.evaluating and logs is not None and any(key.startswith("eval_") for key in logs):
            monitor.end_evaluation(log_step=state.global_step)  # the evaluation's metrics: its memory keys join them
        pending = self._pending
        if pending is None or logs is None:
            return
        step, metrics = pending
        self._pending = None
        if step != state.global_step:
            return
        logs.update(metrics)
        history = state.log_history
        if history and history[-1].get("step") == state.global_step:
            history[-1].update(metrics)

    @entry_point("on_train_end")
    def on_train_end(self, args: "TrainingArguments", state: "TrainerState", control: "TrainerControl", **kwargs: Any) -> None:
        if self._monitor is not None:
            self._monitor.close()  # every rank: rank summaries are gathered into rank zero's report.json

    # ------------------------------------------------------------------ failures
    @entry_point("record_exception()", unwinding=True)
    def record_exception(self, exc: BaseException) -> None:
        """Call from ``except`` around ``trainer.train()``: an OOM becomes an event in ``report.json``
        (files written, no collective), and the hooks are removed. Safe when nothing is running."""
        monitor = self._monitor
        if monitor is None or monitor.closed:
            return
        monitor.record_exception(exc)
        monitor.abandon()

    @entry_point("close()", unwinding=True)
    def close(self) -> None:
        """Remove the hooks if training did not end normally (``on_train_end`` closes them). Safe to call twice."""
        if self._monitor is not None:
            self._monitor.abandon()

    # ------------------------------------------------------------------ results
    @property
    def monitor(self) -> Monitor | None:
        """The :class:`~memcallbacks.Monitor` of the current (or last) ``train()`` call."""
        return self._monitor

    def _current_session(self) -> Any:
        monitor = self._monitor
        return monitor._current_session() if monitor is not None else None
