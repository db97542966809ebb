"""Cheap host reads for step start: Python-object memory, the process's resident and private memory.

Costs measured on this machine (Python 3.11, Linux, 2 shared cores; :func:`measure_costs` repeats
them) — docs/host.md has the table:

* ``/proc/self/statm`` through a kept-open descriptor (``os.pread``): ~1 µs. Resident set and its
  file-backed part, so private (anonymous) resident memory = resident - shared. Every step.
* ``sys.getallocatedblocks()``: CPython 3.11 walks every pymalloc pool to count them, so its cost
  grows with the Python heap: ~1 µs at 24 k blocks, ~70 µs at 0.6 M, ~200 µs at 1.8 M (about
  1 µs per 1 MiB arena). :class:`HostReader` reads it on a stride chosen from its measured cost.
* ``/proc/self/smaps_rollup`` (USS, PSS): the kernel walks every mapping's page tables, 1-6 ms
  on a 300 MiB process, 9-22 ms on a DataLoader worker of one. For DataLoader workers
  (:mod:`memcallbacks.host.workers`), when their page faults ask for it or on a time budget.
* ``/proc/<pid>/stat`` (minor page faults): ~14 µs, ~3 µs through a kept-open descriptor. A
  DataLoader worker's faults, on a small share of the workers' budget.
* ``sys._debugmallocstats()`` (pymalloc's arena bytes, exact): ~1 ms and it prints to fd 2: for a
  census, never per step. ``psutil.Process().memory_info()``: ~35 µs; ``memory_full_info()``
  (USS): ~7 ms.
"""

from __future__ import annotations

import math
import os
import re
import sys
import time
from dataclasses import dataclass
from typing import Callable, NamedTuple

from memcallbacks._base.cpu import PAGE_SIZE, StatmReader

__all__ = [
    "BYTES_PER_BLOCK",
    "FaultCounter",
    "HostReader",
    "HostReading",
    "StatmReader",
    "measure_costs",
    "pymalloc_arena_bytes",
    "pymalloc_bytes",
    "python_object_blocks",
    "smaps_rollup",
]

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


def python_object_blocks() -> int:
    """Memory blocks CPython's object allocator has handed out and not freed (all Python objects)."""
    return sys.getallocatedblocks()


_ROLLUP_FIELDS = {b"Rss": "rss", b"Pss": "pss", b"Private_Clean": "private_clean", b"Private_Dirty": "private_dirty",
                  b"Shared_Clean": "shared_clean", b"Shared_Dirty": "shared_dirty", b"Swap": "swap"}


def smaps_rollup(pid: int | str = "self") -> dict[str, int] | None:
    """``{"rss", "pss", "uss", "swap", ...}`` in bytes from ``/proc/<pid>/smaps_rollup``; None when
    it cannot be read (no such process, not Linux, kernel older than 4.14).

    USS (unique set size) = Private_Clean + Private_Dirty: what the process alone holds, the memory
    freed if it exited. A forked DataLoader worker starts with a USS of a few MiB (its pages are
    its parent's until written) and grows as it touches them (copy on write)."""
    try:
        with open(f"/proc/{pid}/smaps_rollup", "rb") as fh:
            data = fh.read()
    except OSError:
        return None
    out: dict[str, int] = {}
    for line in data.splitlines()[1:]:
        name, _, rest = line.partition(b":")
        key = _ROLLUP_FIELDS.get(name)
        if key is not None:
            out[key] = int(rest.split()[0]) * 1024
    if "rss" not in out:
        return None
    out["uss"] = out.get("private_clean", 0) + out.get("private_dirty", 0)
    return out


def _minflt(data: bytes) -> int:
    # the command name (field 2) is in parentheses and may hold spaces: count the fields after its ')'
    return int(data[data.rindex(b")") + 2:].split()[7])


class FaultCounter:
    """Minor page faults of several processes so far (``/proc/<pid>/stat`` field 10, ``minflt``) through
    kept-open descriptors (``os.pread``: ~3 µs a process warm, ~35 µs after a training step, against
    ~14-40 µs opening the file each time and 9-22 ms for a DataLoader worker's ``smaps_rollup``).

    A forked worker's first write to a page it shares with its parent is a minor fault that makes the
    page private (copy on write), so faults times the page size bound how much could have become
    private since the last count. Memory mapped and unmapped again faults too: evidence, not proof."""

    def __init__(self) -> None:
        self._fds: dict[int, int] = {}

    def read(self, pids: list[int]) -> dict[int, int | None]:
        """Each pid's minor faults (None: gone or unreadable); descriptors of pids not asked for are closed."""
        for pid in [p for p in self._fds if p not in pids]:
            os.close(self._fds.pop(pid))
        out: dict[int, int | None] = {}
        for pid in pids:
            try:
                fd = self._fds.get(pid)
                if fd is None:
                    fd = self._fds[pid] = os.open(f"/proc/{pid}/stat", os.O_RDONLY)
                out[pid] = _minflt(os.pread(fd, 1024, 0))
            except (OSError, ValueError, IndexError):
                out[pid] = None
        return out

    def close(self) -> None:
        for fd in self._fds.values():
            os.close(fd)
        self._fds.clear()

    __del__ = close


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


