"""Host growth: the leak test of :mod:`memcallbacks.leaks.growth` on two host series, and a settle rule.

Two :class:`~memcallbacks.leaks.growth.GrowthDetector` instances (composition, same test, same
latency): one on the Python-object series (``sys.getallocatedblocks()`` x
:data:`~memcallbacks.host.readers.BYTES_PER_BLOCK`), one on the private resident memory
(``statm``: resident - shared). Either confirms a ``host_growth`` finding; when only the resident
series climbs, the Python-object series over the same steps says whether Python objects explain it
(key ``host_growth``) or not (key ``host_growth:native``: C extensions, pinned buffers, tensors on
CPU — on a CPU run the device channel already watches that heap, so ``device_is_host=True`` drops
it and one leak is not reported twice).

Settle rule: a finding whose series has not been re-confirmed for ``settle_steps`` steps and whose
floor rose by less than a quarter of ``min_rate_bytes`` per step over them is *settled* (a cache
that filled and stopped: ``lru_cache(maxsize=...)``, ``deque(maxlen=...)``, a bounded log
history): the finding is updated in place with ``details["open"] = False``. A settled cause that
grows again is re-opened.
"""

from __future__ import annotations

import collections
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


class _Series:
    """One detector, its recent (step, value) reads and the state of its open finding."""

    def __init__(self, detector: GrowthDetector, keep: int) -> None:
        self.detector = detector
        self.reads: collections.deque[tuple[int, int]] = collections.deque(maxlen=keep)
        self.confirmed_step: int | None = None
        self.open = False

    def value_at(self, step: int) -> int | None:
        """The first read at or after ``step`` (the floor there, for a window's start)."""
        for s, v in self.reads:
            if s >= step:
                return v
        return None


