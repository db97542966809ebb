"""Two runs side by side: per-phase peaks, step-start growth, findings and the monitor's own time."""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

from memcallbacks._base.units import format_bytes, format_delta
from memcallbacks._files.verdict import measure_names, problems

__all__ = ["RunFigures", "run_figures", "compare_text", "increases", "parse_threshold"]

_PHASES = ("forward", "backward", "optimizer")


@dataclass
class RunFigures:
    """What one run's files say, as numbers that compare."""

    peaks: dict[str, float | None]
    floor_growth: float | None
    problems: list[str] = field(default_factory=list)
    overhead: float | None = None
    steps: int = 0
    measure: str = "allocated"


def run_figures(report: dict[str, Any], history: Any) -> RunFigures:
    """The figures of one run from its ``report.json`` and ``history.csv``."""
    s = report.get("summary") or {}
    names = measure_names(report)
    growth = None
    if history is not None and len(history) and names["floor_column"] in history:
        floor = history[names["floor_column"]].dropna()
        growth = float(floor.iloc[-1] - floor.iloc[0]) if len(floor) else None
    return RunFigures(
        peaks={p: s.get(f"peak_{p}_bytes") for p in _PHASES},
        floor_growth=growth,
        problems=[f"{f.get('kind')} (step {f.get('step')})" for f in problems(report)],
        overhead=(s.get("cadence") or {}).get("overhead"),
        steps=int(s.get("steps_seen") or 0),
        measure=names["peak"],
    )


def parse_threshold(text: str) -> tuple[float, bool]:
    """``"5%"`` -> ``(0.05, True)``; ``"64MiB"`` -> ``(67108864, False)``; a ``ValueError`` naming the fix otherwise."""
    from memcallbacks._base.units import UNITS

    match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*(%|[A-Za-z]*)\s*", str(text))
    units = {k.lower(): v for k, v in UNITS.items()}
    if not match or (match.group(2) not in ("%", "") and match.group(2).lower() not in units):
        raise ValueError(f"--fail-on-increase {text!r} is not a percentage or a size; pass e.g. 5% or 64MiB")
    value, unit = float(match.group(1)), match.group(2)
    if unit == "%":
        return value / 100.0, True
    return value * (units[unit.lower()] if unit else 1), False


def increases(a: RunFigures, b: RunFigures, threshold: float, relative: bool) -> list[str]:
    """The phases whose peak grew from ``a`` to ``b`` by more than ``threshold`` (a fraction of ``a``'s peak, or bytes)."""
    out = []
    for phase in _PHASES:
        old, new = a.peaks.get(phase), b.peaks.get(phase)
        if old is None or new is None:
            continue
        limit = threshold * old if relative else threshold
        if new - old > limit:
            shown = f"{100 * threshold:g}%" if relative else format_bytes(threshold)
            out.append(f"{phase} peak grew {format_delta(new - old)} ({_percent(old, new)}), past {shown}")
    return out


def _percent(old: float | None, new: float | None) -> str:
    if old is None or new is None or not old:
        return ""
    return f"{100 * (new - old) / old:+.1f}%"


def compare_text(a: RunFigures, b: RunFigures, names: tuple[str, str]) -> str:
    """The side-by-side table."""
    width = max(12, *(len(n) for n in names))
    rows = [f"{'(' + a.measure + ')':<28} {names[0]:>{width}} {names[1]:>{width}}   change"]
    if a.measure != b.measure:
        rows.insert(0, f"note: the runs measured different things ({a.measure} and {b.measure}); the figures do not compare")
    rows.append(f"{'steps':<28} {a.steps:>{width}} {b.steps:>{width}}")
    for phase in _PHASES:
        old, new = a.peaks.get(phase), b.peaks.get(phase)
        change = f"{format_delta(new - old)} ({_percent(old, new)})" if old is not None and new is not None else "-"
        rows.append(f"{f'{phase} peak':<28} {format_bytes(old):>{width}} {format_bytes(new):>{width}}   {change}")
    growth = (format_delta(a.floor_growth), format_delta(b.floor_growth))
    rows.append(f"{'step-start growth':<28} {growth[0]:>{width}} {growth[1]:>{width}}")
    counts = (str(len(a.problems)), str(len(b.problems)))
    rows.append(f"{'problems found':<28} {counts[0]:>{width}} {counts[1]:>{width}}")
    for label, run in ((names[0], a), (names[1], b)):
        if run.problems:
            rows.append(f"  {label}: {', '.join(run.problems)}")
    own = tuple("-" if r.overhead is None else f"{100 * r.overhead:.2f}%" for r in (a, b))
    rows.append(f"{'monitor own time':<28} {own[0]:>{width}} {own[1]:>{width}}")
    return "\n".join(rows)
