"""Host growth: the leak test of ``leaks/growth.py`` on two host series, with its lifecycle.

Two :class:`~memcallbacks.leaks.growth.GrowthDetector` instances (composition, same test, same
latency): one on the Python-object series (``sys.getallocatedblocks()`` x
:data:`~memcallbacks.host.readers.BYTES_PER_BLOCK`), one on the private resident memory
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
from typing import Any

from memcallbacks._base.findings import Finding
from memcallbacks._base.units import KiB, MiB, format_bytes
from memcallbacks.host.readers import BYTES_PER_BLOCK, HostReading
from memcallbacks.leaks.growth import GrowthDetector

__all__ = ["HostGrowth"]

_PYTHON_SHARE = 0.5
"""Python objects explain a resident-memory climb when they grew by at least this share of it."""

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
    ) -> None:
        if not (isinstance(bytes_per_block, int) and bytes_per_block > 0):
            raise ValueError(f"HostGrowth(bytes_per_block={bytes_per_block!r}) must be a positive integer, e.g. 64.")
        kwargs: dict[str, Any] = dict(warmup_steps=warmup_steps, min_rate_bytes=min_rate_bytes, min_growth_bytes=min_growth_bytes)
        self.device_is_host = device_is_host
        self.warmup_steps = warmup_steps
        self.bytes_per_block = bytes_per_block
        self.min_rate_bytes = min_rate_bytes
        self.python = _Series(GrowthDetector(**kwargs), _KEEP_READS)
        self.private = _Series(GrowthDetector(**kwargs), _KEEP_READS)
        self.first: HostReading | None = None
        self.last: HostReading | None = None
        self.baseline: HostReading | None = None
        """The first read after warm-up (the detectors' ``warmup_steps`` reads): growth figures start here."""
        self._python_baseline: int | None = None  # the first Python-object read at or after it
        self._reads = 0
        self.seconds = 0.0
        """Time spent in the block reads this test took itself (after a resident-memory climb)."""
        self.findings: dict[str, Finding] = {}
        """The latest finding per key (open or settled)."""
        self._owner: dict[str, _Series] = {}  # the series that last confirmed each key: its lifecycle decides

    def update(self, reading: HostReading) -> Finding | None:
        """Fold one read in; a Finding when a cause is confirmed, updated, settled or re-opened."""
        step = reading.step
        if self.first is None:
            self.first = reading
        self.last = reading
        self._reads += 1
        if self.baseline is None and self._reads > self.warmup_steps:
            self.baseline = reading
        out: Finding | None = None
        if reading.python_blocks is not None:
            value = reading.python_blocks * self.bytes_per_block
            if self.baseline is not None and self._python_baseline is None:
                self._python_baseline = value
            self.python.reads.append((step, value))
            hit = self.python.detector.update(step, value)
            if hit is not None:
                out = self._settle(self.python, step, hit) if hit.state == "settled" else self._confirm(
                    "host_growth", self.python, step, hit)
        private = reading.private_bytes
        if private > 0:
            self.private.reads.append((step, private))
            hit = self.private.detector.update(step, private)
            if hit is not None and hit.state == "settled":
                out = self._settle(self.private, step, hit) or out
            elif hit is not None and out is None:
                out = self._private_growth(step, hit)
        return out

    @property
    def open_findings(self) -> list[Finding]:
        return [f for f in self.findings.values() if f.details.get("open")]

    def _python_share(self, step: int, since_step: int) -> float:
        """Python objects' growth rate over the private series' rate, on the same steps.

        The block count is read sparsely (its cost grows with the heap), so the span starts at the
        last block read at or before ``since_step`` (or the oldest kept), and a fresh read is taken
        now when the last one is more than 16 steps old: one read per confirmation, after suspicion."""
        reads = self.python.reads
        if not reads or step - reads[-1][0] > 16:
            t0 = time.perf_counter()
            reads.append((step, sys.getallocatedblocks() * self.bytes_per_block))
            self.seconds += time.perf_counter() - t0
        start = next((r for r in reversed(reads) if r[0] <= since_step), reads[0])
        end = reads[-1]
        if end[0] <= start[0]:
            return 0.0
        priv = self.private.reads
        p0 = next((r for r in priv if r[0] >= start[0]), priv[0])
        p1 = priv[-1]
        private_rate = (p1[1] - p0[1]) / max(1, p1[0] - p0[0])
        if private_rate <= 0:
            return 1.0
        return (end[1] - start[1]) / (end[0] - start[0]) / private_rate

    def _private_growth(self, step: int, hit: Finding) -> Finding | None:
        share = self._python_share(step, int(hit.details["since_step"]))
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
            est = "" if series is self.private else f" (≈{format_bytes(rate)}/step at ~{self.bytes_per_block} B a block)"
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
                **{k: d[k] for k in ("settled_step", "settled_bytes", "floor_bytes", "last_rise_step", "grew_steps",
                                     "flat_steps", "settle_after_steps") if k in d},
            }
            self.findings[key] = settled
            if finding.step > latest:
                out, latest = settled, finding.step
        return out

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
        return out
