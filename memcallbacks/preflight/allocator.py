"""How the CUDA caching allocator turns requested bytes into allocated and reserved bytes.

The rules, from ``c10/cuda/CUDACachingAllocator.cpp`` (torch 2.x, default configuration; the
constants live in ``c10/core/CachingDeviceAllocator.h`` in recent versions):

- ``round_size``: a request is rounded up to a multiple of 512 bytes (``kMinBlockSize``), in both
  pools (``roundup_power2_divisions`` is off by default, so there is no large-pool rounding rule
  beyond this); a 0-byte request allocates nothing.
- ``get_pool``: rounded sizes up to 1 MiB (``kSmallSize``) are served by the small pool, larger ones
  by the large pool.
- ``get_allocation_size``: a new segment is 2 MiB (``kSmallBuffer``) for the small pool, 20 MiB
  (``kLargeBuffer``) for sizes under 10 MiB (``kMinLargeAlloc``), else the size rounded up to
  2 MiB (``kRoundLarge``).
- ``get_free_block``: the smallest cached free block of the pool that fits (best fit).
- ``should_split``: the block found (or the new segment) is split when what remains is at least
  512 bytes in the small pool, and only when it is more than 1 MiB (``kSmallSize``) in the large
  pool; otherwise the whole block is handed out, and ``memory_allocated()`` counts all of it. An
  11 MiB tensor gets a 12 MiB segment whose 1 MiB remainder is not split off: it counts 12 MiB; a
  cached 20 MiB block reused for a 19.5 MiB tensor counts 20 MiB.
- ``free_block``/``try_merge_blocks``: a freed block merges with free neighbours of its segment.

Not modelled: expandable segments (``PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True``, where the
large pool splits at 512 bytes and segments grow in place), ``max_split_size_mb``,
``roundup_power2_divisions``, ``garbage_collection_threshold``, streams other than the current one,
and ``empty_cache()`` or the release of cached segments when ``cudaMalloc`` fails. The replay is an
estimate of ``memory_allocated()`` and ``max_memory_reserved()``, not a copy of the allocator.

cuBLAS's workspace (``aten/src/ATen/cuda/CublasHandlePool.cpp``) is allocated through the same
allocator and kept: ``4096 KiB x 2 + 16 KiB x 8`` by default, ``4096 KiB x 8`` on Hopper
(``CUBLAS_WORKSPACE_CONFIG`` overrides both); how many of them a step holds is
:mod:`memcallbacks.preflight.workspaces`'s business.
"""

from __future__ import annotations

import bisect
import dataclasses
import os
import re
from collections.abc import Iterable, Mapping, Sequence

__all__ = [
    "MIN_BLOCK", "SMALL_SIZE", "SMALL_BUFFER", "LARGE_BUFFER", "MIN_LARGE_ALLOC", "ROUND_LARGE",
    "CachingAllocatorModel", "Replay", "allocation_size", "block_bytes", "cublas_workspace_bytes", "replay",
    "reserved_bytes", "round_cuda", "round_size", "should_split",
]

MIN_BLOCK = 512  # kMinBlockSize: every block is a multiple of this
SMALL_SIZE = 1 << 20  # kSmallSize: the largest request of the small pool
SMALL_BUFFER = 2 << 20  # kSmallBuffer: the small pool's segments
LARGE_BUFFER = 20 << 20  # kLargeBuffer: the large pool's segments for requests under kMinLargeAlloc
MIN_LARGE_ALLOC = 10 << 20  # kMinLargeAlloc: from here on a request gets a segment of its own size
ROUND_LARGE = 2 << 20  # kRoundLarge: ... rounded up to this


