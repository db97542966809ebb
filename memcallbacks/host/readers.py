"""Host reads beyond the per-step one: USS/PSS, pymalloc's bytes, and what each host read costs.

The per-step read (statm, the block count on a stride) is the channel's
(:class:`~memcallbacks.host.channel.HostReader`), a worker's page-fault count the workers'
(:class:`~memcallbacks.host.workers.FaultCounter`): a read step enters neither this module nor a
function of its own for them. Costs measured on this machine (Python 3.11, Linux, 2 shared cores;
:func:`measure_costs` repeats them) — docs/host.md has the table:

* ``/proc/self/statm`` through a kept-open descriptor (``os.pread``): ~1 µs. Resident set and its
  file-backed part, so private (anonymous) resident memory = resident - shared. Every step.
* ``sys.getallocatedblocks()``: CPython 3.11 walks every pymalloc pool to count them, so its cost
  grows with the Python heap: ~1 µs at 24 k blocks, ~70 µs at 0.6 M, ~200 µs at 1.8 M (about
  1 µs per 1 MiB arena). ``HostReader`` reads it on a stride chosen from its measured cost.
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

import os
import re
import sys
import time
from typing import Callable

from memcallbacks._base.cpu import StatmReader

__all__ = [
    "StatmReader",
    "measure_costs",
    "pymalloc_arena_bytes",
    "pymalloc_bytes",
    "python_object_blocks",
    "smaps_rollup",
]


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