@dataclass
class HostReader:
    """The host read at step start: ``statm`` every call, the Python block count on a stride.

    ``read(step)`` costs ~1-3 µs plus, on every ``blocks_every``-th call, ``sys.getallocatedblocks()``
    (40 µs warm, 1-3 ms after a training step has evicted the pool headers from the caches, on a
    0.5 M-block heap: it touches every 16 KiB pool).
    The stride is chosen from that call's measured cost so that it averages at most
    ``blocks_budget_us`` per step, and it is at most ``max_blocks_every`` (the growth test tolerates
    a thinned series: its blocks span steps, not reads). ``seconds`` totals the time spent in reads.
    """

    blocks_budget_us: float = 5.0
    """Average cost per step allowed for the Python block count."""
    max_blocks_every: int = 256
    """The block count is read at least every this many calls (at ~2 ms a cold read on a 0.5 M-block
    heap that is ~8 µs a step; on a small heap it is read every step)."""
    max_blocks_gap_steps: int = 16
    """...and at least every this many steps: the calls follow the watch's cadence (every step for the
    first 48, then its read steps), so a stride in calls alone can leave hundreds of steps between
    two block counts. The calls themselves are on the budget's cadence, so this bounds steps, not time."""

    def __post_init__(self) -> None:
        if not (self.blocks_budget_us > 0 and math.isfinite(self.blocks_budget_us)):
            raise ValueError(f"HostReader(blocks_budget_us={self.blocks_budget_us!r}) must be a positive number of "
                             "microseconds, e.g. 5.0.")
        if not (isinstance(self.max_blocks_every, int) and self.max_blocks_every >= 1):
            raise ValueError(f"HostReader(max_blocks_every={self.max_blocks_every!r}) must be an integer >= 1, e.g. 256.")
        if not (isinstance(self.max_blocks_gap_steps, int) and self.max_blocks_gap_steps >= 1):
            raise ValueError(f"HostReader(max_blocks_gap_steps={self.max_blocks_gap_steps!r}) must be an integer >= 1, e.g. 16.")
        self._statm = StatmReader()
        self._blocks_step: int | None = None
        self.blocks_every = 1
        self.blocks_cost_us = 0.0
        self.calls = 0
        self.seconds = 0.0

    def read(self, step: int) -> HostReading:
        t0 = time.perf_counter()
        rss, private = self._statm.read()
        blocks: int | None = None
        last = self._blocks_step
        # at least every max_blocks_gap_steps steps, unless the count is so dear (1-3 ms on a large heap
        # after a step) that it would cost more than twice its budget per step: then as rarely as that allows
        gap = max(self.max_blocks_gap_steps, math.ceil(self.blocks_cost_us / (2 * self.blocks_budget_us)))
        if self.calls % self.blocks_every == 0 or last is None or step - last >= gap:
            self._blocks_step = step
            t1 = time.thread_time()  # CPU time: a read preempted on a shared machine is not a slow read
            blocks = sys.getallocatedblocks()
            cost = (time.thread_time() - t1) * 1e6
            # a slow moving average: one read evicted from the cache must not thin the series
            self.blocks_cost_us = cost if self.calls == 0 else 0.8 * self.blocks_cost_us + 0.2 * cost
            self.blocks_every = max(1, min(self.max_blocks_every, math.ceil(self.blocks_cost_us / self.blocks_budget_us)))
        self.calls += 1
        self.seconds += time.perf_counter() - t0
        return HostReading(step, rss, private, blocks)

    def close(self) -> None:
        self._statm.close()


def _time_us(fn: Callable[[], object], repeat: int) -> float:
    fn()
    t0 = time.perf_counter()
    for _ in range(repeat):
        fn()
    return (time.perf_counter() - t0) / repeat * 1e6


def measure_costs(repeat: int = 200) -> dict[str, float]:
    """Median-free mean cost in µs of each candidate host read, in this process as it is now.

    ``repeat`` calls of the cheap reads; a tenth as many (at least 3) of the slow ones."""
    if repeat < 1:
        raise ValueError(f"measure_costs(repeat={repeat}) must be at least 1; try 200.")
    slow = max(3, repeat // 10)
    statm = StatmReader()
    costs = {
        "statm (kept-open fd)": _time_us(statm.read, repeat),
        "sys.getallocatedblocks": _time_us(sys.getallocatedblocks, repeat),
        "smaps_rollup (USS/PSS)": _time_us(smaps_rollup, slow),
        "sys._debugmallocstats (arena bytes)": _time_us(pymalloc_arena_bytes, slow),
    }
    statm.close()
    try:
        import psutil

        proc = psutil.Process()
        costs["psutil memory_info"] = _time_us(proc.memory_info, repeat)
        costs["psutil memory_full_info (USS)"] = _time_us(proc.memory_full_info, slow)
    except Exception:
        pass
    return costs
