"""The answer first: one line on what happened in a run, and the lines the console shows at its end."""

from __future__ import annotations

import importlib
import math
import re
import sys
from pathlib import Path
from typing import Any, Callable

from memcallbacks._base.findings import step_text
from memcallbacks._base.units import format_bytes

__all__ = ["ConsoleVerdict", "measure_names", "run_peak", "run_rise", "verdict_lines", "console_lines", "console_channel", "problems", "fix_words"]

_PHASES = ("forward", "backward", "optimizer", "other")


def measure_names(report: dict[str, Any]) -> dict[str, str]:
    """What the figures are, in the reader's terms: on CPU the peaks are resident memory (RSS), the
    step-start floor is resident memory too and ``allocated`` is the C heap in use; on a GPU the
    allocator's allocated and reserved bytes."""
    device = (report.get("summary") or {}).get("device") or {}
    if device.get("peak_source") == "rss_high_water_mark":
        return {"peak": "resident memory", "floor": "resident at step start", "floor_column": "reserved",
                "heap": "heap in use at step start", "reserved": "resident memory", "cpu": "yes"}
    return {"peak": "allocated", "floor": "allocated at step start", "floor_column": "allocated",
            "heap": "", "reserved": "reserved", "cpu": ""}


def _number(value: Any) -> float | None:
    try:
        value = float(value)
    except (TypeError, ValueError):
        return None
    return None if math.isnan(value) else value


def run_peak(report: dict[str, Any], history: Any = None) -> dict[str, Any] | None:
    """``{"bytes", "phase", "step"}`` of the run's highest per-phase peak: from the history's rows
    when there are any (the step is known), else from the summary's per-phase peaks (step None)."""
    s = report.get("summary") or {}
    if isinstance(s.get("peak"), dict) and s["peak"].get("bytes") is not None:
        return s["peak"]
    if history is not None and len(history):
        best: dict[str, Any] | None = None
        for phase in _PHASES:
            col = f"peak_{phase}"
            if col not in history:
                continue
            values = history[col].astype(float)
            if values.notna().any():
                i = values.idxmax()
                if best is None or values[i] > best["bytes"]:
                    best = {"bytes": int(values[i]), "phase": phase, "step": int(history.loc[i, "step"])}
        if best is not None:
            return best
    peaks = {p: _number(s.get(f"peak_{p}_bytes")) for p in _PHASES}
    peaks = {p: v for p, v in peaks.items() if v is not None}
    if not peaks:
        return None
    phase = max(peaks, key=peaks.__getitem__)
    return {"bytes": int(peaks[phase]), "phase": phase, "step": None}


def problems(report: dict[str, Any]) -> list[dict[str, Any]]:
    """The open problems among the findings (not settled growth, not advice)."""
    return [f for f in report.get("findings") or [] if isinstance(f, dict) and (f.get("state") or "open") == "open"
            and (f.get("severity") or "problem") == "problem" and not (f.get("details") or {}).get("caused_by")]


_FIX_VERBS = frozenset("""Add Avoid Bound Break Call Check Clear Close Compare Delete Detach Disable Drop Enable Free Give Join Keep
    Limit Lower Make Move Pass Put Raise Reduce Release Remove Replace Return Run Set Shard Snapshot Store Take Try Use Wrap""".split())


def fix_words(message: str, words: int = 8) -> str:
    """The fix's first words from a finding's message: after ``Fix:`` when it says so, else its first
    sentence past the first that starts with an imperative (``Return ...``, ``Bound ...``, ```del ...```)."""
    text = " ".join(str(message).split())
    fix = ""
    if "Fix:" in text:
        fix = text.split("Fix:", 1)[1].strip()
    else:
        sentences = [x for x in re.split(r"(?<=[.!?])\s+(?=[A-Z`(])", text) if x.strip()]
        fix = next((x for x in sentences[1:] if x.split()[0].rstrip(":,") in _FIX_VERBS or x.startswith("`del ")), "")
    parts = fix.split()
    return " ".join(parts[:words]) + (" ..." if len(parts) > words else "")


