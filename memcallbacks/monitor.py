"""``Monitor``: the framework-free monitor for plain PyTorch loops (the Accelerate adapter's base).

Phases are found without annotations when a model is given: a forward pre-hook opens the step
(when ``track``/``step`` are not used), a tensor hook on the model's output marks the start of
backward, an autograd-engine callback queued from it marks the end of backward, and torch's
global optimizer-step hooks bound the optimizer step. ``track(iterable)``, ``step()`` and
``phase(name)`` mark boundaries explicitly for loops the hooks cannot see.
"""

from __future__ import annotations

import contextlib
import logging
import time
import weakref
from typing import Any, Iterable, Iterator, Sequence

import torch
from torch import nn

from memcallbacks._base.config import MonitorConfig, given_fields, resolve_config, settings_of
from memcallbacks._base.options import AdvancedOptions, KeywordCheck, LeakOptions, SnapshotOptions
from memcallbacks._base.columns import OPTIMIZER, OTHER
from memcallbacks._base.cpu import CLOCK_READS
from memcallbacks._runtime.adapter_support import OptimizerHooks, check_plain_arguments, device_for, phase_index
from memcallbacks._runtime.guard import entry_point
from memcallbacks._runtime.model_hooks import ModelHooks
from memcallbacks._runtime.plain_support import AccumulationWindow, PlainControls, TrackGuard, plain_cleanup
from memcallbacks._runtime.schedule import HookMeter
from memcallbacks._runtime.session import LogFn, Session

__all__ = ["Monitor"]


