"""The snapshot file: format constants, writing within a byte budget, reading plain data only.

A snapshot is the plain dict ``torch.cuda.memory._snapshot()`` returns, pickled with protocol 4
so pytorch.org/memory_viz loads it: ``segments`` (the allocator's state at the end, blocks with
their Python frames) and ``device_traces`` (one list of trace entries per device: ``alloc``,
``free_requested``, ``free_completed``, ``segment_alloc``, ``segment_free``, ``oom``, ...).
memcallbacks adds one top-level key, ``"memcallbacks"``, with its own metadata (step marks, the
trigger, what a bounded capture dropped); memory_viz ignores it.
"""

from __future__ import annotations

import os
import pickle
from pathlib import Path
from typing import Any

from memcallbacks._files.outputs import atomic_write
from memcallbacks._base.units import format_bytes

__all__ = [
    "SNAPSHOT_PROTOCOL",
    "META_KEY",
    "SNAPSHOT_FILE",
    "CPU_SNAPSHOT_FILE",
    "OOM_SNAPSHOT_FILE",
    "DEFAULT_MAX_ENTRIES",
    "snapshot_file_name",
    "SnapshotError",
    "EmptySnapshotError",
    "SnapshotTooLarge",
    "write_snapshot",
    "snapshot_size",
    "load_snapshot",
    "validate_snapshot",
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

OP_FILENAME = "<torch op>"
"""Filename of the pseudo-frame naming the torch op in CPU captures (memory_viz shows it as a frame)."""


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


def plain_data(value: Any) -> Any:
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
        return {(k if isinstance(k, (int, str)) else str(k)): plain_data(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [plain_data(v) for v in value]
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


NOT_A_SNAPSHOT = "is not a memory snapshot (expected a dict with 'segments' and 'device_traces', as written by torch.cuda.memory._dump_snapshot() or memcallbacks"


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
        raise SnapshotError(f"{path} {NOT_A_SNAPSHOT}; it could not be read as a plain pickle: {reason})") from None
    return validate_snapshot(data, source=str(path))


def validate_snapshot(data: Any, source: str = "snapshot") -> dict[str, Any]:
    """Check the structure and fill keys older torch versions omit; return the snapshot dict.

    Accepts a list of segments (``torch.cuda.memory_snapshot()``) as a snapshot without traces.
    """
    if isinstance(data, list) and data and all(isinstance(s, dict) and "blocks" in s for s in data):
        data = {"segments": data, "device_traces": []}
    if not isinstance(data, dict) or not ({"segments", "device_traces"} & set(data)):
        got = f"a dict with keys {sorted(map(str, data))[:6]}" if isinstance(data, dict) else f"a {type(data).__name__}"
        raise SnapshotError(f"{source} {NOT_A_SNAPSHOT}; got {got})")
    data.setdefault("segments", [])
    data.setdefault("device_traces", [])
    segments, traces = data["segments"], data["device_traces"]
    if not isinstance(segments, list) or not all(isinstance(s, dict) and isinstance(s.get("blocks", []), list) for s in segments):
        raise SnapshotError(f"{source} {NOT_A_SNAPSHOT}; its 'segments' is not a list of segment dicts)")
    if not isinstance(traces, list) or not all(isinstance(t, list) for t in traces):
        raise SnapshotError(f"{source} {NOT_A_SNAPSHOT}; its 'device_traces' is not a list of per-device lists)")
    for trace in traces:
        if trace and not (isinstance(trace[0], dict) and "action" in trace[0]):
            raise SnapshotError(f"{source} {NOT_A_SNAPSHOT}; its trace entries have no 'action')")
    if not segments and not any(traces):
        raise EmptySnapshotError(
            f"{source} is an empty memory snapshot: no segments and no trace entries, so nothing was recorded. "
            f"On CUDA, turn history on before the steps you want to see (torch.cuda.memory._record_memory_history"
            f"(max_entries=100000), or memcallbacks' start_recording()) and dump after them; on CPU, capture steps "
            f"with memcallbacks' CpuCapture. See docs/snapshots.md."
        )
    return data
