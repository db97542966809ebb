"""Render a snapshot offline: one self-contained HTML page (no scripts) and a PNG of the curve."""

from __future__ import annotations

import base64
import html
import io
import logging
import os
from pathlib import Path
from typing import Any, Sequence

import numpy as np

from memcallbacks._files.outputs import atomic_write
from memcallbacks._base.units import GiB, MiB, format_bytes
from memcallbacks.snapshot.sites import Allocation, SiteTotal
from memcallbacks.snapshot.summary import DeviceSummary, SnapshotSummary, summarize_snapshot
from memcallbacks.snapshot.summary_text import device_name

log = logging.getLogger(__name__)

__all__ = ["render_snapshot"]


def render_snapshot(
    snapshot: dict[str, Any],
    out: str | os.PathLike[str],
    *,
    source: str = "",
    window: tuple[int, int] | None = None,
    trigger: int | None = None,
    top: int = 10,
    png: bool = True,
) -> dict[str, Path]:
    """Write ``out`` (HTML, images inline, no scripts, no network) and the curve as ``out`` with ``.png``; return the paths.

    Without matplotlib the HTML draws the curve as inline SVG and no PNG is written.
    """
    out = Path(out)
    summary = summarize_snapshot(snapshot, source=source, window=window, trigger=trigger, top=top)
    written: dict[str, Path] = {}
    image = _plot_png(summary) if png else None
    if image is not None:
        written["png"] = atomic_write(out.with_suffix(".png"), lambda fh: fh.write(image), mode="wb")
    document = _html(summary, image, title=Path(source).name if source else out.stem)
    written["html"] = atomic_write(out, lambda fh: fh.write(document))
    return written


def _unit(peak: float) -> tuple[float, str]:
    return (float(GiB), "GiB") if peak >= 2 * GiB else (float(MiB), "MiB")