class Monitor(KeywordCheck, PlainControls):
    """Per-phase memory of a plain PyTorch training loop.

    Args:
        model: optional; when given, forward/backward boundaries are found with hooks.
        optimizer: optional; the optimizer phase is bounded by torch's optimizer-step hooks either way.
            Given, it tells :meth:`track` that batches without an optimizer step are gradient
            accumulation from the first batch on.
        log_fn: optional ``log_fn(metrics: dict[str, float], step: int)``, called on rank zero on logged steps.
        device: the device to measure; default: the model's, else CPU.
        config: a :class:`~memcallbacks.MonitorConfig` (or a dict of its fields). The other keywords
            are its fields (docs/configuration.md); those you write win over ``config``.

    Example::

        monitor = Monitor(model, optimizer, log_every_n_steps=10)
        for batch in monitor.track(loader):
            loss = model(batch).sum()
            loss.backward()
            optimizer.step(); optimizer.zero_grad()
        monitor.close()
        print(monitor.format_report())
    """

    framework = "torch"

    #: ``track()``: an accumulation window (batches without an optimizer step) is closed as its own row
    #: once it holds ``max(max_micro_batches, 2 * the most batches seen between two optimizer steps)``
    #: batches; each later batch is then its own row until an optimizer step is seen again (an
    #: optimizer that does not step is not accumulating). Raise it (on the class or the instance)
    #: when a first accumulation window holds more batches than this.
    max_micro_batches: int = 256
    #: the name messages use for this monitor (an adapter's private subclass gives its public class's)
    _public_name: str | None = None

    def __init__(
        self,
        model: nn.Module | None = None,
        optimizer: torch.optim.Optimizer | None = None,
        log_fn: LogFn | None = None,
        *,
        device: torch.device | str | None = None, config: MonitorConfig | dict[str, Any] | None = None,
        log_every_n_steps: int | None = None, sample_every_n_steps: int | None = None, log_keys: str | Sequence[str] = "default",
        output_dir: str | None = None, write_files: bool = True, plot: bool = True, console_summary: bool = True,
        detect_leaks: bool = True, watch_host: bool = True,
        preflight: bool = False, capacity_bytes: int | str | None = None, auto_snapshot: bool = False, leaks: LeakOptions = LeakOptions(),
        snapshot: SnapshotOptions = SnapshotOptions(), advanced: AdvancedOptions = AdvancedOptions(),
    ) -> None:
        check_plain_arguments(type(self).__name__, model, optimizer, log_fn)
        self.config = resolve_config(config, given_fields(locals(), self._keywords), type(self).__name__)
        self._session = Session(settings_of(self.config), self.framework, self._public_name or type(self).__name__, logging.getLogger(type(self).__module__))
        self._session.attach(log_fn=log_fn)
        self._session.ending.ends_with(self._exit_failing)  # an error nobody catches ends the run as `with` does
        self._meter = HookMeter(self._session.schedule)  # every hook call's whole time is the monitor's own
        self._model_hooks = ModelHooks(self._session, self._forward_pre, self._meter)  # the forward hooks, the step's outputs
        self._optimizer_hooks = OptimizerHooks(self._optimizer_pre, self._optimizer_post, self._meter)  # installed by _install_hooks
        self._optimizer_hooks.gates = self._model_hooks.gates  # the same list: opened by a quiet step's post-hook
        self._step = 0
        self._stepped = False  # an optimizer step happened in the open step
        self._window = AccumulationWindow(accumulates=optimizer is not None)  # track()'s window; auto mode reads accumulates
        self._batch: Any = None  # the item track() yielded, held until the step ends
        self._closed = False
        self._explicit = False  # track() or step() marks boundaries; the forward hook then leaves steps alone
        self._track_guard = TrackGuard(type(self).__name__)  # a track() inside a running track() is ignored
        device = device_for(type(self).__name__, device, model, optimizer)
        # what this monitor changes in the process is undone by close(), or by this finalizer when
        # the monitor is dropped without close() (an exception in the loop body): see lifecycle.py
        self._cleanup = plain_cleanup(self._public_name or type(self).__name__, self._session, self._model_hooks.handles)
        self._start(device)
        self._finalizer = weakref.finalize(self, self._cleanup.abandoned)
        self._session.attach(model=model, optimizer=optimizer)
        self._install_hooks(model)

    # ------------------------------------------------------------------ setup
    def _start(self, device: torch.device) -> None:
        self._session.start(device)

    def _install_hooks(self, model: nn.Module | None) -> None:
        # torch's global hook table holds the monitor weakly: one dropped without close() can be collected
        self._cleanup.handles.extend(self._optimizer_hooks.install())
        if model is not None:
            self._hook_model(model)

    def _hook_model(self, model: nn.Module) -> None:
        """Watch ``model``'s forward passes (its hooks are installed now unless they are off)."""
        self._session.watch_first_forward(model)  # preflight=True: predicted at its first training forward
        self._model_hooks.add(model)

    # ------------------------------------------------------------------ hooks (never raise)
    @entry_point("forward pre-hook")
    def _forward_pre(self, module: nn.Module, args: Any) -> None:
        if self._model_hooks.evaluating:
            self._session.eval_batch()  # one forward of a hooked model is one evaluation batch
            return
        if self._session.lingering_due:
            self._session.check_lingering(self._batch)
        # without track()/step(), a training forward after an optimizer step starts the next step; with no
        # optimizer known (weights updated by hand, as pytorch/examples' word_language_model does), one after a backward
        if self._explicit or self._closed or not (torch.is_grad_enabled() and module.training):
            return
        session = self._session
        if session.step_open and (self._stepped or self._optimizer_hooks.stepped or not self._window.accumulates and self._model_hooks.backward_seen):
            self._end()
        if not session.step_open:
            self._begin(auto=True)

    @entry_point("optimizer pre-hook")
    def _optimizer_pre(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        if self._session.lingering_due:
            self._session.check_lingering(self._batch)
        if self._session.step_open:
            self._session.boundary(OTHER)

    @entry_point("optimizer hook")
    def _optimizer_post(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        self._window.accumulates = True  # an optimizer exists: batches without a step accumulate
        self._model_hooks.open_gates()  # the next forward may start the next step
        if self._session.step_open:
            self._stepped = True
            self._session.boundary(OPTIMIZER)

    # ------------------------------------------------------------------ steps
    def _begin(self, epoch: int = 0, batch_idx: int | None = None, batch: Any = None, defer_lingering: bool = False, auto: bool = False) -> None:
        self._stepped = False
        self._session.begin_step(
            self._step, epoch, self._step if batch_idx is None else batch_idx, batch=batch, defer_lingering=defer_lingering
        )
        # auto: the forward pre-hook began it; with an optimizer known an optimizer step ends it, without one a backward
        optimizer_known = self._window.accumulates
        self._model_hooks.settle(auto_step_begun=auto and optimizer_known, awaiting_backward=auto and not optimizer_known)
        session, hooks = self._session, self._optimizer_hooks  # a quiet step's optimizer pre-hook has nothing to do (an observer may want it)
        hooks.pre_open = not session.quiet_step or session.lingering_due or session.observed
        hooks.post_open = not (optimizer_known and session.quiet_step and not session.observed and not session.lingering_pending)  # quiet: notes it

    def _end(self) -> None:
        hooks, optimizer_hooks = self._model_hooks, self._optimizer_hooks
        hooks.open_gates()
        self._stepped, optimizer_hooks.stepped = self._stepped or optimizer_hooks.stepped, False  # noted by a quiet post-hook
        optimizer_hooks.pre_open = optimizer_hooks.post_open = True
        batch, output, outputs = self._batch, hooks.output, hooks.outputs
        self._batch = hooks.output = None
        hooks.outputs = []
        if self._session.step_open:
            self._session.end_step(OTHER, batch=batch, loss=output, outputs=outputs)
            self._step += 1
            if self._stepped:  # a new accumulation window (inline: no call per step)
                window = self._window
                window.longest, window.size = (window.size if window.size > window.longest else window.longest), 0
        del batch, output, outputs
        self._stepped = False
        hooks.backward_open = False

    def track(self, iterable: Iterable[Any]) -> Iterator[Any]:
        """Yield from ``iterable``, marking a step boundary before each item.

        Rows are per optimizer step. Once an optimizer is known (passed to the monitor, or seen
        stepping), a batch after which no optimizer step ran is gradient accumulation: the next batch
        continues the same step (``micro_batches`` counts them), the first window included. Without
        any optimizer (evaluation-like loops, manual updates) every item is its own row. A window
        that reaches :attr:`max_micro_batches` batches without an optimizer step is closed as its own
        row, and items are rows of their own until an optimizer step is seen again. The last,
        incomplete window is a row too (at the end of ``iterable``, or at :meth:`close`). A track()
        inside a running track() loop is ignored, with one warning: it yields ``iterable`` unchanged.
        """
        if self._track_guard.nested():
            return iter(iterable)
        return self._track_guard.started(self._track(iterable))

    def _track(self, iterable: Iterable[Any]) -> Iterator[Any]:
        if self._used_after_close("track"):
            yield from iterable
            return
        self._explicit = True
        session, hooks, window, meter = self._session, self._optimizer_hooks, self._window, self._meter
        for batch_idx, item in enumerate(iterable):  # timed: the bookkeeping after the user's optimizer step is own time
            reads, t0 = CLOCK_READS[0], time.perf_counter()
            # an optimizer step ended a quiet step and the next one is quiet: counted only, here, without the step's end
            # and start or a call through the guard (each frame costs µs of cold caches after the user's optimizer step)
            if (self._stepped or hooks.stepped) and session.quiet_next(self._step + 1):
                self._step, self._stepped, hooks.stepped = self._step + 1, False, False
                window.longest, window.size = max(window.size, window.longest), 1
                meter.book(t0, reads)
            else:
                meter.call(self._track_item, (batch_idx, item), {})
            self._batch = item  # also when _track_item failed part-way
            del item
            yield self._batch
        self._track_end()

    @entry_point("track() step end")
    def _track_end(self) -> None:
        self._end()

    @entry_point("track() step start")
    def _track_item(self, batch_idx: int, item: Any) -> None:
        session, window, hooks = self._session, self._window, self._optimizer_hooks
        if session.step_open and (self._stepped or hooks.stepped or not window.accumulates or window.size >= self.max_micro_batches
                                  and window.overflows(self.max_micro_batches)):  # called only for a window at the limit
            self._end()
        window.size += 1
        if session.step_open:
            session.micro_batch()
        else:
            # the caller's loop variable still holds the previous batch until this yield returns:
            # check for lingering references at the step's first forward/optimizer hook instead
            self._begin(batch_idx=batch_idx, batch=item, defer_lingering=True)
            self._model_hooks.explicit_step()

    @contextlib.contextmanager
    def step(self) -> Iterator[None]:
        """``with monitor.step(): ...`` — one row for exactly this block. An OOM inside is recorded,
        the files are written, and the error propagates."""
        if self._used_after_close("step"):
            yield
            return
        self._meter.call(self._step_enter, (), {})
        try:
            yield
        except BaseException as exc:
            self.record_exception(exc)
            raise
        finally:
            self._meter.call(self._track_end, (), {})

    @entry_point("step() start")
    def _step_enter(self) -> None:
        self._explicit = True
        if self._session.step_open:
            self._end()
        self._begin()
        self._model_hooks.explicit_step()

    @contextlib.contextmanager
    def phase(self, name: str) -> Iterator[None]:
        """``with monitor.phase("forward"): ...`` — attribute this block's peak to a phase explicitly."""
        index = phase_index(name)  # a ValueError for a name that is not a phase
        if self._used_after_close("phase"):
            yield
            return
        self._phase_enter()
        try:
            yield
        finally:
            self._session.boundary(index)

    @entry_point("phase() start")
    def _phase_enter(self) -> None:
        if not self._session.step_open:
            self._begin()
        self._session.boundary(OTHER)

    # ------------------------------------------------------------------ driven steps
    # For adapters whose framework announces steps itself (the Transformers callback): the
    # framework's events open and close steps; the model hooks still find forward and backward.

    @entry_point("open_step()")
    def open_step(self, step: int, epoch: int = 0, batch_idx: int = 0) -> None:
        """The framework started optimizer step ``step``; a further micro-batch if one is open."""
        if self._session.step_open:
            self._session.micro_batch()
            return
        self._model_hooks.backward_open = False
        self._step = step  # for OOM events
        if self._hooks_before_eval is not None:  # an evaluation is still open (a tentative one): it ends here
            self.end_evaluation()
        self._session.begin_step(step, epoch, batch_idx)

    @entry_point("end_phase()")
    def end_phase(self, phase: int) -> None:
        """The framework says a phase ended (``OTHER`` before clipping, ``OPTIMIZER`` after the step)."""
        if self._session.step_open:
            self._session.boundary(phase)

    @entry_point("close_step()")
    def close_step(self, *, log_step: int | None = None) -> bool:
        """The framework ended the step: write its row. Returns whether the step was a logged one."""
        session = self._session
        if not session.step_open:
            return False
        logged = session.log_this_step
        hooks = self._model_hooks  # the step's forward output, for leak detection, handed over
        output, outputs = hooks.output, hooks.outputs
        hooks.output, hooks.outputs = None, []
        session.end_step(OTHER, log_step=log_step, loss=output, outputs=outputs)
        del output, outputs
        return logged
