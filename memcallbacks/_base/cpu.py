"""The CPU backend, the host's cheap reads, the thread's CPU clock own time is read on, and the
budget's guard over that own time (:class:`BudgetGuard`, which the step schedule owns).

The reads: glibc's heap in use, the resident set (``statm``) and its resettable high-water mark
(``getrusage`` after ``/proc/self/clear_refs``)."""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import gc
import logging
import math
import os
import re
import resource
import sys
import threading
import time
from typing import Any, Callable, Iterator, Protocol

import torch

from memcallbacks._base.backend import PEAK_RSS_HWM, PEAK_SAMPLED, MemoryBackend

log = logging.getLogger(__name__)

__all__ = [
    "CpuBackend", "StatmReader", "HwmReader", "HWM_PINNED_SLACK", "heap_in_use_bytes", "host_rss_reader", "set_mmap_threshold", "FIXED_MMAP_THRESHOLD",
    "load_malloc_trim", "Tripwire", "rss_tripwire", "pymalloc_bytes", "pymalloc_arena_bytes", "own_time", "counted_collection", "watch_collections",
    "unwatch_collections", "CLOCK_READS", "IMPORT_S", "IMPORTS",
]

# RUSAGE_THREAD skips summing CPU time over every thread (RUSAGE_SELF does); ru_maxrss is the
# same process-wide high-water mark either way.
_RUSAGE_THREAD = getattr(resource, "RUSAGE_THREAD", resource.RUSAGE_SELF)


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


#: The mmap threshold this process fixed with :func:`set_mmap_threshold` (None: glibc's adaptive one, or not known)
FIXED_MMAP_THRESHOLD: list[int | None] = [None]


def set_mmap_threshold(nbytes: int) -> bool:
    """Fix glibc's mmap threshold (``mallopt``); True on success. Process-wide and not reversible."""
    mallopt = _libc_function("mallopt")
    done = mallopt is not None and bool(mallopt(_M_MMAP_THRESHOLD, ctypes.c_int(nbytes)))
    if done:
        FIXED_MMAP_THRESHOLD[0] = nbytes
    return done


def load_malloc_trim() -> Callable[[], Any] | None:
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


PAGE_SIZE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096
"""Bytes a page: what ``/proc``'s page counts (``statm``, a process's faults) are multiplied by."""

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


HEAP_COST_WEIGHT = 0.125
"""Weight of the newest heap read's time in :attr:`CpuBackend.heap_cost_s` (an exponential mean:
the mean, not the median, is what reads spaced by their cost add up to; ``mallinfo2``'s time has
a long tail in a real fit, 160 µs median and 296 µs mean on one measured Lightning run)."""

HWM_PINNED_SLACK = 4 << 20
"""Right after a reset the high-water mark equals the resident set; more than this above it, the
mark is pinned (see :class:`CpuBackend`)."""


