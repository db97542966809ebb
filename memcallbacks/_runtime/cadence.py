"""Which steps are watched, sampled and logged, and the sampling interval the overhead budget allows.

Three cadences, each with its own job:

* **watch** (every step): one memory read at step start (glibc's in-use heap on CPU, the
  allocator's ``memory_allocated`` on accelerators) for growth detection and the snapshot triggers, plus the lingering check. It runs whether or not anything is logged.
* **sample**: per-phase peaks and a history row. Its interval is chosen from the measured cost
  of a sampled step and the measured step time so that the monitor stays within
  ``overhead_budget`` (``sample_every_n_steps`` overrides it).
* **log**: a logger write, every ``log_every_n_steps`` (the framework's setting by default). Logged
  steps are always sampled.

The watch is thinned only when its own cost alone would exceed the budget (very short CPU steps,
where one ``mallinfo2`` read can take 15-150 µs in a fragmented training heap).
"""

from __future__ import annotations

import collections
import math
import time
from typing import Any, Callable

from memcallbacks._config import MonitorConfig
from memcallbacks._runtime.devices import heap_in_use_bytes, host_rss_reader

__all__ = ["Cadence", "watch_reader", "LINGERING_EVERY_STEP_UNTIL"]

# Lingering references are checked after every one of the first steps, then on sampled steps only.
LINGERING_EVERY_STEP_UNTIL = 20
# Steps sampled at the start, before the budget has measurements to choose from.
MEASURE_STEPS = 8
# The interval is chosen again every this many steps, from the latest measurements.
CHOOSE_EVERY = 16
MAX_INTERVAL = 1024
MAX_WATCH_INTERVAL = 8


def watch_reader(backend: Any) -> Callable[[], int]:
    """The read that sees a tensor leak step over step (docs/benchmarks.md): glibc's in-use heap on
    CPU (``mallinfo2``; RSS from ``statm`` is cheaper but lags a leak while freed heap is reused),
    the caching allocator's own counter elsewhere (~1 µs)."""
    if backend.kind == "cpu":
        return heap_in_use_bytes
    return lambda: backend.current()[0]


def _median(values: Any) -> float:
    ordered = sorted(values)
    return float(ordered[len(ordered) // 2]) if ordered else math.nan


class Cadence:
    """Step intervals for watching, sampling and logging, and the monitor's measured cost."""

    def __init__(self, config: MonitorConfig) -> None:
        self.config = config
        self.budget = config.overhead_budget
        self.explicit = config.sample_every_n_steps is not None
        self.sample_every = config.sample_every_n_steps or 1
        self.watch_every = 1
        self.log_every = 50
        self.logs = True  # False: the run has nowhere to log (no logger), so no step is a logged step
        self.log_first_step = False
        self._last_start: float | None = None
        self._step_times: collections.deque[float] = collections.deque(maxlen=64)
        self._watch_costs: collections.deque[float] = collections.deque(maxlen=64)
        self._sample_costs: collections.deque[float] = collections.deque(maxlen=32)
        self.own_s = 0.0
        self.step_s = 0.0
        self.steps = 0

    def configure(self, *, log_every: int, logs: bool, log_first_step: bool) -> None:
        self.log_every = log_every
        self.logs = bool(logs)
        self.log_first_step = bool(log_first_step)

    # ------------------------------------------------------------------ decisions (counts only)
    def will_log(self, count: int) -> bool:
        if not self.logs:
            return False
        return (count + 1) % self.log_every == 0 or (self.log_first_step and count == 0)

    def wants_sample(self, count: int, log: bool) -> bool:
        if log or (count + 1) % self.sample_every == 0:
            return True
        return not self.explicit and count < MEASURE_STEPS

    def wants_watch(self, count: int) -> bool:
        return self.watch_every == 1 or count % self.watch_every == 0

    # ------------------------------------------------------------------ measurements
    def step_started(self, count: int) -> None:
        """Time the previous step (start to start, the monitor's own time included)."""
        now = time.perf_counter()
        if self._last_start is not None:
            elapsed = now - self._last_start
            self._step_times.append(elapsed)
            self.step_s += elapsed
            self.steps += 1
        self._last_start = now
        if count >= MEASURE_STEPS and (count - MEASURE_STEPS) % CHOOSE_EVERY == 0:
            self.choose()  # first as soon as the measured steps are over, then every CHOOSE_EVERY

    def pause(self) -> None:
        """Evaluation or a checkpoint between steps: the next start-to-start gap is not a step."""
        self._last_start = None

    def charge(self, seconds: float, sampled: bool, typical: bool = True) -> None:
        """Add the monitor's own time for one step; ``typical=False`` (a census after a finding)
        counts in the overhead but not in the costs that choose the intervals."""
        self.own_s += seconds
        if typical:
            (self._sample_costs if sampled else self._watch_costs).append(seconds)

    def choose(self) -> None:
        """Pick the watch and sample intervals that keep the monitor within the budget."""
        step = _median(self._step_times)
        if not step > 0:
            return
        allowed = self.budget * step
        watch = _median(self._watch_costs) if self._watch_costs else 0.0
        # thinned only if it must (its cost alone is over the budget): that delays detection
        self.watch_every = min(MAX_WATCH_INTERVAL, max(1, math.ceil(watch / allowed)))
        if self.explicit or not self._sample_costs:
            return
        extra = max(_median(self._sample_costs) - watch, 0.0)
        left = allowed - watch / self.watch_every
        every = MAX_INTERVAL if left <= 0 else math.ceil(extra / left)
        self.sample_every = max(1, min(MAX_INTERVAL, every))

    # ------------------------------------------------------------------ what it says about itself
    @property
    def overhead(self) -> float:
        """The monitor's measured own time as a fraction of the step time (NaN before two steps)."""
        return self.own_s / self.step_s if self.step_s > 0 else math.nan

    def summary(self) -> dict[str, Any]:
        step = _median(self._step_times)
        return {
            "overhead_budget": self.budget,
            "overhead": None if math.isnan(self.overhead) else round(self.overhead, 5),
            "watch_every_n_steps": self.watch_every,
            "sample_every_n_steps": self.sample_every,
            "sample_interval_source": "config" if self.explicit else "overhead_budget",
            "log_every_n_steps": self.log_every if self.logs else None,
            "step_time_median_s": None if math.isnan(step) else step,
            "watch_cost_median_us": round(_median(self._watch_costs) * 1e6, 2) if self._watch_costs else None,
            "sample_cost_median_us": round(_median(self._sample_costs) * 1e6, 2) if self._sample_costs else None,
        }
