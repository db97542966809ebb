"""The leak watch at step boundaries: lingering references, growth, cycles and the census.

``LeakWatch`` runs the detectors (lingering references in :mod:`memcallbacks.leaks.lingering`, baseline
growth in :mod:`memcallbacks.leaks.growth`, periodic garbage collection in :mod:`memcallbacks.leaks.cycles`)
and, when one fires, the census of :mod:`memcallbacks.leaks.census` to name the holders. It is
framework-free; the session hands over the batch, the loss and the training objects.
"""

from __future__ import annotations

import copy
import logging
from typing import Any, Callable

from memcallbacks._base.config import MonitorConfig
from memcallbacks._base.findings import Finding
from memcallbacks._base.own_clock import own_time
from memcallbacks.leaks.census import Census, take_census
from memcallbacks.leaks.cycles import GarbageCollector
from memcallbacks.leaks.garbage import cyclic_garbage_note
from memcallbacks.leaks.frozen import visible_heap
from memcallbacks.leaks.gc_watch import CollectionWatch
from memcallbacks.leaks.growth import GrowthDetector
from memcallbacks.leaks.holders import find_holders, group_paths
from memcallbacks.leaks.lingering import LingeringDetector, chain_finding
from memcallbacks.leaks.roots import find_graph_root
from memcallbacks.leaks.search_failure import holders_unavailable, search_or_note
from memcallbacks.leaks.tensors import describe_tensor, graph_bytes

log = logging.getLogger(__name__)

__all__ = ["LeakWatch"]

# A growth finding names what grew between a census at detection and one at least this many steps later
# (at the next read from then on, or when the run ends).
GROWTH_CENSUS_GAP = 16

NO_TENSOR_GREW = (
    " The censuses found no tensor that grew between them: what grew is not tensor memory Python can reach "
    "(numpy arrays, Python objects such as lists of floats or strings, a native library's buffers, or "
    "tensors only C++ holds); look at per-step caches of those, or at the library the step calls."
)


