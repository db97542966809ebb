"""The plain loop's ``Monitor`` besides its loop's events: status, saved state, its end, track().

:class:`PlainControls` is the base of :class:`~memcallbacks.Monitor` (``monitor.py``), as
:class:`~memcallbacks._runtime.results.SessionResults` is the base of every adapter: its methods
are Monitor's public API and read the monitor's own state (``_session``, ``_closed``, ``_step``,
``_model_hooks``, ``_cleanup``, ``_finalizer``), set by ``Monitor.__init__``. Nothing here runs
on the step path (``track()``'s items, ``step()``, the hooks).
"""


from __future__ import annotations

import contextlib
import inspect
import logging
import weakref
from typing import TYPE_CHECKING, Any, Iterator, TypeVar

from memcallbacks._runtime.adapter_support import saved_step
from memcallbacks._runtime.end_write import write_at_exit
from memcallbacks._runtime.guard import entry_point
from memcallbacks._runtime.lifecycle import Cleanup
from memcallbacks._runtime.model_hooks import remove_all
from memcallbacks._runtime.results import SessionResults

__all__ = []

if TYPE_CHECKING:  # pragma: no cover
    from memcallbacks._runtime.model_hooks import ModelHooks
    from memcallbacks._runtime.session import LogFn, Session

log = logging.getLogger("memcallbacks.monitor")  # the name users filter on (Monitor's module)

__all__ = ["PlainControls", "PlainCleanup", "plain_cleanup"]

_Self = TypeVar("_Self", bound="PlainControls")


def plain_cleanup(owner: str, session: Session, forward_handles: list[Any]) -> Cleanup:
    """What a plain-loop monitor changes in the process, to be undone by ``close()`` or by the
    finalizer of a monitor dropped without it: the session stopped, the forward hooks removed (the
    optimizer hooks' handles join ``Cleanup.handles``). It holds the session and the very list of
    forward hook handles, never the monitor."""
    cleanup = PlainCleanup(owner, session)
    cleanup.add("stop the session", session.stop)
    cleanup.add("remove its forward hooks", lambda: remove_all(forward_handles))
    return cleanup


class PlainCleanup(Cleanup):
    """:class:`Cleanup` for a plain-loop monitor: dropped without ``close()``, it leaves the run's journal ended
    with the run's plain data so far, and the writer process builds the file set from it when the interpreter
    exits (end_write.py): nothing is imported or drawn in the finalizer."""

    def __init__(self, owner: str, session: Session) -> None:
        super().__init__(owner)
        self.session = session

    def abandoned(self) -> None:
        """The finalizer of a monitor dropped without ``close()``."""
        if self.done:
            return
        path = self.session.ending.abandon()
        if path is None and self.session.files:  # its run ended already (an exception hook wrote the files)
            self.run()
            return
        if path is None:  # nothing to leave: write_files=False, or no step recorded
            super().abandoned()
            return
        log.warning("memcallbacks: a %s was dropped without close(); its hooks are removed and the process state it changed "
                    "is restored. Its journal %s keeps the run's record (memcallbacks report %s), and its files are written "
                    "there when the interpreter exits. Call close(), or use `with %s(...) as monitor:`.",
                    self.owner, path.name, path.parent, self.owner)
        write_at_exit(path, self.owner)
        self.run()


