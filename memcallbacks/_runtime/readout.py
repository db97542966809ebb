"""The engine's rows read out: a logged step's keys and values, the history frames, the summary.

Functions of plain data (rows in :mod:`memcallbacks._base.columns`' layout), called by
:class:`~memcallbacks._runtime.sampling.MemoryEngine` on logged steps and at the run's end.
"""


from __future__ import annotations

from typing import Any
from memcallbacks._base.columns import (
    ALLOCATED,
    ALLOC_RETRIES,
    COLUMNS,
    EVAL_COLUMNS,
    HOST_RSS,
    INACTIVE_SPLIT,
    MONITOR_TIME_S,
    OOMS,
    PEAK_ALLOCATED,
    PEAK_BACKWARD,
    PEAK_FORWARD,
    PEAK_OPTIMIZER,
    PEAK_RESERVED,
    PHASES,
    RESERVED,
)
from memcallbacks._base.units import GiB
from memcallbacks._base.columns import ALLOCATED

__all__ = ["step_keys", "step_values", "history_frame", "eval_frame", "summarise", "empty_history", "empty_eval_history", "extra_metrics"]


def step_keys(p: str, device_kind: str) -> list[str]:
    """The logged keys of a training step, under prefix ``p``."""
    keys = [
        f"{p}/allocated_GiB",
        f"{p}/reserved_GiB",
        f"{p}/peak_forward_GiB",
        f"{p}/peak_backward_GiB",
        f"{p}/peak_optimizer_GiB",
        f"{p}/peak_step_GiB",
        f"{p}/peak_reserved_GiB",
        f"{p}/max_allocated_GiB",
        f"{p}/host_rss_GiB",
        f"{p}/monitor_time_ms",
    ]
    if device_kind != "cpu":
        keys += [f"{p}/alloc_retries", f"{p}/ooms", f"{p}/inactive_split_GiB"]
    return keys


def step_values(row: list[Any], max_allocated: int, device_kind: str) -> list[float]:
    """``row``'s values for :func:`step_keys`, in its order."""
    values = [
        row[ALLOCATED] / GiB,
        row[RESERVED] / GiB,
        row[PEAK_FORWARD] / GiB,
        row[PEAK_BACKWARD] / GiB,
        row[PEAK_OPTIMIZER] / GiB,
        row[PEAK_ALLOCATED] / GiB,
        row[PEAK_RESERVED] / GiB,
        max_allocated / GiB,
        row[HOST_RSS] / GiB,
        row[MONITOR_TIME_S] * 1e3,
    ]
    if device_kind != "cpu":
        values += [float(row[ALLOC_RETRIES]), float(row[OOMS]), row[INACTIVE_SPLIT] / GiB]
    return values


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


# ---------------------------------------------------------------------- the keys a run adds to a logged step's: findings, overhead, theory, snapshots, gc, host
def extra_metrics(
    config: Any, row: list[Any] | None, *, findings: int, overhead: float, preflight: Any, capacity: float | None,
    state: Any, snap: Any, last_gc: dict[str, Any] | None, host: dict[str, float] | None = None,
) -> dict[str, float]:
    """``capacity``: the device's bytes where the dashboard shows a capacity line (else None);
    ``preflight``/``state``/``snap``: the run's pre-flight check, theory check and snapshot policy;
    ``host``: the host channel's latest figures (docs/host.md), None where it is off."""
    p = config.prefix
    nan = float("nan")
    extra = {f"{p}/findings": float(findings), f"{p}/overhead": overhead}
    extra.update(preflight.metrics(row))
    if capacity is not None:
        extra[f"{p}/capacity_GiB"] = float(capacity or 0) / GiB
    if config.estimate_model_states:
        unexplained = state.unexplained(float(row[ALLOCATED])) if row is not None else None
        extra[f"{p}/expected_GiB"] = state.expected_states / GiB if state.expected_level is not None else nan
        extra[f"{p}/unexplained_GiB"] = unexplained / GiB if unexplained is not None else nan
    if snap is not None or config.auto_snapshot:
        extra[f"{p}/snapshots"] = float(len(snap.records)) if snap is not None else nan
    if config.watch_host:  # off: no host keys at all (rather than NaN columns)
        host = host or {}
        for key, name in (("host_python_bytes", "host_python_GiB"), ("host_private_bytes", "host_private_GiB"),
                          ("host_worker_uss_bytes", "host_workers_GiB")):
            value = host.get(key)
            extra[f"{p}/{name}"] = value / GiB if value is not None else nan
    if config.gc_every_n_steps:
        extra[f"{p}/gc_time_ms"] = last_gc["seconds"] * 1e3 if last_gc else nan
        extra[f"{p}/gc_collected"] = float(last_gc["collected"]) if last_gc else nan
        extra[f"{p}/gc_freed_GiB"] = (last_gc["bytes_freed"] or 0) / GiB if last_gc else nan
    return extra
