"""Automatic memory snapshots: decide when to record and dump, within a file and byte budget.

Triggers (each configurable in :class:`~memcallbacks.MonitorConfig`): a step's peak above a
fraction of device capacity or above absolute bytes, new allocator retries (the cache had to be
flushed: fragmentation), a new finding, an out-of-memory error, and optionally every N steps.

- CUDA: allocator history (``_record_memory_history``, Python stacks, bounded ring buffer). With
  policy ``"always"`` it records from the start; with ``"armed"`` it starts recording when risk
  rises (a step's peak passes ``ARM_FRACTION`` of the threshold, or any trigger fires before
  recording was on), so the next crossing is captured with its history; ``"off"`` never records
  (an OOM still dumps the allocator's segments). The allocator's OOM observer dumps inside the
  failing allocation.
- CPU: no allocator history exists, so a trigger starts a ``torch.profiler`` capture of the next
  ``snapshot_steps`` steps, converted to the same snapshot format, plus a census of who holds what.

Every file goes to ``<output_dir>/snapshots`` atomically, named with rank and step, beside an
offline HTML/PNG summary. A failed dump warns with its traceback; training goes on.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from memcallbacks._base.config import MonitorConfig
from memcallbacks._base.columns import ALLOC_RETRIES, PEAK_ALLOCATED, PEAK_RESERVED
from memcallbacks._base.units import format_bytes
from memcallbacks.snapshot.cpu_capture import CpuCapture
from memcallbacks.snapshot.files import OOM_SNAPSHOT_FILE, SNAPSHOT_FILE, SnapshotTooLarge, load_snapshot, snapshot_file_name
from memcallbacks.snapshot.record import dump_on_oom, dump_snapshot, is_recording, start_recording, stop_recording
from memcallbacks.snapshot.render import render_snapshot

log = logging.getLogger(__name__)

__all__ = ["AutoSnapshot", "ARM_FRACTION", "OBSERVER_TRIGGER"]

ARM_FRACTION = 0.8
"""``"armed"`` policy: recording starts when a step's peak passes this fraction of the threshold."""

OBSERVER_TRIGGER = "oom (allocator observer)"


