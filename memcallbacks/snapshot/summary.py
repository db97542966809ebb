"""Summarise a snapshot: the allocated curve, the peak and what was live, what stayed, OOMs."""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any, Iterable, Iterator

import numpy as np

from memcallbacks.snapshot.files import NOT_A_SNAPSHOT, META_KEY, SnapshotError, validate_snapshot
from memcallbacks.snapshot.sites import Allocation, SiteTotal, group_by_site

__all__ = ["DeviceSummary", "SnapshotSummary", "summarize_snapshot"]


@dataclass
class DeviceSummary:
    """What one device's trace and segments say."""

    device: int
    entries: int
    allocs: int
    frees: int
    segments: int
    reserved_end: int | None
    """Sum of segment sizes at the end; ``None`` for a CPU capture's synthetic segments."""
    baseline: int
    """Bytes allocated before the first trace entry (as far as the snapshot knows)."""
    allocated: Any = field(repr=False)
    """numpy int64, length ``entries + 1``: bytes allocated after ``k`` entries (``[0]`` is the baseline)."""
    reserved: Any = field(repr=False)
    """Same for reserved bytes when the trace has segment events, else ``None``."""
    peak: int
    peak_at: int
    """Entry count at the peak (``0``: before the first entry; ``entries``: at the end)."""
    end: int
    largest_at_peak: list[Allocation]
    sites_at_peak: list[SiteTotal]
    window: tuple[int, int]
    window_labels: tuple[str, str]
    stayed_alive: list[SiteTotal]
    stayed_alive_bytes: int
    stayed_alive_count: int
    marks: list[tuple[int, str]]
    trigger: tuple[int, str] | None
    ooms: list[tuple[int, int, int | None]]
    """``(entry, requested bytes, device free bytes)`` for each ``oom`` entry."""
    time_us: tuple[int, int] | None
    """First and last ``time_us`` of the trace, when recorded."""


@dataclass
class SnapshotSummary:
    """:func:`summarize_snapshot`'s result."""

    source: str
    kind: str
    devices: list[DeviceSummary]
    metadata: dict[str, Any]
    notes: list[str]


_KINDS = {"cpu_profiler": "CPU capture (memcallbacks, torch.profiler)", "cuda_allocator": "CUDA allocator snapshot (memcallbacks)"}


def summarize_snapshot(
    snapshot: dict[str, Any],
    *,
    source: str = "",
    window: tuple[int, int] | None = None,
    trigger: int | None = None,
    top: int = 10,
    device: int | None = None,
) -> SnapshotSummary:
    """Peak, what was live at the peak (by allocation and by site), what stayed alive, per device.

    ``window``: ``(start, end)`` entry counts; allocations made between them and still alive at
    ``end`` are "allocated but not freed". Default: from the second step mark to the last (the
    first step warms up optimizer state) when the snapshot has marks, else from a third of the
    trace to its end. ``trigger``: an entry count to mark (default: the snapshot's own trigger,
    else its last ``oom`` entry).
    """
    snapshot = validate_snapshot(snapshot, source or "snapshot")
    meta = snapshot.get(META_KEY) if isinstance(snapshot.get(META_KEY), dict) else {}
    kind = _KINDS.get(str(meta.get("kind")), "allocator snapshot (torch.cuda.memory._snapshot)")
    devices = _devices(snapshot) if device is None else [device]
    notes = [str(n) for n in meta.get("notes", [])]
    try:
        summaries = [_summarize_device(snapshot, d, meta, window, trigger, top) for d in devices]
    except (KeyError, TypeError, AttributeError) as exc:  # a hand-made or damaged file
        raise SnapshotError(f"{source or 'snapshot'} {NOT_A_SNAPSHOT}; an entry is malformed: "
                            f"{type(exc).__name__}: {exc})") from exc
    return SnapshotSummary(source=source, kind=kind, devices=summaries, metadata=meta, notes=notes)


