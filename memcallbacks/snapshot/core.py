"""Memory snapshots: record them (CUDA history, CPU profiler), read them, summarise them, render them offline.

A snapshot is the plain dict ``torch.cuda.memory._snapshot()`` returns, pickled with protocol 4
so pytorch.org/memory_viz loads it: ``segments`` (the allocator's state at the end, blocks with
their Python frames) and ``device_traces`` (one list of trace entries per device: ``alloc``,
``free_requested``, ``free_completed``, ``segment_alloc``, ``segment_free``, ``oom``, ...).
memcallbacks adds one top-level key, ``"memcallbacks"``, with its own metadata (step marks, the
trigger, what a bounded capture dropped); memory_viz ignores it.

Building blocks, for the monitor and for people:

* CUDA: :func:`start_recording`, :func:`dump_snapshot` (or :func:`dump_on_oom`), :func:`stop_recording`;
* CPU: :class:`CpuCapture` profiles the next steps with ``torch.profiler`` and converts the
  allocator events into the same format (plus a census of who holds what, as JSON);
* any snapshot: :func:`load_snapshot`, :func:`summarize_snapshot`, :func:`format_summary`,
  :func:`render_snapshot` (one self-contained HTML file and a PNG, no network needed).
"""

from __future__ import annotations

import base64
import bisect
import html
import io
import logging
import os
import pickle
import re
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator, Sequence

import numpy as np
import torch

from memcallbacks._runtime import torch_private as _tp
from memcallbacks._units import GiB, MiB, format_bytes
from memcallbacks._runtime.outputs import atomic_write, write_json

log = logging.getLogger(__name__)

__all__ = [
    "SNAPSHOT_PROTOCOL",
    "META_KEY",
    "SNAPSHOT_FILE",
    "CPU_SNAPSHOT_FILE",
    "OOM_SNAPSHOT_FILE",
    "snapshot_file_name",
    "SnapshotError",
    "EmptySnapshotError",
    "SnapshotTooLarge",
    "start_recording",
    "stop_recording",
    "is_recording",
    "dump_snapshot",
    "dump_on_oom",
    "time_mark",
    "CpuCapture",
    "cpu_events_to_snapshot",
    "write_snapshot",
    "snapshot_size",
    "load_snapshot",
    "validate_snapshot",
    "Allocation",
    "SiteTotal",
    "DeviceSummary",
    "SnapshotSummary",
    "summarize_snapshot",
    "format_summary",
    "render_snapshot",
]

SNAPSHOT_PROTOCOL = 4
"""Pickle protocol of every snapshot written: the one memory_viz's JavaScript unpickler reads."""

META_KEY = "memcallbacks"
"""Top-level key of memcallbacks' metadata in a snapshot dict (memory_viz ignores unknown keys)."""

SNAPSHOT_FILE = "memory_snapshot_step{step}{tag}.pickle"
CPU_SNAPSHOT_FILE = "memory_snapshot_cpu_step{step}{tag}.pickle"
OOM_SNAPSHOT_FILE = "memory_snapshot_oom_step{step}{tag}.pickle"

DEFAULT_MAX_ENTRIES = 100_000
"""Trace entries kept by default (CUDA ring buffer and CPU capture alike): a few hundred MB at most."""

_MARKER = "memcallbacks::step_boundary"
_OP_FILENAME = "<torch op>"
"""Filename of the pseudo-frame naming the torch op in CPU captures (memory_viz shows it as a frame)."""
_SEGMENT_GAP = 1 << 20
"""CPU captures: allocations closer than this share one synthetic segment."""

_FREE_ACTIONS = ("free_completed", "free_requested")


def snapshot_file_name(template: str, step: int | None, *, rank: int = 0, world_size: int = 1) -> str:
    """``snapshot_file_name(SNAPSHOT_FILE, 12)`` -> ``"memory_snapshot_step12.pickle"`` (``.rank{r}`` when distributed)."""
    tag = "" if world_size <= 1 else f".rank{rank}"
    return template.format(step="" if step is None else step, tag=tag)


class SnapshotError(ValueError):
    """A file or object that is not a usable memory snapshot; the message says why and what to do."""


class EmptySnapshotError(SnapshotError):
    """A snapshot with no segments and no trace entries: nothing was recorded."""


class SnapshotTooLarge(RuntimeError):
    """Writing a snapshot would exceed the byte budget; nothing was written."""


# ----------------------------------------------------------------------------------------------
# CUDA: allocator history
# ----------------------------------------------------------------------------------------------


def start_recording(max_entries: int = DEFAULT_MAX_ENTRIES, stacks: str = "python") -> None:
    """Record the CUDA allocator's history: live blocks with their stacks, and the last ``max_entries`` events.

    ``stacks="python"`` (default) records Python frames only; ``"all"`` adds C++ frames, whose
    symbolisation makes every dump slow. Raises ``RuntimeError`` without CUDA (use
    :class:`CpuCapture` there). Stop with :func:`stop_recording` after the last dump.
    """
    if not isinstance(max_entries, int) or max_entries <= 0:
        raise ValueError(f"start_recording(max_entries={max_entries!r}) must be a positive int; try {DEFAULT_MAX_ENTRIES}.")
    if stacks not in ("python", "all"):
        raise ValueError(f"start_recording(stacks={stacks!r}) must be 'python' or 'all'; 'python' is the fast one.")
    if not torch.cuda.is_available():
        raise RuntimeError("start_recording() needs CUDA: the allocator history is a CUDA caching allocator feature. "
                           "On CPU, capture steps with memcallbacks' CpuCapture instead.")
    _tp.cuda_record_memory_history(max_entries, stacks)


