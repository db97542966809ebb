"""Files the monitor leaves behind: ``history.csv``, ``report.json`` and ``memory.png``, written atomically."""

from __future__ import annotations

import json
import logging
import math
import os
import tempfile
from pathlib import Path
from typing import Any, Callable

from memcallbacks._files.fileset import FileSet, unlink_quietly, write_temporary
from memcallbacks._base.columns import file_column
from memcallbacks._files.verdict import verdict_lines
from memcallbacks._base.units import GiB, MiB

log = logging.getLogger(__name__)

__all__ = ["REPORT_VERSION", "atomic_write", "json_safe", "check_writable", "write_outputs", "plot_history", "history_figure", "file_names"]

REPORT_VERSION = 1
"""``report.json``'s ``version``: bumped when a key changes meaning or goes away."""


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
) -> dict[str, str]:
    """Write this rank's files as one set (see :mod:`memcallbacks._files.fileset`); return ``{kind: path}``.

    Every file is staged first; a failure while staging leaves the folder as it was. The plot is
    optional: one that fails is left out, and the others are written. ``ranks`` (rank zero under
    distributed training): every rank's summary, written into a combined ``report.json``.
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
                figure = history_figure(history, title=title, peak_source=peak_source)
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


def plot_history(history: Any, path: Path, *, title: str = "", peak_source: str = "") -> Path | None:
    """Plot baseline, reserved and per-phase peaks over steps (GiB) into a PNG."""
    fig = history_figure(history, title=title, peak_source=peak_source)
    if fig is None:
        return None
    atomic_write(path, lambda fh: fig.savefig(fh, format="png"), mode="wb")
    return path


def _line(ax: Any, x: Any, y: Any, **style: Any) -> None:
    """``y`` over ``x`` as one line through its values that are not NaN (matplotlib leaves a gap at
    every NaN, which turns a series read every few steps into scattered dots)."""
    import numpy as np

    y = np.asarray(y, dtype=float)
    keep = ~np.isnan(y)
    ax.plot(np.asarray(x)[keep], y[keep], **style)


def history_figure(history: Any, *, title: str = "", peak_source: str = "") -> Any:
    """The memory plot as a matplotlib ``Figure`` (None without matplotlib)."""
    global _warned_no_matplotlib
    try:
        import matplotlib

        matplotlib.use("Agg", force=False)
        from matplotlib.figure import Figure
    except Exception:
        if not _warned_no_matplotlib:
            log.info("memcallbacks: matplotlib is not installed; skipping memory.png (pip install matplotlib).")
            _warned_no_matplotlib = True
        return None

    gib, mib = float(GiB), float(MiB)
    x = history["step"].to_numpy()
    fig = Figure(figsize=(10, 7.5), dpi=100)
    ax, ax2 = fig.subplots(2, 1, sharex=True, gridspec_kw={"height_ratios": [3, 2]})
    phases = [("peak_forward", "forward", "tab:blue"), ("peak_backward", "backward", "tab:orange"), ("peak_optimizer", "optimizer", "tab:green")]
    for col, label, color in phases:
        if col in history and history[col].notna().any():
            ax.plot(x, history[col].to_numpy() / gib, label=f"{label} peak", color=color, linewidth=1.4)
        if f"predicted_{col}" in history:  # pre-flight's prediction, in the same frame as the measured peak
            ax.plot(x, history[f"predicted_{col}"].to_numpy() / gib, label=f"{label} predicted", color=color, linestyle="--", linewidth=1.0)
    # on CPU a sampled step may leave the heap unread (NaN, docs/metrics.md): a line through the read ones
    _line(ax, x, history["allocated"].to_numpy() / gib, label="allocated at step start", color="black", linewidth=1.4)
    ax.plot(x, history["reserved"].to_numpy() / gib, label="reserved at step start", color="tab:gray", linestyle="--", linewidth=1.2)
    if "host_rss" in history and peak_source != "rss_high_water_mark":
        ax.plot(x, history["host_rss"].to_numpy() / gib, label="host RSS", color="tab:purple", linestyle=":", linewidth=1.2)
    ax.set_ylabel("GiB")
    note = " (CPU: peaks are RSS high-water marks)" if peak_source == "rss_high_water_mark" else ""
    ax.set_title((title or "memory per phase") + note, fontsize=10)
    ax.grid(True, alpha=0.3)
    ax.legend(loc="best", fontsize=8)
    # what each phase added on top of the step's starting point: the part a person can act on
    base_col = "reserved" if peak_source == "rss_high_water_mark" else "allocated"
    base = history[base_col].to_numpy()
    for col, label, color in phases:
        if col in history and history[col].notna().any():
            _line(ax2, x, (history[col].to_numpy() - base) / mib, label=label, color=color, linewidth=1.4)
        if f"predicted_{col}" in history:
            _line(ax2, x, (history[f"predicted_{col}"].to_numpy() - base) / mib, color=color, linestyle="--", linewidth=1.0)
    ax2.axhline(0, color="black", linewidth=0.8)
    ax2.set_ylabel(f"peak above {base_col}\nat step start (MiB)")
    ax2.set_xlabel("optimizer step")
    ax2.grid(True, alpha=0.3)
    ax2.legend(loc="best", fontsize=8)
    fig.tight_layout()
    return fig
