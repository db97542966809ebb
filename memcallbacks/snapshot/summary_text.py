"""The summary as text: what ``memcallbacks summary`` prints."""

from __future__ import annotations

from typing import Sequence

from memcallbacks._base.units import format_bytes
from memcallbacks.snapshot.sites import SiteTotal
from memcallbacks.snapshot.summary import DeviceSummary, SnapshotSummary

__all__ = ["format_summary", "device_name"]


def device_name(summary: SnapshotSummary, d: DeviceSummary) -> str:
    """``"cpu"`` for a CPU capture, else ``"cuda:N"``."""
    if summary.metadata.get("kind") == "cpu_profiler":
        return "cpu"
    return f"cuda:{d.device}"


def format_summary(summary: SnapshotSummary) -> str:
    """The text ``memcallbacks summary`` prints: peak, top sites at the peak, what stayed alive, OOMs."""
    lines = [f"memory snapshot {summary.source or ''}".rstrip(), f"  {summary.kind}"]
    meta = summary.metadata
    if meta.get("steps"):
        first = meta.get("first_step")
        lines.append(f"  captured {meta['steps']} step(s)" + (f" from step {first}" if first is not None else ""))
    for d in summary.devices:
        name = device_name(summary, d)
        reserved = "" if d.reserved_end is None else f", {format_bytes(d.reserved_end)} reserved at the end"
        lines.append("")
        lines.append(f"device {name}: {d.entries} trace entries ({d.allocs} allocs, {d.frees} frees), {d.segments} segments{reserved}")
        if d.entries:
            where = "before the first entry" if d.peak_at == 0 else f"after entry {d.peak_at} of {d.entries}"
            lines.append(f"  peak allocated      {format_bytes(d.peak)} {where}")
            lines.append(f"  allocated           {format_bytes(d.baseline)} at the start of the trace, {format_bytes(d.end)} at the end")
        else:
            lines.append(f"  allocated           {format_bytes(d.peak)} in the segments (no trace: record history to see events)")
        if d.trigger:
            lines.append(f"  trigger             {d.trigger[1]} at entry {d.trigger[0]}")
        for i, size, free in d.ooms:
            free_s = "" if free is None else f", {format_bytes(free)} free on the device"
            lines.append(f"  OUT OF MEMORY       at entry {i}: {format_bytes(size)} requested{free_s}")
        lines.append("  top allocation sites at the peak:")
        lines.extend(_site_lines(d.sites_at_peak))
        lines.append("  largest live allocations at the peak:")
        for a in d.largest_at_peak:
            extra = f"  [{a.what}]" if a.what else ""
            lines.append(f"    {format_bytes(a.size):>10}  {a.site}{_callers(a.callers)}{extra}")
        if not d.largest_at_peak:
            lines.append("    (none)")
        if d.entries:
            lines.append(f"  stayed alive: allocated between {d.window_labels[0]} and {d.window_labels[1]}, not freed by then: "
                         f"{format_bytes(d.stayed_alive_bytes)} in {d.stayed_alive_count} allocation(s)")
            lines.extend(_site_lines(d.stayed_alive))
    if summary.notes:
        lines.append("")
        lines.extend(f"note: {n}" for n in summary.notes)
    return "\n".join(lines)


def _callers(callers: Sequence[str]) -> str:
    return "".join(f" <- {c}" for c in callers[:2])


def _site_lines(rows: Sequence[SiteTotal]) -> list[str]:
    if not rows:
        return ["    (none)"]
    out = []
    for r in rows:
        extra = f"  [{r.what}]" if r.what else ""
        out.append(f"    {format_bytes(r.bytes):>10}  {r.count:>5} alloc{'s' if r.count != 1 else ' '}  {r.site}{_callers(r.callers)}{extra}")
    return out
