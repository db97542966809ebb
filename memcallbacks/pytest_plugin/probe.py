"""What the pytest plugin measures on one monitor: step marks, two censuses, CPU phase peaks.

A :class:`Probe` observes one :class:`~memcallbacks._runtime.session.Session`'s step protocol
(``Session.observe``: the calls every adapter makes at step and phase boundaries), so it works the same for Lightning,
Accelerate, Transformers and plain loops. It takes a census of live tensor storages after
``warmup`` steps and again at the end of training, and marks every boundary in a
:class:`Timeline`: on CPU a ``torch.profiler`` session whose allocation events give, after the
test, the exact peak of live CPU-allocator bytes in each phase of each step (RSS high-water marks
move with glibc's heap and are not repeatable enough to compare runs).
"""

from __future__ import annotations

import logging
import weakref
from dataclasses import dataclass, field
from typing import Any, Callable

from memcallbacks._base.findings import FindingLog
from memcallbacks._base.units import format_bytes
from memcallbacks.pytest_plugin.cycles import CycleCheck, thaw
from memcallbacks.pytest_plugin.timeline import Timeline
from memcallbacks._base.columns import (ALLOCATED, PEAK_ALLOCATED, PEAK_BACKWARD, PEAK_FORWARD, PEAK_OPTIMIZER, PEAK_OTHER, PHASES,
                                        RESERVED, Phase)

log = logging.getLogger(__name__)

__all__ = ["CARRY_OVER", "LeakResult", "Probe", "Timeline", "host_growth_bytes"]

CARRY_OVER = ("parameters", "gradients", "optimizer state", "buffers", "current batch")
"""Census categories expected to stay alive from step to step: never counted as a leak."""



_CLOSE = {i: ("close", i) for i in range(len(PHASES))}


@dataclass
class LeakResult:
    """The census comparison of one monitor: unexpected tensor bytes after warmup and at the end."""

    warmup_bytes: int
    final_bytes: int
    steps: int
    """Steps between the two censuses."""
    holders: list[str] = field(default_factory=list)
    cost_s: float = 0.0
    new_bytes: int | None = None
    """Bytes of the tensors allocated after warm-up that are alive at the end (what the holders add up to)."""

    @property
    def leaked(self) -> int:
        return self.final_bytes - self.warmup_bytes


def _storage_keys_of(objects: list[Any]) -> set[Any]:
    from memcallbacks._base.storage import storage_keys
    from memcallbacks.leaks.tensors import iter_tensors

    keys: set[Any] = set()
    for obj in objects:
        for t in iter_tensors(obj):
            keys.update((str(k[0]), k[1]) for k, _ in storage_keys(t))  # as TensorRecord names them
    return keys


def _weak_tensors(keys: set[Any]) -> list[tuple[Any, Any]]:
    """``[(storage key, weakref to a tensor on it)]`` for the live tensors on the storages ``keys``."""
    from memcallbacks._base.storage import storage_keys
    from memcallbacks.leaks.census import scan_heap

    out = []
    for t in scan_heap()[1]:
        for key, _ in storage_keys(t):
            key = (str(key[0]), key[1])
            if key in keys:
                try:
                    out.append((key, weakref.ref(t)))
                except TypeError:
                    pass
    return out


def _unexpected(census: Any, ignore: set[Any]) -> tuple[int, dict[Any, Any]]:
    """Bytes (and records by storage) outside the carry-over categories and the framework's bookkeeping."""
    records = {(r.device, r.data_ptr): r for r in census.records if r.category not in CARRY_OVER}
    records = {k: r for k, r in records.items() if k not in ignore}
    return sum(r.nbytes for r in records.values()), records


