"""``report.json``'s shape: the summary first, its values resolved, one figure per meaning."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from memcallbacks._base.columns import PEAK_FORWARD, PHASES, STEP
from memcallbacks._files.verdict import run_peak, verdict_lines

__all__ = ["shape_report", "row_peak"]


def row_peak(rows: list[list[Any]]) -> dict[str, Any] | None:
    """``{"bytes", "phase", "step"}`` of the highest per-phase peak in the history rows (columns.py's layout),
    as :func:`~memcallbacks._files.verdict.run_peak` finds it in their frame (each phase's first highest row,
    the earlier phase on a tie); None when no row has a peak."""
    best: dict[str, Any] | None = None
    for i, phase in enumerate(PHASES):
        col = PEAK_FORWARD + i
        top: tuple[float, Any] | None = None
        for row in rows:
            value = float(row[col])
            if value == value and (top is None or value > top[0]):
                top = (value, row[STEP])
        if top is not None and (best is None or top[0] > best["bytes"]):
            best = {"bytes": int(top[0]), "phase": phase, "step": int(top[1])}
    return best


def shape_report(report: dict[str, Any], output_dir: Path | None, history: Any = None) -> dict[str, Any]:
    """``report`` with ``verdict`` and ``summary`` first, the run's peak (bytes, phase, step) in the
    summary, one ``step_time_median_s`` (over every step, from the cadence) and ``config.output_dir``
    resolved to the folder the files went to."""
    summary = dict(report.get("summary") or {})
    cadence = summary.get("cadence")
    if isinstance(cadence, dict) and "step_time_median_s" in cadence:
        cadence = dict(cadence)
        median = cadence.pop("step_time_median_s")
        if median is not None:
            summary["step_time_median_s"] = median
        summary["cadence"] = cadence
    peak = run_peak(dict(report, summary=summary), history)
    summary = {"peak": peak, **{k: v for k, v in summary.items() if k != "peak"}}
    shaped = dict(report, summary=summary)
    config = report.get("config")
    if isinstance(config, dict) and output_dir is not None:
        shaped["config"] = dict(config, output_dir=str(output_dir))
    first = {"verdict": verdict_lines(shaped, history), "summary": summary, "findings": shaped.get("findings", [])}
    return {**first, **{k: v for k, v in shaped.items() if k not in first}}
