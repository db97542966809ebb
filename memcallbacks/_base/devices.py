"""The one device seam: allocated/reserved bytes and resettable peaks for CUDA, accelerators, CPU.

Nothing outside this module (and ``_torch_private``) names ``torch.cuda``. A backend is chosen
once, from the device the framework trains on, and every later call goes through the small
:class:`MemoryBackend` interface. The hot path (one call per phase boundary) is kept to the
cheapest reads each platform offers; see ``docs/metrics.md`` for what the numbers mean on each.
"""

from __future__ import annotations

import logging
from typing import Any, Callable

import torch

from memcallbacks._base import torch_private as _torch_private

log = logging.getLogger(__name__)

__all__ = [
    "MemoryBackend", "CudaBackend", "AcceleratorBackend", "CpuBackend", "select_backend", "host_rss_reader", "heap_in_use_bytes",
    "HwmReader", "StatmReader", "HWM_PINNED_SLACK", "PEAK_ALLOCATOR", "PEAK_RSS_HWM", "PEAK_SAMPLED", "set_mmap_threshold", "watch_reader",
]

from memcallbacks._base.backend import PEAK_ALLOCATOR, PEAK_RSS_HWM, PEAK_SAMPLED, MemoryBackend, allocator_counters
from memcallbacks._base.cpu import CpuBackend, HWM_PINNED_SLACK, HwmReader, StatmReader, heap_in_use_bytes, host_rss_reader, set_mmap_threshold


class CudaBackend(MemoryBackend):
    """CUDA (and ROCm, which exposes the same API) through the caching allocator's statistics."""

    kind = "cuda"
    peak_source = PEAK_ALLOCATOR
    has_counters = True

    def __init__(self, device: torch.device) -> None:
        super().__init__(device)
        # the C stats binding raises before CUDA is initialised, which would leave every boundary on
        # the slower flattening reader for the whole run
        torch.cuda.init()
        self.index = device.index if device.index is not None else torch.cuda.current_device()
        self._read = _torch_private.cuda_stats_reader(self.index)
        self._reset = _torch_private.cuda_peak_resetter(self.index)
        self._last: dict[str, Any] = {}
        self._capacity: int | None = None

    def baseline(self, allocated: bool = True) -> tuple[int, int, int, int]:
        stats = self._read()
        self._reset()
        self._last = stats
        allocated, reserved = stats["allocated_bytes"]["all"], stats["reserved_bytes"]["all"]
        return allocated["current"], reserved["current"], allocated["peak"], reserved["peak"]

    def interval(self) -> tuple[int, int]:
        stats = self._read()
        self._reset()
        self._last = stats  # counters() as of the step's last boundary, not its start
        return stats["allocated_bytes"]["all"]["peak"], stats["reserved_bytes"]["all"]["peak"]

    def current(self) -> tuple[int, int]:
        stats = self._read()
        return stats["allocated_bytes"]["all"]["current"], stats["reserved_bytes"]["all"]["current"]

    def counters(self) -> dict[str, int]:
        stats = self._last
        if not stats:
            return {}
        return allocator_counters(stats, stats.get("inactive_split_bytes", {}).get("all", {}).get("current", 0))

    def capacity(self) -> int | None:
        """Device memory this process may use: the total, times ``set_per_process_memory_fraction``."""
        if self._capacity is None:
            try:
                self._capacity = int(torch.cuda.mem_get_info(self.index)[1])
            except Exception:
                self._capacity = int(torch.cuda.get_device_properties(self.index).total_memory)
        return int(self._capacity * _torch_private.cuda_memory_fraction(self.index))

    def free(self) -> int | None:
        """``cudaMemGetInfo``'s free bytes (``torch.cuda.mem_get_info``): what ``cudaMalloc`` can still get."""
        try:
            return int(torch.cuda.mem_get_info(self.index)[0])
        except Exception:
            return None


