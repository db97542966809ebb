"""Files the monitor leaves: ``history.csv``, ``report.json`` and ``memory.png``, written atomically."""

from __future__ import annotations

import json
import logging
import math
import os
import tempfile
import time
from pathlib import Path
from typing import Any, Callable

from memcallbacks._base.columns import file_column
from memcallbacks._base.units import GiB, MiB
from memcallbacks._files.fileset import FileSet, unlink_quietly, write_temporary
from memcallbacks._files.verdict import verdict_lines

log = logging.getLogger(__name__)

__all__ = ["REPORT_VERSION", "atomic_write", "json_safe", "check_writable", "write_outputs", "plot_history", "history_figure", "file_names"]

REPORT_VERSION = 2
"""``report.json``'s ``version``: bumped when a key changes meaning or goes away (2: ``verdict`` and
``summary.peak`` added, ``summary.cadence.step_time_median_s`` gone into ``summary.step_time_median_s``,
``history.csv``'s byte columns named with their unit)."""


def atomic_write(path: str | os.PathLike[str], write: Callable[[Any], None], mode: str = "w") -> Path:
    """Write through a temporary file in the same folder and ``os.replace`` it into place."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = write_temporary(path.parent, path.name, write, mode)
    try:
        os.replace(tmp, path)
    except BaseException:
        unlink_quietly(tmp)
        raise
    return path


def check_writable(folder: str | os.PathLike[str], owner: str) -> Path:
    """Create ``folder`` and prove a file can be written there; raise a clear error otherwise."""
    folder = Path(folder)
    try:
        folder.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=".memcallbacks-write-test.", dir=folder)
        os.close(fd)
        os.unlink(tmp)
    except OSError as exc:
        from memcallbacks._base.errors import OutputDirError

        raise OutputDirError(
            f"{owner}: output_dir {str(folder)!r} is not writable ({exc.strerror or exc}). "
            f"Pass output_dir= pointing to a writable folder, or write_files=False to keep results in memory only."
        ) from exc
    return folder


def file_names(rank: int, world_size: int) -> dict[str, str]:
    """``history.csv`` etc. for a single process; ``history.rank{r}.csv`` etc. per rank when distributed."""
    tag = "" if world_size <= 1 else f".rank{rank}"
    return {
        "history": f"history{tag}.csv",
        "eval_history": f"eval_history{tag}.csv",
        "report": f"report{tag}.json",
        "plot": f"memory{tag}.png",
    }


def json_safe(value: Any) -> Any:
    if isinstance(value, float) and (math.isnan(value) or math.isinf(value)):
        return None
    if isinstance(value, dict):
        return {str(k): json_safe(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [json_safe(v) for v in value]
    return value


def write_json(path: Path, payload: dict[str, Any]) -> Path:
    return atomic_write(path, lambda fh: json.dump(json_safe(payload), fh, indent=2, sort_keys=False, default=str))


def write_outputs(
    folder: Path,
    *,
    rank: int,
    world_size: int,
    history: Any,
    eval_history: Any,
    report: dict[str, Any],
    plot: bool,
    title: str = "",
    ranks: list[Any] | None = None,
    end_started: float | None = None,
) -> dict[str, str]:
    """Write this rank's files as one set (see :mod:`memcallbacks._files.fileset`); return ``{kind: path}``.

    Every file is staged first; a failure while staging leaves the folder as it was. The plot is
    optional: one that fails is left out, and the others are written. ``ranks`` (rank zero under
    distributed training): every rank's summary, written into a combined ``report.json``. ``end_started``
    (``time.time()`` when the run's end began): the report's ``summary.cadence.end_wall_s``, the wall time the end
    took up to the report, a writer process's included.
    """
    names = file_names(rank, world_size)
    files = FileSet(folder)
    try:
        files.stage("history", names["history"], lambda fh: history.rename(columns=file_column).to_csv(fh, index=False))
        if len(eval_history):
            files.stage("eval_history", names["eval_history"], lambda fh: eval_history.rename(columns=file_column).to_csv(fh, index=False))
        if plot and len(history):
            peak_source = (report.get("summary") or {}).get("device", {}).get("peak_source", "")
            try:
                figure = history_figure(history, title=title, peak_source=peak_source, eval_history=eval_history,
                                        findings=report.get("findings"))
                if figure is not None:
                    files.stage("plot", names["plot"], lambda fh: figure.savefig(fh, format="png"), mode="wb")
            except Exception:
                log.exception("memcallbacks: could not draw %s; the other files are written without it.", names["plot"])
        integrity = {kind: files.staged_fingerprint(kind) for kind in ("history", "eval_history") if kind in files.staged}
        paths = {kind: str(final) for kind, (_, final) in files.staged.items()}
        paths["report"] = str(folder / names["report"])
        if ranks is not None:
            paths["combined_report"] = str(folder / "report.json")
        report = dict(report, files={**report.get("files", {}), **paths}, integrity=integrity)
        if end_started is not None:  # the wall time the run's end took up to this report (the writer process's included)
            summary = report.get("summary") or {}
            cadence = dict(summary.get("cadence") or {}, end_wall_s=round(max(0.0, time.time() - end_started), 3))
            report["summary"] = dict(summary, cadence=cadence)
        if "verdict" in report:  # findings added after the report was made (the per-rank comparison)
            report["verdict"] = verdict_lines(report, history)
        files.stage("report", names["report"], lambda fh: _dump_json(report, fh))
        if ranks is not None:
            files.stage("combined_report", "report.json", lambda fh: _dump_json(dict(report, ranks=ranks), fh))
    except BaseException:
        files.discard()
        raise
    stale = [names[kind] for kind in ("eval_history", "plot") if kind not in files.staged]
    return files.commit(stale)


def _dump_json(payload: dict[str, Any], fh: Any) -> None:
    json.dump(json_safe(payload), fh, indent=2, sort_keys=False, default=str)


_warned_no_matplotlib = False


def plot_history(history: Any, path: Path, *, title: str = "", peak_source: str = "", eval_history: Any = None,
                 findings: list[dict[str, Any]] | None = None) -> Path | None:
    """Plot per-phase peaks, the step-start floor, evaluation loops and findings over steps into a PNG."""
    fig = history_figure(history, title=title, peak_source=peak_source, eval_history=eval_history, findings=findings)
    if fig is None:
        return None
    atomic_write(path, lambda fh: fig.savefig(fh, format="png"), mode="wb")
    return path


def _line(ax: Any, x: Any, y: Any, label: str | None = None, **style: Any) -> None:
    """``y`` over ``x``, one line per run of consecutive steps (no line across steps without a row),
    each through its values that are not NaN (on CPU a measured step may leave the heap unread, and
    matplotlib would leave a gap at every NaN); a run of one value shows as a point."""
    import numpy as np

    x, y = np.asarray(x, dtype=float), np.asarray(y, dtype=float)
    cuts = np.flatnonzero(np.diff(x) > 1) + 1
    for xs, ys in zip(np.split(x, cuts), np.split(y, cuts)):
        keep = ~np.isnan(ys)
        if keep.any():
            ax.plot(xs[keep], ys[keep], label=label, marker="." if keep.sum() == 1 else None, **style)
            label = None


def _matplotlib_figure() -> Any:
    global _warned_no_matplotlib
    try:
        import matplotlib

        matplotlib.use("Agg", force=False)
        from matplotlib.figure import Figure
    except ImportError:  # anything else (no memory left to load it) is the drawing's failure, said as one
        if not _warned_no_matplotlib:
            log.warning("memcallbacks: matplotlib is not installed; memory.png is not written (pip install matplotlib).")
            _warned_no_matplotlib = True
        return None
    return Figure


_PHASES = (("peak_forward", "forward", "tab:blue", {"linewidth": 4.5}), ("peak_backward", "backward", "tab:orange", {"linewidth": 2.2}),
           ("peak_optimizer", "optimizer", "tab:green", {"linewidth": 1.6, "linestyle": (0, (4, 3))}))
"""Column, label, colour and the style of its line below: each narrower than the one drawn before it, the
last dashed, so phases that rose by the same amount show as one striped line, not as the last one drawn."""


def history_figure(history: Any, *, title: str = "", peak_source: str = "", eval_history: Any = None,
                   findings: list[dict[str, Any]] | None = None) -> Any:
    """The memory plot as a matplotlib ``Figure`` (None without matplotlib): per-phase peaks and the
    step-start floor over steps (top), what each phase rose above the floor (bottom), evaluation
    loops as shaded spans and findings as red lines. On CPU the peaks and the floor are resident
    memory (RSS); the C heap is drawn as its change, never beside RSS."""
    Figure = _matplotlib_figure()
    if Figure is None:
        return None
    import numpy as np

    cpu = peak_source == "rss_high_water_mark"
    gib, mib = float(GiB), float(MiB)
    x = history["step"].to_numpy()
    heap = history["allocated"].to_numpy(dtype=float)
    floor = history["reserved"].to_numpy(dtype=float) if cpu else heap
    fig = Figure(figsize=(10, 7.5), dpi=100)
    # CPU: the phases' peaks are one resident high-water mark, drawn once; what differs is each phase's rise (below)
    ax, ax2 = fig.subplots(2, 1, sharex=True, gridspec_kw={"height_ratios": [2, 3] if cpu else [3, 2]})
    measure = "resident memory" if cpu else "allocated"
    if cpu and "peak_allocated" in history and history["peak_allocated"].notna().any():
        _line(ax, x, history["peak_allocated"].to_numpy() / gib, label="step peak (its high-water mark)", color="tab:brown", linewidth=1.4)
    for col, label, color, style in _PHASES:
        if col in history and history[col].notna().any():
            if not cpu:
                _line(ax, x, history[col].to_numpy() / gib, label=f"{label} peak", color=color, linewidth=1.4)
            rise = np.maximum(history[col].to_numpy(dtype=float) - floor, 0.0)  # a peak never lies below its step's start
            _line(ax2, x, rise / mib, label=label, color=color, **style)
        if f"predicted_{col}" in history:  # pre-flight's prediction, in the same frame as the measured peak
            _line(ax, x, history[f"predicted_{col}"].to_numpy() / gib, label=f"{label} predicted", color=color, linestyle="--", linewidth=1.0)
            _line(ax2, x, (history[f"predicted_{col}"].to_numpy() - floor) / mib, color=color, linestyle="--", linewidth=1.0)
    # on CPU a measured step may leave the heap unread (NaN, docs/metrics.md): a line through the read ones
    _line(ax, x, floor / gib, label=f"{measure} at step start (floor)", color="black", linewidth=1.4)
    if cpu:
        read = heap[~np.isnan(heap)]
        if len(read):
            _line(ax2, x, (heap - read[0]) / mib, label="heap in use at step start,\nchange since the first row", color="black", linestyle=":", linewidth=1.2)
    else:
        _line(ax, x, history["reserved"].to_numpy() / gib, label="reserved at step start", color="tab:gray", linestyle="--", linewidth=1.2)
    _mark_evaluation(ax, ax2, eval_history, gib)
    _mark_findings(ax, ax2, findings)
    ax.set_ylabel(f"GiB ({measure})")
    note = " (CPU: resident memory, peaks are its high-water marks)" if cpu else ""
    ax.set_title((title or "memory per phase") + note, fontsize=10)
    ax.grid(True, alpha=0.3)
    ax.legend(loc="best", fontsize=8)
    ax2.axhline(0, color="black", linewidth=0.8)
    ax2.set_ylabel(f"peak above {measure}\nat step start (MiB)")
    if cpu:
        ax2.set_title("what each phase rose above the resident memory at its step's start", fontsize=10)
    ax2.set_xlabel("optimizer step")
    ax2.grid(True, alpha=0.3)
    ax2.legend(loc="best", fontsize=8)
    fig.tight_layout()
    return fig


def _mark_evaluation(ax: Any, ax2: Any, eval_history: Any, gib: float) -> None:
    """Each evaluation loop as a shaded span where it ran (its ``step`` counts the optimizer steps
    before it: it ran after row ``step - 1``), its peak as a marker."""
    if eval_history is None or not len(eval_history) or "step" not in eval_history:
        return
    import pandas as pd

    labelled: set[str] = set()
    for _, row in eval_history.iterrows():
        stage = str(row.get("stage", "evaluation"))
        if stage == "sanity_check":
            continue  # Lightning's two batches before training: not part of the run's steps
        first = stage not in labelled
        labelled.add(stage)
        for axis in (ax, ax2):
            axis.axvspan(row["step"] - 0.8, row["step"] - 0.2, color="tab:purple", alpha=0.15, linewidth=0,
                         label=f"{stage} loop" if first and axis is ax else None)
        peak = pd.to_numeric(row.get("peak_allocated"), errors="coerce")
        if pd.notna(peak):
            ax.plot([row["step"] - 0.5], [peak / gib], marker="v", color="tab:purple", linestyle="none",
                    label=f"{stage} peak" if first else None)


def _mark_findings(ax: Any, ax2: Any, findings: list[dict[str, Any]] | None) -> None:
    """Each finding as a red vertical line at the step it was confirmed, its kind written beside it."""
    for i, f in enumerate(findings or []):
        if not isinstance(f, dict) or f.get("step") is None:
            continue
        settled = f.get("state") == "settled" or f.get("severity") == "advice"
        for axis in (ax, ax2):
            axis.axvline(f["step"], color="tab:red", linestyle=":" if settled else "-", linewidth=1.0, alpha=0.8,
                         label="finding" if i == 0 and axis is ax else None)
        ax.annotate(str(f.get("kind")), (f["step"], 0.97), xycoords=("data", "axes fraction"), rotation=90,
                    va="top", ha="right", fontsize=8, color="tab:red", xytext=(-2, 0), textcoords="offset points")
