"""CPU capture: profile the next training steps with torch.profiler, kept as a memory snapshot."""

from __future__ import annotations

import logging
import os
import time
from pathlib import Path
from typing import Any

import torch

from memcallbacks._base import torch_private as _tp
from memcallbacks._files.outputs import write_json
from memcallbacks.snapshot.cpu_convert import cpu_events_to_snapshot
from memcallbacks.snapshot.files import CPU_SNAPSHOT_FILE, DEFAULT_MAX_ENTRIES, snapshot_file_name, write_snapshot
from memcallbacks.snapshot.render import render_snapshot

log = logging.getLogger(__name__)

__all__ = ["CpuCapture"]

_MARKER = "memcallbacks::step_boundary"
"""Name of the ``record_function`` range that marks a step boundary inside the profile."""


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
        """The :class:`memcallbacks.leaks.census.Census` taken at the end, when enabled and it succeeded."""
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
    def first_step(self) -> int | None:
        """The step the capture began at (None before it starts)."""
        return self._first_step

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
