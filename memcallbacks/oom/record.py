"""An OOM in a monitored run: explained once, written as ``oom.json``, and an ``"oom"`` finding."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from memcallbacks._base.findings import Finding
from memcallbacks.oom.explanation import OomExplanation, explain_oom, write_oom_json
from memcallbacks.oom.remedies import fix_of

__all__ = ["record_oom"]

_HOLDER_KINDS = ("growth", "lingering", "cycle")


def leak_causes(findings: list[Finding], named: set[str]) -> list[str]:
    """The keys of the leak findings an explanation that blames a leak first is the consequence of: those whose
    holders it names (``named``), or, where it names none and a growth finding has none yet (an OOM before the
    growth's second census), that growth (a user check read "2 problems found" for one cause there)."""
    return [f.key for f in findings if f.kind in _HOLDER_KINDS and f.is_problem
            and (named & set(f.holders) or not named and not f.holders and f.kind == "growth")]


def _holders(findings: list[Finding]) -> list[str]:
    """The leak findings' holders, the most bytes first: who keeps memory from earlier steps."""
    leaks = sorted((f for f in findings if f.kind in _HOLDER_KINDS and f.holders), key=lambda f: -(f.bytes or 0))
    return [h for f in leaks for h in f.holders]


def record_oom(
    exc: BaseException, event: dict[str, Any], *, engine: Any, model: Any, optimizer: Any, precision: str | None,
    findings: list[Finding], capacity: int | None, output_dir: Path | None, snapshots: list[dict[str, Any]],
    log: logging.Logger, owner: str, read_now: tuple[int, int] | None = None,
) -> Finding | None:
    """Explain ``exc`` for the run ``engine`` measures; log it on this rank, write ``oom.json`` into ``output_dir``
    and note both in ``event`` (the report's ``"oom"`` event). Returns the finding, or None when nothing could be said.
    ``read_now``: ``(step, bytes)``, the watch's latest read at a step's start (:func:`explain_oom`).

    Never raises: the run's own error propagates unchanged whatever happens here."""
    try:
        explanation = _explain(exc, event, engine, model, optimizer, precision, findings, capacity, snapshots, read_now)
    except Exception:
        log.warning("%s: could not explain the out-of-memory error (internal error); the run's own error propagates.", owner,
                    exc_info=True)
        return None
    text = explanation.text()
    event["explanation"] = explanation.to_dict()
    if output_dir is not None:
        try:
            event["oom_file"] = str(write_oom_json(explanation, output_dir, engine.world_size))
        except OSError as err:
            log.error("%s: could not write oom.json to %s (%s).", owner, output_dir, err.strerror or err)
    for record in _oom_snapshots(snapshots):  # the snapshot's entry in report.json names its explanation
        record["explanation"] = event.get("oom_file")
    if engine.rank != 0:  # rank zero logs it as its finding
        log.error("%s: %s", owner, text)
    acc = explanation.accounting
    remedies = explanation.remedies
    leak = remedies[0] if remedies and remedies[0].kind == "leak" else None  # the explanation blames the leak first
    named = set(explanation.holders)
    caused_by = leak_causes(findings, named) if leak is not None else []
    details = {"phase": explanation.where.phase, "module": explanation.where.module, "file": event.get("oom_file"),
               "snapshot": explanation.snapshot, "fix": fix_of(remedies)}
    if caused_by:  # one cause: the leak's finding counts it, this one is its consequence (docs/findings.md)
        details["caused_by"] = caused_by
    holders = list(explanation.holders[:5]) if any(r.kind == "leak" for r in remedies) else []  # only where it speaks of them
    return Finding(kind="oom", step=explanation.step, message=text, bytes=acc.figure_bytes, holders=holders,
                   key=f"oom:{explanation.rank}", details=details)


def _oom_snapshots(snapshots: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The snapshot records written for the OOM (the allocator observer's, or the one dumped while unwinding)."""
    return [r for r in snapshots if "oom" in str(r.get("trigger", "")) or "out of memory" in str(r.get("trigger", ""))]


def _explain(exc: BaseException, event: dict[str, Any], engine: Any, model: Any, optimizer: Any, precision: str | None,
             findings: list[Finding], capacity: int | None, snapshots: list[dict[str, Any]],
             read_now: tuple[int, int] | None) -> OomExplanation:
    explanation = explain_oom(
        exc, model=model if hasattr(model, "named_modules") else None, optimizer=optimizer, step=event["step"], rank=engine.rank,
        device=engine.device, rows=engine.rows, baseline_now=engine.step_baseline, holders=_holders(findings),
        capacity=capacity, capacity_source="capacity_bytes" if capacity else "", device_capacity=engine.capacity, precision=precision,
        read_now=read_now,
    )
    for record in _oom_snapshots(snapshots)[-1:]:
        files = record.get("files") or {}
        explanation.snapshot = files.get("snapshot") or next(iter(files.values()), None)
    return explanation