class PlainControls(SessionResults):
    """The plain loop's ``Monitor`` besides its loop's events: status, session configuration,
    saved state, and the end of the run."""

    _session: Session
    _closed: bool
    _step: int
    _model_hooks: ModelHooks
    _cleanup: Cleanup
    _finalizer: weakref.finalize
    _warned_closed = False  # the used-after-close warning was given (once per monitor)
    _hooks_before_eval: bool | None = None  # an evaluation is open: whether the model hooks were on before it
    _eval_tentative = False  # the open evaluation may not come: no forward, no row

    def _end(self) -> None:  # pragma: no cover - Monitor's: end the open step
        raise NotImplementedError

    @contextlib.contextmanager
    def evaluate(self, stage: str = "validate") -> Iterator[None]:
        """``with monitor.evaluate(): ...`` — an evaluation loop, recorded apart from training rows."""
        self.begin_evaluation(stage)
        try:
            yield
        finally:
            self.end_evaluation()

    def begin_evaluation(self, stage: str = "validate", step: int | None = None, *, tentative: bool = False) -> None:
        """The first half of :meth:`evaluate`, for a loop whose evaluation is no single block (a framework's
        callbacks): ``step`` names the row (default: the monitor's step count). Ignored while one is open.
        ``tentative``: an evaluation that may not come (the Trainer's next eval dataset); if it has run no
        forward of the model when it ends (or :meth:`open_step` or :meth:`close` ends it), it leaves no row."""
        if self._hooks_before_eval is not None:
            return
        self._eval_tentative = tentative
        self._session.begin_eval(stage, self._step if step is None else step)
        self._hooks_before_eval = self._model_hooks.evaluation(True)  # its batches are counted at the model's forwards

    def end_evaluation(self, log_step: int | None = None) -> None:
        """The second half of :meth:`evaluate`: the evaluation's row is closed and its keys logged at
        ``log_step`` (default: the monitor's step count). Nothing without an open evaluation."""
        was_on, self._hooks_before_eval = self._hooks_before_eval, None
        if was_on is None:
            return
        self._model_hooks.evaluation(False, was_on)
        self._session.end_eval(log_step=self._step if log_step is None else log_step, keep_empty=not self._eval_tentative)

    @property
    def evaluating(self) -> bool:
        """An evaluation is open (between :meth:`begin_evaluation` and :meth:`end_evaluation`)."""
        return self._hooks_before_eval is not None

    def pause(self) -> None:
        """The time from the last step's end to the next step is not step time: an evaluation or a
        checkpoint the monitor does not see (``evaluate()`` and ``state_dict()`` pause on their own),
        said before it or after it. It keeps the own-time share, and the budget, true to the steps."""
        self._session.pause()

    # ------------------------------------------------------------------ the end of the run
    @entry_point("record_exception()", unwinding=True)
    def record_exception(self, exc: BaseException) -> None:
        """Record an exception that is ending training as an event in ``report.json`` (``"oom"``
        or ``"exception"``) and write the files. Never raises: the caller's exception propagates."""
        if self._closed:
            return
        self._session.record_exception(exc, self._step)
        self._session.finish(gather=False)

    @entry_point("close()")
    def close(self, gather: bool = True) -> None:
        """End the open step, remove every hook and write the files. Safe to call twice.

        Under torch.distributed every rank must call it (rank summaries are gathered into rank
        zero's report), unless ``gather=False`` (e.g. when only this rank is failing)."""
        if self._closed:
            return
        self._closed = True
        try:
            self.end_evaluation()  # one still open (a tentative one that saw no forward leaves no row)
            self._end()
            self._cleanup.remove_handles()
            self._model_hooks.release()
            self._session.finish(gather=gather)
        finally:
            self._restore()

    def _restore(self) -> None:
        """Undo what this monitor changed in the process (hooks, gc, allocator history, its folder)."""
        self._closed = True
        self._finalizer.detach()
        self._cleanup.run()  # each part on its own: one that fails does not keep the others

    def _used_after_close(self, method: str) -> bool:
        if self._closed and not self._warned_closed:
            self._warned_closed = True
            log.warning("%s.%s() was called after close(): nothing more is recorded. Create a new %s for a new run.",
                        type(self).__name__, method, type(self).__name__)
        return self._closed

    def __enter__(self: _Self) -> _Self:
        return self

    def __exit__(self, exc_type: Any, exc: BaseException | None, tb: Any) -> None:
        if exc is None:
            self.close()
        else:
            self._exit_failing(exc)

    @entry_point("__exit__", unwinding=True)
    def _exit_failing(self, exc: BaseException) -> None:
        self._session.record_exception(exc, self._step)
        self.close(gather=False)  # a failing rank must not wait for the others

    # ------------------------------------------------------------------ status and configuration
    @property
    def closed(self) -> bool:
        """True after :meth:`close` (or an adapter's abandon): the hooks are gone."""
        return self._closed

    @property
    def step_open(self) -> bool:
        return self._session.step_open

    def attach(self, *, log_fn: LogFn | None = None, title: str | None = None, trackers: Any = None) -> None:
        """Where logged metrics go (``log_fn(metrics, step)``), the title of the report and plot, and
        the run's own trackers (:class:`memcallbacks.trackers.Trackers`) that get the dashboard and files."""
        self._session.attach(log_fn=log_fn, title=title, **({"trackers": trackers} if trackers is not None else {}))

    def set_training_objects(self, model: Any, optimizer: Any, **strategy: Any) -> None:
        """The model and optimizer the census and the theory check look at (``precision``,
        ``strategy``, ``world_size`` as in :func:`memcallbacks.estimate.estimate`)."""
        self._session.attach(model=model, optimizer=optimizer, **strategy)

    def will_log(self, count: int) -> bool:
        """Whether the step after ``count`` steps is a logged step: every ``log_every_n_steps`` steps;
        never when the run has nowhere to log. From counts only, so every rank agrees."""
        return self._session.schedule.will_log(count)

    def state_dict(self) -> dict[str, Any]:
        state = self._session.state_dict()
        state["step"] = self._step
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        key = f"{type(self).__name__}.load_state_dict"
        self._session.load_state_dict(state, key)
        self._step = saved_step(state, self._step, key)


