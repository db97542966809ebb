"""Who holds what a detector found: holder searches and censuses, run only once something is found.

The step's checks (``_runtime/checks.py``) detect; this object explains. A lingering finding gets
the reference that keeps the previous step alive (through the autograd graph to its leaves); a
graph chain, the variable that links the steps' graphs; a growth finding, two censuses
:data:`GROWTH_CENSUS_GAP` steps apart whose difference names what grew, by holder. Every search's
time is handed to ``book`` (the schedule's finding work, which the budget's guard leaves out).
"""

from __future__ import annotations

import copy
import logging
from typing import Any, Callable

from memcallbacks._base.findings import Finding
from memcallbacks._base.cpu import own_time
from memcallbacks.leaks.census import Census, take_census
from memcallbacks.leaks.frozen import visible_heap
from memcallbacks.leaks.garbage import cyclic_garbage_note
from memcallbacks.leaks.gc_watch import CollectionWatch
from memcallbacks.leaks.holders import find_holders, group_paths
from memcallbacks.leaks.lingering import LingeringDetector
from memcallbacks.leaks.lingering_text import chain_finding
from memcallbacks.leaks.roots import find_graph_root
from memcallbacks.leaks.search_failure import holders_unavailable
from memcallbacks.leaks.tensors import describe_tensor, graph_bytes

log = logging.getLogger(__name__)

__all__ = ["Attribution", "GROWTH_CENSUS_GAP", "NO_TENSOR_GREW"]

# A growth finding names what grew between a census at detection and one at least this many steps later
# (at the next read from then on, or when the run ends).
GROWTH_CENSUS_GAP = 16

NO_TENSOR_GREW = (
    " The censuses found no tensor that grew between them: what grew is not tensor memory Python can reach "
    "(numpy arrays, Python objects such as lists of floats or strings, a native library's buffers, or "
    "tensors only C++ holds); look at per-step caches of those, or at the library the step calls."
)


