"""Findings: what the leak detectors report, and a log that keeps one finding per cause."""

from __future__ import annotations

import copy
import logging
import re
from dataclasses import asdict, dataclass, field
from typing import Any, Iterator

log = logging.getLogger(__name__)

__all__ = ["Finding", "FindingLog", "announce", "announce_join", "evidence_lines", "finding_counts", "finding_label",
           "same_cause", "step_text"]

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
    evidence: list[dict[str, Any]] = field(default_factory=list)
    """What each detector saw of this cause, when more than one did (one cause, one finding: see
    :func:`same_cause`): ``{"kind", "key", "step", "last_step", "bytes", "seen", "holders"}`` per
    detector, first seen first. Empty when one detector found it."""

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
        """An open problem: not settled, not advice, not an OOM a leak's finding caused (``details["caused_by"]``: that
        finding counts the cause). What ``memory/findings`` counts and the pytest plugin fails on."""
        return self.state == "open" and self.severity == "problem" and not self.details.get("caused_by")

    @property
    def label(self) -> str:
        """``growth``, ``growth, settled`` or ``lingering, advice``: the kind and any state that is not the default."""
        extra = [x for x in (self.state if self.state != "open" else "", self.severity if self.severity != "problem" else "") if x]
        return ", ".join([self.kind, *extra])

    def __str__(self) -> str:
        lines = [f"[{self.label}] {step_text(self.to_steps())}: {self.message}"]
        lines += [f"    held by: {h}" for h in self.holders]
        lines += [f"    {line}" for line in evidence_lines(self.to_dict())]
        return "\n".join(lines)


def evidence_lines(item: dict[str, Any]) -> list[str]:
    """``seen: lingering at step 1 (8.0 MiB): Step 0's autograd graph ...``: one line per detector that saw
    the cause, from a finding or its report.json dict; none for a finding one detector made."""
    entries = item.get("evidence") or []
    if len(entries) < 2:
        return []
    lines = []
    for e in entries:
        first, last = e.get("step"), e.get("last_step")
        when = f"step {first}" + (f" to {last}" if last not in (None, first) else "")
        size = f" ({_fmt(e['bytes'])})" if isinstance(e.get("bytes"), (int, float)) else ""
        lines.append(f"seen: {e.get('kind')} at {when}{size}: {e.get('seen', '')}")
    return lines


# ---------------------------------------------------------------------- one cause, one finding
#: Which kind a cause takes when several detectors saw it: a cycle is why its tensors linger and grow; a
#: growth is what a lingering step turns into when every step is kept.
_CAUSE_ORDER = {"cycle": 0, "growth": 1, "lingering": 2}

#: Types every Python cycle passes through: they do not tell two cycles apart.
_PLAIN_TYPES = frozenset("dict list tuple set frozenset cell function method builtin_function_or_method type module weakref "
                         "ReferenceType defaultdict OrderedDict deque".split())


def cycle_types(description: str) -> list[str]:
    """The types that tell a cycle apart (``"Foo -> LambdaLR -> list -> function -> Foo holds ..."`` -> ``["Foo",
    "LambdaLR"]``), from a cycle's description; sorted, the plain containers every cycle passes through left out."""
    chain = description.removeprefix("cyclic garbage: ").split(" holds ")[0]
    names = {part.strip() for part in chain.split(" -> ") if part.strip()}
    return sorted(names - _PLAIN_TYPES) or sorted(names)


def same_cause(a: Finding, b: Finding) -> bool:
    """Whether two detectors' findings are one cause (docs/findings.md, "One cause, one finding"):

    - a cycle and what it keeps, or two sightings of one cycle: the same cycle types (``details["cycles"]``: a
      ``cycle`` finding's, a lingering step found in cyclic garbage, a growth whose tensors sit there);
    - a lingering step and the growth it turns into: the lingering graph's step among a graph chain's
      (``details["from_step"]`` in ``details["graph_steps_alive"]``), or a holder both name (``details["held_by"]``).

    Two ranks' findings are one cause when they are the same finding (:func:`_on_another_rank`); advice never
    joins, nor do other kinds."""
    da, db = a.details, b.details
    if "advice" in (a.severity, b.severity):
        return False
    if da.get("rank") != db.get("rank"):
        return _on_another_rank(a, b)
    if a.kind not in _CAUSE_ORDER or b.kind not in _CAUSE_ORDER or (a.kind == b.kind and a.kind != "cycle"):
        return False
    cycles_a = {t for c in da.get("cycles") or () for t in c}
    cycles_b = {t for c in db.get("cycles") or () for t in c}
    if cycles_a & cycles_b:
        return True
    if {a.kind, b.kind} != {"lingering", "growth"}:
        return False
    ling, grow = (a, b) if a.kind == "lingering" else (b, a)
    dl, dg = ling.details, grow.details
    if dl.get("graph_alive") and dl.get("from_step") in (dg.get("graph_steps_alive") or ()):
        return True
    return bool(set(dl.get("held_by") or ()) & set(dg.get("held_by") or ()))


