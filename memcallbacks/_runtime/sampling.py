"""The framework-free sampling engine: phase boundaries in, one history row per training step out.

Adapters translate their framework's hooks into four calls — ``begin_step``, ``boundary``,
``end_step`` and ``begin_eval``/``end_eval`` — and ask for ``log_values()`` on the steps they
log. Each phase's peak is the device's real peak since the previous boundary (the peak counter is
reset at every boundary); because that reset is process-global, the run's lifetime peak is kept
here (``max_allocated``/``max_reserved``).
"""

from __future__ import annotations

import logging
import math
import time
from typing import Any, Callable

from memcallbacks._base import distributed as _distributed
from memcallbacks._base.config import MonitorConfig
from memcallbacks._base.cpu import own_time
from memcallbacks._base.keys import MIN_OVER_RANKS
from memcallbacks._base.units import GiB
from memcallbacks._base.devices import MemoryBackend, host_rss_reader, select_backend
from memcallbacks._runtime.readout import eval_frame, history_frame, summarise
from memcallbacks._base.columns import (
    ALLOCATED,
    ALLOC_RETRIES,
    BATCH_IDX,
    COLUMNS,
    EPOCH,
    E_ALLOCATED,
    E_ALLOCATED_AFTER,
    E_BATCHES,
    E_PEAK_ALLOCATED,
    E_PEAK_RESERVED,
    HOST_RSS,
    INACTIVE_SPLIT,
    MICRO_BATCHES,
    MONITOR_TIME_S,
    OOMS,
    OPTIMIZER,
    OPTIMIZER_STEPS,
    OTHER,
    PEAK_ALLOCATED,
    PEAK_BACKWARD,
    PEAK_FORWARD,
    PEAK_OPTIMIZER,
    PEAK_RESERVED,
    RESERVED,
    STEP,
    STEP_TIME_S,
)

log = logging.getLogger(__name__)

__all__ = ["MemoryEngine"]

STATE_VERSION = 1
"""Version of the checkpointed monitor state (``state_dict()``)."""


_NAN = math.nan
_MIN_KEYS = tuple(f"/{name}" for name in MIN_OVER_RANKS)  # keys whose ranks meet as a minimum (the rank that runs out first)