def stop_recording() -> None:
    """Stop recording the CUDA allocator's history; safe to call twice and without CUDA.

    Dump before stopping: a snapshot taken after this holds no trace.
    """
    try:
        _tp.cuda_stop_memory_history()
    except Exception:
        log.exception("memcallbacks: could not stop the CUDA allocator history")


def is_recording() -> bool:
    """Whether the CUDA allocator is recording history now."""
    return _tp.cuda_memory_history_enabled()


def time_mark(label: str) -> dict[str, Any]:
    """``{"label": label, "time_us": now}``: a step mark for :func:`dump_snapshot`, on the clock of the trace's ``time_us``."""
    return {"label": str(label), "time_us": time.time_ns() // 1000}


def dump_snapshot(
    path: str | os.PathLike[str],
    *,
    max_bytes: int | None = None,
    marks: Sequence[dict[str, Any]] = (),
    trigger: str | dict[str, Any] | None = None,
    metadata: dict[str, Any] | None = None,
) -> Path:
    """Write the CUDA allocator's snapshot to ``path``: pickle protocol 4, atomically, within ``max_bytes``.

    ``marks``: step boundaries from :func:`time_mark`, drawn on the rendered curve and used as the
    default "allocated but not freed" window. ``trigger``: why this dump happened (a reason
    string, marked at the dump's time, or ``{"reason": ..., "time_us": ...}``). Raises
    :class:`SnapshotTooLarge` (and writes nothing) past ``max_bytes``.
    """
    snapshot = _tp.cuda_memory_snapshot()
    meta: dict[str, Any] = {
        "format": 1,
        "kind": "cuda_allocator",
        "source": "torch.cuda.memory._snapshot()",
        "torch": torch.__version__,
        "created_unix_s": time.time(),
        "marks": [dict(m) for m in marks],
        "trigger": _trigger_dict(trigger),
    }
    meta.update(metadata or {})
    snapshot[META_KEY] = _plain(meta)
    return write_snapshot(snapshot, path, max_bytes=max_bytes)


def dump_on_oom(
    path: str | os.PathLike[str] | Callable[[], str | os.PathLike[str]],
    *,
    max_bytes: int | None = None,
    once: bool = True,
    marks: Callable[[], Sequence[dict[str, Any]]] | None = None,
) -> Callable[[], None]:
    """Dump a snapshot when the CUDA allocator runs out of memory; returns ``detach()`` (safe to call twice).

    The dump happens inside the failing allocation, before ``torch.OutOfMemoryError`` reaches the
    training code, so the snapshot shows the state that failed (the trace ends with its ``oom``
    entry). ``path`` may be a callable giving the path then (e.g. with the step in it); ``marks``
    a callable giving the step marks so far. ``once``: detach after the first dump, so a loop that
    catches OOMs and retries does not dump each time. A failed dump is logged, never raised.
    """
    detach: Callable[[], None] = lambda: None  # noqa: E731

    def observer(device: int, requested: int, device_allocated: int, device_free: int) -> None:
        if once:
            detach()
        target = path() if callable(path) else path
        reason = (f"out of memory on cuda:{device}: {format_bytes(requested)} requested, "
                  f"{format_bytes(device_allocated)} allocated, {format_bytes(device_free)} free")
        try:
            dump_snapshot(target, max_bytes=max_bytes, trigger=reason, marks=marks() if marks else ())
            log.warning("memcallbacks: %s; memory snapshot written to %s", reason, target)
        except Exception:
            log.exception("memcallbacks: could not write the out-of-memory snapshot to %s", target)

    detach = _tp.cuda_attach_oom_observer(observer)
    return detach


def _trigger_dict(trigger: str | dict[str, Any] | None) -> dict[str, Any] | None:
    if trigger is None:
        return None
    if isinstance(trigger, str):
        return {"reason": trigger, "time_us": time.time_ns() // 1000}
    return dict(trigger)


# ----------------------------------------------------------------------------------------------
# Writing and reading
# ----------------------------------------------------------------------------------------------


def _plain(value: Any) -> Any:
    """Only types memory_viz's unpickler reads: dict, list, tuple, str, int, float, bool, None."""
    if value is None or type(value) in (bool, str, int, float):
        return value
    if isinstance(value, bool):
        return bool(value)
    if isinstance(value, str):  # e.g. torch.__version__, a str subclass that would pickle as a class
        return str(value)
    if isinstance(value, int):
        return int(value)
    if isinstance(value, float):
        return float(value)
    if isinstance(value, dict):
        return {(k if isinstance(k, (int, str)) else str(k)): _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    if isinstance(value, Path):
        return str(value)
    try:  # numpy / torch scalars
        item = value.item()
        if isinstance(item, (int, float, bool)):
            return item
    except Exception:
        pass
    return str(value)


class _BudgetWriter:
    def __init__(self, fh: Any, max_bytes: int | None, path: Path) -> None:
        self.fh, self.max_bytes, self.path, self.written = fh, max_bytes, path, 0

    def write(self, data: bytes) -> int:
        self.written += len(data)
        if self.max_bytes is not None and self.written > self.max_bytes:
            raise SnapshotTooLarge(
                f"snapshot for {str(self.path)!r} is larger than max_bytes={self.max_bytes} "
                f"({format_bytes(self.max_bytes)}); nothing was written. Raise the snapshot byte budget "
                f"or record fewer entries (max_entries)."
            )
        return self.fh.write(data)


def write_snapshot(snapshot: dict[str, Any], path: str | os.PathLike[str], *, max_bytes: int | None = None) -> Path:
    """Pickle ``snapshot`` to ``path`` with protocol 4, atomically; raise :class:`SnapshotTooLarge` past ``max_bytes``."""
    path = Path(path)
    if max_bytes is not None and max_bytes <= 0:
        raise SnapshotTooLarge(f"no snapshot byte budget left for {str(path)!r} (max_bytes={max_bytes}); nothing was written.")
    return atomic_write(path, lambda fh: pickle.dump(snapshot, _BudgetWriter(fh, max_bytes, path), protocol=SNAPSHOT_PROTOCOL), mode="wb")


def snapshot_size(path: str | os.PathLike[str]) -> int:
    """Bytes a written snapshot takes on disk (0 when it does not exist): what a per-run budget counts."""
    try:
        return os.path.getsize(path)
    except OSError:
        return 0


class _PlainUnpickler(pickle.Unpickler):
    """Snapshots hold plain data only; refusing classes keeps ``pickle.load`` from running code."""

    def find_class(self, module: str, name: str) -> Any:
        raise pickle.UnpicklingError(f"it holds a Python object ({module}.{name}), and snapshots hold plain data only")


_NOT_A_SNAPSHOT = "is not a memory snapshot (expected a dict with 'segments' and 'device_traces', as written by torch.cuda.memory._dump_snapshot() or memcallbacks"


def load_snapshot(path: str | os.PathLike[str]) -> dict[str, Any]:
    """Read and check a snapshot pickle; raises ``FileNotFoundError`` or :class:`SnapshotError` with a clear message.

    Reads only plain data (no classes are unpickled), so opening a file is safe.
    """
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"no such file: {path}")
    if path.is_dir():
        raise SnapshotError(f"{path} is a folder, not a snapshot file; pass the .pickle inside it.")
    try:
        with open(path, "rb") as fh:
            data = _PlainUnpickler(fh).load()
    except Exception as exc:  # any unpickling failure means the same thing to the user
        reason = str(exc) or type(exc).__name__
        raise SnapshotError(f"{path} {_NOT_A_SNAPSHOT}; it could not be read as a plain pickle: {reason})") from None
    return validate_snapshot(data, source=str(path))


def validate_snapshot(data: Any, source: str = "snapshot") -> dict[str, Any]:
    """Check the structure and fill keys older torch versions omit; return the snapshot dict.

    Accepts a list of segments (``torch.cuda.memory_snapshot()``) as a snapshot without traces.
    """
    if isinstance(data, list) and data and all(isinstance(s, dict) and "blocks" in s for s in data):
        data = {"segments": data, "device_traces": []}
    if not isinstance(data, dict) or not ({"segments", "device_traces"} & set(data)):
        got = f"a dict with keys {sorted(map(str, data))[:6]}" if isinstance(data, dict) else f"a {type(data).__name__}"
        raise SnapshotError(f"{source} {_NOT_A_SNAPSHOT}; got {got})")
    data.setdefault("segments", [])
    data.setdefault("device_traces", [])
    segments, traces = data["segments"], data["device_traces"]
    if not isinstance(segments, list) or not all(isinstance(s, dict) and isinstance(s.get("blocks", []), list) for s in segments):
        raise SnapshotError(f"{source} {_NOT_A_SNAPSHOT}; its 'segments' is not a list of segment dicts)")
    if not isinstance(traces, list) or not all(isinstance(t, list) for t in traces):
        raise SnapshotError(f"{source} {_NOT_A_SNAPSHOT}; its 'device_traces' is not a list of per-device lists)")
    for trace in traces:
        if trace and not (isinstance(trace[0], dict) and "action" in trace[0]):
            raise SnapshotError(f"{source} {_NOT_A_SNAPSHOT}; its trace entries have no 'action')")
    if not segments and not any(traces):
        raise EmptySnapshotError(
            f"{source} is an empty memory snapshot: no segments and no trace entries, so nothing was recorded. "
            f"On CUDA, turn history on before the steps you want to see (torch.cuda.memory._record_memory_history"
            f"(max_entries=100000), or memcallbacks' start_recording()) and dump after them; on CPU, capture steps "
            f"with memcallbacks' CpuCapture. See docs/snapshots.md."
        )
    return data


# ----------------------------------------------------------------------------------------------
# CPU: capture steps with torch.profiler and convert them to the snapshot format
# ----------------------------------------------------------------------------------------------


class CpuCapture:
    """Profile the next ``steps`` training steps on CPU and keep them as a memory snapshot.

    There is no allocator history on CPU, so this runs ``torch.profiler`` (``profile_memory=True``,
    shapes, Python stacks) from :meth:`start` to the ``steps``-th :meth:`step` and converts its
    allocation events into the format memory_viz reads: alloc / free trace entries with Python
    frames, and segments holding what is alive at the end. When the capture finishes it also
    takes a census of live tensors (who holds what) and annotates the live blocks with it.

    Drive it at step boundaries::

        capture = CpuCapture(steps=3, out_dir="mem")
        capture.start(step=step)
        ...                      # after each training step:
        if capture.step():       # True when the capture just finished
            paths = capture.write()  # pickle, census JSON, HTML and PNG

    Bounded: at most ``max_entries`` trace entries are kept (the oldest are dropped and the
    snapshot's metadata says how many). The profiler slows the captured steps down (Python stack
    tracing); nothing is profiled outside them. Only one profiler can run at a time:
    :meth:`start` raises ``RuntimeError`` when another one is active.
    """

    def __init__(
        self,
        steps: int = 3,
        out_dir: str | os.PathLike[str] | None = None,
        *,
        max_entries: int = DEFAULT_MAX_ENTRIES,
        with_stack: bool = True,
        record_shapes: bool = True,
        census: bool = True,
        census_time_budget_s: float = 2.0,
        file_name: str = CPU_SNAPSHOT_FILE,
        rank: int = 0,
        world_size: int = 1,
    ) -> None:
        if not isinstance(steps, int) or steps <= 0:
            raise ValueError(f"CpuCapture(steps={steps!r}) must be a positive int; 3 shows a pattern across steps.")
        if not isinstance(max_entries, int) or max_entries <= 0:
            raise ValueError(f"CpuCapture(max_entries={max_entries!r}) must be a positive int; try {DEFAULT_MAX_ENTRIES}.")
        self.steps = steps
        self.out_dir = Path(out_dir) if out_dir is not None else None
        self.max_entries = max_entries
        self.with_stack = with_stack
        self.record_shapes = record_shapes
        self.census_enabled = census
        self.census_time_budget_s = census_time_budget_s
        self.file_name = file_name
        self.rank, self.world_size = rank, world_size
        self.snapshot: dict[str, Any] | None = None
        """The converted snapshot once :attr:`finished`."""
        self.census: Any = None
        """The :class:`memcallbacks.leaks.Census` taken at the end, when enabled and it succeeded."""
        self._prof: Any = None
        self._labels: list[str] = []
        self._first_step: int | None = None
        self._steps_done = 0
        self._trigger: dict[str, Any] | None = None

    @property
    def active(self) -> bool:
        """True between :meth:`start` and the end of the capture."""
        return self._prof is not None

    @property
    def finished(self) -> bool:
        """True once the capture stopped and :attr:`snapshot` holds its result."""
        return self.snapshot is not None

    def start(self, step: int | None = None, *, reason: str | None = None) -> None:
        """Start profiling now (a step boundary); ``step`` is the number of the next step, ``reason`` the trigger."""
        if self._prof is not None:
            raise RuntimeError("CpuCapture.start(): this capture is already running; create a new CpuCapture for another one.")
        from torch.profiler import ProfilerActivity, profile

        if _tp.profiler_enabled():
            raise RuntimeError("CpuCapture.start(): another torch.profiler is running; starting a second one would take its "
                               "events away. Stop it first, or skip this capture.")
        prof = profile(
            activities=[ProfilerActivity.CPU],
            profile_memory=True,
            record_shapes=self.record_shapes,
            with_stack=self.with_stack,
        )
        try:
            prof.start()
        except RuntimeError as exc:
            raise RuntimeError(f"CpuCapture.start(): the profiler would not start ({exc}); is another torch.profiler running?") from exc
        self._prof = prof
        self.snapshot, self.census = None, None
        self._first_step = step
        self._steps_done = 0
        self._labels = []
        self._trigger = {"reason": reason, "time_us": time.time_ns() // 1000} if reason else None
        self._mark("capture start" + (f" (before step {step})" if step is not None else ""))

    def step(self) -> bool:
        """Call at each step boundary; returns True when this call finished the capture."""
        if self._prof is None:
            return False
        self._steps_done += 1
        if self._first_step is not None:
            label = f"after step {self._first_step + self._steps_done - 1}"
        else:
            label = f"after captured step {self._steps_done}"
        self._mark(label)
        if self._steps_done >= self.steps:
            self._finish(early=False)
            return True
        return False

    def stop(self) -> None:
        """Finish now, keeping the steps captured so far (e.g. training ended early); safe when not running."""
        if self._prof is not None:
            self._finish(early=True)

    def close(self) -> None:
        """Stop the profiler and discard an unfinished capture; safe to call twice."""
        prof, self._prof = self._prof, None
        if prof is not None:
            try:
                prof.stop()
            except Exception:
                log.exception("memcallbacks: could not stop the CPU capture's profiler")

    def _mark(self, label: str) -> None:
        with torch.profiler.record_function(_MARKER):
            pass
        self._labels.append(label)

    def _finish(self, *, early: bool) -> None:
        prof, self._prof = self._prof, None
        prof.stop()
        events, mark_times = _tp.profiler_memory_events(prof, _MARKER)
        del prof
        if len(mark_times) != len(self._labels):
            log.debug("memcallbacks: %d step marks in the profile, %d expected", len(mark_times), len(self._labels))
        holders: dict[int, dict[str, Any]] = {}
        if self.census_enabled:
            holders = self._take_census()
        notes = []
        if early:
            notes.append(f"stopped early, after {self._steps_done} of {self.steps} steps")
        self.snapshot = cpu_events_to_snapshot(
            events,
            marks=list(zip(self._labels, mark_times)),
            max_entries=self.max_entries,
            holders=holders,
            trigger=self._trigger,
            metadata={"steps": self._steps_done, "first_step": self._first_step, "with_stack": self.with_stack},
            notes=notes,
        )

    def _take_census(self) -> dict[int, dict[str, Any]]:
        try:
            from memcallbacks.leaks import take_census

            self.census = take_census(step=self._first_step, time_budget_s=self.census_time_budget_s, ignore=[self])
        except Exception:
            log.exception("memcallbacks: the census after the CPU capture failed; the snapshot has no holders")
            return {}
        holders = {}
        for r in self.census.records:
            if str(r.device).startswith("cpu"):
                holders[int(r.data_ptr)] = {
                    "nbytes": int(r.nbytes), "shape": r.shape, "category": r.category,
                    "holder": r.holder, "path": r.path,
                }
        return holders

    def write(
        self,
        path: str | os.PathLike[str] | None = None,
        *,
        render: bool = True,
        max_bytes: int | None = None,
    ) -> dict[str, Path]:
        """Write the snapshot pickle (and ``.census.json``, ``.html``, ``.png`` beside it); return ``{kind: path}``.

        ``path`` defaults to ``out_dir / CPU_SNAPSHOT_FILE``. ``max_bytes`` bounds the pickle
        (:class:`SnapshotTooLarge` when over, and nothing is written).
        """
        if self.snapshot is None:
            raise RuntimeError("CpuCapture.write(): the capture has not finished; call step() until it returns True, or stop().")
        if path is None:
            if self.out_dir is None:
                raise ValueError("CpuCapture.write(): pass a path, or create the capture with out_dir=.")
            path = self.out_dir / snapshot_file_name(self.file_name, self._first_step, rank=self.rank, world_size=self.world_size)
        path = Path(path)
        written = {"snapshot": write_snapshot(self.snapshot, path, max_bytes=max_bytes)}
        stem = path.with_suffix("")
        if self.census is not None:
            written["census"] = write_json(Path(f"{stem}.census.json"), self.census.to_dict())
        if render:
            written.update(render_snapshot(self.snapshot, Path(f"{stem}.html"), source=str(path)))
        return written


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

    total = sum(1 if e.nbytes > 0 else 2 for e in cpu)
    first, kept_count = 0, total
    while kept_count > max_entries and first < len(cpu):
        kept_count -= 1 if cpu[first].nbytes > 0 else 2
        first += 1
    kept = cpu[first:]
    dropped = total - kept_count

    frame_cache: dict[tuple[str, int, str], dict[str, Any]] = {}
    stack_cache: dict[tuple[str, tuple[tuple[str, int, str], ...]], list[dict[str, Any]]] = {}

    def frames_of(e: _tp.ProfilerAllocation) -> list[dict[str, Any]]:
        key = (e.op, e.frames)
        frames = stack_cache.get(key)
        if frames is None:
            raw = (((_OP_FILENAME, 0, e.op),) if e.op else ()) + e.frames
            frames = []
            for f in raw:
                d = frame_cache.get(f)
                if d is None:
                    d = frame_cache[f] = {"filename": str(f[0]), "line": int(f[1]), "name": str(f[2])}
                frames.append(d)
            stack_cache[key] = frames
        return frames

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

    mark_list = []
    for label, t_ns in marks:
        mark_list.append({"label": label, "time_us": int(t_ns) // 1000, "index": bisect.bisect_right(times, int(t_ns)), "device": 0})

    # what is alive at the end: the trace's live allocations, then census tensors older than the capture
    blocks = [(e.ptr, e.nbytes, frames_of(e)) for e in live.values()]
    known = set(live)
    for addr, info in holders.items():
        if addr not in known and info.get("nbytes", 0) > 0:
            blocks.append((addr, int(info["nbytes"]), []))
    blocks.sort(key=lambda b: b[0])
    alive: list[tuple[int, int, list[dict[str, Any]]]] = []
    for b in blocks:
        if alive and b[0] < alive[-1][0] + alive[-1][1]:
            continue  # overlapping storages (views of foreign memory): keep the first
        alive.append(b)

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
        "notes": [
            "CPU capture: segments are synthetic address ranges around the captured allocations, not allocator "
            "reservations ('reserved' means nothing here).",
            "Tensors allocated before the capture appear only when the census found them alive at the end; "
            "their frees are not reported by the profiler.",
            *([f"bounded: the oldest {dropped} trace entries were dropped (max_entries={max_entries})."] if dropped else []),
            *notes,
        ],
    }
    meta.update(metadata or {})
    return {"segments": segments, "device_traces": [trace], META_KEY: _plain(meta)}


def _synthetic_segments(intervals: list[tuple[int, int]], alive: list[tuple[int, int, list[dict[str, Any]]]]) -> list[dict[str, Any]]:
    """Address ranges covering every interval, with the alive blocks inside and inactive gaps between them."""
    ranges: list[list[int]] = []
    for start, size in sorted(intervals):
        end = start + max(int(size), 1)
        if ranges and start <= ranges[-1][1] + _SEGMENT_GAP:
            ranges[-1][1] = max(ranges[-1][1], end)
        else:
            ranges.append([start, end])
    segments = []
    i = 0
    for start, end in ranges:
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


# ----------------------------------------------------------------------------------------------
# Analysis
# ----------------------------------------------------------------------------------------------

_TORCH_DIR = os.path.dirname(os.path.abspath(torch.__file__)) + os.sep
_PKG_DIR = os.path.dirname(os.path.abspath(__file__)) + os.sep
# torch's own files, by absolute path (CUDA snapshots) or trimmed to "torch/nn/..." (the profiler's stacks)
_INTERNAL_RE = re.compile(r"(?:^|[\\/])torch[\\/]|(?:^|[\\/])memcallbacks[\\/]_?[A-Za-z_]+\.py$")


def _is_python_frame(f: dict[str, Any]) -> bool:
    name = str(f.get("filename", ""))
    return name.endswith(".py") or name in ("<stdin>", "<string>") or name.startswith("<ipython")


def _is_internal(f: dict[str, Any]) -> bool:
    name = str(f.get("filename", ""))
    return name.startswith(_TORCH_DIR) or name.startswith(_PKG_DIR) or _INTERNAL_RE.search(name) is not None


def frame_label(f: dict[str, Any]) -> str:
    """``"train.py:42 in forward"``."""
    return f"{os.path.basename(str(f.get('filename', '?')))}:{f.get('line', 0)} in {f.get('name', '?')}"


def _site_index(frames: Sequence[dict[str, Any]]) -> int | None:
    """The frame to name an allocation by: the innermost Python frame outside torch (and memcallbacks)."""
    first_python = None
    for i, f in enumerate(frames):
        if _is_python_frame(f):
            if not _is_internal(f):
                return i
            if first_python is None:
                first_python = i
    if first_python is not None:
        return first_python
    return 0 if frames else None


NO_STACK = "<no stack recorded>"
BEFORE_TRACE = "<allocated before the trace, no stack>"


@dataclass(frozen=True)
class Allocation:
    """One allocation seen in a snapshot."""

    addr: int
    size: int
    frames: tuple[dict[str, Any], ...] = field(repr=False)
    index: int | None
    """Trace entry of the ``alloc``; ``None`` when it happened before the trace (older or dropped)."""
    freed_only: bool = False
    """Only its free was traced: the frames are those of the free."""
    holder: dict[str, Any] | None = field(default=None, repr=False)
    """Census data (``category``, ``holder``, ``shape``, ``path``) when the snapshot carries it."""
    pending_free: bool = False
    """Freed by Python but not yet reusable (``free_requested`` without ``free_completed``: in use on a stream)."""

    @property
    def site(self) -> str:
        i = _site_index(self.frames)
        if i is None:
            return BEFORE_TRACE if self.index is None and not self.freed_only else NO_STACK
        f = self.frames[i]
        if f.get("filename") == _OP_FILENAME:
            return f"{f.get('name', '?')} (no Python stack)"
        return frame_label(f)

    @property
    def site_file(self) -> str:
        i = _site_index(self.frames)
        return "" if i is None else f"{self.frames[i].get('filename', '')}:{self.frames[i].get('line', 0)}"

    @property
    def callers(self) -> tuple[str, ...]:
        """Up to three Python frames outside torch above the site."""
        i = _site_index(self.frames)
        if i is None:
            return ()
        out = [frame_label(f) for f in self.frames[i + 1:] if _is_python_frame(f) and not _is_internal(f)]
        return tuple(out[:3])

    @property
    def op(self) -> str:
        for f in self.frames:
            if f.get("filename") == _OP_FILENAME:
                return str(f.get("name", ""))
        return ""

    @property
    def what(self) -> str:
        """Op, census category/holder/shape: whatever the snapshot says about the tensor."""
        parts = []
        if self.op:
            parts.append(self.op)
        if self.holder:
            h = self.holder
            parts.append(" ".join(str(x) for x in (h.get("shape"), h.get("category")) if x))
            if h.get("holder"):
                parts.append(f"held by {h['holder']}")
        if self.freed_only:
            parts.append("(stack of its free)")
        if self.pending_free:
            parts.append("freed, waiting for its stream")
        return ", ".join(p for p in parts if p)


@dataclass
class SiteTotal:
    """Allocations grouped by site."""

    site: str
    bytes: int
    count: int
    callers: tuple[str, ...]
    site_file: str
    what: str


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


def _group(allocs: Iterable[Allocation], top: int) -> list[SiteTotal]:
    groups: dict[tuple[str, str], list[Any]] = {}
    for a in allocs:
        key = (a.site_file or a.site, a.op)  # one line of user code can allocate very different things
        g = groups.get(key)
        if g is None:
            g = groups[key] = [a, 0, 0]
        g[1] += a.size
        g[2] += 1
        if a.size > g[0].size:
            g[0] = a
    rows = [SiteTotal(a.site, n, c, a.callers, a.site_file, a.what) for a, n, c in groups.values()]
    rows.sort(key=lambda r: -r.bytes)
    return rows[:top]


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
    kind = {"cpu_profiler": "CPU capture (memcallbacks, torch.profiler)", "cuda_allocator": "CUDA allocator snapshot (memcallbacks)"}.get(
        str(meta.get("kind")), "allocator snapshot (torch.cuda.memory._snapshot)")
    devices = _devices(snapshot) if device is None else [device]
    notes = [str(n) for n in meta.get("notes", [])]
    try:
        summaries = [_summarize_device(snapshot, d, meta, window, trigger, top) for d in devices]
    except (KeyError, TypeError, AttributeError) as exc:  # a hand-made or damaged file
        raise SnapshotError(f"{source or 'snapshot'} {_NOT_A_SNAPSHOT}; an entry is malformed: "
                            f"{type(exc).__name__}: {exc})") from exc
    return SnapshotSummary(source=source, kind=kind, devices=summaries, metadata=meta, notes=notes)


def _summarize_device(
    snapshot: dict[str, Any], device: int, meta: dict[str, Any], window: tuple[int, int] | None, trigger: int | None, top: int,
) -> DeviceSummary:
    traces = snapshot["device_traces"]
    trace: list[dict[str, Any]] = traces[device] if device < len(traces) else []
    segments = [s for s in snapshot["segments"] if int(s.get("device", 0) or 0) == device]
    holders_raw = meta.get("holders") or {}
    holders = {int(k): v for k, v in holders_raw.items()} if isinstance(holders_raw, dict) else {}
    n = len(trace)
    actions = [e.get("action") for e in trace]
    free_action = "free_completed" if "free_completed" in actions else "free_requested"

    # pass 1: which frees have their alloc in the trace; what is live at the end
    live_end: dict[int, int] = {}
    freed_before: list[int] = []
    for i, e in enumerate(trace):
        a = actions[i]
        if a == "alloc":
            live_end[e["addr"]] = i
        elif a == free_action and live_end.pop(e.get("addr"), None) is None:
            freed_before.append(i)
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
        e = trace[i]
        initial.setdefault(e["addr"], Allocation(e["addr"], int(e.get("size", 0)), tuple(e.get("frames") or ()), None, freed_only=True))
    baseline = sum(a.size for a in initial.values())

    # pass 2: the curves
    delta = np.zeros(n + 1, dtype=np.int64)
    seg_delta = np.zeros(n + 1, dtype=np.int64)
    has_segment_events = False
    allocs = frees = 0
    ooms: list[tuple[int, int, int | None]] = []
    for i, e in enumerate(trace):
        a = actions[i]
        if a == "alloc":
            delta[i + 1] = int(e.get("size", 0))
            allocs += 1
        elif a == free_action:
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
    synthetic = bool(meta.get("synthetic_segments"))
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

    # marks, window, trigger
    times = [e.get("time_us") for e in trace]
    has_times = n > 0 and all(isinstance(t, (int, float)) for t in times)
    sorted_times = np.maximum.accumulate(np.asarray(times, dtype=np.float64)) if has_times else None

    def at_time(t_us: float) -> int:
        return int(np.searchsorted(sorted_times, t_us, side="right")) if sorted_times is not None else n

    marks: list[tuple[int, str]] = []
    for m in meta.get("marks") or []:
        if not isinstance(m, dict):
            continue
        if m.get("index") is not None and int(m.get("device", device) or 0) == device:
            marks.append((min(int(m["index"]), n), str(m.get("label", ""))))
        elif m.get("time_us") is not None and sorted_times is not None:
            marks.append((at_time(float(m["time_us"])), str(m.get("label", ""))))
    marks.sort(key=lambda m: m[0])
    if window is None:
        if len(marks) >= 3:
            (s, sl), (e_, el) = marks[1], marks[-1]
        elif len(marks) == 2:
            (s, sl), (e_, el) = marks[0], marks[1]
        else:
            s, sl, e_, el = n // 3, "a third into the trace", n, "the end"
        window = (s, e_)
        labels = (f"{sl} (entry {s})", f"{el} (entry {e_})")
    else:
        window = (max(0, min(int(window[0]), n)), max(0, min(int(window[1]), n)))
        labels = (f"entry {window[0]}", f"entry {window[1]}")
    trig: tuple[int, str] | None = None
    if trigger is not None:
        trig = (max(0, min(int(trigger), n)), "trigger")
    elif isinstance(meta.get("trigger"), dict):
        t = meta["trigger"]
        reason = str(t.get("reason") or "trigger")
        if t.get("index") is not None:
            trig = (min(int(t["index"]), n), reason)
        elif t.get("time_us") is not None:
            trig = (at_time(float(t["time_us"])), reason)
    elif ooms:
        trig = (ooms[-1][0], "out of memory")

    # pass 3: the live set at the peak, and what the window allocated that is still alive at its end
    live = dict(initial)
    pending: set[int] = set()

    def state(allocs: Iterable[Allocation]) -> list[Allocation]:
        return [replace(a, pending_free=True) if a.addr in pending else a for a in allocs]

    w0, w1 = window
    at_peak = state(live.values()) if peak_at == 0 else []
    stayed: dict[int, Allocation] = {}
    stayed_list: list[Allocation] = []
    for i in range(max(peak_at, w1) if n else 0):
        e = trace[i]
        a = actions[i]
        if a == "alloc":
            addr = e["addr"]
            alloc = Allocation(addr, int(e.get("size", 0)), tuple(e.get("frames") or ()), i,
                               holder=holders.get(addr) if i == live_end.get(addr) else None)
            live[addr] = alloc
            pending.discard(addr)
            if w0 <= i < w1:
                stayed[addr] = alloc
        elif a == free_action:
            live.pop(e.get("addr"), None)
            stayed.pop(e.get("addr"), None)
            pending.discard(e.get("addr"))
        elif a == "free_requested":
            pending.add(e.get("addr"))
        if i + 1 == peak_at:
            at_peak = state(live.values())
        if i + 1 == w1:
            stayed_list = state(stayed.values())
    if not n:
        at_peak = end_blocks
    at_peak.sort(key=lambda a: -a.size)
    stayed_list.sort(key=lambda a: -a.size)
    first_last = (int(times[0]), int(times[-1])) if has_times else None
    return DeviceSummary(
        device=device,
        entries=n,
        allocs=allocs,
        frees=frees,
        segments=len(segments),
        reserved_end=reserved_end,
        baseline=baseline,
        allocated=allocated,
        reserved=reserved,
        peak=peak,
        peak_at=peak_at,
        end=int(allocated[-1]),
        largest_at_peak=at_peak[:top],
        sites_at_peak=_group(at_peak, top),
        window=window,
        window_labels=labels,
        stayed_alive=_group(stayed_list, top),
        stayed_alive_bytes=sum(a.size for a in stayed_list),
        stayed_alive_count=len(stayed_list),
        marks=marks,
        trigger=trig,
        ooms=ooms,
        time_us=first_last,
    )


# ----------------------------------------------------------------------------------------------
# Text
# ----------------------------------------------------------------------------------------------


def _device_name(summary: SnapshotSummary, d: DeviceSummary) -> str:
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
        name = _device_name(summary, d)
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


# ----------------------------------------------------------------------------------------------
# Offline rendering: one self-contained HTML file and a PNG
# ----------------------------------------------------------------------------------------------


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
    name = _device_name(summary, d)
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


def _site_table(rows: Sequence[SiteTotal], empty: str) -> str:
    if not rows:
        return f'<p class="note">{html.escape(empty)}</p>'
    out = ["<table><tr><th>bytes</th><th>allocations</th><th>site</th><th>called from</th><th>what</th></tr>"]
    for r in rows:
        out.append(
            f'<tr><td class="n">{format_bytes(r.bytes)}</td><td class="n">{r.count}</td>'
            f'<td class="mono" title="{html.escape(r.site_file)}">{html.escape(r.site)}</td>'
            f'<td class="mono">{"<br>".join(html.escape(c) for c in r.callers)}</td><td>{html.escape(r.what)}</td></tr>'
        )
    out.append("</table>")
    return "".join(out)


def _alloc_table(allocs: Sequence[Allocation]) -> str:
    if not allocs:
        return '<p class="note">No live allocations.</p>'
    out = ["<table><tr><th>bytes</th><th>allocated at entry</th><th>site</th><th>called from</th><th>what</th></tr>"]
    for a in allocs:
        when = "before the trace" if a.index is None else str(a.index)
        out.append(
            f'<tr><td class="n">{format_bytes(a.size)}</td><td class="n">{when}</td>'
            f'<td class="mono" title="{html.escape(a.site_file)}">{html.escape(a.site)}</td>'
            f'<td class="mono">{"<br>".join(html.escape(c) for c in a.callers)}</td><td>{html.escape(a.what)}</td></tr>'
        )
    out.append("</table>")
    return "".join(out)


def _html(summary: SnapshotSummary, image: bytes | None, *, title: str) -> str:
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
    for d in summary.devices:
        name = _device_name(summary, d)
        parts.append(f"<h2>Device {e(name)}</h2>")
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
        parts.append("<table>" + "".join(f"<tr><th>{e(k)}</th><td>{e(v)}</td></tr>" for k, v in rows) + "</table>")
        if image is None and d.entries:
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
    if summary.notes:
        parts.append("<h2>Notes</h2><ul>" + "".join(f'<li class="note">{e(n)}</li>' for n in summary.notes) + "</ul>")
    parts.append(
        '<p class="note">The site is the innermost Python frame outside torch. For the interactive timeline, open the '
        ".pickle in pytorch.org/memory_viz (drag and drop; the file stays in the browser). This page needs no network.</p>"
    )
    parts.append("</body></html>")
    return "\n".join(parts)