class AcceleratorBackend(MemoryBackend):
    """Any other torch accelerator (XPU, MPS, HPU, ...) through ``torch.accelerator`` or its device module.

    Where the accelerator keeps allocator statistics with resettable peaks (XPU does), they are
    used; where it only reports current usage (MPS), the peak is the largest value sampled at
    phase boundaries and ``peak_source`` says so.
    """

    kind = "accelerator"
    has_counters = True  # empty where the accelerator keeps no statistics (MPS)

    def __init__(self, device: torch.device) -> None:
        super().__init__(device)
        self.kind = device.type
        self._module = getattr(torch, device.type, None)
        self._stats_fn: Callable[[], dict[str, Any]] | None = None
        self._reset_fn: Callable[[], None] | None = None
        self._last: dict[str, Any] = {}
        accel = getattr(torch, "accelerator", None)
        for owner in (accel, self._module):
            stats_fn = getattr(owner, "memory_stats", None)
            reset_fn = getattr(owner, "reset_peak_memory_stats", None)
            if stats_fn is None or reset_fn is None:
                continue
            try:
                if "allocated_bytes.all.peak" in stats_fn(device):
                    self._stats_fn = lambda f=stats_fn: f(device)
                    self._reset_fn = lambda f=reset_fn: f(device)
                    break
            except Exception:
                log.debug("memory_stats of %r unusable for %s", owner, device, exc_info=True)
        if self._stats_fn is not None:
            self.peak_source = PEAK_ALLOCATOR
        else:
            self.peak_source = PEAK_SAMPLED
            self._previous = self._current()

    def _current(self) -> tuple[int, int]:
        module = self._module
        if module is None:
            return 0, 0
        if self.device.type == "mps":
            return int(module.current_allocated_memory()), int(module.driver_allocated_memory())
        allocated = getattr(module, "memory_allocated", None)
        reserved = getattr(module, "memory_reserved", None)
        a = int(allocated()) if allocated else 0
        return a, int(reserved()) if reserved else a

    def baseline(self, allocated: bool = True) -> tuple[int, int, int, int]:
        if self._stats_fn is not None:
            stats = self._stats_fn()
            self._reset_fn()  # type: ignore[misc]
            self._last = stats
            return (
                int(stats.get("allocated_bytes.all.current", 0)),
                int(stats.get("reserved_bytes.all.current", 0)),
                int(stats.get("allocated_bytes.all.peak", 0)),
                int(stats.get("reserved_bytes.all.peak", 0)),
            )
        allocated, reserved = self._current()
        peak_allocated, peak_reserved = self._sampled_peak(allocated, reserved)
        return allocated, reserved, peak_allocated, peak_reserved

    def interval(self) -> tuple[int, int]:
        if self._stats_fn is not None:
            stats = self._stats_fn()
            self._reset_fn()  # type: ignore[misc]
            self._last = stats  # counters() as of the step's last boundary, not its start
            return int(stats.get("allocated_bytes.all.peak", 0)), int(stats.get("reserved_bytes.all.peak", 0))
        return self._sampled_peak(*self._current())

    def current(self) -> tuple[int, int]:
        if self._stats_fn is not None:
            stats = self._stats_fn()
            return int(stats.get("allocated_bytes.all.current", 0)), int(stats.get("reserved_bytes.all.current", 0))
        return self._current()

    def _sampled_peak(self, allocated: int, reserved: int) -> tuple[int, int]:
        before = self._previous
        self._previous = (allocated, reserved)
        return max(before[0], allocated), max(before[1], reserved)

    def counters(self) -> dict[str, int]:
        stats = self._last
        if not stats:
            return {}
        return allocator_counters(stats, stats.get("inactive_split_bytes.all.current", 0))

    def capacity(self) -> int | None:
        accel = getattr(torch, "accelerator", None)
        info = getattr(accel, "get_memory_info", None)
        if info is not None:
            try:
                return int(info(self.device)[1])
            except Exception:
                pass
        if self.device.type == "mps" and self._module is not None:
            try:
                return int(self._module.recommended_max_memory())
            except Exception:
                return None
        return None

    def free(self) -> int | None:
        """The free bytes of ``torch.accelerator.get_memory_info`` where the accelerator has it."""
        info = getattr(getattr(torch, "accelerator", None), "get_memory_info", None)
        if info is None:
            return None
        try:
            return int(info(self.device)[0])
        except Exception:
            return None


def select_backend(device: torch.device | str | None, *, cpu_mmap_threshold: int | None = None) -> MemoryBackend:
    """Pick the backend for ``device`` (``None`` means CPU)."""
    device = torch.device(device) if device is not None else torch.device("cpu")
    if device.type == "cpu":
        if cpu_mmap_threshold is not None and not set_mmap_threshold(cpu_mmap_threshold):
            log.warning("memcallbacks: cpu_mmap_threshold=%d could not be applied (mallopt unavailable: not glibc?).", cpu_mmap_threshold)
            cpu_mmap_threshold = None
        return CpuBackend(device, trim_heap=cpu_mmap_threshold is not None)
    if device.type == "cuda":
        return CudaBackend(device)
    return AcceleratorBackend(device)


def watch_reader(backend: Any) -> Callable[[], int | None]:
    """The read that sees a tensor leak step over step: glibc's in-use heap on CPU (it sees a leak
    that refills freed heap, which RSS does not), the caching allocator's counter elsewhere."""
    if backend.kind == "cpu":
        return heap_in_use_bytes if heap_in_use_bytes() is not None else (lambda: backend.current()[0])
    return lambda: backend.current()[0]
