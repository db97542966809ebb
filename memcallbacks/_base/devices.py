"""The one device seam: allocated/reserved bytes and resettable peaks for CUDA, other accelerators and CPU.

Nothing outside this module (and ``_torch_private``) names ``torch.cuda``. A backend is chosen
once, from the device the framework trains on, and every later call goes through the small
:class:`MemoryBackend` interface. The hot path (one call per phase boundary) is kept to the
cheapest reads each platform offers; see ``docs/metrics.md`` for what the numbers mean on each.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import os
import resource
import sys
from typing import Any, Callable

import torch

from memcallbacks._base import torch_private as _torch_private

log = logging.getLogger(__name__)

__all__ = ["MemoryBackend", "CudaBackend", "AcceleratorBackend", "CpuBackend", "select_backend", "host_rss_reader"]

# RUSAGE_THREAD skips summing CPU time over every thread (RUSAGE_SELF does); ru_maxrss is the
# same process-wide high-water mark either way.
_RUSAGE_THREAD = getattr(resource, "RUSAGE_THREAD", resource.RUSAGE_SELF)

PEAK_ALLOCATOR = "allocator"
"""Peaks are the allocator's own resettable high-water marks (CUDA, XPU, ...)."""
PEAK_RSS_HWM = "rss_high_water_mark"
"""Peaks are the kernel's resettable resident-set high-water mark (CPU on Linux)."""
PEAK_SAMPLED = "sampled"
"""No resettable peak exists: the peak is the largest value seen at phase boundaries."""


def _allocator_counters(stats: dict[str, Any], inactive_split_bytes: Any) -> dict[str, int]:
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

    def __init__(self, device: torch.device) -> None:
        self.device = device

    def baseline(self) -> tuple[int, int, int, int]:
        """Return ``(allocated, reserved, peak_allocated, peak_reserved)`` and reset the peaks."""
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

    def close(self) -> None:
        """Release OS handles. Safe to call twice."""

    def describe(self) -> dict[str, Any]:
        return {"kind": self.kind, "device": str(self.device), "peak_source": self.peak_source}


class CudaBackend(MemoryBackend):
    """CUDA (and ROCm, which exposes the same API) through the caching allocator's statistics."""

    kind = "cuda"
    peak_source = PEAK_ALLOCATOR

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

    def baseline(self) -> tuple[int, int, int, int]:
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
        return _allocator_counters(stats, stats.get("inactive_split_bytes", {}).get("all", {}).get("current", 0))

    def capacity(self) -> int | None:
        """Device memory this process may use: the total, times ``set_per_process_memory_fraction``."""
        if self._capacity is None:
            try:
                self._capacity = int(torch.cuda.mem_get_info(self.index)[1])
            except Exception:
                self._capacity = int(torch.cuda.get_device_properties(self.index).total_memory)
        return int(self._capacity * _torch_private.cuda_memory_fraction(self.index))


class AcceleratorBackend(MemoryBackend):
    """Any other torch accelerator (XPU, MPS, HPU, ...) through ``torch.accelerator`` or its device module.

    Where the accelerator keeps allocator statistics with resettable peaks (XPU does), they are
    used; where it only reports current usage (MPS), the peak is the largest value sampled at
    phase boundaries and ``peak_source`` says so.
    """

    kind = "accelerator"

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

    def baseline(self) -> tuple[int, int, int, int]:
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
        return _allocator_counters(stats, stats.get("inactive_split_bytes.all.current", 0))

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


class _MallInfo2(ctypes.Structure):
    _fields_ = [
        (name, ctypes.c_size_t)
        for name in ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks", "keepcost")
    ]


_M_MMAP_THRESHOLD = -3


_libc_handle: list[Any] = []  # [the C library or None], loaded on first use


def _libc() -> Any:
    """glibc through ctypes (one handle for the process), or None off Linux / when it cannot load."""
    if not _libc_handle:
        libc = None
        if sys.platform.startswith("linux"):
            try:
                libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
            except OSError:
                pass
        _libc_handle.append(libc)
    return _libc_handle[0]


def _libc_function(name: str) -> Any:
    libc = _libc()
    return getattr(libc, name, None) if libc is not None else None


def set_mmap_threshold(nbytes: int) -> bool:
    """Fix glibc's mmap threshold (``mallopt``); True on success. Process-wide and not reversible."""
    mallopt = _libc_function("mallopt")
    return mallopt is not None and bool(mallopt(_M_MMAP_THRESHOLD, ctypes.c_int(nbytes)))


def _load_malloc_trim() -> Callable[[], Any] | None:
    """``malloc_trim(0)`` (glibc), or None: gives the pages of free heap chunks back to the OS."""
    trim = _libc_function("malloc_trim")
    if trim is None:
        return None
    trim.argtypes = [ctypes.c_size_t]
    return lambda: trim(0)


