"""Memory snapshots: record them (CUDA history, CPU capture), read, summarise and render them offline."""

# files: format, write, read; record: CUDA history; cpu_capture + cpu_convert: CPU; sites + summary: analysis;
# summary_text: the text; render: HTML/PNG; auto: the monitor's automatic snapshot policy (private, not re-exported).

from __future__ import annotations

from typing import Any

from memcallbacks.snapshot.files import (
    CPU_SNAPSHOT_FILE,
    META_KEY,
    OOM_SNAPSHOT_FILE,
    SNAPSHOT_FILE,
    SNAPSHOT_PROTOCOL,
    EmptySnapshotError,
    SnapshotError,
    SnapshotTooLarge,
    load_snapshot,
    snapshot_file_name,
    snapshot_size,
    validate_snapshot,
    write_snapshot,
)
from memcallbacks.snapshot.render import render_snapshot
from memcallbacks.snapshot.sites import Allocation, SiteTotal
from memcallbacks.snapshot.summary import DeviceSummary, SnapshotSummary, summarize_snapshot
from memcallbacks.snapshot.summary_text import format_summary

# The public names, grouped by what a user does with them (each module's own __all__ lists them by module).
__all__ = [
    # record: CUDA allocator history
    "start_recording", "stop_recording", "is_recording", "time_mark", "dump_snapshot", "dump_on_oom",
    # capture: CPU steps through torch.profiler
    "CpuCapture", "cpu_events_to_snapshot",
    # read and write
    "load_snapshot", "validate_snapshot", "write_snapshot", "snapshot_size",
    "SnapshotError", "EmptySnapshotError", "SnapshotTooLarge",
    # analyse and show
    "summarize_snapshot", "format_summary", "render_snapshot",
    "SnapshotSummary", "DeviceSummary", "Allocation", "SiteTotal",
    # the file format and names
    "SNAPSHOT_PROTOCOL", "META_KEY", "SNAPSHOT_FILE", "CPU_SNAPSHOT_FILE", "OOM_SNAPSHOT_FILE", "snapshot_file_name",
]

# Recording and CPU capture need torch; reading, summarising and rendering a snapshot do not (the CLI's
# ``summary`` and ``render`` start in ~0.1 s instead of ~1.2 s), so those names are imported on first use.
_NEEDS_TORCH = {
    "CpuCapture": "cpu_capture", "cpu_events_to_snapshot": "cpu_convert",
    **{name: "record" for name in ("dump_on_oom", "dump_snapshot", "is_recording", "start_recording", "stop_recording", "time_mark")},
}


def __getattr__(name: str) -> Any:
    module = _NEEDS_TORCH.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    import importlib

    value = getattr(importlib.import_module(f"{__name__}.{module}"), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_NEEDS_TORCH))