class Attribution:
    """The holder searches and censuses of one run's leak watch. ``ignore``: the monitor's own
    objects, never holders; ``collections``: the gc watch, told that the garbage inspections here
    are the monitor's own; ``book(seconds)``: where the searches' time goes."""

    def __init__(self, time_budget_s: float, ignore: list[Any], *, book: Callable[[float], None] | None = None,
                 collections: CollectionWatch | None = None) -> None:
        self.time_budget_s = time_budget_s
        self.ignore = ignore
        self.book = book
        self.collections = collections
        self.model: Any = None  # what the census looks at
        self.optimizer: Any = None
        self._census_failure: Exception | None = None  # the last census that raised
        self._census_s = 0.0  # the last census's time
        self._growth_census: Census | None = None
        self.census_due: int | None = None
        """The step from which a growth's second census is taken (None: none is waiting)."""
        self._growth_finding: Finding | None = None
        self._growth_census_cost = 0.0  # census A's time
        self._growth_note = ""  # NO_TENSOR_GREW once the censuses found no tensor that grew

    def _booked(self, t0: float) -> None:
        if self.book is not None:
            self.book(own_time() - t0)

    # ------------------------------------------------------------------ lingering references and chains
    def lingering_holders(self, lingering: LingeringDetector) -> list[str]:
        """Who keeps the previous step alive: the reference to the graph first (the cause — a kept
        loss), rendered through the autograd graph to the leaves it holds; then the other paths."""
        targets = lingering.alive_tensors()
        holders: list[str] = []
        root = lingering.graph_root()
        if root is not None:
            leaves = [t for t in targets if getattr(t, "is_leaf", False) and t.requires_grad]
            tail = ", ".join(f"leaf tensor {describe_tensor(t)}" for t in leaves[:3]) or "its saved tensors"
            if any(t.grad is not None for t in leaves[:3]):
                tail += " (and its .grad)"
            search = self.find_holders([root])
            holders += [f"{p.path} -> autograd graph -> {tail}" for p in search.paths[:2]]
            del root
        return holders + self.holders_of(targets)[: max(0, 5 - len(holders))]

    def holders_of(self, tensors: list[Any]) -> list[str]:
        if not tensors:
            return []
        search = self.find_holders(tensors)
        paths = search.paths
        total = sum(p.nbytes for p in paths)
        # a holder of under 1/256 of what was found (a kept output's 4-byte loss next to its logits) is noise
        paths = [p for p in paths if p.nbytes * 256 >= total] or paths[:1]
        return group_paths(paths)[:5]

    def blame_garbage(self, finding: Finding, lingering: LingeringDetector) -> None:
        """No live object holds what lingers: if it sits in cyclic garbage, say so (and which cycle)."""
        targets = lingering.alive_tensors()
        root = lingering.graph_root()
        if root is not None:
            targets.append(root)
        del root
        if not targets:
            return
        note = self.garbage_note(targets)
        del targets
        if note is None:
            return
        finding.holders = note.holders
        finding.details["in_cyclic_garbage"] = True
        finding.message = note.message(finding.message)

    def chain(self, step: int, chain: list[tuple[int, Any]]) -> Finding | None:
        """The finding for graphs of several earlier steps alive at once, with the variable that links
        them; its whole time booked once (the holder search inside included), over a visible heap."""
        t0 = own_time()
        try:
            with visible_heap():
                return self._chain(step, chain)
        finally:
            self._booked(t0)

    def _chain(self, step: int, chain: list[tuple[int, Any]]) -> Finding | None:
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
                search = find_holders([root], time_budget_s=self.time_budget_s, ignore=self.ignore)  # booked by chain()
                holders = [f"{p.path} -> autograd graphs of steps {steps[0]}..{steps[-1]} and on" for p in search.paths[:2]]
                if not holders and self.garbage_note([root]) is not None:
                    return None  # graphs waiting in cyclic garbage, not a chain: the collection watch reports cycles
            except Exception as exc:
                failure = exc
            del root
        finding = chain_finding(step, steps, nbytes, holders)
        return holders_unavailable(finding, failure) if failure is not None and finding is not None else finding

    def find_holders(self, targets: list[Any]) -> Any:
        """:func:`find_holders` with the monitor's own objects ignored, its time booked."""
        t0 = own_time()
        try:
            return find_holders(targets, time_budget_s=self.time_budget_s, ignore=self.ignore)
        finally:
            self._booked(t0)

    def garbage_note(self, targets: list[Any]) -> Any:
        if self.collections is not None:
            self.collections.own = True
        try:
            return cyclic_garbage_note(targets)
        finally:
            if self.collections is not None:
                self.collections.own = False

    # ------------------------------------------------------------------ growth: two censuses name what grew
    def growth(self, step: int, finding: Finding | None, batch: Any) -> list[Finding]:
        """What the growth detector said at ``step`` (``finding``, or None), with its holders once the
        second census is due: census A when a growth is first raised (again when a settled one
        re-opens), census B :data:`GROWTH_CENSUS_GAP` steps later."""
        due = self.census_due
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
            self._growth_census = self.measured_census(batch)
            self._growth_census_cost = self._census_s
            self.census_due = step + GROWTH_CENSUS_GAP
        elif due is not None and step >= due:
            return self._name_growth(step, batch)
        return [finding]

    def finish(self) -> list[Finding]:
        """The run ends: a growth finding still waiting for its second census gets it now (a short
        run, or one whose reads are far apart, would otherwise end with a growth finding and no holder)."""
        if self.census_due is None or self._growth_finding is None:
            return []
        return self._name_growth(self._growth_finding.step, None, sighting=False)

    def _name_growth(self, step: int, batch: Any, sighting: bool = True) -> list[Finding]:
        self.census_due = None
        finding, before = self._growth_finding, self._growth_census
        self._growth_census = None
        if finding is None:
            return []
        after = self.measured_census(batch) if before is not None else None
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

    # ------------------------------------------------------------------ censuses
    def measured_census(self, batch: Any) -> Census | None:
        """:meth:`census` for the detectors' own use, timed and booked: a failure only costs the holders."""
        t0 = own_time()
        try:
            census = self.census(batch)
        except Exception as exc:
            log.debug("census failed", exc_info=True)
            self._census_failure = exc  # the growth finding says why it has no holders
            return None
        finally:
            self._census_s = own_time() - t0
            if self.book is not None:
                self.book(self._census_s)
        return census

    def census(self, batch: Any = None) -> Census:
        """A census now (for ``explain()``): live tensors by category, and who holds the suspicious ones."""
        return take_census(model=self.model, optimizer=self.optimizer, current_batch=batch,
                           time_budget_s=self.time_budget_s, ignore=self.ignore)
