"""The growth finding's lifecycle: when the floor last rose (:class:`RiseTracker`), when a growth
has stopped, and the settled finding (docs/findings.md, "The lifecycle: raised, settled, re-opened")."""

from __future__ import annotations

import collections
import copy

from memcallbacks._base.findings import Finding
from memcallbacks._base.units import format_bytes

__all__ = ["RAISE_MAX_GAPS", "SETTLE_MIN_GAPS", "RiseTracker", "settled_finding"]

RAISE_MAX_GAPS = 2
"""A finding is raised (or updated) only while its floor rose within this many expected rise
intervals: growth that already stopped is not raised (see SETTLE_MIN_GAPS for the measurement)."""

SETTLE_MIN_GAPS = 4
"""A finding settles only after this many expected rise intervals pass with no rise (see
:meth:`RiseTracker.settle_after`). Measured on planted leaks in a plain loop at defaults (4 MiB to
64 KiB per step, fixed and variable batch sizes, 150-400 steps, reads thinned after step 48): the longest stretch without a rise inside a
continuing leak was 1.3 expected intervals, the expected interval being one tolerance of growth at the
leak's rate or the steps between reads, whichever is longer (docs/findings.md, "The lifecycle")."""


class RiseTracker:
    """When the memory floor last rose, on block minima: the evidence that growth goes on or stopped.

    A *rise* is a block minimum above the floor of the last rise by more than the tolerance: twice
    the step-to-step noise (the median within-block range), and at least ``min_rate_bytes``. A floor
    that drops below the last rise's (memory freed) moves the reference down with it.

    Thinned reads (the watch's cadence backed off, the host's Python-object count on a stride): a
    block that holds one read has no within-block range, so it adds nothing to the noise estimate
    (zeros would shrink the tolerance to ``min_rate_bytes`` and make the allocator's slow creep over
    a long gap a "rise"), and its rise counts only when the floor climbed by at least half of
    ``min_rate_bytes`` per step since the last rise (the same rate the growth detector
    asks of a read): a leak does, a full cache creeping by a few KiB between reads does not.
    """

    __slots__ = ("min_rate_bytes", "anchor", "anchor_step", "last_rise", "start", "_ranges", "_last_add", "read_gap")

    def __init__(self, min_rate_bytes: int) -> None:
        self.min_rate_bytes = min_rate_bytes
        self.anchor: int | None = None  # the floor at the last rise
        self.anchor_step = 0  # the step the anchor was set at
        self.last_rise: int | None = None
        self.start: int = 0  # where the growth under test began (the trend's first block)
        self._ranges: collections.deque[int] = collections.deque(maxlen=16)
        self._last_add: int | None = None
        self.read_gap = 1  # steps between the last two closed blocks: nothing is known in between

    @property
    def tolerance(self) -> float:
        ranges = sorted(self._ranges)
        noise = ranges[len(ranges) // 2] if ranges else 0
        return max(2.0 * noise, float(self.min_rate_bytes))

    def add(self, step: int, lo: int, spread: int, reads: int = 2) -> None:
        """One closed block: its last step, its minimum, its range and the reads it holds."""
        if self._last_add is not None and step > self._last_add:
            self.read_gap = step - self._last_add
        self._last_add = step
        if reads > 1:
            self._ranges.append(spread)
        if self.anchor is None:
            self.anchor, self.anchor_step = lo, step
            return
        tolerance = self.tolerance
        if lo > self.anchor + tolerance:
            if reads > 1 or lo - self.anchor >= self.min_rate_bytes / 2 * (step - self.anchor_step):
                self.anchor, self.anchor_step, self.last_rise = lo, step, step
        elif lo < self.anchor - tolerance:
            self.anchor, self.anchor_step = lo, step

    def rose(self, step: int, lo: int, since: int) -> None:
        """A strict climb ending at ``step`` (the fast test): the floor rose now."""
        self.anchor, self.anchor_step, self.last_rise = lo, step, step
        self.started(since)

    def started(self, since: int) -> None:
        if self.last_rise is None or since < self.start or self.start == 0:
            self.start = since

    def since_rise(self, step: int) -> int:
        return step - self.last_rise if self.last_rise is not None else 0

    def expected_gap(self, rate: float) -> float:
        """Steps between two rises of a leak that goes on at ``rate``: one tolerance of growth, or
        the steps between two blocks when reads are further apart than that."""
        return max(self.tolerance / max(rate, 1.0), float(self.read_gap))

    def settle_after(self, rate: float) -> int:
        """Flat steps that show growth at ``rate`` bytes/step has stopped: as many as it grew for
        (a warm-up as long as its plateau is still ambiguous), and at least ``SETTLE_MIN_GAPS``
        expected rise intervals (the longest quiet stretch a continuing leak showed is far shorter)."""
        grew = (self.last_rise or 0) - self.start
        gap = self.expected_gap(rate)
        return int(max(grew, SETTLE_MIN_GAPS * gap, 8))

    def stopped(self, step: int, rate: float) -> bool:
        if self.last_rise is None:
            return False
        return step - self.last_rise >= self.settle_after(rate)


def settled_finding(last: Finding, step: int, rises: RiseTracker, floor_step: int, rate: float) -> Finding:
    """``last`` (an open growth finding) marked settled at ``step``: the floor has stayed flat since
    ``rises.last_rise`` for :meth:`RiseTracker.settle_after` steps at ``rate``."""
    assert rises.last_rise is not None
    settled = copy.copy(last)
    settled.details = dict(last.details)
    settled.count = 0  # an update of the same cause, not a new sighting
    settled.step = step
    grew = rises.last_rise - rises.start
    flat = step - rises.last_rise
    settled.bytes = int(last.bytes or 0)
    settled.state = "settled"
    settled.details.update(
        settled_step=step,
        settled_bytes=int(last.bytes or 0),
        last_rise_step=rises.last_rise,
        grew_steps=grew,
        flat_steps=flat,
        steps_since_rise=flat,
        settle_after_steps=rises.settle_after(rate),
    )
    settled.message = (
        f"Settled: memory at step start grew by {format_bytes(settled.bytes)} from step {floor_step} to step "
        f"{rises.last_rise} ({grew} steps), then stayed flat for {flat} steps (to step {step}). Growth that "
        "stops is a cache or queue filling during warm-up (a bounded queue, a cache per shape), not a leak; "
        "the finding re-opens if it grows again."
    )
    return settled