# ---------------------------------------------------------------------- track()'s bookkeeping: one running loop per monitor, and the gradient-accumulation window
log = logging.getLogger("memcallbacks.monitor")

__all__ = ["TrackGuard", "AccumulationWindow"]


class TrackGuard:
    def __init__(self, owner: str) -> None:
        self.owner = owner
        self._running: weakref.ref[Any] | None = None
        self._warned = False

    def nested(self) -> bool:
        """Is a ``track()`` loop running? Then the new one is ignored (one warning per monitor)."""
        running = self._running() if self._running is not None else None
        if running is None or inspect.getgeneratorstate(running) != inspect.GEN_SUSPENDED:
            return False
        if not self._warned:
            self._warned = True
            log.warning("%s.track() was called inside a loop over another %s.track(): the inner loop is not tracked (its "
                        "items are part of the outer loop's step, not rows of their own). Call track() on the one loop whose "
                        "items are training steps.", self.owner, self.owner)
        return True

    def started(self, items: Iterator[Any]) -> Iterator[Any]:
        self._running = weakref.ref(items)
        return items


class AccumulationWindow:
    """``track()``'s gradient-accumulation window: the batches since the last row that ended with an
    optimizer step, and whether a batch without one continues the open step."""

    def __init__(self, accumulates: bool) -> None:
        # True when a batch that ends without an optimizer step is gradient accumulation (the next
        # batch continues the open step): an optimizer is known, given to the monitor or seen stepping
        # by the global hooks. False again after a window overflowed (see Monitor.max_micro_batches)
        # until the next optimizer step. The Accelerate adapter sets it too.
        self.accumulates = accumulates
        self.size = 0  # track()ed batches since the last row that ended with an optimizer step
        self.longest = 0  # the most batches seen between two optimizer steps (Monitor._end updates both)

    def overflows(self, limit: int) -> bool:
        """This many batches without an optimizer step is not accumulation (the optimizer is idle): the
        open step ends, and each item is a row of its own until an optimizer step is seen again."""
        if self.size >= limit and self.size >= 2 * self.longest:
            self.accumulates = False
            return True
        return False
