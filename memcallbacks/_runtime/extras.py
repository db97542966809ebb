"""What a session adds to the engine's rows: the extra logged keys (findings, the monitor's overhead,
the theory check, snapshots, garbage collection) and the extra checkpointed state (events, findings)."""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

from memcallbacks._findings import Finding

from memcallbacks._runtime.columns import ALLOCATED
from memcallbacks._runtime.sampling import GIB

if TYPE_CHECKING:
    from memcallbacks._runtime.session import Session

log = logging.getLogger(__name__)

__all__ = ["extra_metrics", "session_state", "load_session_state"]


def extra_metrics(session: "Session", row: list[Any] | None) -> dict[str, float]:
    """Findings count, overhead, theory check and gc, with the same keys on every rank and every logged step."""
    config = session.config
    p = config.prefix
    nan = float("nan")
    extra = {f"{p}/findings": float(session._findings.problems()), f"{p}/overhead": session.cadence.overhead}
    extra.update(session.preflight.metrics(row))
    if session.dashboard.capacity:
        extra[f"{p}/capacity_GiB"] = float(session.engine.capacity or 0) / GIB
    state = session.state
    if config.estimate_model_states:
        unexplained = state.unexplained(float(row[ALLOCATED])) if row is not None else None
        extra[f"{p}/expected_GiB"] = state.expected_states / GIB if state.expected_level is not None else nan
        extra[f"{p}/unexplained_GiB"] = unexplained / GIB if unexplained is not None else nan
    snap = session.snap
    if snap is not None or config.auto_snapshot:
        extra[f"{p}/snapshots"] = float(len(snap.records)) if snap is not None else nan
    if config.gc_every_n_steps:
        last = session.watch.last_gc if session.watch is not None else None
        extra[f"{p}/gc_time_ms"] = last["seconds"] * 1e3 if last else nan
        extra[f"{p}/gc_collected"] = float(last["collected"]) if last else nan
        extra[f"{p}/gc_freed_GiB"] = (last["bytes_freed"] or 0) / GIB if last else nan
    return extra


def session_state(session: "Session") -> dict[str, Any]:
    """The engine's checkpointed state plus the session's events and findings."""
    state = session.engine.state_dict()
    state["events"] = list(session.events)
    state["findings"] = session._findings.to_list()
    return state


def load_session_state(session: "Session", state: dict[str, Any], key: str = "state_dict") -> None:
    """Restore a checkpointed state; a bad one raises one ``ValueError`` naming ``key`` (see saved_state.py)."""
    read = session.engine.load_state_dict(state, key)
    if read is None:
        return
    session.events = read["events"]
    fields = set(Finding.__dataclass_fields__)
    for item in read["findings"]:
        try:
            session._findings.add(Finding(**{k: v for k, v in item.items() if k in fields}))
        except (TypeError, ValueError):
            log.debug("dropping unreadable finding from checkpoint: %r", item)
