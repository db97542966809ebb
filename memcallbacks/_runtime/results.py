"""The public results every adapter exposes (history, peaks, findings, files), read from its session."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

from memcallbacks._base.findings import Finding
from memcallbacks._runtime.guard import Guarded

if TYPE_CHECKING:  # pragma: no cover
    from memcallbacks._runtime.session import Session

__all__ = ["SessionResults"]


class SessionResults(Guarded):
    """The public results of an adapter, read from the session of its current (or last) run.

    Adapters that own one session for their lifetime set ``_session``; adapters whose session is
    made per run (the Transformers callback) override :meth:`_current_session`. Before any run,
    every result is empty rather than an error.
    """

    _session: Session | None = None

    def _current_session(self) -> Session | None:
        return self._session

    # (the accessors below share one shape on purpose: each is a documented public property that
    # reads one thing from the current session, or an empty value before any run)

    @property
    def history(self) -> Any:
        """One row per sampled optimizer step (pandas.DataFrame); columns in docs/metrics.md."""
        session = self._current_session()
        if session is None:
            from memcallbacks._runtime.readout import empty_history

            return empty_history()
        return session.history_frame()

    @property
    def eval_history(self) -> Any:
        """One row per validation/test/predict run (pandas.DataFrame)."""
        session = self._current_session()
        if session is None:
            from memcallbacks._runtime.readout import empty_eval_history

            return empty_eval_history()
        return session.eval_history_frame()

    @property
    def max_allocated(self) -> int:
        """Peak allocated bytes since the start (the monitor resets the device's own peak counter)."""
        session = self._current_session()
        return session.engine.max_allocated if session is not None else 0  # the engine keeps it: the device's own counter is reset

    @property
    def max_reserved(self) -> int:
        session = self._current_session()
        return session.engine.max_reserved if session is not None else 0

    @property
    def enabled(self) -> bool:
        session = self._current_session()
        return session is not None and session.enabled

    @property
    def findings(self) -> list[Finding]:
        session = self._current_session()
        return session.findings if session is not None else []

    @property
    def events(self) -> list[dict[str, Any]]:
        session = self._current_session()
        return session.events if session is not None else []

    @property
    def files(self) -> dict[str, str]:
        session = self._current_session()
        return session.files if session is not None else {}

    @property
    def output_dir(self) -> Path | None:
        session = self._current_session()
        return session.output_dir if session is not None else None

    def summary(self) -> dict[str, Any]:
        session = self._current_session()
        return session.summary() if session is not None else {}

    def report(self) -> dict[str, Any]:
        """What ``report.json`` holds: version, config, summary, findings, events and files."""
        session = self._current_session()
        return session.report() if session is not None else {}

    def format_report(self) -> str:
        """The report as text (what ``memcallbacks report OUTPUT_DIR`` prints); after the run's end printed the verdict
        on the console, its first line points at it instead of repeating it."""
        session = self._current_session()
        if session is None:
            return "memcallbacks: no training has run yet."
        return session.ending.console.report_text(session.ending.format_report())

    def explain(self, batch: Any = None) -> Any:
        """Take a census now: live tensors by category (parameters, gradients, optimizer state,
        batches, graph-held, ...) and the reference paths holding the suspicious ones. Returns a
        ``Census``: ``.summary()`` for text, ``.to_frame()`` for a table."""
        session = self._current_session()
        if session is None:
            raise RuntimeError(f"{type(self).__name__}.explain() needs a model: call it during or after training.")
        try:
            return session.explain(batch)
        except Exception as exc:  # the census walks the whole heap: a user's object can make it raise
            from memcallbacks.leaks.search_failure import census_error

            raise census_error(type(self).__name__, exc) from exc
