"""Host reads beyond the per-step one: USS/PSS, the block count, and what each host read costs.

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

import sys
import time
from typing import Callable

from memcallbacks._base.cpu import StatmReader, pymalloc_arena_bytes

__all__ = ["measure_costs", "python_object_blocks", "smaps_rollup"]


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
