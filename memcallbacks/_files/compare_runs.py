"""Two runs side by side: peaks, the step's own memory (each phase's rise above its start), findings."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from memcallbacks._base.units import MiB, format_bytes, format_delta, parse_threshold
from memcallbacks._files.verdict import measure_names, problems

__all__ = ["RunFigures", "run_figures", "compare_text", "increases", "parse_threshold", "gated", "gate_words", "CPU_NOISE_BYTES", "cpu_floor"]

_PHASES = ("forward", "backward", "optimizer")

CPU_NOISE_BYTES = 2 * MiB
CPU_NOISE_SHARE = 0.25
"""On CPU a rise must also exceed the larger of these to fail the gate (:func:`cpu_floor`): forward's rise above
its step's start (resident memory) moves between identical runs by whether one or two of the step's tensors land
on fresh pages or on blocks glibc kept: 17.3-19.3 MiB of 19.2 here, 19.6 vs 23.7 MiB (+21%) once in CI
(docs/metrics.md#comparing-two-runs). A size of the step's tensors, so a share of the rise, with 2 MiB below it."""


def cpu_floor(before: float) -> float:
    """What a CPU rise at glibc's defaults must exceed, besides the limit, to fail the gate: 2 MiB or a quarter
    of the baseline's rise, whichever is larger (:data:`CPU_NOISE_SHARE`)."""
    return max(CPU_NOISE_BYTES, CPU_NOISE_SHARE * before)


@dataclass
class RunFigures:
    """What one run's files say, as numbers that compare."""

    peaks: dict[str, float | None]
    floor_growth: float | None
    problems: list[str] = field(default_factory=list)
    overhead: float | None = None
    steps: int = 0
    measure: str = "allocated"
    rises: dict[str, float | None] = field(default_factory=dict)
    """The most each phase rose above its step's start over the run: the step's own memory."""
    cpu: bool = False
    """The peaks are the resident set's high-water mark (CPU)."""
    follows_tensors: bool = False
    """CPU with ``cpu_mmap_threshold`` set: freed tensors above it go back to the OS, so the resident
    memory follows tensor lifetimes and every phase's rise repeats between identical runs."""


def run_figures(report: dict[str, Any], history: Any) -> RunFigures:
    """The figures of one run from its ``report.json`` and ``history.csv``."""
    s = report.get("summary") or {}
    names = measure_names(report)
    growth = None
    if history is not None and len(history) and names["floor_column"] in history:
        floor = history[names["floor_column"]].dropna()
        growth = float(floor.iloc[-1] - floor.iloc[0]) if len(floor) else None
    rises: dict[str, float | None] = {}
    for phase in _PHASES:
        rise = s.get(f"peak_{phase}_above_baseline_bytes")
        if not isinstance(rise, (int, float)) and history is not None and len(history) and f"peak_{phase}" in history:
            rise = (history[f"peak_{phase}"] - history[names["floor_column"]]).max()  # a report without the summary's figure
        rises[phase] = max(float(rise), 0.0) if isinstance(rise, (int, float)) and rise == rise else None  # never below the start
    return RunFigures(
        peaks={p: s.get(f"peak_{p}_bytes") for p in _PHASES},
        floor_growth=growth,
        problems=[f"{f.get('kind')} (step {f.get('first_step', f.get('step'))})" for f in problems(report)],  # first raised
        overhead=(s.get("cadence") or {}).get("overhead"),
        steps=int(s.get("steps_seen") or 0),
        measure=names["peak"],
        rises=rises,
        cpu=bool(names["cpu"]),
        follows_tensors=bool(((report.get("config") or {}).get("advanced") or {}).get("cpu_mmap_threshold")),
    )


def gated(a: RunFigures, b: RunFigures) -> list[tuple[str, str]]:
    """``(figure, phase)`` pairs the gate reads: each phase's rise above its step's start (``"rise"``, the
    step's own memory), and off CPU each phase's peak too (the allocator's figures are exact). On CPU at
    glibc's defaults only forward's rise: it repeats between identical runs within a quarter (:func:`cpu_floor`), while
    backward's and optimizer's moved by up to 23% and 94% (glibc keeps or returns the blocks that
    forward's activations free), and the resident peaks are mostly the process itself; with
    ``cpu_mmap_threshold`` set in both runs every phase's rise."""
    if not (a.cpu or b.cpu):
        return [("rise", p) for p in _PHASES] + [("peak", p) for p in _PHASES]
    if a.follows_tensors and b.follows_tensors:
        return [("rise", p) for p in _PHASES]
    return [("rise", "forward")]


def gate_words(a: RunFigures, b: RunFigures) -> str:
    """What the gate reads, in words: ``"the step's own memory (forward's rise above its step's start)"``."""
    figures = gated(a, b)
    rises = [phase for figure, phase in figures if figure == "rise"]
    what = f"{rises[0]}'s rise" if len(rises) == 1 else "each phase's rise"
    peaks = " and the phases' peaks" if any(figure == "peak" for figure, _ in figures) else ""
    return f"the step's own memory ({what} above its step's start){peaks}"


def increases(a: RunFigures, b: RunFigures, threshold: float, relative: bool, under_floor: list[str] | None = None) -> list[str]:
    """What grew from ``a`` to ``b`` by more than ``threshold`` (a fraction of ``a``'s figure, or bytes)
    among :func:`gated`'s figures; on CPU a rise must also exceed :func:`cpu_floor` (2 MiB with
    ``cpu_mmap_threshold`` set in both runs, where the rises follow the tensors): a rise past
    ``threshold`` but not past that goes to ``under_floor`` (when given), in words."""
    out = []
    shown = f"{100 * threshold:g}%" if relative else format_bytes(threshold)
    for figure, phase in gated(a, b):
        old, new = (a.rises, b.rises) if figure == "rise" else (a.peaks, b.peaks)
        before, now = old.get(phase), new.get(phase)
        if before is None or now is None:
            continue
        limit = threshold * before if relative else threshold
        if now - before <= limit:
            continue
        floor = CPU_NOISE_BYTES if a.follows_tensors and b.follows_tensors else cpu_floor(before)
        if (a.cpu or b.cpu) and now - before <= floor:
            if under_floor is not None:
                under_floor.append(f"{phase}'s rise {format_delta(now - before)}, {_percent(before, now)}, "
                                   f"not past {format_bytes(floor)}")
            continue
        change = f"{format_delta(now - before)}, {_percent(before, now)}".rstrip(", ")
        if figure == "rise":
            out.append(f"the step's own memory grew: {phase} rose {format_delta(now)} above its step's start, "
                       f"against {format_delta(before)} ({change}), past {shown}")
        else:
            out.append(f"{phase} peak grew {format_delta(now - before)} ({_percent(before, now)}), past {shown}")
    return out


def _percent(old: float | None, new: float | None) -> str:
    if old is None or new is None or not old:
        return ""
    return f"{100 * (new - old) / old:+.1f}%"


def _change(old: float | None, new: float | None) -> str:
    if old is None or new is None:
        return "-"
    percent = _percent(old, new)
    return f"{format_delta(new - old)}" + (f" ({percent})" if percent else "")


def compare_text(a: RunFigures, b: RunFigures, names: tuple[str, str]) -> str:
    """The side-by-side table: the absolute peaks, then the step's own memory (what each phase rose
    above its step's start, the figure the gate reads marked), the floor's change, findings, own time."""
    width = max(12, *(len(n) for n in names))

    def row(label: str, left: str, right: str, change: str = "") -> str:
        return f"{label:<28} {left:>{width}} {right:>{width}}   {change}".rstrip()

    rows = [row(f"({a.measure})", names[0], names[1], "change")]
    if a.measure != b.measure:
        rows.insert(0, f"note: the runs measured different things ({a.measure} and {b.measure}); the figures do not compare")
    rows.append(row("steps", str(a.steps), str(b.steps)))
    for phase in _PHASES:
        old, new = a.peaks.get(phase), b.peaks.get(phase)
        rows.append(row(f"{phase} peak", format_bytes(old), format_bytes(new), _change(old, new)))
    floor = "resident memory" if a.cpu else "allocated"
    rows.append(f"the step's own memory: the most each phase rose above its step's start ({floor} then)")
    gate = {phase for figure, phase in gated(a, b) if figure == "rise"}
    for phase in _PHASES:
        old, new = a.rises.get(phase), b.rises.get(phase)
        mark = "   (gated)" if phase in gate and len(gate) < len(_PHASES) else ""
        rows.append(row(f"  {phase}", format_delta(old), format_delta(new), _change(old, new) + mark))
    if len(gate) < len(_PHASES):
        rows.append("  (CPU: backward's and optimizer's rises move between identical runs as glibc keeps or returns freed\n"
                    "   blocks; they are shown, not gated, unless both runs set cpu_mmap_threshold: docs/metrics.md#comparing-two-runs)")
    rows.append(row("step-start floor change", format_delta(a.floor_growth), format_delta(b.floor_growth)))
    rows.append(row("problems found", str(len(a.problems)), str(len(b.problems))))
    for label, run in ((names[0], a), (names[1], b)):
        if run.problems:
            rows.append(f"  {label}: {', '.join(run.problems)}")
    own = tuple("-" if r.overhead is None else f"{100 * r.overhead:.2f}%" for r in (a, b))
    rows.append(row("monitor own time", own[0], own[1]))
    return "\n".join(rows)
