"""Host growth: the leak test of ``leaks/growth.py`` on two host series, with its lifecycle.

Two :class:`~memcallbacks.leaks.growth.GrowthDetector` instances (composition, same test, same
latency): one on the Python-object series (``sys.getallocatedblocks()`` x
:data:`BYTES_PER_BLOCK`), one on the private resident memory
(``statm``: resident - shared). Either confirms a ``host_growth`` finding; when only the resident
series climbs, the Python-object series over the same steps says whether Python objects explain it
(key ``host_growth``) or not (key ``host_growth:native``: C extensions, pinned buffers, tensors on
CPU — on a CPU run the device channel already watches that heap, so ``device_is_host=True`` drops
it and one leak is not reported twice).

Lifecycle: the detectors' own (docs/findings.md, "The lifecycle"): a finding is raised while its
series grows, *settled* when the series' floor has stayed flat for the longest of as many steps as it
grew, 4 expected rise intervals, or 8 steps (a cache that filled and stopped: ``lru_cache(maxsize=...)``,
``deque(maxlen=...)``, a bounded log history; ``state == "settled"``, ``details["open"] = False``),
and re-opened when it grows again. The series that last confirmed a key decides when it settles.
Thinned reads (the Python-object count on a stride, reads that follow the watch's cadence) are the
detector's to handle (:class:`~memcallbacks.leaks.growth.RiseTracker`), as for device growth.
"""

from __future__ import annotations

import collections
import copy
import sys
import time
from typing import Any, Callable, NamedTuple

from memcallbacks._base.findings import Finding
from memcallbacks._base.limits import runs_out_text
from memcallbacks._base.units import KiB, MiB, format_bytes
from memcallbacks._base.cpu import heap_in_use_bytes, pymalloc_bytes
from memcallbacks.leaks.growth import GrowthDetector, thinned_rate

__all__ = ["BYTES_PER_BLOCK", "HostGrowth", "HostReading"]

BYTES_PER_BLOCK = 64
"""Nominal bytes per allocated block, to put the block count on a byte scale for the growth test.

Measured with ``tracemalloc`` on leaks of dataclass objects, dicts of floats and memoised token
lists: 57-114 bytes per block (pymalloc blocks are 8-512 bytes; a larger object is one block
from ``malloc``). Findings report bytes from the census (``sys.getsizeof``) and from the private
resident memory, not from this estimate."""


class HostReading(NamedTuple):
    """One host read at step start."""

    step: int
    rss_bytes: int
    """Resident set (``statm`` field 2)."""
    private_bytes: int
    """Resident memory that is not file-backed or shared (resident - shared: the anonymous pages —
    the Python heap, malloc's heap, tensors on CPU)."""
    python_blocks: int | None
    """``sys.getallocatedblocks()``, or None on a step the stride skipped."""

_PYTHON_SHARE = 0.5
"""Python objects explain a resident-memory climb when they grew by at least this share of it."""

_DEVICE_SHARE = 0.25
"""On a CPU run, an open device growth at this share of a resident climb's rate or more is that climb."""

_PYTHON_RATE_DIVISOR = 4
"""The Python-object series' growth test asks a quarter of ``min_rate_bytes`` per step (16 KiB at defaults)."""

_SHARE_READS = 3
"""Python-object reads over a resident-memory climb (the one before it included) before their share of it is
judged: the climb is already confirmed on the resident series, the share only names its cause. The block count
is read every ~16 steps on a large heap, so a fourth read cost a 256 KiB/step leak 4-8 steps (found at 37-41
instead of 33)."""

_SHARE_MIN_Z = 1.0
"""The Python reads over the climb must rise as a trend (3 reads: all in order; 4: at most one pair out of order)."""

_MEASURE_STALE = 16
"""Steps after which the bytes Python objects hold are measured again when asked (the figures, a finding's
message); the growth test reads the block count, never this measure."""

_KEEP_READS = 640
"""Recent reads kept per series (for the Python share over a climb and the per-rank figures)."""


class _Series:
    """One detector and its recent (step, value) reads."""

    def __init__(self, detector: GrowthDetector, keep: int) -> None:
        self.detector = detector
        self.reads: collections.deque[tuple[int, int]] = collections.deque(maxlen=keep)


