"""Growth detection: a steady climb of the memory floor at step start, on block minima; its lifecycle."""

from __future__ import annotations

import collections
import copy
import math
import operator
from dataclasses import dataclass
from typing import Any, Callable

from memcallbacks._base.findings import Finding
from memcallbacks._base.limits import runs_out_text
from memcallbacks._base.units import KiB, MiB, format_bytes

__all__ = ["GrowthDetector", "RiseTracker", "RAISE_MAX_GAPS", "SETTLE_MIN_GAPS", "settled_finding", "thinned_rate"]

# a window's (step, floor, ceiling) blocks: their steps and floors, read by C getters
_STEP, _FLOOR = operator.itemgetter(0), operator.itemgetter(1)

# ---------------------------------------------------------------- the lifecycle: raised, settled, re-opened
# when the floor last rose (RiseTracker), when a growth has stopped, and the settled finding
# (docs/findings.md, "The lifecycle: raised, settled, re-opened")

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

    A rise counts only when the floor climbed by at least half of ``min_rate_bytes`` per step since
    the last rise (the same rate the growth detector asks of a read): a leak does, a full cache
    creeping by a few hundred bytes a step does not, however long it creeps. (Without the rate, a
    creep of 0.3 KiB/step in the Python-object count, the monitor's own history among it, passed the
    16 KiB tolerance every ~50 steps and kept a filled ``lru_cache``'s finding open for good.)

    Thinned reads (the watch's cadence backed off, the host's Python-object count on a stride): a
    block that holds one read has no within-block range, so it adds nothing to the noise estimate
    (zeros would shrink the tolerance to ``min_rate_bytes`` and make the allocator's slow creep over
    a long gap a "rise").
    """

    __slots__ = ("min_rate_bytes", "anchor", "anchor_step", "last_rise", "start", "_ranges", "_last_add", "read_gap", "tolerance")

    def __init__(self, min_rate_bytes: int) -> None:
        self.min_rate_bytes = min_rate_bytes
        self.anchor: int | None = None  # the floor at the last rise
        self.anchor_step = 0  # the step the anchor was set at
        self.last_rise: int | None = None
        self.start: int = 0  # where the growth under test began (the trend's first block)
        self._ranges: collections.deque[int] = collections.deque(maxlen=16)
        self._last_add: int | None = None
        self.read_gap = 1  # steps between the last two closed blocks: nothing is known in between
        # a rise is a floor above the anchor by twice the noise (the median within-block range), and at
        # least min_rate_bytes: kept as the ranges change, not sorted again at every block
        self.tolerance = float(min_rate_bytes)

    def add(self, step: int, lo: int, spread: int, reads: int = 2) -> None:
        """One closed block: its last step, its minimum, its range and the reads it holds."""
        if self._last_add is not None and step > self._last_add:
            self.read_gap = step - self._last_add
        self._last_add = step
        if reads > 1:
            self._ranges.append(spread)
            ranges = sorted(self._ranges)
            self.tolerance = max(2.0 * ranges[len(ranges) // 2], float(self.min_rate_bytes))
        if self.anchor is None:
            self.anchor, self.anchor_step = lo, step
            return
        tolerance = self.tolerance
        if lo > self.anchor + tolerance:
            if lo - self.anchor >= self.min_rate_bytes / 2 * (step - self.anchor_step):
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
        runs_out=None,  # a growth that stopped does not run memory out: its forecast is withdrawn
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


# ---------------------------------------------------------------- the growth test

def thinned_rate(reads: list[tuple[int, int]], max_points: int = 24) -> tuple[float, float]:
    """``(rate, z)`` of ``(step, bytes)`` reads that may be thinned (uneven steps apart): the Theil–Sen
    slope per step and the Mann–Kendall z of the trend, on at most ``max_points`` reads spread evenly.

    The one rule both channels use to say how fast a sparse series grew over a span: a single jump
    between two reads (a list built at an epoch's start) moves the median slope little and the trend
    z not at all, where a two-point difference would take it for the whole span's growth."""
    if len(reads) > max_points:
        stride = (len(reads) - 1) / (max_points - 1)
        reads = [reads[round(i * stride)] for i in range(max_points)]
    n = len(reads)
    if n < 2:
        return 0.0, 0.0
    s = 0
    slopes = []
    for i in range(n - 1):
        xi, yi = reads[i]
        for j in range(i + 1, n):
            d = reads[j][1] - yi
            s += (d > 0) - (d < 0)
            slopes.append(d / ((reads[j][0] - xi) or 1))
    slopes.sort()
    m = len(slopes)
    rate = slopes[m // 2] if m % 2 else (slopes[m // 2 - 1] + slopes[m // 2]) / 2
    z = (s - (s > 0) + (s < 0)) / math.sqrt(n * (n - 1) * (2 * n + 5) / 18)
    return rate, z


class _Level:
    """Step-start baselines summarised as blocks of ``size`` steps: (first step, min, max)."""

    __slots__ = ("size", "blocks", "n", "step0", "lo", "hi")

    def __init__(self, size: int, keep: int) -> None:
        self.size = size
        self.blocks: collections.deque[tuple[int, int, int]] = collections.deque(maxlen=keep)
        self.n = 0
        self.step0 = 0
        self.lo = 0
        self.hi = 0

    def add(self, step: int, lo: int, hi: int) -> bool:
        """Fold one sample (or a finer block) in; True when a block closed."""
        if self.n == 0:
            self.step0, self.lo, self.hi = step, lo, hi
        else:
            if lo < self.lo:
                self.lo = lo
            if hi > self.hi:
                self.hi = hi
        self.n += 1
        if self.n < self.size:
            return False
        self.blocks.append((self.step0, self.lo, self.hi))
        self.n = 0
        return True


@dataclass
class _Trend:
    rate: float
    span_steps: int
    since_step: int
    z: float
    noise: float


class GrowthDetector:
    """Finds a steady climb of the step-start baseline (allocated bytes when a step begins).

    Feed ``update(step, baseline_bytes)`` once per optimizer step. After ``warmup_steps`` the
    baselines are summarised as per-block minima (blocks of ``block_steps`` steps, and of
    ``8 * block_steps`` for slow leaks). The minimum of a block is the memory floor: a variable
    batch, a long sequence, an eval pass or a checkpoint save only add on top of it, while a leak
    raises it. A window of block minima fires when all of these hold:

    * Mann–Kendall monotonic trend, z >= ``z_min`` (6 blocks: at most one pair out of order);
    * Theil–Sen slope >= ``min_rate_bytes`` per step;
    * growth over the window (slope x span) >= ``min_growth_bytes`` and >= ``noise_factor`` x
      the median within-block range (the step-to-step noise);
    * no single block-to-block jump carries more than ``max_jump_fraction`` of the growth, and no
      two together more than ``max_two_jumps_fraction`` (one-off steps such as a lazily built
      cache or a native library's workspace are not leaks, even when two of them fall in one
      window on a heap that creeps up by a few KiB per step).

    Fast leaks are also tested on blocks of 1 and 2 steps (``fast_block_steps``), where the
    within-block range says nothing about noise; there each block-to-block rise must also be
    at least ``min_step_fraction`` of the median rise (a leak is steady; noise is not). So the
    latency scales with the rate: with the defaults a leak of 4 MiB/step is found about 6 steps
    after warm-up, 1 MiB/step about 10, 256 KiB/step about 24, 64 KiB/step about 190.
    ``update`` costs about 1-2 µs: the trend test runs only when a block closes and the floor
    has risen by ``min_growth_bytes`` inside the window.
    """

    def __init__(
        self,
        *,
        warmup_steps: int = 10,
        min_rate_bytes: int = 64 * KiB,
        min_growth_bytes: int = 4 * MiB,
        block_steps: int = 4,
        min_blocks: int = 6,
        max_blocks: int = 16,
        z_min: float = 2.3,
        noise_factor: float = 2.0,
        max_jump_fraction: float = 0.5,
        max_two_jumps_fraction: float = 0.75,
        fast_block_steps: tuple[int, ...] = (1, 2),
        min_step_fraction: float = 0.25,
    ) -> None:
        checks = (
            ("warmup_steps", warmup_steps, warmup_steps >= 0, "use 0 or more"),
            ("min_rate_bytes", min_rate_bytes, min_rate_bytes > 0, "use a positive byte count, e.g. 65536"),
            ("min_growth_bytes", min_growth_bytes, min_growth_bytes >= 0, "use 0 or more bytes"),
            ("block_steps", block_steps, block_steps >= 1, "use 1 or more"),
            ("min_blocks", min_blocks, min_blocks >= 4, "use 4 or more (fewer blocks cannot show a trend)"),
            ("max_blocks", max_blocks, max_blocks >= min_blocks, "use at least min_blocks"),
            ("z_min", z_min, z_min > 0, "use e.g. 2.3"),
            ("noise_factor", noise_factor, noise_factor >= 0, "use 0 or more"),
            ("max_jump_fraction", max_jump_fraction, 0 < max_jump_fraction <= 1, "use a value in (0, 1]"),
            ("max_two_jumps_fraction", max_two_jumps_fraction, max_jump_fraction <= max_two_jumps_fraction <= 1,
             "use a value between max_jump_fraction and 1"),
        )
        for name, value, ok, fix in checks:
            if not ok:
                raise ValueError(f"GrowthDetector({name}={value!r}) is invalid; {fix}.")
        self.warmup_steps = warmup_steps
        self.min_rate_bytes = min_rate_bytes
        self.min_growth_bytes = min_growth_bytes
        self.block_steps = block_steps
        self.min_blocks = min_blocks
        self.max_blocks = max_blocks
        self.z_min = z_min
        self.noise_factor = noise_factor
        self.max_jump_fraction = max_jump_fraction
        self.max_two_jumps_fraction = max_two_jumps_fraction
        self.fast_block_steps = tuple(n for n in fast_block_steps if 1 <= n < block_steps)
        self.min_step_fraction = min_step_fraction
        self.forecast: Callable[[int, float, bool], dict[str, Any] | None] | None = None
        """``forecast(step, rate, new)``: when memory runs out at ``rate`` bytes/step (``new``: a finding raised or
        re-opened now; rate 0: it settled), asked at every open finding (the runtime's ``Forecast.device``)."""
        self.reset()

    def reset(self) -> None:
        """Forget all history (e.g. when a new fit starts)."""
        self._seen = 0
        self._fine = _Level(self.block_steps, self.max_blocks)
        self._coarse = _Level(8, self.max_blocks)  # 8 fine blocks per coarse block
        self._fast = [_Level(n, self.min_blocks) for n in self.fast_block_steps]
        self._floor0: tuple[int, int] | None = None  # (step, bytes) of the first floor after warm-up
        self._last_step: int | None = None
        self._last_read: int | None = None
        self._last_read_rise: int | None = None
        self._read_gap = 1
        self._strict_climb: int | None = None
        self.rises = RiseTracker(self.min_rate_bytes)
        self.last: Finding | None = None
        """The latest growth finding, if the leak has been confirmed."""

    def update(self, step: int, baseline_bytes: int) -> Finding | None:
        """Record the baseline at the start of ``step``; a Finding while a leak is confirmed.

        The finding (key ``"growth"``) is returned again, with new numbers, each time a later
        block confirms the trend; a :class:`FindingLog` keeps one entry and updates it.
        """
        self._seen += 1
        if self._seen <= self.warmup_steps:
            return None
        for level in self._fast:
            if level.add(step, baseline_bytes, baseline_bytes):
                finding = self._fast_block_closed(step, level)
                if finding is not None:
                    return finding
        # A block spans ``block_steps`` steps, not samples: when the watch is thinned (every k-th
        # step read) a block holds fewer reads, so the latency in steps does not grow with k.
        gap = step - self._last_step if self._last_step is not None and step > self._last_step else 1
        self._last_step = step
        # the last read that rose by at least half the slowest reported rate since the read before
        prev = self._last_read
        if prev is not None and baseline_bytes - prev >= self.min_rate_bytes * gap // 2:
            self._last_read_rise = step
        self._last_read = baseline_bytes
        self._read_gap = gap
        fine = self._fine  # _Level.add inlined: this is the per-step path
        if fine.n == 0:
            fine.step0 = step
            fine.lo = fine.hi = baseline_bytes
        elif baseline_bytes < fine.lo:
            fine.lo = baseline_bytes
        elif baseline_bytes > fine.hi:
            fine.hi = baseline_bytes
        fine.n += 1
        if step + gap - fine.step0 < fine.size:
            return None
        fine.blocks.append((fine.step0, fine.lo, fine.hi))
        self.rises.add(step, fine.lo, fine.hi - fine.lo, fine.n)
        fine.n = 0
        found = self._block_closed(step)
        if found is None and self.last is not None and self.last.state == "open":
            return self._maybe_settle(step)
        return found

    def _fast_block_closed(self, step: int, level: _Level) -> Finding | None:
        """A fast leak, on blocks of 1-2 steps: a strict, steady climb over ``min_blocks`` blocks."""
        blocks = level.blocks
        if len(blocks) < self.min_blocks or blocks[-1][1] - blocks[0][1] < self.min_growth_bytes:
            return None
        ys = [b[1] for b in blocks]
        rises = sorted(ys[i + 1] - ys[i] for i in range(len(ys) - 1))
        if rises[0] <= 0 or rises[0] < self.min_step_fraction * rises[len(rises) // 2]:
            return None
        trend = self._test_window(list(blocks))
        if trend is None:
            return None
        if self._floor0 is None or self._floor0[0] > blocks[0][0]:
            self._floor0 = (blocks[0][0], blocks[0][1])
        self.rises.rose(step, ys[-1], trend.since_step)  # a strict climb up to this step: growing now
        self._strict_climb = step
        return self._finding(step, ys[-1], trend)

    def _block_closed(self, step: int) -> Finding | None:
        fine, coarse = self._fine, self._coarse
        step0, lo, hi = fine.blocks[-1]
        if self._floor0 is None:
            self._floor0 = (step0, lo)
        trend = self._test(fine.blocks)
        if coarse.add(step0, lo, hi) and trend is None:
            trend = self._test(coarse.blocks)
        if trend is None:
            return None
        return self._finding(step, lo, trend)

    def _finding(self, step: int, lo: int, trend: _Trend) -> Finding | None:
        assert self._floor0 is not None
        rises = self.rises
        rises.started(trend.since_step)
        last = self.last
        if last is not None and last.state == "settled":
            if (rises.last_rise is None or rises.last_rise <= last.details["settled_step"]
                    or lo - last.details["floor_bytes"] < self.min_growth_bytes):
                return None  # the window still holds the growth that settled: nothing new
            rises.start = last.details["settled_step"]  # the new growth's own length decides when it settles
        elif not self._growing(step, trend.rate) or rises.stopped(step, trend.rate):
            return None  # the growth had stopped when the trend was confirmed: a warm-up, not a leak
        floor_step, floor_bytes = self._floor0
        growth = lo - floor_bytes
        open_since = last.details.get("since_step", step) if last is not None and last.state != "settled" else step
        since = min(trend.since_step, open_since)  # an open growth's start, not the latest window's (a user check: "since step 54")
        runs_out = self.forecast(step, trend.rate, last is None or last.state == "settled") if self.forecast is not None else None
        finding = Finding(
            kind="growth",
            step=step,
            key="growth",
            bytes=int(growth),
            message=(
                f"Memory at step start grew steadily by {format_bytes(trend.rate)}/step since step "
                f"{since} (+{format_bytes(growth)} since step {floor_step}). {runs_out_text(runs_out, end=' ')}Something keeps "
                "memory from every step, most often tensors: a list or dict on a module or a global that gets "
                "a tensor per step (`self.cache.append(out)`), a running total without `.detach()` "
                "(`total += loss` — use `total += loss.item()`), or outputs stored on `self`. Store "
                "`.item()` or `.detach().cpu()` values, bound or clear the cache, and check the "
                "holders: two censuses some steps apart name the tensors that grew, or say that none did."
            ),
            details={
                "rate_bytes_per_step": int(trend.rate),
                "growth_bytes": int(growth),
                "since_step": since,
                "window_steps": trend.span_steps,
                "z": round(trend.z, 2),
                "noise_bytes": int(trend.noise),
                "floor_bytes": int(lo),
                "steps_since_rise": rises.since_rise(step),
                "runs_out": runs_out,
            },
        )
        if last is not None:
            finding.first_step = last.first_step
            finding.details["reopened"] = int(last.details.get("reopened", 0))
            for key in ("reopened_step", "settled_step", "settled_bytes"):
                if key in last.details:
                    finding.details[key] = last.details[key]
            if last.state == "settled":
                finding.details["reopened"] += 1
                finding.details["reopened_step"] = step
            if finding.details["reopened"]:
                finding.message = (
                    f"Re-opened at step {finding.details['reopened_step']}: the growth that settled at step "
                    f"{finding.details['settled_step']} ({format_bytes(finding.details['settled_bytes'])} above step "
                    f"{floor_step}) grows again. "
                ) + finding.message
        self.last = finding
        return finding

    def _growing(self, step: int, rate: float) -> bool:
        """The evidence that the growth goes on at ``step``: a strict climb up to this step (the fast
        test), or this read rose since the one before (by half the slowest reported rate per step
        between them: with reads thinned to every few dozen steps, a warm-up that stopped shows the
        same floor at both) and the block minima rose within ``RAISE_MAX_GAPS`` expected intervals
        (a leak that goes on showed at most 1.3; a warm-up that stopped shows many)."""
        rises = self.rises
        if self._strict_climb == step:
            return True
        if self._last_read_rise != step:
            return False
        return rises.last_rise is None or step - rises.last_rise <= RAISE_MAX_GAPS * rises.expected_gap(rate)

    def _maybe_settle(self, step: int) -> Finding | None:
        """The open finding, marked settled, once the floor has stayed flat long enough."""
        last = self.last
        assert last is not None
        rate = float(last.details.get("rate_bytes_per_step") or self.min_rate_bytes)
        if not self.rises.stopped(step, rate):
            return None
        floor_step = self._floor0[0] if self._floor0 is not None else (last.first_step or 0)
        self.last = settled_finding(last, step, self.rises, floor_step, rate)
        withdrawn = self.forecast(step, 0.0, False) if self.forecast is not None else None
        if withdrawn is not None:  # the settled line says it (announce)
            self.last.details["runs_out_withdrawn"] = withdrawn["step"]
        return self.last

    def _test(self, blocks: collections.deque[tuple[int, int, int]]) -> _Trend | None:
        n_all = len(blocks)
        if n_all < self.min_blocks:
            return None
        for n in (self.min_blocks, n_all) if n_all > self.min_blocks else (n_all,):
            trend = self._test_window(list(blocks)[-n:])
            if trend is not None:
                return trend
        return None

    def _test_window(self, window: list[tuple[int, int, int]]) -> _Trend | None:
        ys = list(map(_FLOOR, window))  # builtins, not comprehensions: this runs at every read
        # Cheap gate first: the floor must have risen by the minimum growth inside the window.
        if ys[-1] - min(ys) < self.min_growth_bytes or ys[-1] <= ys[0]:
            return None
        xs = list(map(_STEP, window))
        n = len(ys)
        s = 0
        slopes = []
        for i in range(n - 1):
            yi, xi = ys[i], xs[i]
            for j in range(i + 1, n):
                d = ys[j] - yi
                s += (d > 0) - (d < 0)
                slopes.append(d / ((xs[j] - xi) or 1))
        z = (s - 1) / math.sqrt(n * (n - 1) * (2 * n + 5) / 18)
        if z < self.z_min:
            return None
        slopes.sort()
        m = len(slopes)
        rate = slopes[m // 2] if m % 2 else (slopes[m // 2 - 1] + slopes[m // 2]) / 2
        if rate < self.min_rate_bytes:
            return None
        span = xs[-1] - xs[0]
        growth = rate * span
        ranges = sorted(b[2] - b[1] for b in window)
        noise = float(ranges[len(ranges) // 2])
        if growth < self.min_growth_bytes or growth < self.noise_factor * noise:
            return None
        total = ys[-1] - ys[0]
        jumps = sorted(ys[i + 1] - ys[i] for i in range(n - 1))
        if jumps[-1] > self.max_jump_fraction * total or jumps[-1] + jumps[-2] > self.max_two_jumps_fraction * total:
            return None
        # A leak that started inside the window is steeper than the whole-window slope says.
        recent = sorted((ys[j] - ys[i]) / ((xs[j] - xs[i]) or 1) for i in range(n - 4, n) for j in range(i + 1, n))
        rate = max(rate, recent[len(recent) // 2])
        return _Trend(rate=rate, span_steps=span, since_step=xs[0], z=z, noise=noise)