class CpuBackend(MemoryBackend):
    """The process itself, for training on CPU.

    - ``allocated``: bytes in use by the C heap (glibc ``mallinfo2``: ``uordblks + hblkhd``),
      which is where torch's CPU allocator puts tensors. Falls back to RSS off glibc. The read
      walks every free chunk; its measured cost (:attr:`heap_cost_s`) lets the step schedule skip it
      on sampled steps it does not name (``baseline(allocated=False)``: NaN).
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
        # with cpu_mmap_threshold: free heap chunks left from before the threshold was fixed are
        # given back once, at the first sampled step, so a tensor placed in one faults its pages in
        # and shows in the RSS peak instead of reusing pages that are still resident. Not at every
        # step or boundary: 100-250 µs a trim on a real fit's heap, and the pages it gives back are
        # faulted in again by the step; the chunks the run frees later are its own to reuse (a step's
        # tensors below the threshold reuse them in any process)
        self._trim = load_malloc_trim() if trim_heap else None
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
        # Whether ``getrusage``'s high-water mark is reset at every phase boundary and not pinned above
        # the resident set: then it is the resident set's peak since the last sampled step, which the
        # RSS tripwire reads for a fraction of a ``statm`` read's cost (:func:`rss_tripwire`). A field,
        # not a property: the schedule reads it after every sampled step.
        self.resets_hwm = False
        if not sys.platform.startswith("linux"):
            return
        try:
            self._clear_fd = os.open("/proc/self/clear_refs", os.O_WRONLY)
            os.write(self._clear_fd, b"5")
            self._status_fd = os.open("/proc/self/status", os.O_RDONLY)
            self.peak_source = PEAK_RSS_HWM
            self.resets_hwm = not self._use_status
        except OSError as exc:
            log.info("memcallbacks: /proc/self/clear_refs is not writable (%s); CPU peaks are sampled at phase boundaries.", exc)
            self.close()

    def _status_hwm(self) -> int:
        data = os.pread(self._status_fd, 4096, 0)  # type: ignore[arg-type]
        start = data.index(b"VmHWM:") + 6
        return int(data[start : data.index(b"kB", start)]) * 1024

    def _hwm_and_reset(self, trim: bool = False) -> int:
        if trim and self._trim is not None:
            self._trim()  # before the reset, so it cannot raise the peak
            self._trim = None
        if self._use_status:
            peak = self._status_hwm()
        else:
            peak = resource.getrusage(_RUSAGE_THREAD).ru_maxrss * 1024
        os.write(self._clear_fd, b"5")  # type: ignore[arg-type]
        return peak

    def hwm_pinned(self) -> bool:
        """Between sampled steps (the watch's scheduled read, at a step's start): whether the high-water mark the RSS
        tripwire reads is pinned above the resident set, checked as a sampled step checks it (:meth:`baseline`): the
        mark reset, read again and compared with the resident set. A run that frees memory brings an inherited mark
        into view at any step; sampled steps may be hundreds of steps apart, and a tripwire reading a pinned mark is
        blind to a leak until it passes the mark. Pinned: VmHWM from now on, and True (the schedule's tripwire goes
        to ``statm``)."""
        if not self.resets_hwm or self._generation != _fork_generation:
            return False
        os.write(self._clear_fd, b"5")  # type: ignore[arg-type]
        return self._pinned_after_reset(self._rss())

    def _pinned_after_reset(self, rss: int) -> bool:
        """Right after a reset ``getrusage`` must equal the resident set ``rss``; if it is higher, the process-wide
        maximum is pinned (an inherited mark, see the class docstring) and only VmHWM stays resettable: read from now
        on, and True. 0.3 µs; :meth:`baseline` and :meth:`hwm_pinned` check with it."""
        after = resource.getrusage(_RUSAGE_THREAD).ru_maxrss * 1024
        if after <= rss + HWM_PINNED_SLACK:
            return False
        log.debug("getrusage maxrss is pinned (%d > rss %d); reading VmHWM instead", after, rss)
        self._use_status = True
        self.resets_hwm = False
        return True

    def heap(self) -> int | None:
        """The heap in use (``mallinfo2``), its time folded into :attr:`heap_cost_s`; None off glibc >= 2.33."""
        fn = self._mallinfo2
        if fn is None:
            return None
        t0 = time.perf_counter()
        info = fn()
        self.observe_heap_cost(time.perf_counter() - t0)
        return int(info.uordblks + info.hblkhd)

    def observe_heap_cost(self, seconds: float) -> None:
        """One heap read took ``seconds`` (here, or the step schedule's own read of the same figure)."""
        cost = self.heap_cost_s
        self.heap_cost_s = seconds if cost == 0.0 else cost + (seconds - cost) * HEAP_COST_WEIGHT

    def baseline(self, allocated: bool = True) -> tuple[int, int, int, int]:
        """``allocated=False`` leaves the heap unread (NaN in its place): ``mallinfo2`` walks every
        free chunk, 100-300 µs in a real fit, and the step schedule asks for it only on the steps it
        names (``Schedule.heap_due``). Without ``mallinfo2`` the figure is the RSS, read anyway."""
        if self._generation != _fork_generation:
            self._open()
        heap = self.heap() if allocated or self._mallinfo2 is None else math.nan
        if self.peak_source == PEAK_RSS_HWM:
            peak = self._hwm_and_reset(trim=True)
            rss = self._rss()
            if not self._use_status:  # at every sampled step: an inherited mark comes into view once the run frees memory
                self._pinned_after_reset(rss)
        else:
            rss = self._rss()
            peak = max(self._previous_rss, rss)
            self._previous_rss = rss
        return (rss if heap is None else heap), rss, peak, peak  # type: ignore[return-value]

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
        heap = self.heap()
        return (rss if heap is None else heap), rss

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
        state["_trim"] = self._trim is not None  # a ctypes function: reloaded where the trim is still due
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._mallinfo2 = _load_mallinfo2()
        self._trim = load_malloc_trim() if self._trim else None

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
    """``/proc/<pid>/statm`` through a kept-open descriptor (``pid`` None: this process).

    ``reader()`` is the resident set in bytes (the CPU backend's and the tripwire's read);
    ``reader.read()`` is ``(resident, private)`` in bytes, private = resident - shared (the anonymous
    pages: the Python heap, malloc's heap, tensors on CPU), or ``(0, 0)`` where ``/proc`` cannot be
    read. Both are one ``pread``: the descriptor is reopened after a fork (``_fork_generation``, no
    ``getpid`` per read) or unpickling, and closed by :meth:`close`."""

    __slots__ = ("pid", "_page", "_generation", "_fd")

    def __init__(self, pid: int | None = None) -> None:
        self.pid = pid
        self._page = PAGE_SIZE
        self._generation = -1
        self._fd: int | None = None

    def _open(self) -> int:
        """The descriptor, (re)opened in this process (forked or fresh: /proc/self was resolved at open time)."""
        self.close()
        self._fd = fd = os.open(f"/proc/{self.pid or 'self'}/statm", os.O_RDONLY)
        self._generation = _fork_generation
        return fd

    def __call__(self) -> int:
        fd = self._fd if self._generation == _fork_generation else self._open()  # a global, not getpid()
        return int(os.pread(fd, 128, 0).split()[1]) * self._page  # type: ignore[arg-type]

    def read(self) -> tuple[int, int]:
        """``(resident, private)`` bytes; ``(0, 0)`` where it cannot be read (not Linux, no such process)."""
        try:
            fd = self._fd if self._generation == _fork_generation else self._open()
            fields = os.pread(fd, 128, 0).split()  # type: ignore[arg-type]
        except OSError:
            return 0, 0
        resident = int(fields[1])
        return resident * self._page, (resident - int(fields[2])) * self._page

    def close(self) -> None:
        fd, self._fd = getattr(self, "_fd", None), None
        self._generation = -1  # a read after close opens the file again
        if fd is not None:
            try:
                os.close(fd)
            except OSError:
                pass

    def __del__(self) -> None:
        self.close()

    def __getstate__(self) -> dict[str, Any]:
        return {"pid": self.pid, "_page": self._page, "_generation": -1, "_fd": None}

    def __setstate__(self, state: dict[str, Any]) -> None:
        for name, value in state.items():
            setattr(self, name, value)


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


# ------------------------------------------------------------------ the RSS tripwire
def rss_tripwire(read: Callable[[], int | None] | None, *, hwm_resets: bool = False) -> Tripwire | None:
    """The cheap read the schedule checks between the watch's reads where that read is costly (glibc's heap): the
    resident set, or its high-water mark where the backend resets it at every phase boundary
    (``hwm_resets``; cheaper for the next step). None where the watch's read is cheap enough."""
    if read is not heap_in_use_bytes:
        return None
    try:
        rss = host_rss_reader()
        rss()
    except Exception:
        return None
    if not isinstance(rss, StatmReader):
        return None  # psutil's read is too slow for it
    if hwm_resets:
        try:
            hwm = HwmReader()
            if hwm() > 0:
                return Tripwire(hwm, "hwm")
        except Exception:
            pass
    return Tripwire(rss, "rss")


class Tripwire:
    """The resident set (``source`` ``"rss"``) or its high-water mark (``"hwm"``), or 0 if the
    kernel stops answering (which never trips, and never fails a step: the schedule checks it on
    quiet steps, which do nothing else). Picklable, like the reader inside."""

    __slots__ = ("_rss", "source")

    def __init__(self, rss: Callable[[], int], source: str = "rss") -> None:
        self._rss = rss
        self.source = source

    def __call__(self) -> int:
        try:
            return self._rss()
        except Exception:
            return 0

    @property
    def reader(self) -> Callable[[], int]:
        return self._rss

    def __getstate__(self) -> tuple[Callable[[], int], str]:
        return self._rss, self.source

    def __setstate__(self, state: tuple[Callable[[], int], str]) -> None:
        self._rss, self.source = state


# ---------------------------------------------------------------------- pymalloc's bytes
# What Python's own allocator holds, beside glibc's heap (heap_in_use_bytes): ~1 ms a read (it walks every
# pool and prints to fd 2), so the host channel takes it on a stride and a census at will, never every step.
_ARENAS = re.compile(rb"(\d+) arenas \* (\d+) bytes/arena")
_IN_BLOCKS = re.compile(rb"# bytes in allocated blocks += +([\d,]+)")


def _malloc_stats() -> bytes | None:
    """What ``sys._debugmallocstats()`` prints to fd 2 (~0.5-1.5 ms: it walks every pool), captured."""
    r, w = os.pipe()
    saved = os.dup(2)
    try:
        sys.stderr.flush()
        os.dup2(w, 2)
        try:
            sys._debugmallocstats()  # type: ignore[attr-defined]
        finally:
            os.dup2(saved, 2)
            os.close(w)
        chunks = []
        while True:
            chunk = os.read(r, 1 << 16)
            if not chunk:
                break
            chunks.append(chunk)
    except Exception:
        return None
    finally:
        os.close(saved)
        os.close(r)
    return b"".join(chunks)


def pymalloc_arena_bytes() -> int | None:
    """Bytes of pymalloc arenas now allocated, parsed from ``sys._debugmallocstats()`` (~1 ms: for
    a census, never per step). None where CPython does not print it."""
    m = _ARENAS.search(_malloc_stats() or b"")
    return int(m.group(1)) * int(m.group(2)) if m else None


_CLASS_ROW = re.compile(rb"^ +\d+ +(\d+) +\d+ +(\d+) +\d+$", re.MULTILINE)


def pymalloc_bytes() -> int | None:
    """Bytes Python asked pymalloc for (every object of 512 bytes or less), from ``sys._debugmallocstats()``:
    the bytes in its allocated blocks less 8 a block, since every request is rounded up to a multiple of 16
    (a 24-byte float takes a 32-byte block; ``tracemalloc`` and ``sys.getsizeof`` count 24). None where
    CPython does not print them."""
    stats = _malloc_stats() or b""
    m = _IN_BLOCKS.search(stats)
    if not m:
        return None
    blocks = 0
    for _, count in _CLASS_ROW.findall(stats):  # one row per size class
        blocks += int(count)
    return max(0, int(m.group(1).replace(b",", b"")) - 8 * blocks)


# ---------------------------------------------------------------------- the monitor's clock
# Its own time is read on its thread's CPU time, less Python's own collections. Wall time charged the
# monitor for what a busy machine did to it (a time slice given to another process, a collection of the
# whole heap landing inside a 50 µs hook): on a loaded 2-core machine one short run's own time read 69% of
# its steps. A collection Python starts by itself is the heap's cost wherever it lands; one the monitor
# runs (``gc_every_n_steps``) is its own and stays counted (:func:`counted_collection`).

_thread_time = time.thread_time
_ident = threading.get_ident
_gc_s: dict[int, float] = {}  # thread -> CPU seconds in the older generations' automatic collections
_gc_start: dict[int, float] = {}
CLOCK_READS = [0]  # reads of own_time() so far: a hook call in which none happened timed nothing (HookMeter)
IMPORT_S: dict[int, float] = {}  # thread -> CPU seconds in the imports the monitor's code started (_base/hidden_costs.py)
IMPORTS = [0.0, 0]  # those seconds, every thread, and the modules: totals the schedule reads (no call on the step path)
_counting = 0  # > 0 inside counted_collection(): that collection is the monitor's own work
_watchers = 0


def _on_collection(phase: str, info: dict[str, Any]) -> None:
    # the young generation's collections are short and frequent: not worth two clock reads each
    if _counting or info.get("generation", 2) == 0:
        return
    thread = _ident()
    if phase == "start":
        _gc_start[thread] = _thread_time()
    else:
        start = _gc_start.pop(thread, None)
        if start is not None:
            _gc_s[thread] = _gc_s.get(thread, 0.0) + _thread_time() - start


def own_time() -> float:
    """Seconds on the monitor's clock; the difference of two reads on one thread is what the code between cost
    (the imports the monitor's code starts are left out too: the schedule books them as a part of their own)."""
    CLOCK_READS[0] += 1
    thread = _ident()
    return _thread_time() - _gc_s.get(thread, 0.0) - IMPORT_S.get(thread, 0.0)


def watch_collections() -> bool:
    """From now on, leave Python's automatic collections out of :func:`own_time` (a run's start). True."""
    global _watchers
    _watchers += 1
    if _on_collection not in gc.callbacks:
        gc.callbacks.append(_on_collection)
    return True


def unwatch_collections() -> bool:
    """Undo one :func:`watch_collections` (a run's end); the callback goes with the last one. False."""
    global _watchers
    _watchers = max(0, _watchers - 1)
    if not _watchers and _on_collection in gc.callbacks:
        gc.callbacks.remove(_on_collection)
    return False


@contextlib.contextmanager
def counted_collection() -> Iterator[None]:
    """Collections inside the block are the monitor's own work and stay in :func:`own_time`."""
    global _counting
    _counting += 1
    try:
        yield
    finally:
        _counting -= 1


# The budget's guard: own time over windows of at least this many steps after the first QUIET_FROM, and of
# at least CONTROL_S of step time: over a few tens of milliseconds (32 steps of 1.6 ms), one read's cost
# or one time slice on a busy machine decides the rate, and a back-off is never undone.
CONTROL_STEPS = 32
CONTROL_S = 0.25
MAX_BACKOFF = 1024
# the parts whose interval the guard widens, as its log line names them
PART_NAMES = {"lingering": "the lingering check", "read": "the memory reads", "sample": "sampled steps"}


class OwnTimeRecord(Protocol):
    """What the guard reads of the step schedule (``_runtime/schedule.py``)."""

    steps: int
    timed_s: float
    own_s: float
    parts: dict[str, float]
    read_every: int
    sample_every: int
    log_every: int
    explicit: bool
    logs: bool


class BudgetGuard:
    """Over windows of at least :data:`CONTROL_STEPS` steps and :data:`CONTROL_S` seconds of step time
    after the first ``QUIET_FROM``, the own
    time measured (finding work excepted) against the budget; over it, the costliest part that has
    an interval (the lingering check, sampling, the reads) backs off: its interval doubles. Said
    once in the log; every back-off is in report.json. Picklable."""

    def __init__(self, budget: float, first: int, max_interval: int) -> None:
        self.budget = budget
        self.max_interval = max_interval  # an interval at this is not widened further
        self.backoff = {"read": 1, "sample": 1, "lingering": 1}  # the multipliers of the intervals
        self.backoffs: list[dict[str, Any]] = []  # each time the guard widened an interval
        self.over_budget_windows = 0
        self.said: set[str] = set()  # what the guard has said in the log (each once)
        self.announce: tuple[logging.Logger, str] | None = None  # (logger, owner): where the back-off is said
        self.window: tuple[int, float, float, dict[str, float]] = (first, 0.0, 0.0, {})

    def check(self, schedule: OwnTimeRecord) -> None:
        """One window's check: reads ``schedule``'s totals and widens its intervals."""
        start, own0, step0, parts0 = self.window
        steps = schedule.steps
        elapsed = schedule.timed_s - step0
        if steps < start + CONTROL_STEPS or elapsed < CONTROL_S:
            return
        parts = schedule.parts
        own = schedule.own_s - parts["findings"]  # finding work excepted (finding_s)
        self.window = (steps, own, schedule.timed_s, dict(parts))
        rate = (own - own0) / elapsed
        if rate <= self.budget:
            return
        spent = {}
        for key, seconds in parts.items():
            spent[key] = seconds - parts0.get(key, 0.0)
        # the parts whose interval the guard can widen (logged steps are sampled whatever the interval)
        controllable = {"lingering": spent["lingering"]}
        if schedule.read_every < self.max_interval:
            controllable["read"] = spent["read"]
        if not schedule.explicit and (not schedule.logs or schedule.sample_every < schedule.log_every):
            controllable["sample"] = spent["sample"]
        part = max(controllable, key=lambda k: controllable[k])
        self.over_budget_windows += 1
        if controllable[part] <= 0 or self.backoff[part] >= MAX_BACKOFF:
            if self.say("floor"):  # what is left is the logged steps and the tripwire
                logger, owner = self.announce  # type: ignore[misc]
                logger.info(
                    "%s: its own time was %.2f%% of step time over the last %d steps, above overhead_budget=%g, "
                    "and nothing it can sample less often is left: the rest is the logged steps (every %s), which "
                    "log_every_n_steps sets, and its hooks' calls (%.3g s of %.3g s), which every step makes.",
                    owner, 100 * rate, steps - start, self.budget, schedule.log_every if schedule.logs else "-",
                    spent.get("hooks", 0.0), own - own0,
                )
            return
        self.backoff[part] *= 2
        self.backoffs.append({"step": steps, "part": part, "own_time": round(rate, 5), "factor": self.backoff[part]})
        if len(self.backoffs) > 64:
            del self.backoffs[:32]
        if self.say("backoff"):
            logger, owner = self.announce  # type: ignore[misc]
            logger.info(
                "%s: its own time was %.2f%% of step time over the last %d steps, above overhead_budget=%g; "
                "the costliest part (%s: %.3g s of %.3g s) now runs half as often. Later back-offs are listed "
                "in report.json (summary.cadence.backoffs).",
                owner, 100 * rate, steps - start, self.budget, PART_NAMES[part], spent[part], own - own0,
            )

    def say(self, what: str) -> bool:
        """Whether to say ``what`` now: once per run, on rank zero (where :attr:`announce` is set)."""
        if self.announce is None or what in self.said:
            return False
        self.said.add(what)
        return True