# ----------------------------------------------------------------------------------------------
# One device: the trace is read in three passes (live set at the end, the curves, the replay)
# ----------------------------------------------------------------------------------------------


@dataclass
class _Trace:
    """One device's trace entries with their actions, and which action frees a block."""

    entries: list[dict[str, Any]]
    actions: list[Any]
    free_action: str

    @classmethod
    def of(cls, entries: list[dict[str, Any]]) -> _Trace:
        actions = [e.get("action") for e in entries]
        return cls(entries, actions, "free_completed" if "free_completed" in actions else "free_requested")

    def __len__(self) -> int:
        return len(self.entries)


class _Clock:
    """Maps a ``time_us`` to an entry count (the entry count at the end when the trace has no times)."""

    def __init__(self, trace: _Trace) -> None:
        self.n = len(trace)
        times = [e.get("time_us") for e in trace.entries]
        has_times = self.n > 0 and all(isinstance(t, (int, float)) for t in times)
        self.sorted = np.maximum.accumulate(np.asarray(times, dtype=np.float64)) if has_times else None
        self.span = (int(times[0]), int(times[-1])) if has_times else None

    def index(self, t_us: float) -> int:
        return int(np.searchsorted(self.sorted, t_us, side="right")) if self.sorted is not None else self.n


@dataclass
class _Curves:
    allocated: Any
    reserved: Any
    reserved_end: int | None
    peak: int
    peak_at: int
    allocs: int
    frees: int
    ooms: list[tuple[int, int, int | None]]


def _summarize_device(
    snapshot: dict[str, Any], device: int, meta: dict[str, Any], window: tuple[int, int] | None, trigger: int | None, top: int,
) -> DeviceSummary:
    traces = snapshot["device_traces"]
    trace = _Trace.of(traces[device] if device < len(traces) else [])
    segments = [s for s in snapshot["segments"] if int(s.get("device", 0) or 0) == device]
    holders_raw = meta.get("holders") or {}
    holders = {int(k): v for k, v in holders_raw.items()} if isinstance(holders_raw, dict) else {}
    n = len(trace)
    live_end, freed_before = _live_at_end(trace)
    initial, end_blocks = _start_state(trace, segments, live_end, freed_before, holders)
    baseline = sum(a.size for a in initial.values())
    curves = _curves(trace, segments, baseline, end_blocks, synthetic=bool(meta.get("synthetic_segments")))
    clock = _Clock(trace)
    marks = _marks(meta, device, clock)
    window, labels = _window(window, marks, n)
    at_peak, stayed_list = _replay(trace, initial, live_end, holders, curves.peak_at, window)
    if not n:
        at_peak = end_blocks
    at_peak.sort(key=lambda a: -a.size)
    stayed_list.sort(key=lambda a: -a.size)
    return DeviceSummary(
        device=device,
        entries=n,
        allocs=curves.allocs,
        frees=curves.frees,
        segments=len(segments),
        reserved_end=curves.reserved_end,
        baseline=baseline,
        allocated=curves.allocated,
        reserved=curves.reserved,
        peak=curves.peak,
        peak_at=curves.peak_at,
        end=int(curves.allocated[-1]),
        largest_at_peak=at_peak[:top],
        sites_at_peak=group_by_site(at_peak, top),
        window=window,
        window_labels=labels,
        stayed_alive=group_by_site(stayed_list, top),
        stayed_alive_bytes=sum(a.size for a in stayed_list),
        stayed_alive_count=len(stayed_list),
        marks=marks,
        trigger=_trigger_at(trigger, meta, curves.ooms, clock),
        ooms=curves.ooms,
        time_us=clock.span,
    )


def _live_at_end(trace: _Trace) -> tuple[dict[int, int], list[int]]:
    """Pass 1: the ``alloc`` entry of each block live at the end, by address; the frees whose alloc is not in the trace."""
    live_end: dict[int, int] = {}
    freed_before: list[int] = []
    for i, e in enumerate(trace.entries):
        a = trace.actions[i]
        if a == "alloc":
            live_end[e["addr"]] = i
        elif a == trace.free_action and live_end.pop(e.get("addr"), None) is None:
            freed_before.append(i)
    return live_end, freed_before


