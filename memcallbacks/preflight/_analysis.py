"""From a tracked step's storage events to per-phase peaks, the breakdown at each, top modules."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence

from memcallbacks._base.columns import TRAINING_PHASES as PHASES
from memcallbacks.preflight._tracking import (
    ACTIVATIONS,
    CATEGORIES,
    TEMPORARIES,
    Allocation,
    StorageTracker,
)

__all__ = ["PhaseResult", "StepResult", "analyse"]

OUTSIDE_MODULES = "(outside modules)"
WORKSPACE = "workspace"  # the breakdown's category for cuBLAS workspaces (CUDA targets)


@dataclasses.dataclass(frozen=True)
class PhaseResult:
    peak_bytes: int
    breakdown: dict[str, int]  # category -> bytes alive at the peak


@dataclasses.dataclass(frozen=True)
class StepResult:
    start_bytes: int  # alive when the step starts
    end_bytes: int  # alive when it ends (after zero_grad)
    phases: dict[str, PhaseResult]
    top_modules: list[tuple[str, int]]  # activation bytes alive at forward's end, by module
    activation_bytes: int
    last_ops: dict[str, str]  # phase -> an op allocating at the phase's peak


def _category(record: Allocation, forward_end: int) -> str:
    if record.category is not None:
        return record.category
    if record.phase == "forward" and (record.died is None or record.died > forward_end):
        return ACTIVATIONS
    return TEMPORARIES


def _alive_at(record: Allocation, index: int) -> bool:
    return record.born <= index and (record.died is None or record.died > index)


def analyse(
    tracker: StorageTracker,
    bounds: Sequence[int],
    size: Callable[[int], int],
    *,
    top: int = 10,
    record_bytes: Sequence[int] | None = None,
    workspace_at: Mapping[int, int] | None = None,
) -> StepResult:
    """``bounds`` are the event counts at step start and at the end of forward, backward, optimizer.

    Event ``i`` happens in the phase whose range ``[bounds[j], bounds[j+1])`` holds it; a phase's
    peak is the largest running total after any of its events (or its starting total). A record
    counts ``size(record.nbytes)``, or ``record_bytes[i]`` when given (an allocator replay's blocks).
    ``workspace_at``: event index -> bytes allocated just before that event and never freed (cuBLAS
    workspaces); they count in the totals and as the ``workspace`` category of the breakdowns.
    """
    records, events = tracker.records, tracker.events
    start, forward_end = bounds[0], bounds[1]
    sizes = list(record_bytes) if record_bytes is not None else [size(r.nbytes) for r in records]
    extra = dict(workspace_at or {})
    total = 0
    totals: list[int] = []
    for i, (index, sign) in enumerate(events):
        total += extra.get(i, 0) + sign * sizes[index]
        totals.append(total)
    at = lambda i: totals[i] if i >= 0 else 0  # noqa: E731 - total after event i
    phases: dict[str, PhaseResult] = {}
    last_ops: dict[str, str] = {}
    for j, phase in enumerate(PHASES):
        lo, hi = bounds[j], bounds[j + 1]
        best_i, best = lo - 1, at(lo - 1)
        for i in range(lo, hi):
            if totals[i] > best:
                best_i, best = i, totals[i]
        breakdown = dict.fromkeys(CATEGORIES, 0)
        for i, record in enumerate(records):
            if _alive_at(record, best_i):
                breakdown[_category(record, forward_end - 1)] += sizes[i]
        if workspace_at is not None:
            breakdown[WORKSPACE] = sum(b for at, b in extra.items() if at <= best_i)
        phases[phase] = PhaseResult(best, breakdown)
        if best_i >= lo:
            last_ops[phase] = records[events[best_i][0]].op
    by_module: dict[str, int] = {}
    activation_bytes = 0
    for i, record in enumerate(records):
        if _category(record, forward_end - 1) == ACTIVATIONS and _alive_at(record, forward_end - 1):
            name = record.module or OUTSIDE_MODULES
            by_module[name] = by_module.get(name, 0) + sizes[i]
            activation_bytes += sizes[i]
    ranked = sorted(by_module.items(), key=lambda kv: kv[1], reverse=True)[:top]
    return StepResult(at(start - 1), at(bounds[-1] - 1), phases, ranked, activation_bytes, last_ops)