def _load_mallinfo2() -> Callable[[], _MallInfo2] | None:
    fn = _libc_function("mallinfo2")  # glibc >= 2.33; the older mallinfo() overflows past 2 GiB
    if fn is None:
        return None
    fn.restype = _MallInfo2
    fn.argtypes = []
    return fn


_heap_reader: list[Any] = []  # [mallinfo2 or None], loaded on first use


def heap_in_use_bytes() -> int | None:
    """Bytes in use in the glibc malloc heap (``uordblks + hblkhd`` of ``mallinfo2``): the CPU
    counterpart of CUDA's "allocated" (freed memory malloc keeps does not count). ``None`` off glibc >= 2.33."""
    if not _heap_reader:
        _heap_reader.append(_load_mallinfo2())
    fn = _heap_reader[0]
    if fn is None:
        return None
    info = fn()
    return int(info.uordblks + info.hblkhd)


_fork_generation = 0
"""Forks this process has gone through, as seen from the child (``os.register_at_fork``): the
descriptors of ``/proc/self/...`` opened before a fork name the parent's files, and the readers
below reopen theirs when this has moved. A comparison with a global instead of an ``os.getpid()``
call: a system call between two training steps costs the next one 3-15 µs on this machine's
kernel (cold caches after the switch; docs/benchmarks.md), many times its own time."""


def _forked() -> None:
    global _fork_generation
    _fork_generation += 1


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forked)


HWM_PINNED_SLACK = 4 << 20
"""Right after a reset the high-water mark equals the resident set; more than this above it, the
mark is pinned (see :class:`CpuBackend`)."""


class CpuBackend(MemoryBackend):
    """The process itself, for training on CPU.

    - ``allocated``: bytes in use by the C heap (glibc ``mallinfo2``: ``uordblks + hblkhd``),
      which is where torch's CPU allocator puts tensors. Falls back to RSS off glibc.
    - ``reserved``: the resident set size (RSS) of the process.
    - peaks: the kernel's resident-set high-water mark, reset at every phase boundary by
      writing ``5`` to ``/proc/self/clear_refs``; read through ``getrusage`` and checked
      against RSS, falling back to ``VmHWM`` in ``/proc/self/status`` when ``getrusage``'s value
      is pinned above it (a process started by ``exec`` inherits the high-water mark of the address
      space it replaced: a launcher's, a test runner's; ``getrusage`` reports the larger). Where no resettable mark exists (macOS, Windows, locked-down
      ``/proc``), the peak is the largest RSS sampled at phase boundaries.

    Peaks on CPU are therefore RSS peaks: compare them with ``reserved``, not ``allocated``.
    """

    kind = "cpu"

    def __init__(self, device: torch.device | None = None, *, trim_heap: bool = False) -> None:
        super().__init__(device or torch.device("cpu"))
        self._mallinfo2 = _load_mallinfo2()
        # with cpu_mmap_threshold: free heap chunks (left from before the threshold was fixed) are
        # given back at every boundary, so a tensor placed in one faults its pages in and shows in
        # the RSS peak instead of reusing pages that are still resident
        self._trim = _load_malloc_trim() if trim_heap else None
        self._rss = host_rss_reader()
        self._generation = -1  # the _fork_generation its descriptors were opened in (-1: none yet)
        self._clear_fd: int | None = None
        self._status_fd: int | None = None
        self._use_status = False
        self._previous_rss = 0
        self._open()

    def _open(self) -> None:
        self.close()
        self._generation = _fork_generation
        self.peak_source = PEAK_SAMPLED
        if not sys.platform.startswith("linux"):
            return
        try:
            self._clear_fd = os.open("/proc/self/clear_refs", os.O_WRONLY)
            os.write(self._clear_fd, b"5")
            self._status_fd = os.open("/proc/self/status", os.O_RDONLY)
            self.peak_source = PEAK_RSS_HWM
        except OSError as exc:
            log.info("memcallbacks: /proc/self/clear_refs is not writable (%s); CPU peaks are sampled at phase boundaries.", exc)
            self.close()

    def _status_hwm(self) -> int:
        data = os.pread(self._status_fd, 4096, 0)  # type: ignore[arg-type]
        start = data.index(b"VmHWM:") + 6
        return int(data[start : data.index(b"kB", start)]) * 1024

    def _hwm_and_reset(self) -> int:
        if self._trim is not None:
            self._trim()  # a few µs when nothing is free; before the reset, so it cannot raise the peak
        if self._use_status:
            peak = self._status_hwm()
        else:
            peak = resource.getrusage(_RUSAGE_THREAD).ru_maxrss * 1024
        os.write(self._clear_fd, b"5")  # type: ignore[arg-type]
        return peak

    @property
    def resets_hwm(self) -> bool:
        """Whether ``getrusage``'s high-water mark is reset at every phase boundary and not pinned
        above the resident set: then it is the resident set's peak since the last sampled step, which the
        RSS tripwire can read for a fraction of a ``statm`` read's cost (``cadence.rss_tripwire``)."""
        return self.peak_source == PEAK_RSS_HWM and not self._use_status and sys.platform.startswith("linux")

    def baseline(self) -> tuple[int, int, int, int]:
        if self._generation != _fork_generation:
            self._open()
        info = self._mallinfo2() if self._mallinfo2 is not None else None
        if self.peak_source == PEAK_RSS_HWM:
            peak = self._hwm_and_reset()
            rss = self._rss()
            if not self._use_status:
                # Right after a reset getrusage must equal RSS; if it is higher, the process-wide
                # maximum is pinned (an inherited mark, see the class docstring) and only VmHWM
                # stays resettable. Checked at every sampled step (0.3 µs): a mark inherited
                # above the start-up RSS comes into view once the run frees memory.
                after = resource.getrusage(_RUSAGE_THREAD).ru_maxrss * 1024
                if after > rss + HWM_PINNED_SLACK:
                    log.debug("getrusage maxrss is pinned (%d > rss %d); reading VmHWM instead", after, rss)
                    self._use_status = True
        else:
            rss = self._rss()
            peak = max(self._previous_rss, rss)
            self._previous_rss = rss
        allocated = info.uordblks + info.hblkhd if info is not None else rss
        return allocated, rss, peak, peak

    def interval(self) -> tuple[int, int]:
        if self._clear_fd is None and self._generation != _fork_generation:
            self._open()
        if self.peak_source == PEAK_RSS_HWM:
            peak = self._hwm_and_reset()
        else:
            rss = self._rss()
            peak = max(self._previous_rss, rss)
            self._previous_rss = rss
        return peak, peak

    def current(self) -> tuple[int, int]:
        rss = self._rss()
        info = self._mallinfo2() if self._mallinfo2 is not None else None
        return (info.uordblks + info.hblkhd if info is not None else rss), rss

    def capacity(self) -> int | None:
        try:
            import psutil

            return int(psutil.virtual_memory().total)
        except Exception:
            return None

    def __getstate__(self) -> dict[str, Any]:
        state = dict(self.__dict__)
        state["_clear_fd"] = state["_status_fd"] = None
        state["_generation"] = -1  # reopened on first use in the new process
        state["_mallinfo2"] = None
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._mallinfo2 = _load_mallinfo2()

    def close(self) -> None:
        for name in ("_clear_fd", "_status_fd"):
            fd = getattr(self, name, None)
            if fd is not None:
                try:
                    os.close(fd)
                except OSError:
                    pass
                setattr(self, name, None)

    def describe(self) -> dict[str, Any]:
        out = super().describe()
        out["allocated_source"] = "glibc mallinfo2" if self._mallinfo2 is not None else "rss"
        return out


