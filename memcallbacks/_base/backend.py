"""The device seam's interface: what every memory backend answers (docs/metrics.md: per device)."""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["MemoryBackend", "PEAK_ALLOCATOR", "PEAK_RSS_HWM", "PEAK_SAMPLED", "allocator_counters"]

PEAK_ALLOCATOR = "allocator"
"""Peaks are the allocator's own resettable high-water marks (CUDA, XPU, ...)."""
PEAK_RSS_HWM = "rss_high_water_mark"
"""Peaks are the kernel's resettable resident-set high-water mark (CPU on Linux)."""
PEAK_SAMPLED = "sampled"
"""No resettable peak exists: the peak is the largest value seen at phase boundaries."""


def allocator_counters(stats: dict[str, Any], inactive_split_bytes: Any) -> dict[str, int]:
    """``counters()`` of a caching allocator's statistics (the keys CUDA and XPU share)."""
    return {
        "alloc_retries": int(stats.get("num_alloc_retries", 0)),
        "ooms": int(stats.get("num_ooms", 0)),
        "inactive_split_bytes": int(inactive_split_bytes),
    }


class MemoryBackend:
    """Reads one device's memory. Subclasses implement the three reads; all return bytes.

    ``baseline()`` and ``interval()`` both end the current measuring interval and start a new
    one (peaks are reset), so consecutive calls partition time into phases.
    """

    kind: str = "unknown"
    peak_source: str = PEAK_SAMPLED
    heap_cost_s: float = 0.0
    """What reading ``allocated`` costs, a running estimate in seconds: 0 where it is an allocator's
    counter (read on every sampled step); the CPU backend measures its heap read (glibc's
    ``mallinfo2``), which the step schedule reads only on the steps it names (``Schedule.heap_due``)."""
    has_counters: bool = False
    """``counters()`` can say something (a caching allocator): a sampled step's end asks it only then."""

    def __init__(self, device: torch.device) -> None:
        self.device = device

    def baseline(self, allocated: bool = True) -> tuple[int, int, int, int]:
        """Return ``(allocated, reserved, peak_allocated, peak_reserved)`` and reset the peaks.
        ``allocated=False``: a backend whose ``allocated`` read is costly (:attr:`heap_cost_s`) may
        skip it and return NaN in its place; the others read it anyway."""
        raise NotImplementedError

    def interval(self) -> tuple[int, int]:
        """Return ``(peak_allocated, peak_reserved)`` since the previous call and reset the peaks."""
        raise NotImplementedError

    def current(self) -> tuple[int, int]:
        """Return ``(allocated, reserved)`` now, without touching the peaks (off the hot path)."""
        raise NotImplementedError

    def counters(self) -> dict[str, int]:
        """Cumulative allocator counters as of the last ``baseline()`` or ``interval()`` (empty where none exist)."""
        return {}

    def capacity(self) -> int | None:
        """Total bytes of the device (host RAM for CPU), or None when unknown."""
        return None

    def free(self) -> int | None:
        """Bytes the device's driver can still hand out now (other processes and the runtime's own context
        taken), or None where the device cannot say (the host: ``memcallbacks._base.limits`` reads its limits)."""
        return None

    def close(self) -> None:
        """Release OS handles. Safe to call twice."""

    def describe(self) -> dict[str, Any]:
        return {"kind": self.kind, "device": str(self.device), "peak_source": self.peak_source}


