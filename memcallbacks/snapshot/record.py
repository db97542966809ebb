"""CUDA allocator history: start and stop recording, mark steps, dump a snapshot (also in an OOM).

Every private torch call goes through :mod:`memcallbacks._base.torch_private`.
"""

from __future__ import annotations

import logging
import os
import time
from pathlib import Path
from typing import Any, Callable, Sequence

import torch

from memcallbacks._base import torch_private as _tp
from memcallbacks._base.units import format_bytes
from memcallbacks.snapshot.files import DEFAULT_MAX_ENTRIES, META_KEY, plain_data, write_snapshot

log = logging.getLogger(__name__)

__all__ = [
    "start_recording",
    "stop_recording",
    "is_recording",
    "time_mark",
    "dump_snapshot",
    "dump_on_oom",
]


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
    snapshot[META_KEY] = plain_data(meta)
    return write_snapshot(snapshot, path, max_bytes=max_bytes)


def dump_on_oom(
    path: str | os.PathLike[str] | Callable[[], str | os.PathLike[str]],
    *,
    max_bytes: int | None | Callable[[], int | None] = None,
    once: bool = True,
    marks: Callable[[], Sequence[dict[str, Any]]] | None = None,
    room: Callable[[], bool] | None = None,
) -> Callable[[], None]:
    """Dump a snapshot when the CUDA allocator runs out of memory; returns ``detach()`` (safe to call twice).

    The dump happens inside the failing allocation, before ``torch.OutOfMemoryError`` reaches the
    training code, so the snapshot shows the state that failed (the trace ends with its ``oom``
    entry). ``path`` may be a callable giving the path then (e.g. with the step in it); ``marks``
    a callable giving the step marks so far. ``once``: detach after the first dump, so a loop that
    catches OOMs and retries does not dump each time. A failed dump is logged, never raised.
    ``max_bytes`` may be a callable, read when the OOM happens (the bytes left in a run's budget
    after earlier dumps; 0 means none left, not unlimited); ``room()`` False skips the dump.
    """
    detach: Callable[[], None] = lambda: None  # noqa: E731

    def observer(device: int, segment: int, device_limit: int, device_free: int) -> None:
        # torch calls observers as (device, alloc_size, device total or the per-process limit, device free);
        # alloc_size is the segment cudaMalloc was asked for (get_allocation_size: a 4 MiB tensor asks for a
        # 20 MiB segment), not the tensor's bytes. The allocator's lock is released by then, so its stats
        # could be read, but nothing here allocates
        if once:
            detach()
        reason = (f"out of memory on cuda:{device}: a new {format_bytes(segment)} segment (the request rounded up to the "
                  f"caching allocator's segment size) did not fit, "
                  f"{format_bytes(device_free)} free of {format_bytes(device_limit)} (device total or per-process limit)")
        budget = max_bytes() if callable(max_bytes) else max_bytes
        if room is not None and not room():
            log.warning("memcallbacks: %s; no snapshot written (the run's snapshot budget is used up)", reason)
            return
        target = path() if callable(path) else path
        try:
            dump_snapshot(target, max_bytes=budget, trigger=reason, marks=marks() if marks else ())
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
