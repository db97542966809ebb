"""What closing a step does, after ``Session.end_step``: the engine's row, the lingering marks, the tripwire, the pre-flight comparison, the budget's charge, snapshots, the quiet stretch that follows and a logged step's keys.

Functions of the session (its attributes, read and set as ``Session.end_step`` would): the
session calls them in place of methods, so a step costs no more calls than it did.
"""

from __future__ import annotations

import time
from typing import Any

from memcallbacks._base.columns import MONITOR_TIME_S, PEAK_RESERVED
from memcallbacks._runtime.extras import extra_metrics

__all__ = ["close_step", "close_row", "plan_quiet", "extra_keys"]


def close_step(session: Any, closing: int, log_step: int | None, batch: Any, loss: Any, outputs: Any) -> list[Any] | None:
    """``Session.end_step`` without its observers: the row, the quiet stretch after it, and the logged keys."""
    if session.quiet_step:
        session.quiet_step = session.step_open = False
        return None
    engine = session.engine
    row = None
    if session.lingering_due:
        session.check_lingering(batch)  # charged on its own (charge_other), so timed before t_end
    t_end = time.perf_counter()
    if engine.enabled:
        try:
            row = close_row(session, closing, t_end, batch, loss, outputs)
        except Exception as exc:
            engine.fail(exc, "step end")
    session.step_open = False
    plan_quiet(session)
    if session.log_this_step and (row is not None or engine.world_size > 1):
        try:
            metrics = engine.log_values(row, extra_keys(session, row))
            session.emit(metrics, session.current_step if log_step is None else log_step)
        except Exception as exc:
            engine.fail(exc, "logging")
    return row


def close_row(session: Any, closing: int, t_end: float, batch: Any, loss: Any, outputs: Any) -> list[Any] | None:
    """The engine's row, the lingering marks, the tripwire, the pre-flight comparison, the budget, snapshots."""
    engine, checks = session.engine, session.checks
    sampled = engine.sampling
    row = engine.end_step(closing)
    # lingering references: every step at first (leaky loops leak from step 1), then after every
    # cadence.mark_every-th sampled step (weak references and graph marks, ~2-45 µs, and a check
    # at the next step start, which then is not quiet)
    watch = checks.watch
    if watch is not None and (session.marks or checks.lingering_wants_mark):
        t0 = time.perf_counter()
        watch.end_step(session.current_step, batch, loss, outputs)
        if row is not None:
            row[MONITOR_TIME_S] += time.perf_counter() - t0
        session.samples_unmarked = 0
    elif sampled:
        session.samples_unmarked += 1
    session.marks = False
    if row is not None:
        if session.plan.rebase(row[PEAK_RESERVED], pinned=not getattr(engine.backend, "resets_hwm", False)):
            session.log.debug("memcallbacks: the resident-set high-water mark is pinned above the resident set; the RSS tripwire reads statm")
        checks.preflight.compare(row)
        session.cadence.charge(row[MONITOR_TIME_S], sampled=True)
    elif session.fast_s is not None:  # an unsampled step: its start and its end, as one cost
        session.cadence.charge(session.fast_s + time.perf_counter() - t_end, sampled=False, typical=session.fast_typical)
    session.fast_s = None
    if session.snap is not None and (row is not None or session.sink.new):
        new = session.sink.take_new()
        if row is not None:
            session.snap.after_row(session.current_step, row, new)
        else:  # a watched step found something: the finding triggers, not the row
            session.snap.after_findings(session.current_step, new)
    return row


def plan_quiet(session: Any) -> None:
    """After a step: the quiet stretch that follows, unless something needs the next step."""
    checks = session.checks
    watch = checks.watch
    busy = (
        not session.engine.enabled or session.lingering_due or checks.lingering_pending or checks.state.wanted or checks.preflight.due
        or (session.snap is not None and session.snap.busy)
        or (watch is not None and watch.collections is not None and watch.collections.due)
    )
    session.plan.plan_after(session.current_count, busy=busy, reads=watch is not None)


def extra_keys(session: Any, row: list[Any] | None) -> dict[str, float]:
    """The keys a logged step adds to the engine's (extras.py)."""
    dashboard, checks = session.dashboard, session.checks
    return extra_metrics(
        session.config, row, findings=session.sink.problems(), overhead=session.cadence.overhead, preflight=checks.preflight,
        capacity=session.engine.capacity if dashboard.capacity else None, state=checks.state, snap=session.snap,
        last_gc=checks.watch.last_gc if checks.watch is not None else None, host=checks.host_figures(),
    )
