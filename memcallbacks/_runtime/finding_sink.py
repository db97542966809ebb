"""Where every part of a run reports its findings: one per cause, logged once on rank zero."""

from __future__ import annotations

import logging
from typing import Any, Callable

from memcallbacks._base import distributed as _distributed
from memcallbacks._base.findings import Finding, FindingLog, announce, announce_join

__all__ = ["FindingSink"]


class FindingSink:
    """The run's findings (a :class:`FindingLog`), the ones new since the snapshot policy last
    looked, and the warnings they produced. ``rank``: called at each warning (rank zero logs)."""

    def __init__(self, owner: str, log: logging.Logger, rank: Callable[[], int]) -> None:
        self.owner = owner
        self.log = log
        self.rank = rank
        self.reset()

    def reset(self) -> None:
        self.kept = FindingLog()  # one finding per cause
        self.new: list[Finding] = []
        self._holders_logged: set[str] = set()
        self._shared: dict[str, tuple[int, str]] = {}  # key -> (count, state) last sent to rank zero

    @property
    def findings(self) -> list[Finding]:
        return self.kept.findings

    def add(self, finding: Finding) -> None:
        """Keep one finding per cause; log a new cause once on rank zero (a problem as a warning,
        advice at INFO), and a change of state (settled, re-opened) once more."""
        kept = self.kept
        if kept.add(finding):
            self.new.append(finding)
            if self.rank() == 0:
                announce(self.log, self.owner, kept.get(finding.key) or finding)
            if finding.holders:
                self._holders_logged.add(finding.key)
        elif kept.joined is not None:  # a detector's finding of a cause already found: said once, as its evidence
            self.new.append(finding)
            if finding.holders:
                self._holders_logged.add(kept.joined.key)
            if self.rank() == 0:
                announce_join(self.log, self.owner, kept.joined, finding)
        elif kept.changed is not None and self.rank() == 0:  # settled, or re-opened (docs/findings.md)
            announce(self.log, self.owner, self.kept.changed, changed=True)
        elif finding.holders and finding.key not in self._holders_logged:
            # growth: the holders come from a second census some steps after the first warning
            self._holders_logged.add(finding.key)
            cause = kept.get(finding.key)
            if self.rank() == 0:
                # said as a warning where the growth is the cause; as the evidence of another cause, at INFO
                level = logging.WARNING if cause is None or cause.key == finding.key else logging.INFO
                self.log.log(level, "%s: what grew (%s finding of step %d):\n%s", self.owner, finding.kind,
                             finding.first_step or finding.step, "\n".join(f"    {h}" for h in finding.holders))

    def share_with_rank_zero(self, rank: int, device: Any, step: int) -> int:
        """A collective (every rank calls it at the same step): the findings each other rank made or
        changed since the last call reach rank zero, which keeps them as ``rank N: ...`` findings
        (key ``rankN:<key>``, ``details["rank"]``, ``details["shared_at_step"]``: rank zero's step when it first
        heard), logs and reports them. Costs one all-reduce of a
        number when no rank has news, one object gather more when one has. Returns the findings received."""
        mine = self.news_for_rank_zero(rank)
        news, _ = _distributed.max_over_ranks([float(len(mine))], device)
        if not news[0] > 0:
            return 0
        return self.receive_from_ranks(rank, _distributed.gather_objects(mine, device), step)

    def news_for_rank_zero(self, rank: int) -> list[dict[str, Any]]:
        """This rank's findings that rank zero has not heard of as they are now (none on rank zero), as dicts; marked
        as sent. The run's end hands them over in its own gather (``RunEnd``), so a finding of a run shorter than the
        logging interval, or made after the last exchange, reaches rank zero too."""
        mine: list[dict[str, Any]] = []
        if rank == 0:
            return mine
        for f in self.kept.findings:  # rank zero's own kinds (rankN:..., rank_imbalance) come back only from a checkpoint
            if not f.key.startswith("rank") and self._shared.get(f.key) != (f.count, f.state, len(f.evidence)):
                self._shared[f.key] = (f.count, f.state, len(f.evidence))
                mine.append(f.to_dict())
        return mine

    def receive_from_ranks(self, rank: int, gathered: list[list[dict[str, Any]]] | None, step: int) -> int:
        """Rank zero keeps what each other rank sent (:meth:`news_for_rank_zero`, gathered in rank order) as its
        ``rank N: ...`` findings; other ranks ignore it. Returns the findings received."""
        received = 0
        for other, items in enumerate(gathered or []):
            if rank != 0 or other == 0:
                continue
            for item in items or []:
                try:
                    self.add(_from_rank(item, other, self.kept, step))
                except (TypeError, ValueError, KeyError):
                    self.log.debug("dropping an unreadable finding from rank %d: %r", other, item)
                    continue
                received += 1
        return received

    def problems(self) -> int:
        """Open problems: findings that are neither settled growth nor advice (``memory/findings``)."""
        return self.kept.problems()

    def take_new(self) -> list[Finding]:
        new, self.new = self.new, []
        return new

    def to_list(self) -> list[dict[str, Any]]:
        return self.kept.to_list()

    def restore(self, items: list[dict[str, Any]]) -> None:
        """Findings read back from a checkpoint; unreadable ones are dropped."""
        for item in items:
            try:
                self.kept.add(_finding(item))
            except (TypeError, ValueError):
                self.log.debug("dropping unreadable finding from checkpoint: %r", item)


def _from_rank(item: dict[str, Any], rank: int, kept: FindingLog, step: int) -> Finding:
    """Rank ``rank``'s finding as rank zero keeps it: key ``rank{rank}:<key>`` (its evidence's keys too), message
    ``rank {rank}: ...``, ``details["rank"]`` and ``details["shared_at_step"]`` (rank zero's step when it first heard)."""
    key = f"rank{rank}:{item['key']}"
    known = kept.get(key)
    shared_at = known.details.get("shared_at_step", step) if known is not None else step
    evidence = [dict(e, key=f"rank{rank}:{e.get('key')}") for e in item.get("evidence") or []]
    return _finding(dict(item, key=key, message=f"rank {rank}: {item['message']}", evidence=evidence,
                         details=dict(item.get("details") or {}, rank=rank, shared_at_step=shared_at)))


def _finding(item: dict[str, Any]) -> Finding:
    """A :class:`Finding` from its ``to_dict()`` (a checkpoint's, another rank's); unknown keys are dropped."""
    return Finding(**{k: v for k, v in item.items() if k in Finding.__dataclass_fields__})
