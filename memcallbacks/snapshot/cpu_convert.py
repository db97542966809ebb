"""Convert ``torch.profiler`` allocation events (CPU) into the snapshot format memory_viz reads."""

from __future__ import annotations

import bisect
import time
from typing import Any, Iterable, Sequence

import torch

from memcallbacks._base import torch_private as _tp
from memcallbacks.snapshot.files import OP_FILENAME, DEFAULT_MAX_ENTRIES, META_KEY, plain_data

__all__ = ["cpu_events_to_snapshot"]

_SEGMENT_GAP = 1 << 20
"""CPU captures: allocations closer than this share one synthetic segment."""

_Block = tuple[int, int, list[dict[str, Any]]]
"""``(address, size, frames)`` of a block alive at the end of a capture."""


def cpu_events_to_snapshot(
    events: Iterable[_tp.ProfilerAllocation],
    *,
    marks: Sequence[tuple[str, int]] = (),
    max_entries: int = DEFAULT_MAX_ENTRIES,
    holders: dict[int, dict[str, Any]] | None = None,
    trigger: dict[str, Any] | None = None,
    metadata: dict[str, Any] | None = None,
    notes: Sequence[str] = (),
) -> dict[str, Any]:
    """Convert profiler allocation events (CPU ones) into a memory_viz snapshot.

    Every allocation becomes an ``alloc`` entry, every free a ``free_requested`` +
    ``free_completed`` pair (CPU frees complete at once), each with its Python frames (innermost
    first, after a ``<torch op>`` pseudo-frame naming the op). Only the newest ``max_entries``
    entries are kept. Segments hold what is alive at the end; they are synthetic address ranges
    (the CPU allocator has no segments), so "reserved" means nothing in them. ``marks``:
    ``(label, time_ns)`` step boundaries. ``holders``: census records by address; live tensors
    the trace never saw allocated (older than the capture) are added as blocks without frames.
    """
    holders = dict(holders or {})
    events = list(events)
    cpu = [e for e in events if e.device_type == "cpu" and e.nbytes != 0]
    others = sum(1 for e in events if e.device_type != "cpu")

    live: dict[int, _tp.ProfilerAllocation] = {}
    for e in cpu:
        if e.nbytes > 0:
            live[e.ptr] = e
        else:
            live.pop(e.ptr, None)

    kept, dropped = _newest_entries(cpu, max_entries)
    frames_of = _StackTable()
    trace, times = _trace_entries(kept, frames_of)
    mark_list = [
        {"label": label, "time_us": int(t_ns) // 1000, "index": bisect.bisect_right(times, int(t_ns)), "device": 0}
        for label, t_ns in marks
    ]
    alive = _alive_blocks(live, holders, frames_of)
    alive_addrs = {b[0] for b in alive}
    intervals = [(e["addr"], e["size"]) for e in trace] + [(a, s) for a, s, _ in alive]
    segments = _synthetic_segments(intervals, alive)
    meta: dict[str, Any] = {
        "format": 1,
        "kind": "cpu_profiler",
        "source": "memcallbacks CpuCapture: torch.profiler with profile_memory=True",
        "device": "cpu",
        "torch": torch.__version__,
        "created_unix_s": time.time(),
        "max_entries": max_entries,
        "dropped_entries": dropped,
        "events_other_devices": others,
        "synthetic_segments": True,
        "marks": mark_list,
        "trigger": trigger,
        "holders": {a: {k: v for k, v in h.items() if k != "nbytes"} for a, h in holders.items() if a in alive_addrs},
        "notes": _capture_notes(dropped, max_entries, notes),
    }
    meta.update(metadata or {})
    return {"segments": segments, "device_traces": [trace], META_KEY: plain_data(meta)}


def _newest_entries(cpu: list[_tp.ProfilerAllocation], max_entries: int) -> tuple[list[_tp.ProfilerAllocation], int]:
    """The newest events that fit in ``max_entries`` trace entries (a free is two), and how many entries were dropped."""
    total = sum(1 if e.nbytes > 0 else 2 for e in cpu)
    first, kept_count = 0, total
    while kept_count > max_entries and first < len(cpu):
        kept_count -= 1 if cpu[first].nbytes > 0 else 2
        first += 1
    return cpu[first:], total - kept_count


class _StackTable:
    """Frame dicts shared between entries with the same op and stack (a capture repeats a few stacks many times)."""

    def __init__(self) -> None:
        self._frames: dict[tuple[str, int, str], dict[str, Any]] = {}
        self._stacks: dict[tuple[str, tuple[tuple[str, int, str], ...]], list[dict[str, Any]]] = {}

    def __call__(self, e: _tp.ProfilerAllocation) -> list[dict[str, Any]]:
        key = (e.op, e.frames)
        frames = self._stacks.get(key)
        if frames is None:
            raw = (((OP_FILENAME, 0, e.op),) if e.op else ()) + e.frames
            frames = []
            for f in raw:
                d = self._frames.get(f)
                if d is None:
                    d = self._frames[f] = {"filename": str(f[0]), "line": int(f[1]), "name": str(f[2])}
                frames.append(d)
            self._stacks[key] = frames
        return frames


def _trace_entries(kept: list[_tp.ProfilerAllocation], frames_of: _StackTable) -> tuple[list[dict[str, Any]], list[int]]:
    """One ``alloc`` per allocation, ``free_requested`` + ``free_completed`` per free; and each entry's time in ns."""
    trace: list[dict[str, Any]] = []
    times: list[int] = []
    for e in kept:
        t_us = e.time_ns // 1000
        frames = frames_of(e)
        if e.nbytes > 0:
            trace.append({"action": "alloc", "addr": e.ptr, "size": e.nbytes, "stream": 0, "time_us": t_us, "frames": frames})
            times.append(e.time_ns)
        else:
            for action in ("free_requested", "free_completed"):
                trace.append({"action": action, "addr": e.ptr, "size": -e.nbytes, "stream": 0, "time_us": t_us, "frames": frames})
                times.append(e.time_ns)
    return trace, times


def _alive_blocks(
    live: dict[int, _tp.ProfilerAllocation], holders: dict[int, dict[str, Any]], frames_of: _StackTable,
) -> list[_Block]:
    """What is alive at the end: the trace's live allocations, then census tensors older than the capture."""
    blocks = [(e.ptr, e.nbytes, frames_of(e)) for e in live.values()]
    known = set(live)
    for addr, info in holders.items():
        if addr not in known and info.get("nbytes", 0) > 0:
            blocks.append((addr, int(info["nbytes"]), []))
    blocks.sort(key=lambda b: b[0])
    alive: list[_Block] = []
    for b in blocks:
        if alive and b[0] < alive[-1][0] + alive[-1][1]:
            continue  # overlapping storages (views of foreign memory): keep the first
        alive.append(b)
    return alive


def _capture_notes(dropped: int, max_entries: int, notes: Sequence[str]) -> list[str]:
    return [
        "CPU capture: segments are synthetic address ranges around the captured allocations, not allocator "
        "reservations ('reserved' means nothing here).",
        "Tensors allocated before the capture appear only when the census found them alive at the end; "
        "their frees are not reported by the profiler.",
        *([f"bounded: the oldest {dropped} trace entries were dropped (max_entries={max_entries})."] if dropped else []),
        *notes,
    ]


def _address_ranges(intervals: list[tuple[int, int]]) -> list[list[int]]:
    """``[start, end]`` ranges covering every interval; intervals closer than ``_SEGMENT_GAP`` share one."""
    ranges: list[list[int]] = []
    for start, size in sorted(intervals):
        end = start + max(int(size), 1)
        if ranges and start <= ranges[-1][1] + _SEGMENT_GAP:
            ranges[-1][1] = max(ranges[-1][1], end)
        else:
            ranges.append([start, end])
    return ranges


def _synthetic_segments(intervals: list[tuple[int, int]], alive: list[_Block]) -> list[dict[str, Any]]:
    """Address ranges covering every interval, with the alive blocks inside and inactive gaps between them."""
    segments = []
    i = 0
    for start, end in _address_ranges(intervals):
        blocks: list[dict[str, Any]] = []
        cursor = start
        while i < len(alive) and alive[i][0] < end:
            addr, size, frames = alive[i]
            if addr > cursor:
                blocks.append({"address": cursor, "size": addr - cursor, "requested_size": 0, "state": "inactive", "frames": []})
            blocks.append({"address": addr, "size": size, "requested_size": size, "state": "active_allocated", "frames": frames})
            cursor = addr + size
            i += 1
        if cursor < end:
            blocks.append({"address": cursor, "size": end - cursor, "requested_size": 0, "state": "inactive", "frames": []})
        active = sum(b["size"] for b in blocks if b["state"] == "active_allocated")
        segments.append({
            "device": 0,
            "address": start,
            "total_size": end - start,
            "allocated_size": active,
            "active_size": active,
            "requested_size": active,
            "stream": 0,
            "segment_type": "large" if end - start > _SEGMENT_GAP else "small",
            "segment_pool_id": (0, 0),
            "is_expandable": False,
            "frames": [],
            "blocks": blocks,
        })
    return segments
