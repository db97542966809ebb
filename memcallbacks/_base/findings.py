"""Findings: what the leak detectors report, and a log that keeps one finding per cause."""

from __future__ import annotations

import copy
import logging
from dataclasses import asdict, dataclass, field
from typing import Any, Iterator

log = logging.getLogger(__name__)

__all__ = ["Finding", "FindingLog"]

KINDS = ("growth", "lingering", "cycle", "unexplained", "preflight", "host_growth", "worker_growth", "rank_imbalance")


@dataclass
class Finding:
    """One diagnosed memory problem, with the evidence and the fix.

    ``key`` names the cause: the :class:`FindingLog` keeps one finding per key, so a leak that
    shows every step is reported once (a growth finding is updated in place as it grows).
    """

    kind: str
    """``"growth"``, ``"lingering"``, ``"cycle"``, ``"unexplained"``, ``"preflight"``, or a host kind:
    ``"host_growth"``, ``"worker_growth"``, ``"rank_imbalance"`` (docs/findings.md, "Host memory")."""
    step: int
    """Optimizer step at which the finding was (last) confirmed."""
    message: str
    """One paragraph a user can act on: what was seen, the usual cause, the fix."""
    bytes: int | None = None
    """Bytes involved (held, grown or freed), when known."""
    holders: list[str] = field(default_factory=list)
    """Human-readable reference paths, e.g. ``"LitModel.cache[17]"``."""
    details: dict[str, Any] = field(default_factory=dict)
    """JSON-able extras (rates, counts, step ranges)."""
    key: str = ""
    """Stable cause identifier; defaults to ``kind``."""
    first_step: int | None = None
    """Step at which this cause was first reported; defaults to ``step``."""
    count: int = 1
    """How many times the cause was reported (by a detector, or re-added to a log)."""

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"Finding.kind={self.kind!r} is not one of {KINDS}; use one of those.")
        if not self.key:
            self.key = self.kind
        if self.first_step is None:
            self.first_step = self.step

    def to_dict(self) -> dict[str, Any]:
        """A JSON-able dict (``json.dumps(finding.to_dict())`` works)."""
        out = asdict(self)
        out["details"] = _jsonable(self.details)
        return out

    def __str__(self) -> str:
        lines = [f"[{self.kind}] step {self.step}: {self.message}"]
        lines += [f"    held by: {h}" for h in self.holders]
        return "\n".join(lines)


def with_holders_note(message: str, reason: str) -> str:
    """``message`` saying that its holders are unknown because their search failed with ``reason`` (once)."""
    note = f" (Holders unknown: the search for them failed with {reason}; the finding rests on the memory numbers alone.)"
    return message if note in message else message + note


def _jsonable(value: Any) -> Any:
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, dict):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple, set, frozenset)):
        return [_jsonable(v) for v in value]
    return repr(value)


class FindingLog:
    """Keeps one :class:`Finding` per ``key``, in first-seen order.

    ``add`` returns True the first time a key is seen (the caller announces it, e.g. logs a
    warning); later adds of the same key update the stored finding (step, bytes and message are
    replaced; holders are replaced when the update has any) and bump ``count`` without announcing
    again. ``details`` are merged: the update's entries win, and entries only an earlier report
    had are kept - a growth finding reports its census cost once, with the holders, and keeps it
    through the later updates that carry only new rates. The log stores copies: changing a
    finding after adding it does not change the log.
    """

    def __init__(self, *, max_findings: int = 1000) -> None:
        if max_findings < 1:
            raise ValueError(f"FindingLog(max_findings={max_findings}) must be at least 1.")
        self.max_findings = max_findings
        self._by_key: dict[str, Finding] = {}
        self.dropped = 0
        """Findings with new keys refused because ``max_findings`` was reached."""

    def add(self, finding: Finding) -> bool:
        """Record ``finding``; True when its key is new."""
        old = self._by_key.get(finding.key)
        if old is None:
            if len(self._by_key) >= self.max_findings:
                self.dropped += 1
                return False
            stored = copy.copy(finding)
            stored.details = dict(finding.details)  # not shared: updates merge into this dict
            stored.holders = list(finding.holders)
            self._by_key[finding.key] = stored
            return True
        old.step = finding.step
        old.message = finding.message
        old.bytes = finding.bytes
        old.details.update(finding.details)
        if finding.holders:
            old.holders = list(finding.holders)
            old.details.pop("holders_unavailable", None)
        elif old.details.get("holders_unavailable"):
            old.message = with_holders_note(old.message, old.details["holders_unavailable"])  # an update's text lacks it
        old.count += finding.count
        return False

    def get(self, key: str) -> Finding | None:
        return self._by_key.get(key)

    def __contains__(self, key: object) -> bool:
        return key in self._by_key

    def __iter__(self) -> Iterator[Finding]:
        return iter(list(self._by_key.values()))

    def __len__(self) -> int:
        return len(self._by_key)

    @property
    def findings(self) -> list[Finding]:
        return list(self._by_key.values())

    def to_list(self) -> list[dict[str, Any]]:
        return [f.to_dict() for f in self._by_key.values()]

    def clear(self) -> None:
        self._by_key.clear()
        self.dropped = 0
