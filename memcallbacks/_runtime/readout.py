"""The engine's rows read out at the run's end: the history frames and the summary.

Functions of plain data (rows in :mod:`memcallbacks._base.columns`' layout), called by
:class:`~memcallbacks._runtime.sampling.MemoryEngine` (a logged step's keys are the engine's own).
"""


from __future__ import annotations

from typing import Any
from memcallbacks._base.columns import ALLOCATED, COLUMNS, EVAL_COLUMNS, PHASES

__all__ = ["history_frame", "eval_frame", "summarise", "empty_history", "empty_eval_history"]


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
