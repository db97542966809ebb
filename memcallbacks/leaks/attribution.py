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
from memcallbacks.leaks.census import NO_ROOT, NOT_SEARCHED, UNNAMED, Census, container_of, take_census
from memcallbacks.leaks.frozen import visible_heap
from memcallbacks.leaks.garbage import GarbageNote, cyclic_garbage_note, garbage_holding, gc_paused
from memcallbacks.leaks.gc_watch import CollectionWatch
from memcallbacks.leaks.holders import find_holders, group_paths
from memcallbacks.leaks.lingering import LingeringDetector
from memcallbacks.leaks.lingering_text import chain_finding, growth_fix, holder_cause, through_exception
from memcallbacks.leaks.roots import find_graph_root, find_graph_roots
from memcallbacks.leaks.search_failure import holders_unavailable, search_or_note
from memcallbacks.leaks.tensors import describe_tensor, graph_bytes
from memcallbacks._base.units import format_bytes

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
                 collections: CollectionWatch | None = None, allocated_now: Callable[[], int | None] | None = None) -> None:
        """``allocated_now``: the watch's memory read, for a growth's size at the run's end (:meth:`finish`)."""
        self.time_budget_s = time_budget_s
        self.allocated_now = allocated_now
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
        self._growth_fix = ""  # the fix for the holder that grew most, once the censuses named it
        self._census_step = 0  # census A's step
        self._named_step: int | None = None  # the step of the last census that named the holders
        self._named_held: list[str] = []  # the holders that census named
        self._census_total_s = 0.0  # the censuses' time after census A
        self.cycles_seen = False
        """A lingering step or a chain of graphs turned out to sit in cyclic garbage."""

    def _booked(self, t0: float) -> None:
        if self.book is not None:
            self.book(own_time() - t0)

    # ------------------------------------------------------------------ lingering references and chains
    def explain_lingering(self, finding: Finding, lingering: LingeringDetector) -> Finding:
        """``finding`` with who keeps the previous step alive, and the fix for that holder (a list on a module is not a
        loop variable the next step rebinds); a ``cycle`` finding instead when only cyclic garbage holds it. The
        automatic collector is held off meanwhile: it would free that garbage while the search looks for it."""
        with gc_paused():
            held_by: list[str] = []
            finding.holders = search_or_note(finding, lambda: self.lingering_holders(lingering, held_by), [])
            if finding.holders:
                finding.details["held_by"] = held_by
                if finding.severity == "problem":
                    finding.message = holder_cause(finding.message, finding.holders[0])
                return finding
            if "holders_unavailable" in finding.details:
                return finding
            note = search_or_note(finding, lambda: self._lingering_garbage(lingering), None)
        if note is None:
            return finding
        what = finding.message.split(" still alive")[0]
        self.cycles_seen = True
        return note.cycle_finding(finding, finding.step, what, finding.bytes or 0)

    def _lingering_garbage(self, lingering: LingeringDetector) -> GarbageNote | None:
        targets = lingering.alive_tensors()
        root = lingering.graph_root()
        if root is not None:
            targets.append(root)
        del root
        return self.garbage_note(targets) if targets else None

    def lingering_holders(self, lingering: LingeringDetector, held_by: list[str] | None = None) -> list[str]:
        """Who keeps the previous step alive: the reference to the graph first (the cause — a kept
        loss), rendered through the autograd graph to the leaves it holds; then the other paths.
        ``held_by`` gets the holders' containers (``FSDPBlocks.kept``), what ties it to a growth of theirs."""
        targets = lingering.alive_tensors()
        holders: list[str] = []
        held_by = [] if held_by is None else held_by
        root = lingering.graph_root()
        if root is not None:
            leaves = [t for t in targets if getattr(t, "is_leaf", False) and t.requires_grad]
            tail = ", ".join(f"leaf tensor {describe_tensor(t)}" for t in leaves[:3]) or "its saved tensors"
            if any(t.grad is not None for t in leaves[:3]):
                tail += " (and its .grad)"
            search = self.find_holders([root])
            holders += [f"{p.path} -> autograd graph -> {tail}" for p in search.paths[:2]]
            held_by += [container_of(p.holder) for p in search.paths[:2]]
            del root
        return holders + self.holders_of(targets, held_by)[: max(0, 5 - len(holders))]

    def holders_of(self, tensors: list[Any], held_by: list[str] | None = None) -> list[str]:
        if not tensors:
            return []
        search = self.find_holders(tensors)
        paths = search.paths
        total = sum(p.nbytes for p in paths)
        # a holder of under 1/256 of what was found (a kept output's 4-byte loss next to its logits) is noise
        paths = [p for p in paths if p.nbytes * 256 >= total] or paths[:1]
        if held_by is not None:
            held_by += [c for c in dict.fromkeys(container_of(p.holder) for p in paths) if c not in held_by]
        return group_paths(paths)[:5]

    def chain(self, step: int, chain: list[tuple[int, Any]]) -> Finding | None:
        """The finding for graphs of several earlier steps alive at once, with the variable that links
        them; its whole time booked once (the holder search inside included), over a visible heap, with the
        automatic collector held off (graphs in cyclic garbage are a cycle's: see :meth:`explain_lingering`)."""
        t0 = own_time()
        try:
            with visible_heap(), gc_paused():
                return self._chain(step, chain)
        finally:
            self._booked(t0)

    def _chain(self, step: int, chain: list[tuple[int, Any]]) -> Finding | None:
        steps = [s for s, _ in chain]
        # the marked losses themselves when they are alive (no heap scan; the heap listing also misses a frozen heap),
        # else a tensor of each step's graph: the oldest is the one whose holder links them, all of them are its size
        marked = [getattr(sentinel, "loss_ref", lambda: None)() for _, sentinel in chain]
        root = marked[0] if marked[0] is not None else find_graph_root(chain[0][1])
        roots = [r for r in marked[1:] if r is not None] + ([root] if root is not None else [])
        if len(roots) < len(chain):
            roots += find_graph_roots([sentinel for (_, sentinel), r in zip(chain[1:], marked[1:]) if r is None])
        del chain, marked
        holders: list[str] = []
        held_by: list[str] = []
        failure: Exception | None = None
        note: GarbageNote | None = None
        nbytes = graph_bytes(roots or ([root] if root is not None else []))  # every step's graph the chain keeps
        del roots
        if root is not None:
            try:
                search = find_holders([root], time_budget_s=self.time_budget_s, ignore=self.ignore)  # booked by chain()
                holders = [f"{p.path} -> autograd graphs of steps {steps[0]}..{steps[-1]} and on" for p in search.paths[:2]]
                held_by = [container_of(p.holder) for p in search.paths[:2]]
                if not holders:
                    note = self.garbage_note([root])
            except Exception as exc:
                failure = exc
            del root
        finding = chain_finding(step, steps, nbytes, holders)
        if note is not None:  # graphs waiting in cyclic garbage: a cycle keeps them, not a variable that links them
            self.cycles_seen = True
            what = f"The autograd graphs of steps {', '.join(map(str, steps))} ({format_bytes(nbytes)}) were all"
            return note.cycle_finding(finding, step, what, nbytes)
        if held_by:
            finding.details["held_by"] = held_by
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
        for text in (self._growth_note, self._growth_fix):
            if text and finding.state == "open" and text not in finding.message:
                finding.message += text  # later confirmations keep what the censuses found
        if first:
            with gc_paused():  # the same heap as census B's will see: cyclic garbage still there
                self._growth_census = self.measured_census(batch)
                note = self._in_cycles(self._growth_census) if self._growth_census is not None else None
            self._growth_census_cost = self._census_s
            self._census_total_s, self._census_step, self._named_step = 0.0, step, None
            self.census_due = step + GROWTH_CENSUS_GAP
            if note is not None:
                return [self._cycle_of(finding, note)]
        elif due is not None and step >= due:
            return self._name_growth(step, batch)
        return [finding]

    def finish(self) -> list[Finding]:
        """The run ends: a growth finding still waiting for its second census gets it now (a short
        run, or one whose reads are far apart, would otherwise end with a growth finding and no holder);
        one still open whose holders were named before its last update is named again against its first
        census, so that the report says what the holders keep at the end, as the growth does."""
        finding = self._growth_finding
        if finding is None:
            return []
        if self.census_due is not None:
            return self._name_growth(finding.step, None, sighting=False)
        stale = self._named_step is not None and finding.step > self._named_step
        if not (stale and finding.state == "open" and self._growth_census is not None and not self._growth_note):
            return []
        live, fix = list(self._named_held), self._growth_fix
        named = self._name_growth(finding.step, None, sighting=False)
        if live and live[0] not in self._named_held:  # its holder is gone (a local of a function that returned): the live one stays
            self._growth_fix = fix
            return []
        return [self._grown_by_the_end(f) if f.kind == "growth" and f.state == "open" else f for f in named]

    def _grown_by_the_end(self, finding: Finding) -> Finding:
        """A growth named at the run's end, with its size then: the memory read now against the floor the growth is
        measured from, when it grew since the growth's last update (reads thinned to every few dozen steps leave the
        last one behind the census), so that the holders' size and the growth's are of the same moment."""
        d = finding.details
        now = self.allocated_now() if self.allocated_now is not None else None
        if now is None or not isinstance(d.get("floor_bytes"), int) or not isinstance(d.get("growth_bytes"), int):
            return finding
        grown = int(now - (d["floor_bytes"] - d["growth_bytes"]))
        if grown <= (finding.bytes or 0):
            return finding
        finding = copy.copy(finding)
        finding.details = dict(d, growth_bytes_at_end=grown)
        finding.bytes = grown
        finding.message += f" By the run's end it had grown by {format_bytes(grown)} in all."
        return finding

    def _name_growth(self, step: int, batch: Any, sighting: bool = True) -> list[Finding]:
        self.census_due = None
        finding, before = self._growth_finding, self._growth_census
        if finding is None:
            return []
        with gc_paused():  # what grew may sit in cyclic garbage: the collector must not free it before it is looked at
            after = self.measured_census(batch) if before is not None else None
            if before is None or after is None:
                self._growth_census = None
                if self._census_failure is None:
                    return []
                finding = holders_unavailable(copy.copy(finding) if not sighting else finding, self._census_failure)
                if not sighting:
                    finding.count = 0
                return [finding]
            self._named_step = step
            self._census_total_s += self._census_s
            deltas = [d for d in after.diff(before) if d.bytes > 0]
            note = self._describe_growth(finding, before, after, deltas)
        if not deltas:
            self._growth_note = NO_TENSOR_GREW
            finding.details["tensors_grew"] = False
        for text in (self._growth_note, self._growth_fix):
            if text and finding.state == "open" and text not in finding.message:
                finding.message += text
        # the censuses' time as the budget counted it (summary.cadence.finding_time_s), not only their scans
        finding.details["census_cost_s"] = round(self._growth_census_cost + self._census_total_s, 3)
        if not sighting:
            finding = copy.copy(finding)
            finding.count = 0  # FindingLog.add: merge the holders, leave the count alone
        if note is not None and not self.cycles_seen:  # what grew sits in cyclic garbage: the growth is a cycle's
            return [finding, self._cycle_of(finding, note)]
        return [finding]

    def _in_cycles(self, census: Census) -> GarbageNote | None:
        """Whether the storages no holder keeps at census A sit in cyclic garbage, looked at only where a cycle was
        seen in this run (a lingering step or graphs in cyclic garbage, a large automatic collection): the look
        collects, and garbage that is not this run's (an earlier fit's in the same process) would lower the floor
        the growth is measured from."""
        collections = self.collections
        if not (self.cycles_seen or (collections is not None and collections.large)):
            return None
        keys = {(r.device, r.data_ptr) for r in census.records if r.holder is None or r.holder == NO_ROOT}
        return garbage_holding(keys) if keys else None

    def _cycle_of(self, growth: Finding, note: GarbageNote) -> Finding:
        """The ``cycle`` finding a growth turns out to be: what grew sits in cyclic garbage. The growth's later updates
        are its evidence (the growth detector's key, in the cycle's evidence, joins it)."""
        self.cycles_seen = True
        d = growth.details
        what = (f"The tensors that made memory at step start grow by {format_bytes(d.get('growth_bytes', growth.bytes))} "
                f"since step {d.get('since_step')} were")
        return note.cycle_finding(growth, growth.step, what, int(growth.bytes or 0))

    def _describe_growth(self, finding: Finding, before: Census, after: Census, deltas: list[Any]) -> GarbageNote | None:
        """The holders that grew between the censuses, each with what it keeps through the autograd graphs of its
        tensors and in all (``details["held_by"]``, ``holder_bytes``); what grew with no holder is looked for in the
        cyclic garbage (``details["cycles"]``: then the growth is a cycle's)."""
        note = None
        finding.holders = [str(d) for d in deltas[:5]]
        named = [d for d in deltas if d.holder not in UNNAMED]
        self._named_held = [d.holder for d in named[:5]]
        if named:
            finding.details["held_by"] = self._named_held
            if named[0] is deltas[0]:  # the fix for the holder that grew most (a kept exception's when its paths say so)
                top = named[0].holder
                kept_exception = any(through_exception(r.path) for r in after.records
                                     if r.path and r.holder is not None and container_of(r.holder) == top)
                self._growth_fix = growth_fix(top, named[0].graph_bytes > 0, kept_exception)
        if deltas:
            top = deltas[0]
            finding.details.update(holder_bytes=int(top.held_bytes if top.held_bytes is not None else top.bytes),
                                   holder_growth_bytes=int(top.bytes), census_steps=[self._census_step, finding.step])
        unnamed = [d for d in deltas[:3] if d.holder in UNNAMED and d.holder != NOT_SEARCHED]
        if unnamed and sum(d.bytes for d in unnamed) * 2 >= sum(d.bytes for d in deltas):
            note = garbage_holding(after.grown_keys(before, [d.holder for d in unnamed]))
            if note is not None:
                finding.details["cycles"] = note.cycles
                finding.holders = (finding.holders + note.holders[:1])[:6]
        return note

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