def _largest(a: int | None, b: int | None) -> int | None:
    return b if a is None else a if b is None else max(a, b)


def _union(a: list[Any] | None, b: list[Any] | None) -> list[Any]:
    return [*(a or []), *(x for x in b or [] if x not in (a or []))]


def _bare_key(finding: Finding) -> str:
    return re.sub(r"^rank\d+:", "", finding.key)


def _on_another_rank(a: Finding, b: Finding) -> bool:
    """Rank zero's finding and another rank's (``details["rank"]``, key ``rankN:...``) are one cause when they are one
    finding: the same key and kind and the same holders (or cycle), or no holder named on either side (the same worker
    cache on every rank, the same leak in every rank's copy of the model)."""
    if a.kind != b.kind or _bare_key(a) != _bare_key(b):
        return False
    ids = [(set(f.details.get("held_by") or ()), {t for c in f.details.get("cycles") or () for t in c}) for f in (a, b)]
    if any(ids[0][i] and ids[1][i] for i in (0, 1)):
        return any(ids[0][i] & ids[1][i] for i in (0, 1))
    return not (ids[0][0] or ids[0][1] or ids[1][0] or ids[1][1])


def evidence_of(finding: Finding) -> dict[str, Any]:
    """What one detector saw: its kind, key, first and last step, bytes, first sentence and holders."""
    seen = " ".join(finding.message.split())
    cut = re.search(r"(?<=[.:;])\s", seen[20:])
    seen = seen[: 20 + cut.start()] if cut else seen
    return {"kind": finding.kind, "key": finding.key, "step": finding.first_step, "last_step": finding.step,
            "bytes": finding.bytes, "seen": seen[:240], "holders": list(finding.holders[:2])}


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
    a settled growth in one line (a warning: it takes back the warning that raised it, and the forecast
    that warning said), an OOM's explanation as an error."""
    if finding.state == "settled":
        d = finding.details
        said = d.get("runs_out_withdrawn")  # the forecast it had said: withdrawn in the same line
        withdrawn = f"; the forecast that memory runs out at about step {said:,} is withdrawn" if isinstance(said, int) else ""
        logger.warning("%s: the growth found at step %s settled at %s (+%s) at step %d: flat for %s steps after growing for %s; "
                       "not a leak unless it grows again%s.", owner, finding.first_step, _fmt(d.get("floor_bytes")),
                       _fmt(d.get("settled_bytes")), finding.step, d.get("flat_steps"), d.get("grew_steps"), withdrawn)
    elif finding.kind == "oom":  # the explanation of the error that ends the run: an error, its text whole
        logger.error("%s: %s", owner, finding.message)
    elif finding.severity == "advice":
        logger.info("%s has advice: %s", owner, str(finding))  # the text now: the stored finding changes later
    elif changed:
        logger.warning("%s: a memory problem re-opened: %s", owner, str(finding))
    else:
        logger.warning("%s found a memory problem: %s", owner, str(finding))