class HostGrowth:
    """Growth test on the host series. Feed :meth:`update` with each :class:`HostReading`."""

    def __init__(
        self,
        *,
        device_is_host: bool = False,
        warmup_steps: int = 10,
        min_rate_bytes: int = 64 * KiB,
        min_growth_bytes: int = 4 * MiB,
        settle_steps: int = 96,
        bytes_per_block: int = BYTES_PER_BLOCK,
    ) -> None:
        if not (isinstance(settle_steps, int) and settle_steps >= 8):
            raise ValueError(f"HostGrowth(settle_steps={settle_steps!r}) must be an integer >= 8, e.g. 96 (a slow leak "
                             "is re-confirmed every 32 steps).")
        if not (isinstance(bytes_per_block, int) and bytes_per_block > 0):
            raise ValueError(f"HostGrowth(bytes_per_block={bytes_per_block!r}) must be a positive integer, e.g. 64.")
        kwargs: dict[str, Any] = dict(warmup_steps=warmup_steps, min_rate_bytes=min_rate_bytes, min_growth_bytes=min_growth_bytes)
        self.device_is_host = device_is_host
        self.settle_steps = settle_steps
        self.bytes_per_block = bytes_per_block
        self.min_rate_bytes = min_rate_bytes
        keep = 4 * settle_steps + 256
        self.python = _Series(GrowthDetector(**kwargs), keep)
        self.private = _Series(GrowthDetector(**kwargs), keep)
        self.first: HostReading | None = None
        self.last: HostReading | None = None
        self.seconds = 0.0
        """Time spent in the block reads this test took itself (after a resident-memory climb)."""
        self.findings: dict[str, Finding] = {}
        """The latest finding per key (open or settled)."""

    def update(self, reading: HostReading) -> Finding | None:
        """Fold one read in; a Finding when a cause is confirmed, updated, settled or re-opened."""
        step = reading.step
        if self.first is None:
            self.first = reading
        self.last = reading
        out: Finding | None = None
        if reading.python_blocks is not None:
            value = reading.python_blocks * self.bytes_per_block
            self.python.reads.append((step, value))
            hit = self.python.detector.update(step, value)
            if hit is not None and self._stale(self.python, step, hit):
                hit = None
            if hit is not None:
                out = self._confirm("host_growth", self.python, step, hit)
        private = reading.private_bytes
        if private > 0:
            self.private.reads.append((step, private))
            hit = self.private.detector.update(step, private)
            if hit is not None and self._stale(self.private, step, hit):
                hit = None
            if hit is not None and out is None:
                out = self._private_growth(step, hit)
        if out is None:
            out = self._settle(step)
        return out

    def _stale(self, series: _Series, step: int, hit: Finding) -> bool:
        """True when the detector's window is mostly an old climb: over the window's recent half (at
        least 8 steps) the series rose by less than the settle rule's rate (a quarter of
        ``min_rate_bytes`` per step; the median slope between reads, so one late jump does not count
        as a climb). When the watch thins its reads, a window of 16 blocks keeps the dense first
        steps' climb (a cache filling) long after it stopped, and its slope would re-confirm a full
        cache and keep it from settling. Needs 4 reads in that half (the sparse Python-object
        series may have fewer: then the hit stands)."""
        recent = max(8, int(hit.details.get("window_steps") or 0) // 2)
        reads = [(s, v) for s, v in series.reads if s >= step - recent]
        if len(reads) < 4:
            return False
        if len(reads) > 24:  # bounded cost: 24 reads evenly spread, the last one kept
            reads = [reads[round(i * (len(reads) - 1) / 23)] for i in range(24)]
        slopes = sorted((v1 - v0) / (s1 - s0) for i, (s0, v0) in enumerate(reads) for s1, v1 in reads[i + 1:] if s1 > s0)
        return not slopes or slopes[len(slopes) // 2] < self.min_rate_bytes / 4

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

    def _confirm(self, key: str, series: _Series, step: int, hit: Finding, python_share: float | None = None) -> Finding:
        series.confirmed_step = step
        series.open = True
        d = hit.details
        rate = int(d["rate_bytes_per_step"])
        private_rate = self.private.detector.last.details["rate_bytes_per_step"] if self.private.detector.last else None
        if key == "host_growth":
            est = "" if series is self.private else f" (≈{format_bytes(rate)}/step at ~{self.bytes_per_block} B a block)"
            what = (
                f"Host memory in Python objects grew steadily since step {d['since_step']}{est}"
                + (f"; private resident memory by {format_bytes(private_rate)}/step" if private_rate else "")
                + ". Something keeps Python objects from every step: a dict or list on a module, a callback or "
                "the model that gets entries every step (a per-step record, a memo cache with no bound such as "
                "`functools.lru_cache(maxsize=None)` on unique inputs, objects kept by a library between steps). "
                "Bound the cache (`lru_cache(maxsize=...)`, `collections.deque(maxlen=...)`), clear it each epoch, or "
                "keep summaries instead of objects; the host census names the type and the holder."
            )
        else:
            what = (
                f"Private resident memory grew steadily by {format_bytes(rate)}/step since step {d['since_step']} while "
                "Python objects did not explain it (they grew by "
                f"{100 * (python_share or 0):.0f}% of it): native memory — a C extension's cache, pinned or "
                "shared-memory buffers kept per step (`pin_memory` batches held), tensors kept on the CPU, or "
                "allocator fragmentation. Keep fewer CPU tensors between steps, release pinned buffers, and take a "
                "snapshot or a `tracemalloc` window to see the allocating code."
            )
        finding = Finding(
            kind="host_growth",
            step=step,
            key=key,
            bytes=int(hit.bytes or 0),
            message=what,
            details={
                "series": "python_objects" if series is self.python else "private_resident",
                "rate_bytes_per_step": rate,
                "growth_bytes": int(d["growth_bytes"]),
                "since_step": d["since_step"],
                "window_steps": d["window_steps"],
                "z": d["z"],
                "open": True,
                "python_share": None if python_share is None else round(python_share, 2),
            },
        )
        old = self.findings.get(key)
        if old is not None:
            finding.first_step = old.first_step
        self.findings[key] = finding
        return finding

    def _settle(self, step: int) -> Finding | None:
        for key, finding in list(self.findings.items()):
            if not finding.details.get("open"):
                continue
            series = self.python if finding.details["series"] == "python_objects" else self.private
            if series.confirmed_step is None or step - series.confirmed_step < self.settle_steps:
                continue
            reads = [(s, v) for s, v in series.reads if s > step - self.settle_steps]
            if len(reads) < 4:
                continue
            q = max(1, len(reads) // 4)
            rise = min(v for _, v in reads[-q:]) - min(v for _, v in reads[:q])
            span = max(1, reads[-1][0] - reads[0][0])
            if rise >= self.min_rate_bytes / 4 * span:
                continue
            series.open = False
            settled = Finding(
                kind="host_growth",
                step=step,
                key=key,
                bytes=finding.bytes,
                message=(
                    f"Host memory grew from step {finding.first_step} to {series.confirmed_step}, then stayed flat for "
                    f"{step - series.confirmed_step} steps: a cache that filled and stopped (a bounded `lru_cache`, a "
                    "`deque(maxlen=...)`, a log history of bounded size), not a leak. No action needed unless the "
                    "plateau itself is too high."
                ),
                details={"open": False, "settled_at_step": step, "plateau_rise_bytes": int(rise)},
                first_step=finding.first_step,
            )
            finding.details.update(settled.details)
            finding.message, finding.step = settled.message, step
            return settled
        return None

    def figures(self) -> dict[str, float]:
        """This process's host figures for the per-rank gather (:func:`memcallbacks.host.ranks.find_imbalance`)."""
        if self.last is None or self.first is None:
            return {}
        out: dict[str, float] = {
            "host_rss_bytes": float(self.last.rss_bytes),
            "host_private_bytes": float(self.last.private_bytes),
            "host_private_growth_bytes": float(self.last.private_bytes - self.first.private_bytes),
        }
        if self.python.reads:
            first = self.python.reads[0][1] if self.first.python_blocks is None else self.first.python_blocks * self.bytes_per_block
            out["host_python_bytes"] = float(self.python.reads[-1][1])
            out["host_python_growth_bytes"] = float(self.python.reads[-1][1] - first)
        return out
