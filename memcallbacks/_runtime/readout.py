"""The engine's rows read out at the run's end: the history frames and the summary (the cadence's too).

Functions of plain data (rows in :mod:`memcallbacks._base.columns`' layout), called by
:class:`~memcallbacks._runtime.sampling.MemoryEngine` (a logged step's keys are the engine's own), and
:func:`cadence_summary`, what :meth:`Schedule.summary <memcallbacks._runtime.schedule.Schedule.summary>` says.
"""


from __future__ import annotations

import math
from statistics import median_high
from typing import Any, Sequence

from memcallbacks._base.columns import ALLOCATED, COLUMNS, EVAL_COLUMNS, PHASES

__all__ = ["history_frame", "eval_frame", "predicted_columns", "summarise", "empty_history", "empty_eval_history", "cadence_summary"]


def history_frame(rows: list[list[Any]], device_kind: str) -> Any:
    """The training rows as a DataFrame: integer columns as integers, no allocator counters on CPU."""
    import pandas as pd

    frame = pd.DataFrame(rows, columns=list(COLUMNS))
    if not frame.empty:
        for col in ("step", "epoch", "batch_idx", "micro_batches", "optimizer_steps"):
            if frame[col].notna().all():  # never lose the files over one unreadable row
                frame[col] = frame[col].astype("int64")
        if device_kind == "cpu":
            frame = frame.drop(columns=["alloc_retries", "ooms", "inactive_split"])
    return frame


def predicted_columns(frame: Any, spec: dict[str, Any] | None) -> Any:
    """``predicted_peak_{forward,backward,optimizer}`` (in the measured peaks' frame) and ``predicted_peak_error``
    (measured step peak minus the predicted one), from the pre-flight's ``spec`` (``PreflightCheck.column_spec``)."""
    if spec is None or frame.empty:
        return frame
    base = frame["reserved"].astype(float) if spec["relative"] else 0.0
    columns = [f"predicted_peak_{ph}" for ph in spec["peaks"]]
    for col, peak in zip(columns, spec["peaks"].values()):
        frame[col] = base + float(peak - spec["start"])
    frame["predicted_peak_error"] = frame["peak_allocated"] - frame[columns].max(axis=1)
    return frame


def eval_frame(eval_rows: list[list[Any]]) -> Any:
    import pandas as pd

    return pd.DataFrame(eval_rows, columns=list(EVAL_COLUMNS))