def announce_join(logger: logging.Logger, owner: str, cause: Finding, seen: Finding) -> None:
    """Log once that a detector's finding (``seen``) is the evidence of a cause already reported: as a warning when
    the cause's kind changed with it (a lingering step that grows), else at INFO."""
    if len(cause.details.get("ranks") or ()) > 1 and "rank" not in seen.details:  # rank zero's own, another rank's before
        logger.warning("%s found a memory problem (rank %s found it too): %s", owner,
                       ", ".join(str(r) for r in cause.details["ranks"] if r), str(cause))
    elif cause.key == seen.key and cause.kind == seen.kind:  # it took the cause over: what the others saw is its evidence
        earlier = [e for e in cause.evidence if e.get("key") != seen.key]
        what = ", ".join(f"the {e.get('kind')} found at step {e.get('step')}" for e in earlier) or "an earlier finding"
        logger.warning("%s: %s and this %s are one cause: %s", owner, what, seen.kind, str(cause))
    else:
        logger.info("%s: the %s seen at step %s is the evidence of the %s found at step %s (one cause).", owner, seen.kind,
                    seen.first_step, cause.kind, cause.first_step)


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
    """Keeps one :class:`Finding` per cause, in first-seen order.

    ``add`` returns True the first time a cause is seen (the caller announces it, e.g. logs a
    warning); later adds of the same key update the stored finding (step, bytes and message are
    replaced; holders are replaced when the update has any) and bump ``count`` without announcing
    again. ``details`` are merged: the update's entries win, and entries only an earlier report
    had are kept - a growth finding reports its census cost once, with the holders, and keeps it
    through the later updates that carry only new rates. An update does not change the cause a
    finding named (``details["cause"]``, with the message and fix that go with it). The log stores
    copies: changing a finding after adding it does not change the log.

    A finding of a new key that is the same cause as a stored one (:func:`same_cause`) joins it
    (:attr:`joined`): the one cause keeps the first step and takes the kind of the cause (a cycle over
    what it keeps, a growth over the lingering step it grew from), and its ``evidence`` lists what each
    detector saw. Later adds of the joined key update its evidence only.
    """

    def __init__(self, *, max_findings: int = 1000) -> None:
        if max_findings < 1:
            raise ValueError(f"FindingLog(max_findings={max_findings}) must be at least 1.")
        self.max_findings = max_findings
        self._by_key: dict[str, Finding] = {}
        self._joined_to: dict[str, str] = {}  # a detector's key -> the key of the cause it joined
        self._other_ranks: set[str] = set()  # keys of other ranks' findings that are one of this log's (details["ranks"])
        self.dropped = 0
        """Findings with new keys refused because ``max_findings`` was reached."""
        self.changed: Finding | None = None
        """After :meth:`add`: the stored finding when the add changed its state (settled, re-opened)."""
        self.joined: Finding | None = None
        """After :meth:`add`: the stored cause when the added finding joined it (one cause, several detectors)."""
        self.open_problems = 0
        """Open problems: findings neither settled nor advice (counted when one is added or changes state)."""
        self.version = 0
        """Moves at every add and clear: a reader that saw this version has seen every finding as it is."""

    def add(self, finding: Finding) -> bool:
        """Record ``finding``; True when it is a new cause."""
        self.version += 1
        self.changed = self.joined = None
        key = self._joined_to.get(finding.key, finding.key)
        old = self._by_key.get(key)
        if old is None:
            cause = next((f for f in self._by_key.values() if same_cause(f, finding)), None)
            if cause is not None:
                self._join(cause, finding)
                return False
            if len(self._by_key) >= self.max_findings:
                self.dropped += 1
                return False
            stored = copy.copy(finding)
            stored.details = dict(finding.details)  # not shared: updates merge into this dict
            stored.holders = list(finding.holders)
            stored.evidence = [dict(e) for e in finding.evidence]
            self._by_key[finding.key] = stored
            for named in {e.get("key") for e in stored.evidence} - {stored.key}:  # what it was seen as: its evidence
                if named in self._by_key:  # another rank's cause, joined there; a growth that turned out to be a cycle's
                    self._join(stored, self._by_key.pop(named))
                elif named:
                    self._joined_to[named] = stored.key  # that detector's later updates are its evidence
            self.joined = None
            self._count()
            return True
        if key != finding.key:  # a detector's update of a cause it joined: its evidence only
            self._note(old, finding)
            return False
        self._update(old, finding)
        other = next((f for f in self._by_key.values() if f is not old and same_cause(f, old)), None)
        if other is not None:  # the update told what the cause is (a growth's holders sit in a cycle found before)
            order = list(self._by_key.values())
            keep, gone = (other, old) if order.index(other) < order.index(old) else (old, other)  # the first seen stays
            del self._by_key[gone.key]
            self._join(keep, gone)
        return False

    def _update(self, old: Finding, finding: Finding) -> None:
        cause = old.details.get("cause")
        if cause is not None and finding.details.get("cause") not in (None, cause):
            # the cause named when it was raised stays, with its message and fix (a worker cache that grows inside the
            # workers is not copy on access at the run's end because the Dataset's size cannot be read any more)
            old.details["other_cause_seen"] = {"cause": finding.details["cause"], "step": finding.step}
            old.step, old.bytes, old.count = finding.step, finding.bytes, old.count + finding.count
            return
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
        self._take_evidence(old, finding)
        if old.evidence:
            self._note(old, finding)
        if (old.state, old.severity) != (finding.state, finding.severity):
            old.state, old.severity = finding.state, finding.severity
            self.changed = old
            self._count()

    def _join(self, cause: Finding, finding: Finding) -> None:
        """``finding`` (not stored, or taken out of the log) is ``cause``'s evidence; of the two, the one whose kind
        names the cause gives the stored finding its kind, key, message and fix."""
        if cause.details.get("rank") != finding.details.get("rank"):
            self._on_ranks(cause, finding)
            return
        if not cause.evidence:
            cause.evidence = [evidence_of(cause)]
        for item in finding.evidence or [evidence_of(finding)]:
            if all(e.get("key") != item.get("key") for e in cause.evidence):
                cause.evidence.append(dict(item))
        identity = {name: _union(cause.details.get(name), finding.details.get(name)) for name in ("held_by", "cycles")}
        largest = _largest(cause.bytes, finding.bytes)  # what the cause keeps alive: the most any detector saw
        first = min(cause.first_step if cause.first_step is not None else cause.step,
                    finding.first_step if finding.first_step is not None else finding.step)
        old_key = cause.key
        if _CAUSE_ORDER[finding.kind] < _CAUSE_ORDER[cause.kind]:  # it names the cause: the stored finding takes its identity
            cause.kind, cause.key, cause.message, cause.bytes = finding.kind, finding.key, finding.message, finding.bytes
            cause.state, cause.severity, cause.details = finding.state, finding.severity, dict(finding.details)
            cause.holders = list(finding.holders) or cause.holders
            self._by_key = {(cause.key if k == old_key else k): f for k, f in self._by_key.items()}
        cause.details.update({name: value for name, value in identity.items() if value})
        cause.bytes = largest
        cause.first_step, cause.step = first, max(cause.step, finding.step)
        cause.count += finding.count
        for key in (old_key, finding.key):
            if key != cause.key:
                self._joined_to[key] = cause.key
        for key, to in self._joined_to.items():
            if to in (old_key, finding.key):
                self._joined_to[key] = cause.key
        self._joined_to.pop(cause.key, None)
        self._take_evidence(cause, finding)
        self.joined = cause
        self._count()

    def _take_evidence(self, cause: Finding, finding: Finding) -> None:
        """What ``finding`` names as its evidence (a cycle found from a growth's tensors names the growth) is
        ``cause``'s: that detector's later updates join it, and a finding of it stored on its own is taken in."""
        for item in finding.evidence:
            named = item.get("key")
            if not named or named in (cause.key, finding.key):
                continue
            if named in self._by_key:
                self._join(cause, self._by_key.pop(named))
                continue
            if not cause.evidence:
                cause.evidence = [evidence_of(cause)]
            if all(e.get("key") != named for e in cause.evidence):
                cause.evidence.append(dict(item))
            self._joined_to[named] = cause.key

    def _on_ranks(self, cause: Finding, finding: Finding) -> None:
        """The same finding on another rank: one cause, found on several ranks (``details["ranks"]``). Rank zero's own
        finding gives it its text; the other rank's later updates only say that it is still seen there."""
        ranks = sorted({int(f.details.get("rank") or 0) for f in (cause, finding)} | set(cause.details.get("ranks") or ()))
        if finding.details.get("rank") is None and cause.details.get("rank") is not None:  # rank zero's own: its text
            old_key = cause.key
            cause.key, cause.message, cause.holders = finding.key, finding.message, list(finding.holders)
            cause.details, cause.evidence = dict(finding.details), [dict(e) for e in finding.evidence]
            cause.state, cause.severity, cause.bytes, cause.step = finding.state, finding.severity, finding.bytes, finding.step
            self._by_key = {(cause.key if k == old_key else k): f for k, f in self._by_key.items()}
            self._joined_to[old_key] = cause.key
            self._other_ranks.add(old_key)
        else:
            self._joined_to[finding.key] = cause.key
            self._other_ranks.add(finding.key)
        cause.details["ranks"] = ranks
        cause.first_step = min(cause.first_step if cause.first_step is not None else cause.step,
                               finding.first_step if finding.first_step is not None else finding.step)
        self.joined = cause
        self._count()

    def _note(self, cause: Finding, finding: Finding) -> None:
        if finding.key in self._other_ranks:
            return  # the same finding on another rank: already counted in details["ranks"]
        if cause.key != finding.key:
            cause.bytes = _largest(cause.bytes, finding.bytes)
        for entry in cause.evidence:
            if entry.get("key") == finding.key:
                entry.update(last_step=finding.step, bytes=finding.bytes if finding.bytes is not None else entry.get("bytes"))
                if finding.holders:
                    entry["holders"] = list(finding.holders[:2])
                return

    def _count(self) -> None:
        self.open_problems = sum(1 for f in self._by_key.values() if f.is_problem)

    def problems(self) -> int:
        """Open problems: findings neither settled nor advice."""
        return self.open_problems

    def get(self, key: str) -> Finding | None:
        return self._by_key.get(self._joined_to.get(key, key))

    def __contains__(self, key: object) -> bool:
        return key in self._by_key or key in self._joined_to

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
        self._joined_to.clear()
        self._other_ranks.clear()
        self.dropped = 0
        self.open_problems = 0