def round_size(nbytes: int) -> int:
    """``round_size``: the request rounded up to 512 bytes (0 stays 0: nothing is allocated)."""
    if nbytes <= 0:
        return 0
    return -(-nbytes // MIN_BLOCK) * MIN_BLOCK


round_cuda = round_size  # the name predict() used before the block rules were modelled


def allocation_size(size: int) -> int:
    """``get_allocation_size``: the segment ``cudaMalloc`` is asked for when no cached block fits ``size``."""
    if size <= SMALL_SIZE:
        return SMALL_BUFFER
    if size < MIN_LARGE_ALLOC:
        return LARGE_BUFFER
    return -(-size // ROUND_LARGE) * ROUND_LARGE


def should_split(block: int, size: int) -> bool:
    """``should_split``: whether a ``block``-byte free block handed out for ``size`` (rounded) bytes is cut."""
    remaining = block - size
    if size <= SMALL_SIZE:  # the small pool
        return remaining >= MIN_BLOCK
    return remaining > SMALL_SIZE


def block_bytes(nbytes: int) -> int:
    """Bytes ``memory_allocated()`` counts for ``nbytes`` served by a new segment (no cached block fits)."""
    size = round_size(nbytes)
    if size == 0:
        return 0
    segment = allocation_size(size)
    return size if should_split(segment, size) else segment


def cublas_workspace_bytes(hopper_or_newer: bool = False, config: str | None = None) -> int:
    """One cuBLAS workspace: ``CUBLAS_WORKSPACE_CONFIG`` (``":4096:8"`` = 8 x 4096 KiB) or torch's default."""
    config = config if config is not None else os.environ.get("CUBLAS_WORKSPACE_CONFIG")
    if config:
        pairs = re.findall(r":(\d+):(\d+)", config)
        if pairs:
            return sum(int(size) * 1024 * int(count) for size, count in pairs)
    return 4096 * 1024 * 8 if hopper_or_newer else 4096 * 1024 * 2 + 16 * 1024 * 8


@dataclasses.dataclass(eq=False)
class _Block:
    size: int
    addr: int
    small: bool
    free: bool = False
    prev: _Block | None = None  # neighbours in the same segment (merging never crosses segments)
    next: _Block | None = None


class _FreeBlocks:
    """One pool's cached free blocks ordered by (size, address), as ``BlockComparatorSize`` orders them."""

    def __init__(self) -> None:
        self.keys: list[tuple[int, int]] = []
        self.blocks: dict[int, _Block] = {}

    def add(self, block: _Block) -> None:
        block.free = True
        bisect.insort(self.keys, (block.size, block.addr))
        self.blocks[block.addr] = block

    def remove(self, block: _Block) -> None:
        del self.keys[bisect.bisect_left(self.keys, (block.size, block.addr))]
        del self.blocks[block.addr]
        block.free = False

    def best_fit(self, size: int) -> _Block | None:
        i = bisect.bisect_left(self.keys, (size, -1))
        if i == len(self.keys):
            return None
        block = self.blocks[self.keys[i][1]]
        self.remove(block)
        return block


class CachingAllocatorModel:
    """The default caching allocator's block bookkeeping for one device and one stream (see the module doc)."""

    def __init__(self) -> None:
        self._pools = {True: _FreeBlocks(), False: _FreeBlocks()}  # small, large
        self._next_addr = 0
        self.allocated = self.reserved = self.peak_allocated = self.peak_reserved = 0

    def malloc(self, nbytes: int) -> _Block | None:
        """Serve a request of ``nbytes``; the block's ``size`` is what ``memory_allocated()`` counts for it."""
        size = round_size(nbytes)
        if size == 0:
            return None
        small = size <= SMALL_SIZE
        block = self._pools[small].best_fit(size)
        if block is None:
            segment = allocation_size(size)
            block = _Block(segment, self._next_addr, small)
            self._next_addr += segment
            self.reserved += segment
            self.peak_reserved = max(self.peak_reserved, self.reserved)
        if should_split(block.size, size):
            rest = _Block(block.size - size, block.addr + size, small, prev=block, next=block.next)
            if block.next is not None:
                block.next.prev = rest
            block.next, block.size = rest, size
            self._pools[small].add(rest)
        self.allocated += block.size
        self.peak_allocated = max(self.peak_allocated, self.allocated)
        return block

    def free(self, block: _Block | None) -> None:
        """Return ``block`` to its pool, merged with the free neighbours of its segment."""
        if block is None:
            return
        self.allocated -= block.size
        pool = self._pools[block.small]
        prev, nxt = block.prev, block.next
        if prev is not None and prev.free:
            pool.remove(prev)
            prev.size += block.size
            prev.next = nxt
            if nxt is not None:
                nxt.prev = prev
            block = prev
        if nxt is not None and nxt.free:
            pool.remove(nxt)
            block.size += nxt.size
            block.next = nxt.next
            if nxt.next is not None:
                nxt.next.prev = block
        pool.add(block)


@dataclasses.dataclass(frozen=True)
class Replay:
    """What :func:`replay` found: per-record block bytes, the extra (never freed) blocks, peak reserved."""

    record_bytes: list[int]
    """Bytes ``memory_allocated()`` counts for each record's storage (its block when it was allocated)."""
    extra_bytes: dict[int, list[int]]
    """For each event index of ``extra``, the block bytes of the allocations injected before it."""
    peak_reserved: int


def replay(events: Iterable[tuple[int, int]], sizes: Sequence[int], extra: Mapping[int, Sequence[int]] | None = None) -> Replay:
    """Replay alloc/free ``events`` (record index, +1/-1) over request ``sizes`` through the allocator model.

    ``extra``: event index -> request sizes allocated just before that event and never freed (the
    cuBLAS workspaces); an index past the last event allocates them at the end.
    """
    model = CachingAllocatorModel()
    blocks: list[_Block | None] = [None] * len(sizes)
    record_bytes = [0] * len(sizes)
    extra = dict(extra or {})
    extra_bytes: dict[int, list[int]] = {}

    def inject(at: int) -> None:
        for nbytes in extra.pop(at, ()):
            block = model.malloc(nbytes)
            extra_bytes.setdefault(at, []).append(block.size if block is not None else 0)

    for n, (index, sign) in enumerate(events):
        inject(n)
        if sign > 0:
            blocks[index] = model.malloc(sizes[index])
            record_bytes[index] = blocks[index].size if blocks[index] is not None else 0
        else:
            model.free(blocks[index])
            blocks[index] = None
    for at in sorted(extra):
        inject(at)
    return Replay(record_bytes, extra_bytes, model.peak_reserved)


def reserved_bytes(events: Iterable[tuple[int, int]], sizes: list[int]) -> int:
    """Peak reserved bytes for alloc/free ``events`` (record index, +1/-1) over request ``sizes``."""
    return replay(events, sizes).peak_reserved
