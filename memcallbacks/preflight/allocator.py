"""How the CUDA caching allocator turns requested bytes into allocated and reserved bytes (a model of it).

Numbers from ``c10/cuda/CUDACachingAllocator.cpp`` and ``aten/src/ATen/cuda/CublasHandlePool.cpp``:

- every block is rounded up to a multiple of 512 bytes (``kMinBlockSize``); that is what
  ``memory_allocated()`` counts;
- blocks up to 1 MiB (``kSmallSize``) come from the small pool, carved out of 2 MiB segments
  (``kSmallBuffer``); blocks up to 10 MiB (``kMinLargeAlloc``) out of 20 MiB segments
  (``kLargeBuffer``); bigger ones get their own segment rounded up to 2 MiB (``kRoundLarge``);
- the first matmul on a stream allocates cuBLAS's workspace through the same allocator and keeps
  it: ``4096 KiB x 2 + 16 KiB x 8`` by default, ``4096 KiB x 8`` on Hopper and newer
  (``CUBLAS_WORKSPACE_CONFIG`` overrides both).

:func:`reserved_bytes` replays the allocations against those segment sizes with best-fit reuse
of freed blocks, splitting and no release of cached segments (``empty_cache`` is never called);
it is an estimate of ``max_memory_reserved()``, not a copy of the allocator.
"""

from __future__ import annotations

import bisect
import os
import re
from collections.abc import Iterable

__all__ = ["MIN_BLOCK", "cublas_workspace_bytes", "reserved_bytes", "round_cuda"]

MIN_BLOCK = 512
SMALL_SIZE = 1 << 20
SMALL_BUFFER = 2 << 20
MIN_LARGE_ALLOC = 10 << 20
LARGE_BUFFER = 20 << 20
ROUND_LARGE = 2 << 20


def round_cuda(nbytes: int) -> int:
    """Bytes ``memory_allocated()`` counts for a request of ``nbytes`` (0 stays 0)."""
    if nbytes <= 0:
        return 0
    return -(-nbytes // MIN_BLOCK) * MIN_BLOCK


def cublas_workspace_bytes(hopper_or_newer: bool = False, config: str | None = None) -> int:
    """cuBLAS's workspace: ``CUBLAS_WORKSPACE_CONFIG`` (``":4096:8"`` = 8 x 4096 KiB) or torch's default."""
    config = config if config is not None else os.environ.get("CUBLAS_WORKSPACE_CONFIG")
    if config:
        pairs = re.findall(r":(\d+):(\d+)", config)
        if pairs:
            return sum(int(size) * 1024 * int(count) for size, count in pairs)
    return 4096 * 1024 * 8 if hopper_or_newer else 4096 * 1024 * 2 + 16 * 1024 * 8


def _segment_size(block: int) -> int:
    if block <= SMALL_SIZE:
        return SMALL_BUFFER
    if block < MIN_LARGE_ALLOC:
        return LARGE_BUFFER
    return -(-block // ROUND_LARGE) * ROUND_LARGE


class _Pool:
    """Free blocks of one pool, sorted by size, so a request takes the smallest that fits (best fit)."""

    def __init__(self) -> None:
        self.free: list[int] = []

    def take(self, block: int) -> bool:
        i = bisect.bisect_left(self.free, block)
        if i == len(self.free):
            return False
        size = self.free.pop(i)
        if size - block >= MIN_BLOCK:  # the remainder stays cached as a free block (split)
            bisect.insort(self.free, size - block)
        return True

    def give(self, block: int) -> None:
        bisect.insort(self.free, block)


def reserved_bytes(events: Iterable[tuple[int, int]], sizes: list[int]) -> int:
    """Peak reserved bytes for alloc/free ``events`` (record index, +1/-1) over request ``sizes``.

    Freed neighbours are not merged back (the real allocator does merge), so a long run can read
    somewhat above the real reserve; short steps on a fresh process match its segment counts.
    """
    small, large = _Pool(), _Pool()
    reserved = peak = 0
    for index, sign in events:
        block = round_cuda(sizes[index])
        if block == 0:
            continue
        pool = small if block <= SMALL_SIZE else large
        if sign < 0:
            pool.give(block)
            continue
        if not pool.take(block):
            segment = _segment_size(block)
            reserved += segment
            if segment > block:
                pool.give(segment - block)
            peak = max(peak, reserved)
    return peak