def _what(finding: dict[str, Any]) -> str:
    holders = finding.get("holders") or []
    if holders:
        return f"held by {holders[0]}"
    headline = str(finding.get("message") or "").strip().split("\n", 1)[0]  # an OOM's explanation: its first line
    message = re.sub(r"^rank \d+: ", "", " ".join(headline.split()))
    message = re.sub(r"^out of memory at step \d+ on rank \d+, ", "", message)  # the line names the kind and step already
    first = re.split(r"(?<=[.;:])\s", message, maxsplit=1)[0]
    first = first.rstrip(".;:")
    return first if len(first) <= 90 else first[:87] + "..."


def run_rise(report: dict[str, Any], history: Any = None) -> dict[str, Any] | None:
    """``{"bytes", "phase", "step"}`` of the most a phase (forward, backward, optimizer) rose above its
    step's start (on CPU the resident memory then): from the history's rows when there are any, else
    from the summary's ``peak_<phase>_above_baseline_bytes`` (step None). Ties go to the earlier phase."""
    names = measure_names(report)
    best: dict[str, Any] | None = None
    if history is not None and len(history) and names["floor_column"] in history:
        floor = history[names["floor_column"]].astype(float)
        for phase in _PHASES[:3]:
            if f"peak_{phase}" in history:
                rise = history[f"peak_{phase}"].astype(float) - floor
                if rise.notna().any() and (best is None or rise.max() > best["bytes"]):
                    i = rise.idxmax()
                    best = {"bytes": max(int(rise[i]), 0), "phase": phase, "step": int(history.loc[i, "step"])}
        return best
    s = report.get("summary") or {}
    for phase in _PHASES[:3]:
        value = _number(s.get(f"peak_{phase}_above_baseline_bytes"))
        if value is not None and (best is None or value > best["bytes"]):
            best = {"bytes": max(int(value), 0), "phase": phase, "step": None}
    return best


def _peak_text(report: dict[str, Any], history: Any) -> str:
    peak = run_peak(report, history)
    if peak is None:
        return "no peak was read"
    names = measure_names(report)
    at = f"step {peak['step']}" if peak.get("step") is not None else ""
    rise = run_rise(report, history) if names["cpu"] else None
    if rise is None:
        return f"peak {format_bytes(peak['bytes'])} {names['peak']} ({peak['phase']}{', ' + at if at else ''})"
    # CPU: the phases' peaks are one resident high-water mark; the phase is named by what it rose above its step's start
    where = f" (step {rise['step']})" if rise.get("step") is not None else ""
    return (f"peak {format_bytes(peak['bytes'])} {names['peak']}{f' ({at})' if at else ''}; "
            f"{rise['phase']} rose most above its step's start, +{format_bytes(rise['bytes'])}{where}")


def verdict_lines(report: dict[str, Any], history: Any = None) -> list[str]:
    """The verdict: its first line says whether a problem was found and where the peak was; then
    one line per problem (kind, step, what, the fix's first words)."""
    s = report.get("summary") or {}
    steps = s.get("steps_seen", 0)
    found = problems(report)
    events = [e for e in report.get("events") or [] if isinstance(e, dict)]
    ooms = [e for e in events if e.get("kind") == "oom"]
    cause = None
    head = (f"{len(found)} problem{'s' if len(found) != 1 else ''} found" if found else "no problem found")
    head = f"memcallbacks: {head} in {steps} step{'s' if steps != 1 else ''}; {_peak_text(report, history)}"
    if ooms:
        head += f"; out of memory at step {ooms[0].get('step')}"
        caused = [k for f in report.get("findings") or [] if isinstance(f, dict) and f.get("kind") == "oom"
                  for k in (f.get("details") or {}).get("caused_by") or ()]
        cause = next((f for f in found if f.get("key") in caused), None)
        if cause is not None:  # one cause: the leak listed below
            head += f", caused by the {finding_name(cause)} found at {step_text(cause).split(' (')[0]}"
    elif events:
        head += f"; the run ended with an exception at step {events[0].get('step')}"
    if s.get("disabled_after_error"):
        head += "; the monitor disabled itself after an internal error"
    others = len(report.get("findings") or []) - len(found) - (1 if cause is not None else 0)
    if others:
        head += f" ({others} more: advice or settled growth)"
    lines = [head]
    for f in found:
        fix = fix_words(f"Fix: {f['details']['fix']}" if "fix" in (f.get("details") or {}) else str(f.get("message") or ""))
        lines.append(f"  - {finding_name(f)}, {step_text(f)}: {_what(f)}" + (f"; fix: {fix}" if fix else ""))
    return lines


