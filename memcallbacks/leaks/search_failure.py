"""When the search for holders fails, the finding stays, without holders, and says why.

Naming holders walks the heap (``gc.get_objects``, ``gc.get_referrers``) and the objects on it;
a user's object whose attribute access raises, a C extension's odd type or an ``OSError`` from a
file-backed object can make that walk fail. The memory numbers behind a finding do not depend on
it: the finding is kept, its ``details["holders_unavailable"]`` holds the error, its message says
the holders are unknown, and the monitor goes on (it no longer switches itself off over it).
``explain()``, which is the census and nothing else, raises :class:`CensusError` instead.
"""

from __future__ import annotations

import logging
from typing import Callable, TypeVar

from memcallbacks._base.findings import Finding, with_holders_note

log = logging.getLogger(__name__)

__all__ = ["CensusError", "holders_unavailable", "search_or_note"]

T = TypeVar("T")


class CensusError(RuntimeError):
    """``explain()`` could not take its census; ``__cause__`` is the original error."""


def _reason(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0]}" if text else type(exc).__name__


def holders_unavailable(finding: Finding, exc: BaseException) -> Finding:
    """Mark ``finding`` as kept without holders because the search raised ``exc``."""
    reason = _reason(exc)
    log.debug("memcallbacks: the holder search for a %s finding failed", finding.kind, exc_info=exc)
    finding.message = with_holders_note(finding.message, reason)
    finding.holders = []
    finding.details["holders_unavailable"] = reason
    return finding


def search_or_note(finding: Finding, search: Callable[[], T], default: T) -> T:
    """``search()``, or ``default`` with ``finding`` marked by :func:`holders_unavailable` when it raises."""
    try:
        return search()
    except Exception as exc:
        holders_unavailable(finding, exc)
        return default


def census_error(owner: str, exc: BaseException) -> CensusError:
    return CensusError(
        f"{owner}.explain() could not take its census of live tensors: {_reason(exc)}. Training and the monitor are not "
        "affected; the census walks every object on the heap, so an object whose attributes raise when read can stop it. "
        "Call explain() again later, or read monitor.findings and monitor.history, which do not need it."
    )