class AutoSnapshot:
    """One run's snapshot policy. All methods swallow their own errors (logged with traceback)."""

    def __init__(
        self,
        config: MonitorConfig,
        *,
        device_kind: str,
        capacity: int | None,
        output_dir: Path,
        rank: int = 0,
        world_size: int = 1,
        alloc_retries_at_start: int = 0,
        logger: logging.Logger | None = None,
    ) -> None:
        self.config = config
        self.kind = device_kind
        self.capacity = capacity
        self.folder = Path(output_dir) / "snapshots"
        self.rank, self.world_size = rank, world_size
        self.log = logger or log
        self.records: list[dict[str, Any]] = []
        self._fired: set[str] = set()
        self._bytes = 0
        self._recording_ours = False
        self._pending_dump: tuple[int, str] | None = None  # (steps left, reason): CUDA, recording started by a trigger
        self._capture: Any = None
        self._capture_reason = ""
        self._detach_oom: Any = None
        self._last_retries = int(alloc_retries_at_start)  # the counter is cumulative per process: only new retries fire
        self._last_retry_step = -(10**9)
        self._budget_warned = False
        self._full = False  # a snapshot did not fit in what was left of the byte budget
        self.step = 0
        self.threshold: float | None = None
        if capacity and config.snapshot_capacity_fraction:
            self.threshold = capacity * config.snapshot_capacity_fraction
        if config.snapshot_peak_bytes is not None:
            self.threshold = min(self.threshold or float("inf"), float(config.snapshot_peak_bytes))

    @classmethod
    def for_backend(cls, config: MonitorConfig, backend: Any, output_dir: Path, rank: int, world_size: int,
                    logger: logging.Logger | None = None) -> "AutoSnapshot":
        """The policy for a run on ``backend`` (its kind, capacity and allocator retries so far)."""
        return cls(config, device_kind=backend.kind, capacity=backend.capacity(), output_dir=output_dir, rank=rank,
                   world_size=world_size, alloc_retries_at_start=backend.counters().get("alloc_retries", 0), logger=logger)

    # ------------------------------------------------------------------ lifecycle
    def start(self) -> None:
        from memcallbacks._files.outputs import check_writable

        check_writable(self.folder, "auto_snapshot")  # before training: an environment problem stops the run
        if self.kind != "cuda":
            return
        try:
            if self.config.snapshot_policy == "always":
                self._record()
            # the budget is read when the OOM happens: earlier dumps may have spent it
            self._detach_oom = dump_on_oom(self._oom_path, max_bytes=self._remaining, room=self._room)
        except Exception:
            self.log.exception("memcallbacks: could not set up CUDA memory snapshots; continuing without them.")

    def stop(self) -> None:
        if self._capture is not None and self._capture.active:
            try:
                self._capture.stop()
                self._write_capture()
            except Exception:
                self.log.exception("memcallbacks: could not write the unfinished CPU capture.")
        self._capture = None
        try:
            self._finish_observer_dump()  # an OOM the training code caught and survived
        except Exception:
            self.log.exception("memcallbacks: could not finish the out-of-memory snapshot.")
        if self._detach_oom is not None:
            self._detach_oom()
            self._detach_oom = None
        if self._recording_ours:
            stop_recording()
            self._recording_ours = False

    # ------------------------------------------------------------------ budget
    def _remaining(self) -> int:
        return max(self.config.max_snapshot_bytes - self._bytes, 0)

    def _room(self) -> bool:
        # a snapshot smaller than every one so far would be needed: the budget is used up (no capture for nothing)
        smallest = min((r["bytes"] for r in self.records if r.get("bytes")), default=1)
        ok = not self._full and len(self.records) < self.config.max_snapshots and self._remaining() >= smallest
        if not ok and not self._budget_warned:
            self._budget_warned = True
            self.log.warning(
                "memcallbacks: snapshot budget used up (%d files, %s of max_snapshot_bytes=%s); later triggers are skipped.",
                len(self.records), format_bytes(self._bytes), format_bytes(self.config.max_snapshot_bytes),
            )
        return ok

    def _path(self, template: str, step: int) -> Path:
        return self.folder / snapshot_file_name(template, step, rank=self.rank, world_size=self.world_size)

    def _oom_path(self) -> Path:
        path = self._path(OOM_SNAPSHOT_FILE, self.step)
        self.records.append({"trigger": OBSERVER_TRIGGER, "step": self.step, "files": {"snapshot": str(path)}})
        return path

    # ------------------------------------------------------------------ recording (CUDA)
    def _record(self) -> None:
        if not is_recording():
            start_recording(self.config.snapshot_max_entries)
            self._recording_ours = True

    def _dump(self, reason: str, step: int) -> None:
        path = self._path(SNAPSHOT_FILE, step)
        written = dump_snapshot(path, max_bytes=self._remaining(), trigger=reason)
        self._account(reason, step, {"snapshot": str(written), **self._render(Path(written))})

    def _render(self, path: Path) -> dict[str, str]:
        """The offline HTML/PNG beside a snapshot pickle (a failed render leaves the pickle alone)."""
        try:
            rendered = render_snapshot(load_snapshot(path), path.with_suffix(".html"), source=str(path))
            return {k: str(v) for k, v in rendered.items()}
        except Exception:
            self.log.exception("memcallbacks: could not render %s (the pickle itself is fine).", path)
            return {}

    def _account(self, reason: str, step: int, files: dict[str, str], record: dict[str, Any] | None = None) -> None:
        size = sum(Path(p).stat().st_size for p in files.values() if Path(p).is_file())
        self._bytes += size
        if record is None:
            record = {"trigger": reason, "step": step}
            self.records.append(record)
        record.update(bytes=size, files=files)
        self.log.warning("memcallbacks: memory snapshot (%s) at step %d written to %s", reason, step, files.get("snapshot"))

    def _finish_observer_dump(self) -> bool:
        """The allocator's OOM observer wrote its pickle inside the failing allocation (where nothing
        else may run); account for it and render its summary now. True when there was one."""
        for record in self.records:
            if record["trigger"] == OBSERVER_TRIGGER and "bytes" not in record:
                path = Path(record["files"]["snapshot"])
                if path.is_file():
                    self._account(record["trigger"], record["step"], {"snapshot": str(path), **self._render(path)}, record)
                else:
                    record.update(bytes=0, files={}, error="the out-of-memory dump failed (see the log)")
                return True
        return False

    # ------------------------------------------------------------------ the CPU capture
    def _write_capture(self) -> None:
        capture, self._capture = self._capture, None
        if capture is None or not capture.finished:
            return
        written = capture.write(max_bytes=self._remaining())
        self._account(self._capture_reason, int(capture.first_step or self.step), {k: str(v) for k, v in written.items()})

    # ------------------------------------------------------------------ hooks from the core
    def on_step_start(self, step: int) -> None:
        """At every step start (cheap unless a capture or a deferred dump is pending)."""
        self.step = step
        try:
            if self._capture is not None and self._capture.step():
                self._write_capture()
            if self._pending_dump is not None:
                left, reason = self._pending_dump
                if left <= 1:
                    self._pending_dump = None
                    self._dump(reason, step)
                else:
                    self._pending_dump = (left - 1, reason)
        except SnapshotTooLarge:
            self._capture, self._full = None, True
            self._room()  # says, once, that the budget is used up
        except Exception:
            self._capture = None
            self.log.exception("memcallbacks: memory snapshot failed; training goes on.")

    @property
    def busy(self) -> bool:
        return self._capture is not None or self._pending_dump is not None

    def after_row(self, step: int, row: list[Any], new_findings: list[Any]) -> None:
        """After a sampled step: check every trigger against its row (bytes in the engine's columns)."""
        cfg = self.config
        try:
            peak_allocated, peak_reserved = float(row[PEAK_ALLOCATED]), float(row[PEAK_RESERVED])
            peak = max(peak_allocated, peak_reserved if self.kind == "cuda" else peak_allocated)
            if self.threshold is not None:
                if peak >= self.threshold:
                    self.fire("threshold", step, f"step peak {format_bytes(peak)} ≥ threshold {format_bytes(self.threshold)}")
                elif self.kind == "cuda" and cfg.snapshot_policy == "armed" and peak >= ARM_FRACTION * self.threshold:
                    if not self._recording_ours:
                        self.log.info("memcallbacks: step peak %s is %.0f%% of the snapshot threshold; recording allocator history.",
                                      format_bytes(peak), 100 * peak / self.threshold)
                    self._record()
            retries = row[ALLOC_RETRIES]
            if cfg.snapshot_on_alloc_retries and retries == retries and retries > self._last_retries:
                self._last_retries = int(retries)
                if step - self._last_retry_step >= 50:  # a burst of retries is one event
                    self._last_retry_step = step
                    self.fire(f"alloc_retries@{step}", step, f"the allocator flushed its cache and retried ({int(retries)} so far): "
                              "fragmentation; try PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True")
            if cfg.snapshot_on_findings:
                for finding in new_findings:
                    self.fire(f"finding:{finding.key}", step, f"{finding.kind} finding")
            every = cfg.snapshot_every_n_steps
            if every and (step + 1) % every == 0:
                self.fire(f"periodic@{step}", step, f"every {every} steps")
        except Exception:
            self.log.exception("memcallbacks: snapshot trigger check failed; training goes on.")

    def after_findings(self, step: int, new_findings: list[Any]) -> None:
        """After a watched (unsampled) step that raised findings: the finding triggers only."""
        if self.config.snapshot_on_findings:
            for finding in new_findings:
                self.fire(f"finding:{finding.key}", step, f"{finding.kind} finding")

    def fire(self, key: str, step: int, reason: str) -> None:
        """A trigger fired (once per key): dump now if history is recording, else capture the next steps."""
        if key in self._fired or self.busy or not self._room():
            return
        self._fired.add(key)
        try:
            if self.kind == "cuda":
                if is_recording():
                    self._dump(reason, step)
                elif self.config.snapshot_policy != "off":
                    self._record()
                    self._pending_dump = (self.config.snapshot_steps, reason)
            elif self.kind == "cpu":
                capture = CpuCapture(
                    steps=self.config.snapshot_steps,
                    out_dir=self.folder,
                    max_entries=self.config.snapshot_max_entries,
                    census_time_budget_s=self.config.census_time_budget_s,
                    rank=self.rank,
                    world_size=self.world_size,
                )
                capture.start(step + 1, reason=reason)
                self._capture, self._capture_reason = capture, reason
        except Exception:
            self._capture = None
            self.log.exception("memcallbacks: could not take the memory snapshot for %s; training goes on.", reason)

    def on_exception(self, exc: BaseException, step: int) -> None:
        """An OOM is ending the run: write what can still be written (the error propagates afterwards)."""
        try:
            if self._capture is not None and self._capture.active:
                self._capture.stop()
                self._capture_reason += " (cut short by out of memory)"
                self._write_capture()
            if self.kind == "cuda":
                if not self._finish_observer_dump() and self._room():
                    path = self._path(OOM_SNAPSHOT_FILE, step)
                    dump_snapshot(path, max_bytes=self._remaining(), trigger=f"out of memory: {exc}")
                    self._account("oom", step, {"snapshot": str(path)})
            elif self._room():
                # CPU: no history to dump; the census says who held what when memory ran out
                from memcallbacks.leaks import take_census
                from memcallbacks._files.outputs import write_json

                census = take_census(time_budget_s=self.config.census_time_budget_s)
                path = self.folder / f"memory_census_oom_step{step}{'' if self.world_size <= 1 else f'.rank{self.rank}'}.json"
                write_json(path, census.to_dict())
                self._account("oom", step, {"census": str(path)})
        except Exception:
            self.log.exception("memcallbacks: could not write the out-of-memory snapshot; the error propagates as is.")