class HostGrowth:
    """Growth test on the host series. Feed :meth:`update` with each :class:`HostReading`."""

    def __init__(
        self,
        *,
        device_is_host: bool = False,
        warmup_steps: int = 10,
        min_rate_bytes: int = 64 * KiB,
        min_growth_bytes: int = 4 * MiB,
        bytes_per_block: int = BYTES_PER_BLOCK,
        device_growth: Callable[[], Finding | None] | None = None,
    ) -> None:
        if not (isinstance(bytes_per_block, int) and bytes_per_block > 0):
            raise ValueError(f"HostGrowth(bytes_per_block={bytes_per_block!r}) must be a positive integer, e.g. 64.")
        kwargs: dict[str, Any] = dict(warmup_steps=warmup_steps, min_rate_bytes=min_rate_bytes, min_growth_bytes=min_growth_bytes)
        self.device_is_host = device_is_host
        self.device_growth = device_growth
        """The device growth test's latest finding (the session's leak watch), asked before a host finding."""
        self.warmup_steps = warmup_steps
        self.bytes_per_block = bytes_per_block
        self.min_rate_bytes = min_rate_bytes
        # Python objects at a quarter of the rate: their series (block counts at step start) is far steadier
        # than resident memory, and a small-object leak of 32 KiB/step is still a leak (found within 300 steps)
        self.python = _Series(GrowthDetector(**{**kwargs, "min_rate_bytes": max(1, min_rate_bytes // _PYTHON_RATE_DIVISOR),
                                               "min_growth_bytes": min_growth_bytes // 2, "warmup_steps": 0}), _KEEP_READS)
        self.private = _Series(GrowthDetector(**kwargs), _KEEP_READS)
        self.first: HostReading | None = None
        self.last: HostReading | None = None
        self.baseline: HostReading | None = None
        """The first read after warm-up (the detectors' ``warmup_steps`` reads): growth figures start here."""
        self._python_baseline: int | None = None  # the first Python-object read at or after it
        self._heap0: tuple[int, int, int] | None = None  # (step, pymalloc bytes, malloc heap bytes) at the baseline
        self._heap: tuple[int, int, int] | None = None  # the latest such measure
        self._reads = 0
        self.seconds = 0.0
        """Time spent in the block reads this test took itself (after a resident-memory climb)."""
        self.findings: dict[str, Finding] = {}
        """The latest finding per key (open or settled)."""
        self._climb_since: int | None = None  # where the private climb under judgement began
        self._owner: dict[str, _Series] = {}  # the series that last confirmed each key: its lifecycle decides
        self.forecast: Callable[[str, int, float, bool], dict[str, Any] | None] | None = None
        """``forecast(key, step, rate, new)``: when host memory runs out at ``rate`` bytes/step (``new``: raised
        or re-opened now; rate 0: settled), asked at every open finding (the runtime's ``Forecast.host``)."""

    def update(self, reading: HostReading) -> Finding | None:
        """Fold one read in; a Finding when a cause is confirmed, updated, settled or re-opened."""
        step = reading.step
        if self.first is None:
            self.first = reading
        self.last = reading
        self._reads += 1
        if self.baseline is None and self._reads > self.warmup_steps:
            self.baseline = reading
            self.measure_python(step)  # the figures' Python-object growth runs from here, as the others
        out: Finding | None = None
        if reading.python_blocks is not None:
            value = reading.python_blocks * self.bytes_per_block
            if self.baseline is not None and self._python_baseline is None:
                self._python_baseline = value
            self.python.reads.append((step, value))
            # its warm-up is the resident series' (in reads, which are every step at first), not ten of
            # its own reads: on a stride those can be hundreds of steps
            hit = self.python.detector.update(step, value) if self.baseline is not None else None
            if hit is not None:
                out = self._settle(self.python, step, hit) if hit.state == "settled" else self._confirm(
                    "host_growth", self.python, step, hit)
        private = reading.private_bytes
        if private > 0:
            self.private.reads.append((step, private))
            hit = self.private.detector.update(step, private)
            if hit is not None and hit.state == "settled":
                self._climb_since = None
                out = self._settle(self.private, step, hit) or out
            elif hit is not None and out is None:
                out = self._private_growth(step, hit)
        return out

    def python_rise(self, since_step: int) -> int:
        """Python objects (the block count, in bytes) at the latest count over the lowest count taken at or
        after ``since_step`` (0 with fewer than two there)."""
        recent = [value for step, value in self.python.reads if step >= since_step]
        return recent[-1] - min(recent) if len(recent) >= 2 else 0

    @property
    def open_findings(self) -> list[Finding]:
        return [f for f in self.findings.values() if f.details.get("open")]

    def _python_share(self, step: int, since_step: int) -> float | None:
        """Python objects' growth rate over the private series' rate, over the climb since ``since_step``;
        None until the Python series has ``_SHARE_READS`` reads there.

        The block count is read sparsely (its cost grows with the heap), so this takes a read of its own
        when the climb has too few (spaced over the climb) or the last is more than 16 steps old: a few
        reads per suspicion. Both rates are :func:`~memcallbacks.leaks.growth.thinned_rate`'s median
        slopes, and the Python one counts only when its reads rise as a trend: one list built between
        two reads (a sampler's indices at an epoch's start) is not Python objects growing."""
        reads = self.python.reads
        # the climb's reads, from the last one before it began (the level it rose from)
        before = next((i for i in range(len(reads) - 1, -1, -1) if reads[i][0] < since_step), None)
        span = [r for r in reads if r[0] >= since_step]
        if before is not None:
            span.insert(0, reads[before])
        spacing = max(1, (step - since_step) // (2 * _SHARE_READS))
        if not span or (len(span) < _SHARE_READS and step - span[-1][0] >= spacing) or step - span[-1][0] > 16:
            t0 = time.perf_counter()
            fresh = (step, sys.getallocatedblocks() * self.bytes_per_block)
            self.seconds += time.perf_counter() - t0
            if not reads or reads[-1][0] < step:
                reads.append(fresh)
                span.append(fresh)
        if len(span) < _SHARE_READS:
            return None
        private = [r for r in self.private.reads if r[0] >= span[0][0]]
        private_rate, _ = thinned_rate(private)
        if private_rate <= 0:
            return 1.0
        python_rate, z = thinned_rate(span)
        return max(0.0, python_rate) / private_rate if z >= _SHARE_MIN_Z else 0.0

    def _device_explains(self, hit: Finding) -> bool:
        """On a CPU run the device heap is in private memory: an open device growth at a quarter of the
        private climb's rate or more is that climb (the device finding names its tensors). Not half: the
        resident climb carries the heap's fragmentation over what is in use (a Lightning module appending
        its activations: 515 KiB/step in use, 1.1 MiB/step resident), and at half a full-suite run once
        judged the rest Python objects (``test_leak_zoo``, the activations case)."""
        if not self.device_is_host or self.device_growth is None:
            return False
        device = self.device_growth()
        if device is None or device.state != "open":
            return False
        return float(device.details.get("rate_bytes_per_step", 0)) >= _DEVICE_SHARE * float(hit.details["rate_bytes_per_step"])

    def _private_growth(self, step: int, hit: Finding) -> Finding | None:
        if self._device_explains(hit):
            return None
        since = int(hit.details["since_step"])
        # the climb's start, not the detector's latest window (which slides with a fast climb): the
        # Python reads spread over the whole climb, a few per suspicion
        self._climb_since = since if self._climb_since is None else min(self._climb_since, since)
        share = self._python_share(step, self._climb_since)
        if share is None:
            return None  # judged at a later read, once the Python series has reads over the climb
        python_open = self.findings.get("host_growth")
        if share >= _PYTHON_SHARE or (python_open is not None and python_open.details.get("open")):
            return self._confirm("host_growth", self.private, step, hit, python_share=share)
        if self.device_is_host:
            return None  # the CPU heap is the device: the device growth test reports it
        return self._confirm("host_growth:native", self.private, step, hit, python_share=share)

    def _what(self, key: str, series: _Series, d: dict[str, Any], python_share: float | None) -> str:
        """The message of an open finding: what grew, the usual causes and the fix."""
        rate = int(d["rate_bytes_per_step"])
        private_rate = self.private.detector.last.details["rate_bytes_per_step"] if self.private.detector.last else None
        if key == "host_growth":
            scale = self._block_scale()
            est = "" if series is self.private else (
                f" (≈{format_bytes(rate * scale)}/step, the block count scaled by the bytes Python objects hold)" if scale
                else f" (≈{format_bytes(rate)}/step at ~{self.bytes_per_block} B a block)")
            return (
                f"Host memory in Python objects grew steadily since step {d['since_step']}{est}"
                + (f"; private resident memory by {format_bytes(private_rate)}/step" if private_rate else "")
                + ". Something keeps Python objects from every step: a dict or list on a module, a callback or "
                "the model that gets entries every step (a per-step record, a memo cache with no bound such as "
                "`functools.lru_cache(maxsize=None)` on unique inputs, objects kept by a library between steps). "
                "Bound the cache (`lru_cache(maxsize=...)`, `collections.deque(maxlen=...)`), clear it each epoch, or "
                "keep summaries instead of objects; the host census names the type and the holder."
            )
        return (
            f"Private resident memory grew steadily by {format_bytes(rate)}/step since step {d['since_step']} while "
            "Python objects did not explain it (they grew by "
            f"{100 * (python_share or 0):.0f}% of it): native memory — a C extension's cache, pinned or "
            "shared-memory buffers kept per step (`pin_memory` batches held), tensors kept on the CPU, or "
            "allocator fragmentation. Keep fewer CPU tensors between steps, release pinned buffers, and take a "
            "snapshot or a `tracemalloc` window to see the allocating code."
        )

    def _confirm(self, key: str, series: _Series, step: int, hit: Finding, python_share: float | None = None) -> Finding:
        """An open detector finding (raised, updated or re-opened) as the host finding of ``key``."""
        d = hit.details
        message = self._what(key, series, d, python_share)
        old = self.findings.get(key)
        reopened = old is not None and old.state == "settled"
        if reopened:
            message = (f"Re-opened at step {step}: the host growth that settled at step {old.details['settled_at_step']} "
                       "grows again. ") + message
        runs_out = self.forecast(key, step, self._resident_rate(series, d), old is None or reopened) if self.forecast else None
        if runs_out:
            message += " " + runs_out_text(runs_out)
        finding = Finding(
            kind="host_growth",
            step=step,
            key=key,
            bytes=int(hit.bytes or 0),
            message=message,
            details={
                "series": "python_objects" if series is self.python else "private_resident",
                "rate_bytes_per_step": int(d["rate_bytes_per_step"]),
                "growth_bytes": int(d["growth_bytes"]),
                "since_step": d["since_step"],
                "window_steps": d["window_steps"],
                "z": d["z"],
                "open": True,
                "python_share": None if python_share is None else round(python_share, 2),
                "runs_out": runs_out,
            },
        )
        if old is not None:
            finding.first_step = old.first_step
            finding.details["reopened"] = int(old.details.get("reopened", 0)) + reopened
            if reopened:
                finding.details["reopened_step"] = step
        self._owner[key] = series
        self.findings[key] = finding
        return finding

    def _settle(self, series: _Series, step: int, hit: Finding) -> Finding | None:
        """The detector of ``series`` settled its growth: settle the open finding that series owns.

        When the series owns two keys (its climb was first native, then explained by Python objects)
        both are settled; the last confirmed is returned (``findings`` holds both)."""
        out: Finding | None = None
        latest = -1
        d = hit.details
        for key, finding in list(self.findings.items()):
            if finding.state != "open" or self._owner.get(key) is not series:
                continue
            settled = copy.copy(finding)
            settled.step, settled.state, settled.count = step, "settled", 0  # an update of the same cause
            settled.message = (
                f"Settled: host memory grew from step {finding.first_step} to step {d['last_rise_step']} "
                f"({d['grew_steps']} steps), then stayed flat for {d['flat_steps']} steps (to step {step}): a cache that "
                "filled and stopped (a bounded `lru_cache`, a `deque(maxlen=...)`, a log history of bounded size), not a "
                "leak. No action needed unless the plateau itself is too high; the finding re-opens if it grows again."
            )
            settled.details = {
                **finding.details,
                "open": False,
                "settled_at_step": step,
                "runs_out": None,  # withdrawn
                **{k: d[k] for k in ("settled_step", "settled_bytes", "floor_bytes", "last_rise_step", "grew_steps",
                                     "flat_steps", "settle_after_steps") if k in d},
            }
            self.findings[key] = settled
            withdrawn = self.forecast(key, step, 0.0, False) if self.forecast is not None else None
            if withdrawn is not None:  # the settled line says it (announce)
                settled.details["runs_out_withdrawn"] = withdrawn["step"]
            if finding.step > latest:
                out, latest = settled, finding.step
        return out

    def _resident_rate(self, series: _Series, d: dict[str, Any]) -> float:
        """The rate host memory grows at, for the forecast: the private resident series' while it grows
        (what the limits count), else the finding's own (Python objects, on the block count's scale)."""
        last = self.private.detector.last
        if series is not self.private and last is not None and last.state == "open":
            return float(last.details["rate_bytes_per_step"])
        return float(d["rate_bytes_per_step"])

    def measure_python(self, step: int) -> None:
        """Measure the bytes Python objects hold (``pymalloc_bytes()`` and the malloc heap, ~0.2-1.5 ms):
        at the baseline, when asked :data:`_MEASURE_STALE` steps after the last measure, and at the run's end."""
        t0 = time.perf_counter()
        small = pymalloc_bytes()
        if small is not None:
            self._heap = (step, small, heap_in_use_bytes() or 0)
            if self._heap0 is None:
                self._heap0 = self._heap
        self.seconds += time.perf_counter() - t0

    def _python_bytes(self) -> tuple[float, float] | None:
        """``(bytes, growth since the baseline)`` of Python objects: the small ones (512 bytes or less,
        pymalloc's blocks) exactly, the large ones (a dict's table, a long list's items, big strings:
        one "block" each in the block count, whatever their size) by the malloc heap's growth, less, on
        a CPU run, the growth the device finding already holds (tensors live in the same heap). Measured again
        first when the last measure is stale: only what asks for it pays (figures, a finding's message)."""
        if self._heap0 is None or self._heap is None or self.last is None:
            return None
        if self.last.step - self._heap[0] >= _MEASURE_STALE:
            self.measure_python(self.last.step)
        large = self._heap[2] - self._heap0[2]
        if self.device_is_host and self.device_growth is not None:
            device = self.device_growth()
            if device is not None:
                large -= int(device.details.get("growth_bytes") or device.bytes or 0)
        large = max(0, large)
        return float(self._heap[1] + large), float(self._heap[1] - self._heap0[1] + large)

    def _block_scale(self) -> float | None:
        """Bytes Python objects gained per nominal block byte since the baseline (the block count calls a
        32-byte float and a 40 KiB dict table one block each), when both grew enough to say."""
        measured = self._python_bytes()
        if measured is None or self._python_baseline is None or not self.python.reads:
            return None
        at = self._heap[0] if self._heap is not None else self.python.reads[-1][0]
        blocks = next((v for st, v in reversed(self.python.reads) if st <= at), self._python_baseline) - self._python_baseline
        if blocks < self.min_rate_bytes or measured[1] <= 0:
            return None
        return min(4.0, max(0.25, measured[1] / blocks))

    def figures(self) -> dict[str, float]:
        """This process's host figures for the per-rank gather (:func:`memcallbacks.host.ranks.find_imbalance`).

        Growth figures run from the first read after warm-up (:attr:`baseline`), as the growth test
        does: what a rank allocates in its first steps (rank zero setting up a logger) is not growth."""
        if self.last is None:
            return {}
        out: dict[str, float] = {
            "host_rss_bytes": float(self.last.rss_bytes),
            "host_private_bytes": float(self.last.private_bytes),
        }
        if self.baseline is not None:
            out["host_private_growth_bytes"] = float(self.last.private_bytes - self.baseline.private_bytes)
        if self.python.reads:
            out["host_python_bytes"] = float(self.python.reads[-1][1])
            if self._python_baseline is not None:
                out["host_python_growth_bytes"] = float(self.python.reads[-1][1] - self._python_baseline)
        measured = self._python_bytes()
        if measured is not None:
            out["host_python_bytes"], out["host_python_growth_bytes"] = measured
        return out