def _start_state(
    trace: _Trace, segments: list[dict[str, Any]], live_end: dict[int, int], freed_before: list[int], holders: dict[int, Any],
) -> tuple[dict[int, Allocation], list[Allocation]]:
    """What was allocated before the first entry (by address), and every block active at the end."""
    initial: dict[int, Allocation] = {}
    end_blocks: list[Allocation] = []
    for seg in segments:
        for addr, b in _blocks(seg):
            if str(b.get("state", "")).startswith("active"):
                alloc = Allocation(addr, _block_requested(b), tuple(_block_frames(b)), live_end.get(addr), holder=holders.get(addr))
                end_blocks.append(alloc)
                if addr not in live_end:
                    initial[addr] = alloc
    for i in freed_before:
        e = trace.entries[i]
        initial.setdefault(e["addr"], Allocation(e["addr"], int(e.get("size", 0)), tuple(e.get("frames") or ()), None, freed_only=True))
    return initial, end_blocks


def _curves(trace: _Trace, segments: list[dict[str, Any]], baseline: int, end_blocks: list[Allocation], *, synthetic: bool) -> _Curves:
    """Pass 2: bytes allocated (and reserved, with segment events) after each entry, the peak, the OOMs."""
    n = len(trace)
    delta = np.zeros(n + 1, dtype=np.int64)
    seg_delta = np.zeros(n + 1, dtype=np.int64)
    has_segment_events = False
    allocs = frees = 0
    ooms: list[tuple[int, int, int | None]] = []
    for i, e in enumerate(trace.entries):
        a = trace.actions[i]
        if a == "alloc":
            delta[i + 1] = int(e.get("size", 0))
            allocs += 1
        elif a == trace.free_action:
            delta[i + 1] = -int(e.get("size", 0))
            frees += 1
        elif a in ("segment_alloc", "segment_map"):
            seg_delta[i + 1] = int(e.get("size", 0))
            has_segment_events = True
        elif a in ("segment_free", "segment_unmap"):
            seg_delta[i + 1] = -int(e.get("size", 0))
            has_segment_events = True
        elif a == "oom":
            ooms.append((i, int(e.get("size", 0)), e.get("device_free")))
    delta[0] = baseline
    allocated = np.cumsum(delta)
    reserved_end = None if synthetic else sum(int(s.get("total_size", 0)) for s in segments)
    reserved = None
    if has_segment_events and reserved_end is not None:
        cum = np.cumsum(seg_delta)
        reserved = reserved_end - cum[-1] + cum
    if n:
        peak_at = int(np.argmax(allocated))
        peak = int(allocated[peak_at])
    else:
        peak_at, peak = 0, sum(a.size for a in end_blocks)
        allocated = np.array([peak], dtype=np.int64)
    return _Curves(allocated, reserved, reserved_end, peak, peak_at, allocs, frees, ooms)


def _marks(meta: dict[str, Any], device: int, clock: _Clock) -> list[tuple[int, str]]:
    """Step marks as ``(entry count, label)``: by their index on this device, else by their time."""
    marks: list[tuple[int, str]] = []
    for m in meta.get("marks") or []:
        if not isinstance(m, dict):
            continue
        if m.get("index") is not None and int(m.get("device", device) or 0) == device:
            marks.append((min(int(m["index"]), clock.n), str(m.get("label", ""))))
        elif m.get("time_us") is not None and clock.sorted is not None:
            marks.append((clock.index(float(m["time_us"])), str(m.get("label", ""))))
    marks.sort(key=lambda m: m[0])
    return marks