def summarise(
    counts: dict[str, Any], rows: list[list[Any]], eval_rows: list[list[Any]], device_info: dict[str, Any], capacity: int | None
) -> dict[str, Any]:
    """The engine's summary: its ``counts`` first, then per-phase maxima, lifetime peaks and the
    monitor's own cost from ``rows``, and the evaluation loops' peaks, as plain JSON-able values."""
    out = dict(counts)
    if device_info:
        out["device"] = dict(device_info)
        out["capacity_bytes"] = capacity
    # peaks on CPU are RSS high-water marks, so their baseline is RSS ("reserved"), not the heap
    base = 6 if device_info.get("peak_source") == "rss_high_water_mark" else 5
    for i, phase in enumerate(PHASES):
        vals = [r[8 + i] for r in rows if r[8 + i] == r[8 + i]]
        out[f"peak_{phase}_bytes"] = int(max(vals)) if vals else None
        deltas = [r[8 + i] - r[base] for r in rows if r[8 + i] == r[8 + i] and r[base] == r[base]]
        out[f"peak_{phase}_above_baseline_bytes"] = int(max(deltas)) if deltas else None
    if rows:
        # rows whose allocated was read (on CPU a sampled step may leave the heap unread: NaN)
        read = [r[ALLOCATED] for r in rows if r[ALLOCATED] == r[ALLOCATED]]
        out["first_allocated_bytes"] = int(read[0]) if read else None
        out["last_allocated_bytes"] = int(read[-1]) if read else None
        cost = sorted(r[18] for r in rows)
        out["monitor_time_per_step_us"] = {
            "median": cost[len(cost) // 2] * 1e6,
            "mean": sum(cost) / len(cost) * 1e6,
        }
        times = sorted(r[17] for r in rows)
        out["step_time_median_s"] = times[len(times) // 2]
    evals = {}
    for r in eval_rows:
        e = evals.setdefault(r[0], {"runs": 0, "peak_allocated_bytes": 0, "peak_reserved_bytes": 0})
        e["runs"] += 1
        e["peak_allocated_bytes"] = max(e["peak_allocated_bytes"], int(r[5]))
        e["peak_reserved_bytes"] = max(e["peak_reserved_bytes"], int(r[6]))
    out["eval"] = evals
    return out


def empty_history() -> Any:
    """The history of a monitor that has not run: no rows, every column."""
    import pandas as pd

    return pd.DataFrame(columns=list(COLUMNS))


def empty_eval_history() -> Any:
    import pandas as pd

    return pd.DataFrame(columns=list(EVAL_COLUMNS))


def _us(values: Sequence[float]) -> float | None:
    return round(float(median_high(values)) * 1e6, 2) if values else None


def cadence_summary(schedule: Any, *, step_times: Sequence[float], costs: tuple[Sequence[float], ...], started: tuple[float, float, float] | None,
                    hooked_calls: int | None, constants: dict[str, Any]) -> dict[str, Any]:
    """report.json's ``summary.cadence``: the intervals chosen, the own time by part, the share of step
    time (the parts :data:`~memcallbacks._runtime.schedule.APART` reported apart), and the measured costs.
    ``started``: (own time, step time, hooks) when the first steps were done."""
    s = schedule
    after, timed, parts = s.overhead_after_start, s.timed_s, s.parts
    overhead = s.overhead
    step = float(median_high(step_times)) if step_times else math.nan
    hooks = None if math.isnan(after) or started is None else round((parts["hooks"] - started[2]) / (timed - started[1]), 5)
    return {
        "overhead_budget": s.budget,
        "overhead": None if math.isnan(overhead) else round(overhead, 5),
        "overhead_after_start": None if math.isnan(after) else round(after, 5),
        "overhead_by_part": {k: round(v / timed, 5) for k, v in parts.items() if k not in constants["apart"]} if timed > 0 else None,
        "hooks_after_start": hooks,  # the hooks' part of overhead_after_start (a floor no interval lowers)
        "step_time_timed_s": round(timed, 6),  # the step time the pauses leave: the shares' denominator
        "finding_time_s": round(s.finding_s, 4),
        "diagnoses": [{"step": d["step"], "seconds": round(d["seconds"], 4)} for d in s.diagnoses],
        "end_of_run_s": round(parts["end"], 6),
        "imports_during_run": s.imports[0], "imports_at_end": s.imports[1],  # modules the monitor's code imported
        "hooked_calls": hooked_calls,  # torch's calls through the monitor's module hooks (None: none hooked)
        "dispatch_call_cost_us": round(s.meters[0].call_cost_s * constants["cold_factor"] * 1e6, 3) if s.meters else None,
        "read_every_n_steps": s.read_every,
        "dense_read_steps": constants["dense_read_steps"],
        "read_bursts": s.bursts,
        "rss_trips": s.trips,
        "rss_checks": s.trip_checks,
        "rss_tripwire": s.tripwire,
        "sample_every_n_steps": s.sample_every,
        "sample_interval_source": "config" if s.explicit else "overhead_budget",
        "log_every_n_steps": s.log_every if s.logs else None,
        "step_time_median_s": None if math.isnan(step) else step,
        "step_time_budgeted_s": s.step_s or None,  # the lower quartile the intervals were chosen from
        "watch_cost_median_us": _us(costs[0]),
        "read_cost_median_us": _us(costs[1]),
        "sample_cost_median_us": _us(costs[2]),
        "lingering_every_n_samples": s.mark_every,
        "lingering_checks": s.lingering_checks,
        "lingering_heap_scans": s.heap_scans,
        "own_time_s": round(s.own_s, 6),
        "own_time_by_part_s": {k: round(v, 6) for k, v in parts.items()},  # µs: the parts add up on short runs too
        "backoffs": list(s.guard.backoffs),
        "over_budget_windows": s.guard.over_budget_windows,
    }