class MemoryEngine:
    """Measures one process. Not thread-safe; adapters call it from the training thread."""

    def __init__(self, config: MonitorConfig) -> None:
        self.config = config
        self.backend: MemoryBackend | None = None
        self.device_info: dict[str, Any] = {}
        self.device: Any = None
        self.capacity: int | None = None
        self._host_rss: Callable[[], int] | None = None
        self.rank, self.world_size = 0, 1
        self.enabled = False  # recording: off until start(), and after the session's failure (Session.fail)
        self.reset()

    # ------------------------------------------------------------------ lifecycle
    def reset(self) -> None:
        self.rows: list[list[Any]] = []
        self.eval_rows: list[list[Any]] = []
        self._stride = 1  # keep every _stride-th step once history has been thinned
        self._seen_steps = 0
        self._sampled_steps = 0
        self.sampling = False  # a sampled step is open
        self.optimizer_steps_total = 0
        self.max_allocated = 0
        self.max_reserved = 0
        self._row: list[Any] | None = None
        self.kept: list[Any] | None = None  # the last row kept (appended to rows)
        self._open = False
        self._step_opt = 0
        self._eval: list[Any] | None = None

    def start(self, device: Any, *, rank: int | None = None, world_size: int | None = None) -> None:
        """Pick the device backend and start measuring (call once per fit, before the first step)."""
        if self.backend is not None:
            self.backend.close()
        self.backend = select_backend(device, cpu_mmap_threshold=self.config.cpu_mmap_threshold)
        self.device = self.backend.device  # the collectives' tensors go here (NCCL needs the right GPU)
        # kept for summaries after stop() released the backend
        self.device_info = self.backend.describe()
        self.capacity = self.backend.capacity()
        self._host_rss = host_rss_reader()
        self.start_allocated = self.backend.current()[0]
        if rank is None or world_size is None:
            rank, world_size = _distributed.rank_and_world()
        self.rank, self.world_size = rank, world_size
        self.enabled = True
        self._peaks(self.backend.baseline())

    def stop(self) -> None:
        """Close the current step (if any) and release OS handles. Safe to call twice."""
        if self._open and self.enabled and self.backend is not None:
            self.end_step()
        self._row = None
        self._open = self.sampling = False
        if self.backend is not None:
            self.backend.close()
            self.backend = None  # a later start() picks a fresh one

    def __getstate__(self) -> dict[str, Any]:
        # OS handles do not travel (DDP spawn pickles callbacks into the workers); start() makes new ones
        state = dict(self.__dict__)
        state["backend"] = None
        state["_host_rss"] = None
        return state

    # ------------------------------------------------------------------ the hot path
    def _peaks(self, sample: tuple[int, ...]) -> None:
        # lifetime peaks from every interval, including the gaps between steps
        if sample[-2] > self.max_allocated:
            self.max_allocated = sample[-2]
        if sample[-1] > self.max_reserved:
            self.max_reserved = sample[-1]

    def begin_step(self, step: int, epoch: int = 0, batch_idx: int = 0, sample: bool = True, heap: bool = True) -> list[Any] | None:
        """Start a training step. A sampled step takes the baseline and measures every phase; an
        unsampled one only counts, at almost no cost (its peaks still reach ``max_allocated`` at
        the next sample, since nothing resets the device's peak counter in between). ``heap=False``:
        the baseline may leave ``allocated`` unread (NaN; the CPU heap, ``Schedule.heap_due``).
        Returns a sampled step's open row, its baseline read (None for an unsampled step)."""
        if self._open:  # the previous step never ended (e.g. an exception was swallowed)
            self.end_step()
        self._open = True
        self.sampling = sample
        self._step_opt = 0
        if not sample:
            return None
        t0 = own_time()
        row = [_NAN] * len(COLUMNS)
        row[STEP], row[EPOCH], row[BATCH_IDX], row[MICRO_BATCHES], row[OPTIMIZER_STEPS] = step, epoch, batch_idx, 1, 0
        row[STEP_TIME_S] = time.perf_counter()
        self._row = row
        sample_ = self.backend.baseline(heap)  # type: ignore[union-attr]
        self._peaks(sample_)
        row[ALLOCATED], row[RESERVED] = sample_[0], sample_[1]
        row[HOST_RSS] = sample_[1] if self.backend.kind == "cpu" else self._host_rss()  # type: ignore[union-attr,misc]
        row[PEAK_ALLOCATED] = row[PEAK_RESERVED] = 0
        row[MONITOR_TIME_S] = own_time() - t0
        return row

    def boundary(self, closing: int) -> None:
        """End the current segment, attributing its peak to phase ``closing``, and open the next."""
        if not self.sampling:
            if closing == OPTIMIZER:
                self._step_opt += 1
            return
        t0 = own_time()
        row = self._row
        if row is None:
            return
        peak_a, peak_r = self.backend.interval()  # type: ignore[union-attr]
        col = 8 + closing
        if not peak_a <= row[col]:  # NaN-safe max
            row[col] = peak_a
        if peak_a > row[PEAK_ALLOCATED]:
            row[PEAK_ALLOCATED] = peak_a
        if peak_r > row[PEAK_RESERVED]:
            row[PEAK_RESERVED] = peak_r
        if peak_a > self.max_allocated:
            self.max_allocated = peak_a
        if peak_r > self.max_reserved:
            self.max_reserved = peak_r
        if closing == OPTIMIZER:
            self._step_opt += 1
        row[MONITOR_TIME_S] += own_time() - t0

    def quiet_step(self, steps: int = 1) -> None:
        """Count steps that are not measured at all (one optimizer step each, as automatic optimization takes)."""
        self._seen_steps += steps
        self.optimizer_steps_total += steps

    def micro_batch(self) -> None:
        """A further batch inside the same optimizer step (gradient accumulation)."""
        row = self._row
        if row is not None and self.sampling:
            self.boundary(OTHER)
            row[MICRO_BATCHES] += 1

    def end_step(self, closing: int = OTHER) -> list[Any] | None:
        """Close the step's last segment (labelled ``closing``) and append its row to the history."""
        if not self._open:
            return None
        self.boundary(closing)
        self._open = False
        self._seen_steps += 1
        self.optimizer_steps_total += self._step_opt
        row = self._row
        if not self.sampling or row is None:
            return None
        self.sampling = False
        t1 = own_time()
        self._row = None
        row[OPTIMIZER_STEPS] = self._step_opt
        counters = self.backend.counters() if self.backend.has_counters else None  # type: ignore[union-attr]
        if counters:
            row[ALLOC_RETRIES], row[OOMS], row[INACTIVE_SPLIT] = counters["alloc_retries"], counters["ooms"], counters["inactive_split_bytes"]
        row[STEP_TIME_S] = time.perf_counter() - row[STEP_TIME_S]
        self._sampled_steps += 1
        if self._sampled_steps % self._stride == 0:
            self.rows.append(row)
            self.kept = row  # the session's journal writes it (also when the halving below drops it)
            if len(self.rows) > self.config.max_history_rows:
                self.rows = self.rows[1::2]
                self._stride *= 2
        row[MONITOR_TIME_S] += own_time() - t1
        return row

    @property
    def seen_steps(self) -> int:
        """Training steps since the last reset, quiet ones included."""
        return self._seen_steps

    @property
    def in_step(self) -> bool:
        return self._open

    @property
    def step_baseline(self) -> int | None:
        """Allocated bytes at the start of the open step, if it is sampled and they were read."""
        row = self._row
        return int(row[ALLOCATED]) if row is not None and self.sampling and row[ALLOCATED] == row[ALLOCATED] else None

    def fill_baseline(self, allocated: int | None) -> int | None:
        """The open sampled step's unread ``allocated``, read after all (the watch's read): into its row."""
        if allocated is not None and self._row is not None and self.sampling:
            self._row[ALLOCATED] = allocated
        return allocated

    def add_own_time(self, seconds: float) -> None:
        """Charge work done for the open step outside the engine (detection) to its ``monitor_time_s``."""
        if self._row is not None:
            self._row[MONITOR_TIME_S] += seconds

    # ------------------------------------------------------------------ evaluation loops
    def begin_eval(self, stage: str, step: int, epoch: int) -> None:
        if self._open:  # evaluation inside an open step: keep its memory out of the step's row
            self.boundary(OTHER)
        sample = self.backend.baseline()  # type: ignore[union-attr]
        self._peaks(sample)
        self._eval = [stage, step, epoch, 0, sample[0], 0, 0, _NAN, self._host_rss()]  # type: ignore[misc]

    def eval_batch(self) -> None:
        if self._eval is not None:
            self._eval[E_BATCHES] += 1

    def end_eval(self, keep_empty: bool = True) -> list[Any] | None:
        """The evaluation's row; ``keep_empty=False`` drops one that counted no batch (None)."""
        row = self._eval
        if row is None:
            return None
        self._eval = None
        if not keep_empty and row[E_BATCHES] == 0:
            return None
        sample = self.backend.baseline()  # type: ignore[union-attr]
        self._peaks(sample)
        row[E_PEAK_ALLOCATED], row[E_PEAK_RESERVED], row[E_ALLOCATED_AFTER] = sample[2], sample[3], sample[0]
        self.eval_rows.append(row)
        if len(self.eval_rows) > self.config.max_history_rows:
            self.eval_rows = self.eval_rows[1::2]
        return row

    # ------------------------------------------------------------------ logging
    def reduce(self, keys: list[str], values: list[float], rank_keys: tuple[str, ...] = ()) -> dict[str, float]:
        """Max over ranks in one collective (when distributed and configured); NaNs are dropped."""
        ranks: list[int] = []
        if self.world_size > 1 and self.config.reduce_across_ranks and _distributed.is_distributed():
            values, ranks = _distributed.max_over_ranks(values, self.device)
        out: dict[str, float] = {}
        for key, value in zip(keys, values):
            if value == value and not math.isinf(value):
                out[key] = float(value)
        if ranks:
            for key in rank_keys:
                if key in out:
                    out[key.removesuffix("_GiB") + "_rank"] = float(ranks[keys.index(key)])
        return out

    def log_values(self, row: list[Any] | None, extra: dict[str, float] | None = None) -> dict[str, float]:
        """The metrics to log for ``row`` (plus ``extra``, reduced the same way); every rank must call
        this on the same steps, with the same ``extra`` keys, when distributed."""
        p = self.config.prefix
        counters = self.device_info.get("kind", "cpu") != "cpu"  # the allocator's counters: not on CPU
        keys = [f"{p}/allocated_GiB", f"{p}/reserved_GiB", f"{p}/peak_forward_GiB", f"{p}/peak_backward_GiB",
                f"{p}/peak_optimizer_GiB", f"{p}/peak_step_GiB", f"{p}/peak_reserved_GiB", f"{p}/max_allocated_GiB",
                f"{p}/host_rss_GiB", f"{p}/monitor_time_ms", f"{p}/peak_forward_above_start_GiB",
                f"{p}/peak_backward_above_start_GiB", f"{p}/peak_optimizer_above_start_GiB", f"{p}/peak_step_above_start_GiB"]
        if counters:
            keys += [f"{p}/alloc_retries", f"{p}/ooms", f"{p}/inactive_split_GiB"]
        if row is None or not self.enabled:
            values = [_NAN] * len(keys)
        else:
            # what each phase rose above the step's start (RSS on CPU, where the peaks are its high-water
            # mark; allocated elsewhere): a rise below zero is none, a phase that did not run stays NaN
            start = row[RESERVED] if self.device_info.get("peak_source") == "rss_high_water_mark" else row[ALLOCATED]
            values = [row[ALLOCATED] / GiB, row[RESERVED] / GiB, row[PEAK_FORWARD] / GiB, row[PEAK_BACKWARD] / GiB,
                      row[PEAK_OPTIMIZER] / GiB, row[PEAK_ALLOCATED] / GiB, row[PEAK_RESERVED] / GiB,
                      self.max_allocated / GiB, row[HOST_RSS] / GiB, row[MONITOR_TIME_S] * 1e3]
            for col in (PEAK_FORWARD, PEAK_BACKWARD, PEAK_OPTIMIZER, PEAK_ALLOCATED):  # a loop: no frame per logged step
                rise = row[col] - start
                values.append(0.0 if rise < 0 else rise / GiB)
            if counters:
                values += [float(row[ALLOC_RETRIES]), float(row[OOMS]), row[INACTIVE_SPLIT] / GiB]
        flip = self.world_size > 1  # the ranks' values meet as a maximum: a minimum is the maximum of the negated
        if extra:
            for key, value in extra.items():
                keys.append(key)
                value = float(value) if self.enabled else _NAN
                values.append(-value if flip and key.endswith(_MIN_KEYS) else value)
        out = self.reduce(keys, values, (f"{p}/peak_step_GiB", f"{p}/allocated_GiB"))
        if flip:
            for key in out:
                if key.endswith(_MIN_KEYS):
                    out[key] = -out[key]
        return out

    def eval_log_values(self, row: list[Any] | None, stage: str) -> dict[str, float]:
        p = self.config.prefix
        short = {"validate": "val", "validation": "val", "sanity_check": "val"}.get(stage, stage)
        keys = [f"{p}/{short}/allocated_GiB", f"{p}/{short}/peak_step_GiB", f"{p}/{short}/peak_reserved_GiB"]
        if row is None or not self.enabled:
            values = [_NAN] * 3
        else:
            values = [row[E_ALLOCATED] / GiB, row[E_PEAK_ALLOCATED] / GiB, row[E_PEAK_RESERVED] / GiB]
        return self.reduce(keys, values, (keys[1],))

    # ------------------------------------------------------------------ results (readout.py)
    def history_frame(self) -> Any:
        return history_frame(self.rows, self.device_info.get("kind", "cpu"))

    def eval_frame(self) -> Any:
        return eval_frame(self.eval_rows)

    def summary(self, *, disabled_after_error: bool = False) -> dict[str, Any]:
        """Per-phase maxima, lifetime peaks and the monitor's own cost, as plain JSON-able values."""
        counts: dict[str, Any] = {
            "steps_recorded": len(self.rows),
            "steps_seen": self._seen_steps,
            "steps_sampled": self._sampled_steps,
            "history_stride": self._stride,
            "max_allocated_bytes": self.max_allocated,
            "max_reserved_bytes": self.max_reserved,
            "rank": self.rank,
            "world_size": self.world_size,
            "disabled_after_error": disabled_after_error,
        }
        return summarise(counts, self.rows, self.eval_rows, self.device_info, self.capacity)

    # ------------------------------------------------------------------ checkpointing
    def state_dict(self) -> dict[str, Any]:
        return {
            "version": STATE_VERSION,
            "columns": list(COLUMNS),
            "rows": [list(r) for r in self.rows],
            "eval_rows": [list(r) for r in self.eval_rows],
            "stride": self._stride,
            "seen_steps": self._seen_steps,
            "sampled_steps": self._sampled_steps,
            "max_allocated": self.max_allocated,
            "max_reserved": self.max_reserved,
        }

    def load_state_dict(self, state: dict[str, Any], key: str = "state_dict") -> dict[str, Any] | None:
        """Restore a saved state (older versions migrate, see saved_state.py); return the read state,
        or None for one of a newer version (skipped with a warning). ``ValueError`` names ``key``."""
        from memcallbacks._files.saved_state import read_state

        read = read_state(state, key, STATE_VERSION)
        if read is None:
            log.warning("memcallbacks: ignoring the memory-monitor state under %r: its version %r is newer than this "
                        "memcallbacks (%d); the history starts afresh.", key, state.get("version"), STATE_VERSION)
            return None
        self.rows = read["rows"]
        self.eval_rows = read["eval_rows"]
        self._stride = max(read["stride"], 1)
        self._seen_steps = read["seen_steps"]
        self._sampled_steps = read["sampled_steps"]
        self.max_allocated = max(self.max_allocated, read["max_allocated"])
        self.max_reserved = max(self.max_reserved, read["max_reserved"])
        return read
