"""What opening a step does, after ``Session.begin_step`` decided its kind: a further micro-batch, a quiet step, a watched one or a sampled one.

Functions of the session (its attributes, read and set as ``Session.begin_step`` would): the
session calls them in place of methods, so a step costs no more calls than it did.
"""

from __future__ import annotations

import time
from typing import Any

from memcallbacks._base.findings import Finding

__all__ = ["micro_batch", "begin_quiet", "begin_watched", "begin_sampled"]


def micro_batch(session: Any) -> None:
    """A further micro-batch of the open step (gradient accumulation)."""
    if session.engine.enabled:
        try:
            session.engine.micro_batch()
        except Exception as exc:
            session.engine.fail(exc, "micro-batch boundary")


def begin_quiet(session: Any, step: int) -> None:
    """Open a quiet step, for the adapters' bookkeeping: nothing is measured."""
    session.quiet_step = session.step_open = True
    session.log_this_step = session.lingering_due = False
    session.engine.quiet_step()
    if session.snap is not None:
        session.snap.step = step


def begin_watched(session: Any, step: int, epoch: int, batch_idx: int, batch: Any, defer_lingering: bool) -> None:
    """An unsampled step: the leak watch only (the lingering check, a memory read on some steps)."""
    t0 = time.perf_counter()
    checks = session.checks
    found: list[Finding] = []
    if checks.watch is not None:
        found = checks.watch.before_baseline(step, batch, lingering=not defer_lingering)
        found += checks.read(session.current_count, batch)
    found += checks.host_read(step)
    session.engine.begin_step(step, epoch, batch_idx, False)
    session.fast_s = time.perf_counter() - t0 - session.plan.read_s  # charged at step end, with the end's own time
    session.fast_typical = not found
    for finding in found:
        session.add_finding(finding)


def begin_sampled(session: Any, step: int, epoch: int, batch_idx: int, batch: Any, defer_lingering: bool) -> None:
    """A sampled step: the watch, then the baseline (which is also the watch's read), then the theory check.

    The baseline's ``allocated`` is read on the steps the plan names (``StepPlan.heap_due``: always
    where it is cheap, the watch's read steps, the theory check's step); on the others it stays
    NaN, unless the resident set has risen as far as the tripwire's threshold (``heap_skipped``)."""
    engine, checks, plan = session.engine, session.checks, session.plan
    watch = checks.watch
    count = session.current_count
    session.fast_s = None
    session.marks = session.marks or session.samples_unmarked + 1 >= session.cadence.mark_every
    t0 = time.perf_counter()
    found = watch.before_baseline(step, batch, lingering=not defer_lingering) if watch is not None else []
    check_state = checks.state.wanted and engine.optimizer_steps_total > 0
    heap = plan.heap_due(count, check_state)
    spent = time.perf_counter() - t0
    engine.begin_step(step, epoch, batch_idx, True, heap)
    t1 = time.perf_counter()
    baseline = engine.step_baseline
    if heap:
        plan.heap_rss = engine.step_reserved
    elif baseline is None and plan.heap_skipped(count, engine.step_reserved):
        baseline = engine.fill_baseline(plan.take_read(count))  # charged as a read (plan.read_s)
    found += checks.read(count, batch, baseline)
    found += checks.host_read(step)
    if check_state and baseline is not None:
        finding = checks.state_finding(step, baseline, batch)
        if finding is not None:
            found.append(finding)
    for finding in found:
        session.add_finding(finding)
    engine.add_own_time(spent + time.perf_counter() - t1 - plan.read_s)