def _window(window: tuple[int, int] | None, marks: list[tuple[int, str]], n: int) -> tuple[tuple[int, int], tuple[str, str]]:
    """The "allocated but not freed" window and its labels: the one given, else from the marks, else the last two thirds."""
    if window is not None:
        window = (max(0, min(int(window[0]), n)), max(0, min(int(window[1]), n)))
        return window, (f"entry {window[0]}", f"entry {window[1]}")
    if len(marks) >= 3:
        (s, sl), (e, el) = marks[1], marks[-1]
    elif len(marks) == 2:
        (s, sl), (e, el) = marks[0], marks[1]
    else:
        s, sl, e, el = n // 3, "a third into the trace", n, "the end"
    return (s, e), (f"{sl} (entry {s})", f"{el} (entry {e})")


def _trigger_at(trigger: int | None, meta: dict[str, Any], ooms: list[tuple[int, int, int | None]], clock: _Clock) -> tuple[int, str] | None:
    """The entry to mark: the one given, else the snapshot's own trigger, else its last OOM."""
    n = clock.n
    if trigger is not None:
        return (max(0, min(int(trigger), n)), "trigger")
    if isinstance(meta.get("trigger"), dict):
        t = meta["trigger"]
        reason = str(t.get("reason") or "trigger")
        if t.get("index") is not None:
            return (min(int(t["index"]), n), reason)
        if t.get("time_us") is not None:
            return (clock.index(float(t["time_us"])), reason)
        return None
    if ooms:
        return (ooms[-1][0], "out of memory")
    return None


def _replay(
    trace: _Trace, initial: dict[int, Allocation], live_end: dict[int, int], holders: dict[int, Any], peak_at: int, window: tuple[int, int],
) -> tuple[list[Allocation], list[Allocation]]:
    """Pass 3: the live set at the peak, and what the window allocated that is still alive at its end."""
    n = len(trace)
    live = dict(initial)
    pending: set[int] = set()

    def state(allocs: Iterable[Allocation]) -> list[Allocation]:
        return [replace(a, pending_free=True) if a.addr in pending else a for a in allocs]

    w0, w1 = window
    at_peak = state(live.values()) if peak_at == 0 else []
    stayed: dict[int, Allocation] = {}
    stayed_list: list[Allocation] = []
    for i in range(max(peak_at, w1) if n else 0):
        e = trace.entries[i]
        a = trace.actions[i]
        if a == "alloc":
            addr = e["addr"]
            alloc = Allocation(addr, int(e.get("size", 0)), tuple(e.get("frames") or ()), i,
                               holder=holders.get(addr) if i == live_end.get(addr) else None)
            live[addr] = alloc
            pending.discard(addr)
            if w0 <= i < w1:
                stayed[addr] = alloc
        elif a == trace.free_action:
            live.pop(e.get("addr"), None)
            stayed.pop(e.get("addr"), None)
            pending.discard(e.get("addr"))
        elif a == "free_requested":
            pending.add(e.get("addr"))
        if i + 1 == peak_at:
            at_peak = state(live.values())
        if i + 1 == w1:
            stayed_list = state(stayed.values())
    return at_peak, stayed_list


def _blocks(segment: dict[str, Any]) -> Iterator[tuple[int, dict[str, Any]]]:
    """``(address, block)``; addresses computed as memory_viz does when old snapshots lack them."""
    addr = int(segment.get("address", 0) or 0)
    for b in segment.get("blocks", []):
        yield int(b.get("address", addr)), b
        addr += int(b.get("size", 0))


def _block_frames(b: dict[str, Any]) -> list[dict[str, Any]]:
    if "frames" in b:
        return b["frames"] or []
    history = b.get("history") or []
    return (history[0].get("frames") or []) if history else []


def _block_requested(b: dict[str, Any]) -> int:
    if "requested_size" in b:
        return int(b["requested_size"])
    history = b.get("history") or []
    if history and "real_size" in history[0]:
        return int(history[0]["real_size"])
    return int(b.get("size", 0))


def _devices(snapshot: dict[str, Any]) -> list[int]:
    found = {i for i, t in enumerate(snapshot["device_traces"]) if t}
    found |= {int(s.get("device", 0) or 0) for s in snapshot["segments"]}
    return sorted(found)
