"""The pytest plugin's timeline: one ``torch.profiler`` session per test (CPU allocation events only)
and the step and phase boundary marks in it, from which :class:`~memcallbacks.pytest_plugin.probe.Probe`
reads the exact peak of live CPU-allocator bytes in each phase of each step."""

from __future__ import annotations

from typing import Any

from memcallbacks._base.columns import PHASES

__all__ = ["Timeline", "MARKER"]

MARKER = "memcallbacks::train_memory_mark"


class Timeline:
    """One ``torch.profiler`` session per test (CPU allocation events only) and the boundary marks in it."""

    def __init__(self) -> None:
        self._prof: Any = None
        self.profiled = False  # the profiler ran in this test: its events sat in the process's native heap
        self.labels: list[tuple[int, tuple[Any, ...]]] = []  # (probe id, label), in mark order
        self.unavailable = ""
        self.steps: dict[int, list[dict[str, int]]] = {}  # probe id -> per step {phase: relative peak}
        self.starts: dict[int, list[int]] = {}  # probe id -> per step the relative level at its start
        self.levels: dict[int, dict[str, int]] = {}  # probe id -> {"anchor": relative level}
        self.settled: dict[int, int] = {}
        """probe id -> how many of its steps had begun at its first census (warm-up's): the steps after it are the
        settled ones (``Probe.measured_steps``)."""

    def start(self) -> None:
        from torch.profiler import ProfilerActivity, profile

        from memcallbacks._base import torch_private as _tp

        if _tp.profiler_enabled():
            self.unavailable = "another torch.profiler was running"
            return
        try:
            prof = profile(activities=[ProfilerActivity.CPU], profile_memory=True)
            prof.__enter__()
        except Exception as exc:  # an unusual torch build: fall back to the monitor's RSS peaks
            self.unavailable = f"torch.profiler would not start ({exc})"
            return
        self._prof = prof
        self.profiled = True

    @property
    def running(self) -> bool:
        return self._prof is not None

    def mark(self, probe: int, label: tuple[Any, ...]) -> None:
        if self._prof is None:
            return
        import torch

        with torch.profiler.record_function(MARKER):
            pass
        self.labels.append((probe, label))

    def stop(self) -> None:
        """Stop profiling and turn the events into per-step phase peaks; safe to call twice."""
        prof, self._prof = self._prof, None
        if prof is None:
            return
        from memcallbacks._base import torch_private as _tp

        try:
            prof.__exit__(None, None, None)
            events, times = _tp.profiler_memory_events(prof, MARKER)
        except Exception as exc:
            self.unavailable = f"the profile could not be read ({type(exc).__name__}: {exc})"
            return
        if len(times) != len(self.labels):
            self.unavailable = f"{len(times)} marks in the profile, {len(self.labels)} expected"
            return
        self._segments([e for e in events if e.device_type == "cpu"], times)

    def _segments(self, events: list[Any], times: list[int]) -> None:
        """Walk events and marks in time order: the running sum of allocations is the live level."""
        level, peak, i = 0, 0, 0
        open_step: dict[int, dict[str, int] | None] = {}
        for (probe, label), t in zip(self.labels, times):
            while i < len(events) and events[i].time_ns < t:
                level += events[i].nbytes
                if level > peak:
                    peak = level
                i += 1
            # the segment that ends at this mark peaked at `peak`
            kind = label[0]
            step = open_step.get(probe)
            if kind == "close" and step is not None:
                name = PHASES[label[1]]
                step[name] = max(step.get(name, peak), peak)
            elif kind == "begin":
                step = {}
                open_step[probe] = step
                self.steps.setdefault(probe, []).append(step)
                self.starts.setdefault(probe, []).append(level)
            elif kind == "end":
                open_step[probe] = None
            elif kind == "anchor":
                self.levels.setdefault(probe, {})["anchor"] = level
                self.settled.setdefault(probe, len(self.steps.get(probe, [])))
            peak = level