def finding_name(finding: dict[str, Any]) -> str:
    """``lingering``; ``rank 1: lingering`` for another rank's finding that rank zero reports; ``growth (ranks 0, 1)``
    for one that several ranks found."""
    details = finding.get("details") or {}
    rank, ranks, kind = details.get("rank"), details.get("ranks") or [], str(finding.get("kind"))
    if len(ranks) > 1:
        return f"{kind} (ranks {', '.join(str(r) for r in ranks)})"
    return f"rank {rank}: {kind}" if rank is not None and re.match(r"rank\d+:", str(finding.get("key", ""))) else kind


def files_folder(report: dict[str, Any]) -> str | None:
    """The folder the run's files are in (from ``files``), or None when none were written."""
    files = report.get("files") or {}
    path = files.get("report") or next(iter(files.values()), None)
    return str(Path(path).parent) if path else None


def console_lines(report: dict[str, Any], history: Any = None) -> list[str]:
    """What rank zero shows on the console when a run ends: the verdict, and where the files are."""
    lines = verdict_lines(report, history)
    folder = files_folder(report)
    if folder:
        lines.append(f"memcallbacks: files in {folder} (memcallbacks report {folder})")
    return lines


def console_channel(framework: str) -> Callable[[str], None]:
    """Where the end-of-run lines go: Lightning's ``rank_zero_info`` (its logger shows INFO without
    any setup), ``print`` elsewhere (the Transformers and Accelerate loggers hide INFO by default),
    through ``tqdm.write`` where tqdm is loaded: a progress bar still open (the Trainer's closes after
    the callbacks' ``on_train_end``) is moved below the lines instead of having them glued to its end."""
    if framework == "lightning":
        for name in ("lightning.pytorch.utilities", "pytorch_lightning.utilities"):
            module = sys.modules.get(name.rsplit(".", 1)[0])  # only a Lightning that is already imported
            if module is None:
                continue
            try:
                return importlib.import_module(name).rank_zero_info  # type: ignore[no-any-return]
            except (ImportError, AttributeError):
                continue
    tqdm = sys.modules.get("tqdm")
    write = getattr(getattr(tqdm, "tqdm", None), "write", None)
    return write if callable(write) else print


VERDICT_ABOVE = "memcallbacks: the report of the run whose verdict is printed above, where it ended"
"""The text report's first line after the console showed the verdict (the report points at it rather than repeating it)."""


class ConsoleVerdict:
    """The verdict rank zero's console shows at the end of a run, said once: a later end of the same run (Lightning's
    ``test()`` or ``validate()`` after ``fit()``) prints it again only when it changed, and the text report asked for
    after it (``print(monitor.format_report())``, as the docs show) points at it instead of repeating it."""

    def __init__(self) -> None:
        self.shown: list[str] = []
        """The verdict lines the console showed last (without the files' line); empty before the first end."""

    def to_show(self, lines: list[str]) -> list[str]:
        """``lines`` (:func:`console_lines`), or none when the console shows this verdict already."""
        verdict = [line for line in lines if not line.startswith("memcallbacks: files in ")]
        if verdict == self.shown:
            return []
        self.shown = verdict
        return lines

    def report_text(self, text: str) -> str:
        """The text report with its verdict lines replaced by :data:`VERDICT_ABOVE` when they are the console's."""
        lines = text.splitlines()
        if not self.shown or lines[: len(self.shown)] != self.shown:
            return text
        return "\n".join([VERDICT_ABOVE, *lines[len(self.shown):]])
