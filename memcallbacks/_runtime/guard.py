"""Fault containment: the one guard every entry point from a framework into the monitor goes through.

A framework calls the monitor from its hooks (Lightning callbacks, Transformers events, module and
optimizer hooks, the plain loop's ``track``/``step``/``close``). An exception raised by the
monitor's own code inside one of those calls must never reach the training loop: it is logged
once with its traceback and the monitor disables itself (``MonitorConfig.strict`` re-raises
instead, for tests). Two kinds of exception pass through on purpose:

- :class:`UsageError`: a bad setup the user must fix before training (an unwritable
  ``output_dir``, two monitors on one folder). They are raised before the first step.
- anything raised by the user's own code that the monitor merely wraps (``accelerator.backward``),
  which the adapters call outside the guard.

Paths that run while the user's exception is unwinding (``on_exception``, teardown, ``close``)
use ``unwinding=True``: nothing escapes them even under ``strict``, so the user's own exception
is the one that propagates.
"""

from __future__ import annotations

import functools
import logging
from traceback import format_exception
from typing import Any, Callable, TypeVar

from memcallbacks._base.errors import OutputDirError, UsageError

log = logging.getLogger(__name__)

__all__ = ["UsageError", "OutputDirError", "Guarded", "session_of", "entry_point", "self_guarded", "contain", "safe_str",
           "log_internal_error"]

F = TypeVar("F", bound=Callable[..., Any])


def safe_str(exc: BaseException, limit: int = 2000) -> str:
    """``str(exc)``, or a placeholder when the exception's own ``__str__`` raises."""
    try:
        text = str(exc)
    except Exception:
        try:
            text = f"<{type(exc).__name__}: __str__ raised>"
        except Exception:  # pragma: no cover - a type whose name cannot be read
            text = "<unprintable exception>"
    return text[:limit]


class Guarded:
    """An object whose methods are entry points: the guard hands a fault to :meth:`_current_session`'s
    session (an adapter whose session is made per run overrides it)."""

    _session: Any = None

    def _current_session(self) -> Any:
        return self._session


def session_of(owner: Any) -> Any:
    """The session an entry point's owner runs now (None: none yet, or not a :class:`Guarded`)."""
    try:
        return owner._current_session() if isinstance(owner, Guarded) else None
    except Exception:
        return None


def log_internal_error(logger: logging.Logger, where: str, exc: BaseException, *, unwinding: bool = False) -> None:
    """An internal error, logged with its traceback. ``unwinding``: the run's own exception is ending the run, so
    training does not go on; ``exc``'s context (that exception, printed where it propagates) is left out."""
    if not unwinding:
        logger.exception("memcallbacks: internal error in %s; the memory monitor disables itself and training goes on.", where,
                         exc_info=exc)
        return
    logger.error("memcallbacks: internal error in %s while the run's own exception unwinds; the memory monitor disables itself "
                 "and that exception propagates unchanged.\n%s", where, "".join(format_exception(exc, chain=False)).rstrip())


def contain(owner: Any, exc: BaseException, where: str, *, unwinding: bool = False) -> None:
    """Hand an internal error to the owner's session (log once, disable); never raises when ``unwinding``.
    A :class:`UsageError` is not internal: it is raised again, for the user to fix."""
    if isinstance(exc, UsageError):
        raise exc
    session = session_of(owner)
    try:
        if session is not None:
            session.fail(exc, where, unwinding=unwinding)  # re-raises under strict
        else:
            log_internal_error(log, where, exc, unwinding=unwinding)
    except Exception as again:
        if not unwinding:
            raise
        if again is not exc:  # pragma: no cover - fail() only re-raises exc itself
            log.exception("memcallbacks: internal error while handling one in %s", where, exc_info=again)
        else:
            log.error("memcallbacks: internal error in %s while an exception was unwinding (strict: not re-raised, "
                      "so the training loop's own exception propagates).", where, exc_info=exc)


def entry_point(where: str, *, unwinding: bool = False) -> Callable[[F], F]:
    """Decorate an adapter method called by a framework: internal errors are contained (see module doc)."""

    def decorate(fn: F) -> F:
        @functools.wraps(fn)
        def guarded(self: Any, *args: Any, **kwargs: Any) -> Any:
            try:
                return fn(self, *args, **kwargs)
            except Exception as exc:
                contain(self, exc, where, unwinding=unwinding)
                return None

        guarded.__memcallbacks_entry_point__ = where  # type: ignore[attr-defined]
        return guarded  # type: ignore[return-value]

    return decorate


def self_guarded(where: str) -> Callable[[F], F]:
    """Mark a framework hook that contains its own faults: its body is one ``try`` block handing an
    exception to :func:`contain` (no wrapper frame: Lightning calls five such hooks on every step)."""

    def mark(fn: F) -> F:
        fn.__memcallbacks_entry_point__ = where  # type: ignore[attr-defined]
        return fn

    return mark