class LeakWatch:
    """Per-step leak detection. Each method is cheap unless something is wrong."""

    def __init__(
        self,
        config: MonitorConfig,
        allocated_now: Callable[[], int | None],
        ignore: list[Any],
        *,
        charge: Callable[[float], None] | None = None,
        wake: Callable[[], None] | None = None,
        schedule: Any = None,
    ) -> None:
        """``charge``: told the seconds the garbage-collection callback spends reading memory;
        ``wake``: called when a large automatic collection makes the next step inspect the garbage;
        ``schedule``: booked the seconds of each lingering check and of each census and holder search
        (:class:`memcallbacks._runtime.schedule.Schedule`), so that the budget sees every part."""
        self.config = config
        self.schedule = schedule
        self._ignore = ignore  # our own objects, never reported as holders
        self.lingering = (
            LingeringDetector(min_bytes=config.lingering_min_bytes) if config.detect_leaks else None
        )
        self.growth = (
            GrowthDetector(
                warmup_steps=config.growth_warmup_steps,
                min_rate_bytes=config.growth_min_bytes_per_step,
                min_growth_bytes=config.growth_min_total_bytes,
            )
            if config.detect_leaks
            else None
        )
        self.gc = (
            GarbageCollector(
                every_n_steps=config.gc_every_n_steps,
                disable_automatic=config.gc_disable_automatic,
                allocated_bytes=allocated_now,
            )
            if config.gc_every_n_steps
            else None
        )
        # Python's automatic collections, measured through gc.callbacks (a `cycle` finding needs no
        # configuration); off when the periodic collection has turned them off anyway
        self.collections = (
            CollectionWatch(allocated_now, min_bytes=config.lingering_min_bytes, charge=charge, wake=wake)
            if config.detect_leaks and not config.gc_disable_automatic
            else None
        )
        self.gc_results: list[dict[str, Any]] = []
        self._growth_census: Census | None = None
        self._census_failure: Exception | None = None  # the last census that raised
        self._growth_census_due: int | None = None  # the step from which census B is taken
        self._growth_finding: Finding | None = None
        self._last_scan: tuple[int, float] | None = None  # (step, seconds) of the last check that scanned the heap
        self._census_s = 0.0  # the last census's time
        self._growth_census_cost = 0.0  # census A's time
        self._growth_note = ""  # NO_TENSOR_GREW once the censuses found no tensor that grew
        self.model: Any = None
        self.optimizer: Any = None

    def start(self) -> None:
        if self.gc is not None:
            self.gc.start()
        if self.collections is not None:
            self.collections.start()

    def stop(self) -> None:
        if self.gc is not None:
            self.gc.stop()
        if self.collections is not None:
            self.collections.stop()

    # ------------------------------------------------------------------ at step start, before the baseline
    def check_lingering(self, step: int, batch: Any) -> list[Finding]:
        if self.lingering is None:
            return []
        schedule = self.schedule
        if schedule is None or not self.lingering.pending:
            return self._check_lingering(step, batch)
        t0, f0 = own_time(), schedule.booked_finding_s
        scans = self.lingering.heap_scans
        # a heap scan (a graph root no variable reaches) is taken when the budget has paid for the last one
        last = self._last_scan
        self.lingering.heap_allowed = last is None or schedule.affords(last[1], step - last[0])
        try:
            return self._check_lingering(step, batch)
        finally:
            spent = own_time() - t0 - (schedule.booked_finding_s - f0)
            if self.lingering.heap_scans > scans:
                schedule.heap_scans += self.lingering.heap_scans - scans
                self._last_scan = (step, spent)
            schedule.book_lingering(spent)

    def _check_lingering(self, step: int, batch: Any) -> list[Finding]:
        assert self.lingering is not None
        found = []
        finding = self.lingering.check(step, current_batch=batch)
        if finding is not None:
            finding.holders = search_or_note(finding, self.lingering_holders, [])
            if not finding.holders and "holders_unavailable" not in finding.details:
                search_or_note(finding, lambda: self._blame_garbage(finding), None)
            found.append(finding)
        chain = self.lingering.chains.check(step)
        if chain is not None:
            t0 = own_time()
            try:
                with visible_heap():
                    finding = self._chain(step, chain)
            finally:
                if self.schedule is not None:
                    self.schedule.book_finding(own_time() - t0)
            if finding is not None:
                found.append(finding)
        return found

    def _chain(self, step: int, chain: list[tuple[int, Any]]) -> Finding | None:
        """The finding for graphs of several earlier steps alive at once, with the variable that links them."""
        steps = [s for s, _ in chain]
        oldest = chain[0][1]
        del chain
        # the marked loss itself when it is alive (no heap scan; the heap listing also misses a frozen heap)
        loss_ref = getattr(oldest, "loss_ref", None)
        root = loss_ref() if loss_ref is not None else None
        if root is None:
            root = find_graph_root(oldest)
        holders: list[str] = []
        nbytes = 0
        failure: Exception | None = None
        if root is not None:
            nbytes = graph_bytes(root)
            try:
                search = self._find_holders([root])
                holders = [f"{p.path} -> autograd graphs of steps {steps[0]}..{steps[-1]} and on" for p in search.paths[:2]]
                if not holders and self._garbage_note([root]) is not None:
                    return None  # graphs waiting in cyclic garbage, not a chain: the collection watch reports cycles
            except Exception as exc:
                failure = exc
            del root
        finding = chain_finding(step, steps, nbytes, holders)
        return holders_unavailable(finding, failure) if failure is not None and finding is not None else finding

    def _find_holders(self, targets: list[Any]) -> Any:
        """:func:`find_holders` with the monitor's own objects ignored, its time booked as finding work."""
        t0 = own_time()
        try:
            return find_holders(targets, time_budget_s=self.config.census_time_budget_s, ignore=self._ignore)
        finally:
            if self.schedule is not None:
                self.schedule.book_finding(own_time() - t0)

    def _garbage_note(self, targets: list[Any]) -> Any:
        if self.collections is not None:
            self.collections.own = True
        try:
            return cyclic_garbage_note(targets)
        finally:
            if self.collections is not None:
                self.collections.own = False

    def _blame_garbage(self, finding: Finding) -> None:
        """No live object holds what lingers: if it sits in cyclic garbage, say so (and which cycle)."""
        assert self.lingering is not None
        targets = self.lingering.alive_tensors()
        root = self.lingering.graph_root()
        if root is not None:
            targets.append(root)
        del root
        if not targets:
            return
        note = self._garbage_note(targets)
        del targets
        if note is None:
            return
        finding.holders = note.holders
        finding.details["in_cyclic_garbage"] = True
        finding.message = note.message(finding.message)

    def before_baseline(self, step: int, batch: Any, *, lingering: bool = True) -> list[Finding]:
        found: list[Finding] = self.check_lingering(step, batch) if lingering else []
        collections = self.collections
        if collections is not None and collections.due:
            finding = self._inspect_collections(collections, step)
            if finding is not None:
                found.append(finding)
        if self.gc is not None:
            if collections is not None:
                collections.own = True
            try:
                result = self.gc.maybe_collect(step)
            finally:
                if collections is not None:
                    collections.own = False
            if result is not None:
                self.gc_results.append(
                    {"step": step, "seconds": result.seconds, "collected": result.collected, "bytes_freed": result.bytes_freed}
                )
                if len(self.gc_results) > 1000:
                    del self.gc_results[: len(self.gc_results) // 2]
                finding = result.to_finding()
                if finding is not None:
                    found.append(finding)
        return found

    def _inspect_collections(self, collections: CollectionWatch, step: int) -> Finding | None:
        try:
            return collections.inspect(step)
        except Exception:
            log.debug("could not inspect the garbage", exc_info=True)
            return None

    # ------------------------------------------------------------------ on sampled steps, after the baseline
    def after_baseline(self, step: int, baseline: int, batch: Any) -> list[Finding]:
        """Feed one memory read (allocated bytes at the start of ``step``) to growth detection; the
        growth finding, and its holders once the second census is due."""
        if self.growth is None:
            return []
        finding = self.growth.update(step, baseline)
        due = self._growth_census_due
        if finding is None:
            if due is not None and step >= due:
                # the holders arrive on a step the detector did not report: an update, not a new sighting
                return self._name_growth(step, batch, sighting=False)
            return []
        reopened = finding.details.get("reopened", 0)
        first = self._growth_finding is None or reopened > self._growth_finding.details.get("reopened", 0)
        self._growth_finding = finding
        if self._growth_note and finding.state == "open" and self._growth_note not in finding.message:
            finding.message += self._growth_note  # later confirmations keep what the censuses found
        if first:
            # census A now (again when a settled growth re-opens); census B some steps later tells what grew, by holder
            self._growth_census = self._census(batch)
            self._growth_census_cost = self._census_s
            self._growth_census_due = step + GROWTH_CENSUS_GAP
        elif due is not None and step >= due:
            return self._name_growth(step, batch)
        return [finding]

    def finish(self) -> list[Finding]:
        """The run ends: a growth finding still waiting for its second census gets it now (a short
        run, or one whose reads are far apart, would otherwise end with a growth finding and no holder)."""
        if self._growth_census_due is None or self._growth_finding is None:
            return []
        return self._name_growth(self._growth_finding.step, None, sighting=False)

    def _name_growth(self, step: int, batch: Any, sighting: bool = True) -> list[Finding]:
        self._growth_census_due = None
        finding, before = self._growth_finding, self._growth_census
        self._growth_census = None
        if finding is None:
            return []
        after = self._census(batch) if before is not None else None
        if before is None or after is None:
            if self._census_failure is None:
                return []
            finding = holders_unavailable(copy.copy(finding) if not sighting else finding, self._census_failure)
            if not sighting:
                finding.count = 0
            return [finding]
        deltas = [d for d in after.diff(before) if d.bytes > 0]
        finding.holders = [str(d) for d in deltas[:5]]
        if not deltas:
            self._growth_note = NO_TENSOR_GREW
            finding.details["tensors_grew"] = False
        if self._growth_note and finding.state == "open" and self._growth_note not in finding.message:
            finding.message += self._growth_note
        # the two censuses' time as the budget counted it (summary.cadence.finding_time_s), not only their scans
        finding.details["census_cost_s"] = round(self._growth_census_cost + self._census_s, 3)
        if not sighting:
            finding = copy.copy(finding)
            finding.count = 0  # FindingLog.add: merge the holders, leave the count alone
        return [finding]

    # ------------------------------------------------------------------ at step end
    def end_step(self, step: int, batch: Any, loss: Any, outputs: Any = None) -> None:
        if self.lingering is not None:
            self.lingering.end_step(step, batch, loss, outputs)

    # ------------------------------------------------------------------ attribution
    def lingering_holders(self) -> list[str]:
        """Who keeps the previous step alive: the reference to the graph first (the cause — a kept
        loss), rendered through the autograd graph to the leaves it holds; then the other paths."""
        assert self.lingering is not None
        targets = self.lingering.alive_tensors()
        holders: list[str] = []
        root = self.lingering.graph_root()
        if root is not None:
            leaves = [t for t in targets if getattr(t, "is_leaf", False) and t.requires_grad]
            tail = ", ".join(f"leaf tensor {describe_tensor(t)}" for t in leaves[:3]) or "its saved tensors"
            if any(t.grad is not None for t in leaves[:3]):
                tail += " (and its .grad)"
            search = self._find_holders([root])
            holders += [f"{p.path} -> autograd graph -> {tail}" for p in search.paths[:2]]
            del root
        return holders + self.holders_of(targets)[: max(0, 5 - len(holders))]

    def holders_of(self, tensors: list[Any]) -> list[str]:
        if not tensors:
            return []
        search = self._find_holders(tensors)
        paths = search.paths
        total = sum(p.nbytes for p in paths)
        # a holder of under 1/256 of what was found (a kept output's 4-byte loss next to its logits) is noise
        paths = [p for p in paths if p.nbytes * 256 >= total] or paths[:1]
        return group_paths(paths)[:5]

    def _census(self, batch: Any) -> Census | None:
        """:meth:`census` for the detectors' own use: a failure only costs the holders."""
        t0 = own_time()
        try:
            census = self.census(batch)
        except Exception as exc:
            log.debug("census failed", exc_info=True)
            self._census_failure = exc  # the growth finding says why it has no holders
            return None
        finally:
            self._census_s = own_time() - t0
            if self.schedule is not None:
                self.schedule.book_finding(self._census_s)
        return census

    def census(self, batch: Any = None) -> Census:
        """A census now (for ``explain()``)."""
        return take_census(
            model=self.model,
            optimizer=self.optimizer,
            current_batch=batch,
            time_budget_s=self.config.census_time_budget_s,
            ignore=self._ignore,
        )

