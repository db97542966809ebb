"""Findings: what the leak detectors report, and a log that keeps one finding per cause."""

from __future__ import annotations

import copy
import logging
from dataclasses import asdict, dataclass, field
from typing import Any, Iterator

log = logging.getLogger(__name__)

__all__ = ["Finding", "FindingLog", "announce", "finding_counts", "finding_label", "step_text"]

KINDS = ("growth", "lingering", "cycle", "unexplained", "preflight", "host_growth", "worker_growth", "rank_imbalance", "oom")
STATES = ("open", "settled")
SEVERITIES = ("problem", "advice")


@dataclass
class Finding:
    """One diagnosed memory problem, with the evidence and the fix.

    ``key`` names the cause: the :class:`FindingLog` keeps one finding per key, so a leak that
    shows every step is reported once (a growth finding is updated in place as it grows).
    """

    kind: str
    """``"growth"``, ``"lingering"``, ``"cycle"``, ``"unexplained"``, ``"preflight"``, or a host kind:
    ``"host_growth"``, ``"worker_growth"``, ``"rank_imbalance"`` (docs/findings.md, "Host memory"), or ``"oom"``:
    an out-of-memory error explained (docs/oom.md)."""
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
    state: str = "open"
    """``"open"``, or ``"settled"``: a growth that stopped (``details["settled_step"]``,
    ``details["settled_bytes"]``); a settled growth that grows again is ``"open"`` once more
    (``details["reopened"]`` counts it). See docs/findings.md, "The lifecycle"."""
    severity: str = "problem"
    """``"problem"`` (a leak or an unexplained use: logged as a warning, fails the pytest plugin), or
    ``"advice"``: bounded and not a leak, with its cost (logged at INFO)."""

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"Finding.kind={self.kind!r} is not one of {KINDS}; use one of those.")
        if self.state not in STATES:
            raise ValueError(f"Finding.state={self.state!r} is not one of {STATES}; use one of those.")
        if self.severity not in SEVERITIES:
            raise ValueError(f"Finding.severity={self.severity!r} is not one of {SEVERITIES}; use one of those.")
        if not self.key:
            self.key = self.kind
        if self.first_step is None:
            self.first_step = self.step

    def to_dict(self) -> dict[str, Any]:
        """A JSON-able dict (``json.dumps(finding.to_dict())`` works)."""
        out = asdict(self)
        out["details"] = _jsonable(self.details)
        return out

    def to_steps(self) -> dict[str, Any]:
        return {"step": self.step, "first_step": self.first_step, "state": self.state}

    @property
    def is_problem(self) -> bool:
        """An open problem: not settled, not advice (what ``memory/findings`` counts and the pytest plugin fails on)."""
        return self.state == "open" and self.severity == "problem"

    @property
    def label(self) -> str:
        """``growth``, ``growth, settled`` or ``lingering, advice``: the kind and any state that is not the default."""
        extra = [x for x in (self.state if self.state != "open" else "", self.severity if self.severity != "problem" else "") if x]
        return ", ".join([self.kind, *extra])

    def __str__(self) -> str:
        lines = [f"[{self.label}] {step_text(self.to_steps())}: {self.message}"]
        lines += [f"    held by: {h}" for h in self.holders]
        return "\n".join(lines)


def step_text(item: dict[str, Any]) -> str:
    """``step 49`` or ``step 49 (confirmed again at step 284)``: the step a finding was first raised at,
    then its latest update (a settled one's: ``settled at step N``), from a finding or its report.json dict."""
    first, last = item.get("first_step"), item.get("step")
    if first is None or first == last:
        return f"step {last}"
    again = "settled at" if item.get("state") == "settled" else "confirmed again at"
    return f"step {first} ({again} step {last})"


def with_holders_note(message: str, reason: str) -> str:
    """``message`` saying that its holders are unknown because their search failed with ``reason`` (once)."""
    note = f" (Holders unknown: the search for them failed with {reason}; the finding rests on the memory numbers alone.)"
    return message if note in message else message + note


def announce(logger: logging.Logger, owner: str, finding: Finding, *, changed: bool = False) -> None:
    """Log a new finding, or one whose state changed, once: a problem as a warning, advice at INFO,
    a settled growth in one line (a warning: it takes back the warning that raised it), an OOM's
    explanation as an error."""
    if finding.state == "settled":
        d = finding.details
        logger.warning("%s: the growth found at step %s settled at %s (+%s) at step %d: flat for %s steps after growing for %s; "
                       "not a leak unless it grows again.", owner, finding.first_step, _fmt(d.get("floor_bytes")),
                       _fmt(d.get("settled_bytes")), finding.step, d.get("flat_steps"), d.get("grew_steps"))
    elif finding.kind == "oom":  # the explanation of the error that ends the run: an error, its text whole
        logger.error("%s: %s", owner, finding.message)
    elif finding.severity == "advice":
        logger.info("%s has advice: %s", owner, finding)
    elif changed:
        logger.warning("%s: a memory problem re-opened: %s", owner, finding)
    else:
        logger.warning("%s found a memory problem: %s", owner, finding)


def _fmt(value: Any) -> str:
    from memcallbacks._base.units import format_bytes

    return format_bytes(value) if isinstance(value, (int, float)) else "?"


def finding_label(item: dict[str, Any]) -> str:
    """:attr:`Finding.label` for a finding read back from ``report.json`` (older files have no state)."""
    extra = [x for x in (item.get("state") or "open", item.get("severity") or "problem") if x not in ("open", "problem")]
    return ", ".join([str(item.get("kind")), *extra])


def finding_counts(items: list[dict[str, Any]]) -> str:
    """``"none"``, ``"2"``, or ``"1 (1 settled growth, 1 advice)"``: open problems first, then the rest."""
    if not items:
        return "none"
    settled = sum(1 for f in items if f.get("state") == "settled")
    advice = sum(1 for f in items if f.get("severity") == "advice" and f.get("state") != "settled")
    problems = len(items) - settled - advice
    rest = [f"{n} {what}" for n, what in ((settled, "settled growth"), (advice, "advice")) if n]
    return f"{problems}" + (f" open problem{'s' if problems != 1 else ''} ({', '.join(rest)})" if rest else "")


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
        self.changed: Finding | None = None
        """After :meth:`add`: the stored finding when the add changed its state (settled, re-opened)."""
        self.open_problems = 0
        """Open problems: findings neither settled nor advice (counted when one is added or changes state)."""
        self.version = 0
        """Moves at every add and clear: a reader that saw this version has seen every finding as it is."""

    def add(self, finding: Finding) -> bool:
        """Record ``finding``; True when its key is new."""
        self.version += 1
        old = self._by_key.get(finding.key)
        self.changed = None
        if old is None:
            if len(self._by_key) >= self.max_findings:
                self.dropped += 1
                return False
            stored = copy.copy(finding)
            stored.details = dict(finding.details)  # not shared: updates merge into this dict
            stored.holders = list(finding.holders)
            self._by_key[finding.key] = stored
            self.open_problems += stored.is_problem
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
        if (old.state, old.severity) != (finding.state, finding.severity):
            self.open_problems += finding.is_problem - old.is_problem
            old.state, old.severity = finding.state, finding.severity
            self.changed = old
        return False

    def problems(self) -> int:
        """Open problems: findings neither settled nor advice."""
        return self.open_problems

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
        self.version += 1
        self._by_key.clear()
        self.dropped = 0
        self.open_problems = 0