def _downsample(y: Any, max_points: int = 4000) -> tuple[Any, Any]:
    """Bucket maxima (peaks survive) for long traces; x is each bucket's first entry count."""
    n = len(y)
    if n <= max_points:
        return np.arange(n), y
    size = -(-n // max_points)
    pad = (-n) % size
    padded = np.concatenate([y, np.full(pad, y[-1], dtype=y.dtype)]) if pad else y
    return np.arange(0, n, size), padded.reshape(-1, size).max(axis=1)


def _plot_png(summary: SnapshotSummary) -> bytes | None:
    try:
        import matplotlib

        matplotlib.use("Agg", force=False)
        from matplotlib.figure import Figure
    except Exception:
        log.info("memcallbacks: matplotlib is not installed; the HTML draws an SVG curve and no PNG is written.")
        return None
    devices = summary.devices
    zoom = [d for d in devices if d.trigger is not None and d.entries > 200]
    cols = 2 if zoom else 1
    fig = Figure(figsize=(7.5 * cols if cols == 2 else 11, 3.6 * len(devices)), dpi=100)
    axes = fig.subplots(len(devices), cols, squeeze=False)
    for row, d in enumerate(devices):
        _plot_device(axes[row][0], summary, d, None)
        if cols == 2:
            if d in zoom:
                half = max(50, d.entries // 20)
                _plot_device(axes[row][1], summary, d, (max(0, d.trigger[0] - half), min(d.entries, d.trigger[0] + half)))  # type: ignore[index]
            else:
                axes[row][1].set_visible(False)
    fig.tight_layout()
    buf = io.BytesIO()
    fig.savefig(buf, format="png")
    return buf.getvalue()


def _plot_device(ax: Any, summary: SnapshotSummary, d: DeviceSummary, span: tuple[int, int] | None) -> None:
    lo, hi = span if span else (0, len(d.allocated) - 1)
    scale, unit = _unit(max(d.peak, int(d.reserved.max()) if d.reserved is not None else 0))
    x, y = _downsample(d.allocated[lo:hi + 1])
    ax.step(x + lo, y / scale, where="post", color="tab:blue", linewidth=1.3, label="allocated")
    if d.reserved is not None:
        xr, yr = _downsample(d.reserved[lo:hi + 1])
        ax.step(xr + lo, yr / scale, where="post", color="tab:gray", linestyle="--", linewidth=1.0, label="reserved")
    w0, w1 = d.window
    if d.entries and w1 > w0:
        ax.axvspan(max(w0, lo), min(w1, hi), color="tab:orange", alpha=0.08, label="'stayed alive' window")
    for k, label in d.marks:
        if lo <= k <= hi:
            ax.axvline(k, color="0.6", linestyle=":", linewidth=0.9)
            ax.annotate(label, (k, 1.0), xycoords=("data", "axes fraction"), fontsize=7, rotation=90, va="top", ha="right", color="0.35")
    if lo <= d.peak_at <= hi:
        ax.plot([d.peak_at], [d.peak / scale], "o", color="tab:red", markersize=5, label=f"peak {format_bytes(d.peak)}")
    if d.trigger and lo <= d.trigger[0] <= hi:
        ax.axvline(d.trigger[0], color="tab:red", linewidth=1.2, label=f"trigger: {d.trigger[1]}"[:60])
    for i, size, _ in d.ooms:
        if lo <= i <= hi:
            ax.plot([i], [d.allocated[i] / scale], "x", color="darkred", markersize=8)
    name = device_name(summary, d)
    ax.set_title(f"{name}: bytes allocated over the trace" + (" (around the trigger)" if span else ""), fontsize=10)
    ax.set_xlabel("trace entry")
    ax.set_ylabel(unit)
    ax.set_xlim(lo, max(hi, lo + 1))
    ax.set_ylim(bottom=0)
    ax.grid(True, alpha=0.3)
    ax.legend(loc="lower right", fontsize=7)


def _svg_curve(d: DeviceSummary) -> str:
    width, height, pad = 900, 240, 40
    x, y = _downsample(d.allocated, 900)
    top = max(int(np.max(y)), 1)
    n = max(len(d.allocated) - 1, 1)

    def px(k: float) -> float:
        return pad + (width - 2 * pad) * k / n

    def py(v: float) -> float:
        return height - pad - (height - 2 * pad) * v / top

    points = " ".join(f"{px(float(a)):.1f},{py(float(b)):.1f}" for a, b in zip(x, y))
    scale, unit = _unit(top)
    parts = [f'<svg viewBox="0 0 {width} {height}" width="{width}" height="{height}" role="img">',
             f'<rect x="0" y="0" width="{width}" height="{height}" fill="white"/>',
             f'<polyline fill="none" stroke="#1f77b4" stroke-width="1.5" points="{points}"/>',
             f'<text x="4" y="{pad - 8}" font-size="11">{top / scale:.2f} {unit}</text>',
             f'<line x1="{pad}" y1="{height - pad}" x2="{width - pad}" y2="{height - pad}" stroke="#444"/>']
    for k, label in d.marks:
        parts.append(f'<line x1="{px(k):.1f}" y1="{pad}" x2="{px(k):.1f}" y2="{height - pad}" stroke="#999" stroke-dasharray="3,3"/>')
        parts.append(f'<text x="{px(k) + 2:.1f}" y="{pad + 10}" font-size="9" fill="#555">{html.escape(label)}</text>')
    if d.trigger:
        parts.append(f'<line x1="{px(d.trigger[0]):.1f}" y1="{pad}" x2="{px(d.trigger[0]):.1f}" y2="{height - pad}" stroke="#d62728"/>')
    parts.append(f'<circle cx="{px(d.peak_at):.1f}" cy="{py(d.peak):.1f}" r="4" fill="#d62728"/>')
    parts.append("</svg>")
    return "".join(parts)


_CSS = """
body{font-family:system-ui,-apple-system,Segoe UI,Helvetica,Arial,sans-serif;margin:24px;color:#222;max-width:1200px}
h1{font-size:20px}h2{font-size:17px;margin-top:28px;border-bottom:1px solid #ddd}h3{font-size:14px;margin-top:18px}
table{border-collapse:collapse;font-size:13px;margin:6px 0}td,th{border:1px solid #ddd;padding:3px 8px;text-align:left;vertical-align:top}
th{background:#f4f4f4}td.n{text-align:right;white-space:nowrap}code,.mono{font-family:ui-monospace,Menlo,Consolas,monospace;font-size:12px}
.note{color:#555;font-size:13px}.warn{color:#a00}img{max-width:100%}
"""


def _table(header: str, rows: Sequence[tuple[str, str, str, str, Sequence[str], str]]) -> str:
    """Rows of ``(bytes, second column, site, site file, callers, what)`` under ``header``'s five column names."""
    out = [f"<table><tr>{header}</tr>"]
    for size, second, site, site_file, callers, what in rows:
        out.append(
            f'<tr><td class="n">{size}</td><td class="n">{second}</td>'
            f'<td class="mono" title="{html.escape(site_file)}">{html.escape(site)}</td>'
            f'<td class="mono">{"<br>".join(html.escape(c) for c in callers)}</td><td>{html.escape(what)}</td></tr>'
        )
    out.append("</table>")
    return "".join(out)


def _site_table(rows: Sequence[SiteTotal], empty: str) -> str:
    if not rows:
        return f'<p class="note">{html.escape(empty)}</p>'
    return _table(
        "<th>bytes</th><th>allocations</th><th>site</th><th>called from</th><th>what</th>",
        [(format_bytes(r.bytes), str(r.count), r.site, r.site_file, r.callers, r.what) for r in rows],
    )


def _alloc_table(allocs: Sequence[Allocation]) -> str:
    if not allocs:
        return '<p class="note">No live allocations.</p>'
    return _table(
        "<th>bytes</th><th>allocated at entry</th><th>site</th><th>called from</th><th>what</th>",
        [(format_bytes(a.size), "before the trace" if a.index is None else str(a.index), a.site, a.site_file, a.callers, a.what)
         for a in allocs],
    )


def _html(summary: SnapshotSummary, image: bytes | None, *, title: str) -> str:
    parts = _html_head(summary, image, title)
    for d in summary.devices:
        parts.extend(_device_html(summary, d, svg=image is None))
    e = html.escape
    if summary.notes:
        parts.append("<h2>Notes</h2><ul>" + "".join(f'<li class="note">{e(n)}</li>' for n in summary.notes) + "</ul>")
    parts.append(
        '<p class="note">The site is the innermost Python frame outside torch. For the interactive timeline, open the '
        ".pickle in pytorch.org/memory_viz (drag and drop; the file stays in the browser). This page needs no network.</p>"
    )
    parts.append("</body></html>")
    return "\n".join(parts)


def _html_head(summary: SnapshotSummary, image: bytes | None, title: str) -> list[str]:
    """The document's start: title, what the snapshot is, and the PNG inline when there is one."""
    e = html.escape
    meta = summary.metadata
    parts = [
        "<!DOCTYPE html>",
        '<html lang="en"><head><meta charset="utf-8">',
        f"<title>memory snapshot: {e(title)}</title><style>{_CSS}</style></head><body>",
        f"<h1>Memory snapshot: {e(title)}</h1>",
        f'<p class="note">{e(summary.kind)}; source: <span class="mono">{e(summary.source or "(in memory)")}</span>'
        + (f"; torch {e(str(meta['torch']))}" if meta.get("torch") else "")
        + (f"; captured {e(str(meta['steps']))} step(s)" if meta.get("steps") else "")
        + "</p>",
    ]
    if image is not None:
        encoded = base64.b64encode(image).decode("ascii")
        parts.append(f'<p><img alt="bytes allocated over the trace" src="data:image/png;base64,{encoded}"></p>')
    return parts


def _device_facts(d: DeviceSummary) -> list[tuple[str, str]]:
    """The device's key numbers as ``(name, value)`` rows."""
    rows = [("trace entries", f"{d.entries} ({d.allocs} allocs, {d.frees} frees)"), ("segments", str(d.segments))]
    if d.entries:
        rows.append(("peak allocated", f"{format_bytes(d.peak)} after entry {d.peak_at}"))
        rows.append(("allocated at the start / end", f"{format_bytes(d.baseline)} / {format_bytes(d.end)}"))
    else:
        rows.append(("allocated in the segments", format_bytes(d.peak)))
    if d.reserved_end is not None:
        rows.append(("reserved at the end", format_bytes(d.reserved_end)))
    if d.trigger:
        rows.append(("trigger", f"{d.trigger[1]} at entry {d.trigger[0]}"))
    for i, size, free in d.ooms:
        rows.append(("out of memory", f"entry {i}: {format_bytes(size)} requested" + ("" if free is None else f", {format_bytes(free)} free")))
    if d.time_us:
        rows.append(("trace spans", f"{(d.time_us[1] - d.time_us[0]) / 1e6:.3f} s"))
    return rows


def _device_html(summary: SnapshotSummary, d: DeviceSummary, *, svg: bool) -> list[str]:
    """One device's section: its numbers, the SVG curve when there is no PNG, the tables."""
    e = html.escape
    parts = [f"<h2>Device {e(device_name(summary, d))}</h2>"]
    parts.append("<table>" + "".join(f"<tr><th>{e(k)}</th><td>{e(v)}</td></tr>" for k, v in _device_facts(d)) + "</table>")
    if svg and d.entries:
        parts.append(_svg_curve(d))
    parts.append(f"<h3>Largest live allocations at the peak ({format_bytes(d.peak)})</h3>")
    parts.append(_alloc_table(d.largest_at_peak))
    parts.append("<h3>Allocation sites at the peak</h3>")
    parts.append(_site_table(d.sites_at_peak, "No live allocations at the peak."))
    if d.entries:
        parts.append(f"<h3>Allocated but not freed: between {e(d.window_labels[0])} and {e(d.window_labels[1])}</h3>")
        parts.append(f'<p class="note">{format_bytes(d.stayed_alive_bytes)} in {d.stayed_alive_count} allocation(s) '
                     "made in this window were still alive at its end, by site:</p>")
        parts.append(_site_table(d.stayed_alive, "Everything allocated in the window was freed by its end."))
    return parts