class StatmReader:
    """RSS from ``/proc/self/statm`` through a kept-open descriptor; reopened after fork or unpickling."""

    def __init__(self) -> None:
        self._page = os.sysconf("SC_PAGE_SIZE")
        self._generation = -1
        self._fd: int | None = None

    def __call__(self) -> int:
        if self._generation != _fork_generation:  # forked (or fresh): /proc/self was resolved at open time
            if self._fd is not None:
                os.close(self._fd)
            self._fd, self._generation = os.open("/proc/self/statm", os.O_RDONLY), _fork_generation
        return int(os.pread(self._fd, 128, 0).split()[1]) * self._page  # type: ignore[arg-type]

    def __getstate__(self) -> dict[str, Any]:
        return {"_page": self._page, "_generation": -1, "_fd": None}


class HwmReader:
    """The resident set's high-water mark (``getrusage(RUSAGE_THREAD).ru_maxrss``, bytes): the
    larger of the current resident set and its peak since the last reset (``CpuBackend`` resets it
    at every phase boundary of a sampled step), or a mark the process inherited through ``exec``
    when that one is larger (pinned: see :class:`CpuBackend`).
    A lighter system call than a ``statm`` read: it slows the training step after it by ~5 µs
    against ~19 (``benchmarks/syscall_cost.py``). Picklable."""

    def __call__(self) -> int:
        return resource.getrusage(_RUSAGE_THREAD).ru_maxrss * 1024


class _PsutilReader:
    def __call__(self) -> int:
        import psutil

        return int(psutil.Process().memory_info().rss)


def host_rss_reader() -> Callable[[], int]:
    """Return a cheap, picklable zero-argument callable giving this process's resident set size in bytes."""
    if sys.platform.startswith("linux"):
        try:
            reader = StatmReader()
            reader()
            return reader
        except (OSError, ValueError, IndexError):
            pass
    return _PsutilReader()


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