class Probe:
    """Step marks, censuses and results for one monitor core. Each wrapper forwards to the real call first-class."""

    def __init__(
        self,
        core: Any,
        timeline: Timeline,
        *,
        warmup: int,
        max_leak: int,
        bookkeeping: Callable[[], list[Any]] | None = None,
        census_every_step: bool = False,
        last_step: Callable[[], bool] | None = None,
        name: str = "",
    ) -> None:
        self.core = core
        self.timeline = timeline
        self.warmup = warmup
        self.max_leak = max_leak
        self.bookkeeping = bookkeeping
        self.census_every_step = census_every_step  # for loops with no end event the probe sees (Accelerate)
        self.last_step = last_step  # True while the run's last step ends: its end census is taken there (Transformers)
        self.cycles = CycleCheck(max_leak)
        self.name = name
        self.steps = 0
        self.leak: LeakResult | None = None
        self._warmup_census: Any = None
        self._warmup_bytes = 0
        self._final_step = -1
        self.frozen = False  # set once the test body has returned: what is alive then says nothing about training
        self._warmup_alive: list[tuple[Any, Any]] = []
        self._last_batch: list[Any] = []  # weak references to the last step's batch tensors
        self.census_seconds = 0.0
        self.anchor_bytes = 0  # total tensor bytes of the latest census, where the timeline's anchor mark is
        self.host_before: Any = None  # the plugin's own host census, at the step the host channel suspected growth
        self.host_explained: Any = None  # HostExplanation: that census against the heap at the end census
        self._host_explained_step = -1
        core.observe(self)

    # ------------------------------------------------------------------ the session's observer hooks
    def step_beginning(self, micro_batch: bool) -> None:
        self.timeline.mark(id(self), _CLOSE[Phase.OTHER] if micro_batch else ("begin",))

    def phase_closed(self, phase: int) -> None:
        self.timeline.mark(id(self), _CLOSE[phase])

    def step_ended(self, batch: Any, loss: Any) -> None:
        self.timeline.mark(id(self), ("end",))
        if self.last_step is not None:  # the step's output is as transient as its batch
            batch = [batch, loss]
        self._step_ended(batch)

    def run_finishing(self) -> None:
        self._final_census(self._batch_alive())
        if self.timeline.running and self._warmup_census is None and self.steps and not self.frozen:
            self._census(self._batch_alive())  # too few steps for the leak check: the anchor for the peaks

    def _step_ended(self, batch: Any) -> None:
        from memcallbacks.leaks.tensors import iter_tensors

        self.steps += 1
        refs = []
        for t in iter_tensors(batch):
            try:
                refs.append(weakref.ref(t))
            except TypeError:
                pass
        self._last_batch = refs
        if self.steps > self.warmup and self.host_before is None and not self.frozen:
            self._host_suspected()
        if self.steps == self.warmup:
            self.cycles.baseline()
            census = self._census(batch)
            if census is not None:
                self._warmup_census = census
                self._warmup_bytes, records = _unexpected(census, self._ignored())
                batch_keys = {(r.device, r.data_ptr) for r in census.records if r.category == "current batch"}
                self._warmup_alive = _weak_tensors(set(records) | batch_keys)
                self.cycles.hold()
        elif self.steps > self.warmup and (self.census_every_step or self._is_last_step()):
            self._final_census(batch)

    # ------------------------------------------------------------------ host growth (docs/pytest.md)
    def _host_suspected(self) -> None:
        """Once the monitor's host channel raised a Python-object growth over ``max_leak``: the
        plugin's own first host census, on a thawed heap (the channel's censuses ran on the heap the
        cycle check froze at warm-up, and ``gc.get_objects()`` does not list frozen objects: the
        leaking container, made before warm-up, would be missing). The second is at the end census."""
        if not any(self._host_leak(f) for f in self.core.findings):
            return
        import time

        from memcallbacks.host.census import take_host_census

        self.cycles.keep_thawed = True
        thaw()
        t0 = time.perf_counter()
        try:
            self.host_before = take_host_census(step=self.steps)
        except Exception:
            log.warning("train_memory: a host census failed; the host holders come from the monitor.", exc_info=True)
            self.host_before = False  # not again
        finally:
            self.census_seconds += time.perf_counter() - t0

    def _explain_host(self) -> None:
        """The host census at an end census: what grew since :meth:`_host_suspected`, and who holds it."""
        before = self.host_before
        if not before or self.steps <= (before.step or 0) or self._host_explained_step == self.steps:
            return
        if self.census_every_step and self._host_explained_step >= 0 and self.steps - self._host_explained_step < 16:
            return  # a loop with no end event: at most every 16 steps
        import time

        from memcallbacks.host.census import explain_host_growth

        self._host_explained_step = self.steps
        t0 = time.perf_counter()
        try:
            self.host_explained = explain_host_growth(before, step=self.steps, ignore=[self, self.timeline, self.core])
        except Exception:
            log.warning("train_memory: the host census failed; the host holders come from the monitor.", exc_info=True)
        finally:
            self.census_seconds += time.perf_counter() - t0

    def host_holders(self) -> list[str] | None:
        """The holders of the plugin's own host census (None when it did not run): the plugin's own
        bookkeeping (its timeline of step marks) left out."""
        explained = self.host_explained
        if explained is None:
            return None
        return [str(h) for h in explained.holders if not h.path.startswith(("TrainMemory.", "Probe.", "Timeline."))]

    def host_types(self) -> list[tuple[str, int]] | None:
        explained = self.host_explained
        return None if explained is None else [(n, c) for n, c, _ in explained.types if c > 0]

    def _is_last_step(self) -> bool:
        try:
            return self.last_step is not None and bool(self.last_step())
        except Exception:
            log.debug("train_memory: could not tell the last step", exc_info=True)
            return False

    def _batch_alive(self) -> list[Any]:
        return [t for t in (r() for r in self._last_batch) if t is not None]

    # ------------------------------------------------------------------ censuses
    def _ignored(self) -> set[Any]:
        if self.bookkeeping is None:
            return set()
        try:
            return _storage_keys_of(self.bookkeeping())
        except Exception:
            log.debug("train_memory: could not read the framework's bookkeeping tensors", exc_info=True)
            return set()

    def _census(self, batch: Any, find_paths: bool = False) -> Any:
        import time

        from memcallbacks.leaks import take_census

        thaw()  # gc.get_objects() does not list a frozen heap
        t0 = time.perf_counter()
        try:
            census = take_census(current_batch=batch, find_paths=find_paths, ignore=[self, self.core])
        except Exception:
            log.warning("train_memory: a tensor census failed; the leak check is skipped for %s.", self.name, exc_info=True)
            return None
        finally:
            self.census_seconds += time.perf_counter() - t0
        if not find_paths:
            self.timeline.mark(id(self), ("anchor",))
            self.anchor_bytes = census.total_bytes
        return census

    def _final_census(self, batch: Any) -> None:
        if self.frozen or self._warmup_census is None or self.steps <= self.warmup or self._final_step == self.steps:
            return
        self._final_step = self.steps
        self.cycles.check(self.steps)
        try:
            census = self._census(batch)
            if census is None:
                return
            ignore = self._ignored()
            final, records = _unexpected(census, ignore)
            leak = LeakResult(self._warmup_bytes, final, self.steps - self.warmup)
            if leak.leaked > self.max_leak:
                leak.holders = self._new_holders(batch, ignore, leak)
            self.leak = leak
            self._explain_host()
        finally:
            # a loop with no end event checks again at its next step end
            if self.census_every_step:
                self.cycles.hold()
            else:
                self.cycles.release()

    def _new_holders(self, batch: Any, ignore: set[Any], leak: LeakResult | None = None) -> list[str]:
        """Who holds the storages that were not alive after warmup: a census with paths, grouped by holder."""
        census = self._census(batch, find_paths=True)
        if census is None:
            return []
        # storages alive since warm-up, by their tensors: an address freed and reused later is new
        before = {key for key, ref in self._warmup_alive if ref() is not None}
        grew: dict[str, list[int]] = {}
        for key, record in _unexpected(census, ignore)[1].items():
            if key in before:
                continue
            acc = grew.setdefault(record.holder or f"({record.category}, holder not found)", [0, 0])
            acc[0] += 1
            acc[1] += record.nbytes
        if leak is not None:
            leak.new_bytes = sum(b for _, b in grew.values())
        # a holder with several new tensors collects them; one new tensor is usually a rebound variable
        ranked = sorted(grew.items(), key=lambda kv: (kv[1][0] < 2, -kv[1][1]))
        return [
            f"{holder} holds {n} tensor{'s' if n != 1 else ''} / {format_bytes(b)} allocated after warm-up"
            for holder, (n, b) in ranked[:5]
        ]

    # ------------------------------------------------------------------ results
    @property
    def device_kind(self) -> str:
        return str(self.core.device_kind)

    def phase_peaks(self) -> tuple[dict[str, int], str]:
        """``({phase: peak bytes}, source)``: the largest peak of each phase over the settled steps (:meth:`measured_steps`)."""
        steps = [step for step, _ in self.measured_steps()]
        anchor = self.timeline.levels.get(id(self), {}).get("anchor")
        if self.device_kind == "cpu" and self.timeline.steps.get(id(self)) is not None and anchor is not None:
            offset = self.anchor_bytes - anchor
            peaks: dict[str, int] = {}
            for step in steps:
                for phase, value in step.items():
                    peaks[phase] = max(peaks.get(phase, value + offset), value + offset)
            if peaks:
                peaks["step"] = max(peaks.values())
            return peaks, "live CPU tensor bytes (torch.profiler allocation events)"
        return self._history_peaks(), f"the monitor's {self.device_kind} peaks"

    def measured_steps(self) -> list[tuple[dict[str, int], int]]:
        """``[(step's {phase: relative peak}, relative level at its start)]`` for the steps the CPU figures read: those
        after the warm-up census, when any ran; all steps otherwise (a run too short for the leak check).

        The warm-up steps are not repeatable in a long pytest process: until the census's ``gc.collect()``
        (:meth:`CycleCheck.baseline`), garbage that earlier tests, or an earlier run of the same test, left in
        reference cycles is still allocated (and a collection may land mid-step), and the census total that makes
        the profile's levels absolute is taken after it. A second in-process run of a conv net read each phase's
        peak 4.5 MiB (+60%) over the first: the first run's 4.6 MiB dataset was alive until warm-up. After the
        census automatic gc is off and the heap frozen (:class:`CycleCheck`), so these steps see only the test."""
        steps = self.timeline.steps.get(id(self)) or []
        starts = self.timeline.starts.get(id(self)) or []
        pairs = list(zip(steps, starts))
        settled = self.timeline.settled.get(id(self))
        after = pairs[settled:] if settled is not None else []
        return after if any(step for step, _ in after) else pairs

    def phase_rises(self) -> dict[str, int]:
        """``{phase: bytes}``: the most each phase (and ``step``, the whole step) rose above its step's
        start over the settled steps (:meth:`measured_steps`): the step's own memory, which the model, the batch and the code decide
        (the absolute peaks also hold the parameters, the optimizer state and the data kept in memory)."""
        rises: dict[str, int] = {}
        if self.device_kind == "cpu" and self.timeline.steps.get(id(self)) is not None:
            for step, start in self.measured_steps():
                for phase, value in step.items():
                    rises[phase] = max(rises.get(phase, 0), value - start)
                if step:
                    rises["step"] = max(rises.get("step", 0), max(step.values()) - start)
            return rises
        return self._history_peaks(above_start=True)

    def _history_peaks(self, above_start: bool = False) -> dict[str, int]:
        rows = self.core.rows
        if not rows:
            return {}
        peaks: dict[str, int] = {}
        columns = ((PEAK_FORWARD, "forward"), (PEAK_BACKWARD, "backward"), (PEAK_OPTIMIZER, "optimizer"), (PEAK_OTHER, "other"), (PEAK_ALLOCATED, "step"))
        start = RESERVED if self.device_kind == "cpu" else ALLOCATED  # the floor of the monitor's peaks (resident memory on CPU)
        for column, phase in columns:
            values = [max(row[column] - row[start], 0) if above_start else row[column] for row in rows
                      if row[column] == row[column] and row[start] == row[start]]  # drop NaN
            if values:
                peaks[phase] = int(max(values))
        return peaks

    def findings(self) -> list[Any]:
        """The monitor's findings that fail a test, and the cycles the plugin's own collections found: one per cause
        (a cycle the monitor also saw as the growth or the lingering step it causes is one finding, as in its report)."""
        found = [f for f in self.core.findings
                 if f.kind in ("lingering", "cycle") or self._device_leak(f) or self._host_leak(f)]
        causes = FindingLog()
        for finding in found + self.cycles.findings:
            causes.add(finding)
        return causes.findings

    def _device_leak(self, finding: Any) -> bool:
        """A device ``growth`` finding, except on CPU under the plugin's own ``torch.profiler``: there
        the monitor reads glibc's heap, where the profiler keeps its events (~850 KiB a step for a
        two-layer GPT-2), so heap growth is no evidence; tensors that stay are bounded by the census
        check (``max_leak``), and a chain of autograd graphs is still a failure."""
        if finding.kind != "growth":
            return False
        chain = finding.details.get("evidence") == "graph_chain"
        return chain or not (self.device_kind == "cpu" and self.timeline.profiled)

    def _host_leak(self, finding: Any) -> bool:
        """A Python-object host growth (key ``host_growth``) of more than ``max_leak`` bytes.

        ``host_growth:native`` (native memory that Python objects do not explain) is not a failure:
        the plugin's own ``torch.profiler`` keeps its events in native memory for the whole test.
        ``worker_growth`` and ``rank_imbalance`` are not leaks of a training step."""
        if finding.kind != "host_growth" or finding.key != "host_growth":
            return False
        return host_growth_bytes(finding) > self.max_leak


def host_growth_bytes(finding: Any) -> int:
    """What a ``host_growth`` finding says grew: the growth test's total, or the census's bytes when larger."""
    details = finding.details or {}
    return max(int(details.get("growth_bytes") or 0), int(finding.bytes or 0))
