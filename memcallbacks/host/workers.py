"""DataLoader workers' private memory: per worker, over the run, and the copy-on-access finding.

Workers are found as the ``multiprocessing`` children of this process that a live DataLoader iterator lists in its
``_workers`` (torch starts every worker as a ``multiprocessing`` process running
``torch.utils.data._utils.worker._worker_loop``, whatever the start method); the worker id is its index there. Each
worker's minor page faults (``/proc/<pid>/stat``, a few µs) are counted at every update on a small share of the
budget; its USS and PSS (``/proc/<pid>/smaps_rollup``, 9-22 ms a worker: the kernel walks its page tables) are read
when the faults since the last read could have made half of ``min_growth_bytes`` private (finding work, apart from the
budget, backing off where faults bring no growth), and otherwise within ``max_overhead`` of the wall time,
``min_interval_s`` or ``max_gap_steps`` after the last read. A worker grows when it keeps what it faults (copy on
access, a cache); one that maps and unmaps large batches faults far more than it keeps. A worker that grew past twice
its parent's Dataset grows inside itself (a cache in ``__getitem__``), which copy on access cannot explain.
Non-persistent workers are started again every epoch: a new set of pids is a new *generation*, and each worker's growth is
measured over its own life.
"""

from __future__ import annotations

import copy
import gc
import multiprocessing
import operator
import os
import time
import weakref
from dataclasses import dataclass, field
from typing import Any

from memcallbacks._base.cpu import PAGE_SIZE
from memcallbacks._base.findings import Finding
from memcallbacks._base.units import MiB, format_bytes
from memcallbacks.host.holders import deep_size, empty_containers
from memcallbacks.host.readers import smaps_rollup

__all__ = ["FaultCounter", "WorkerInfo", "WorkerWatch", "dataloader_workers"]

_KEEP_DEAD = 64
"""Exited workers whose memory did not grow that are kept (the ones that grew stay for the finding)."""


@dataclass(frozen=True)
class WorkerInfo:
    pid: int
    worker_id: int | None
    dataset: str
    """The type name of the worker's Dataset."""


def _iterators(young: bool = False) -> list[Any]:
    """The live multi-process DataLoader iterators (each knows its workers by worker id); ``young``: only
    those in the collector's two young generations (an epoch's new iterator, made a step or two ago,
    is most often there: a walk of those lists, not of the whole heap)."""
    try:
        from torch.utils.data.dataloader import _MultiProcessingDataLoaderIter as Iter
    except Exception:
        return []
    if young:
        return [obj for g in (0, 1) for obj in gc.get_objects(generation=g) if isinstance(obj, Iter)]
    # an instance refers to its (heap) type, so gc finds every live iterator without a heap list
    return [obj for obj in gc.get_referrers(Iter) if isinstance(obj, Iter)]


def dataloader_workers(known: dict[int, WorkerInfo | None] | None = None, datasets: dict[int, Any] | None = None) -> list[WorkerInfo]:
    """The live DataLoader worker processes this process started (persistent or not).

    Candidates are this process's ``multiprocessing`` children (every DataLoader worker is one,
    whatever the start method); a child not seen before is identified through the live
    DataLoader iterators' ``_workers`` (``multiprocessing`` drops a started process's target, so
    its arguments cannot say). ``known`` caches identities by pid between calls (None: not a
    worker), so the search runs only when new children appear (an epoch of non-persistent
    workers). ``datasets`` (when given) gets a weak reference to each new worker's Dataset, by pid."""
    known = {} if known is None else known
    children: list[int] = []  # loops, not comprehensions: this runs at each of the watch's reads
    new: set[int] = set()
    for child in multiprocessing.active_children():
        if child.pid is not None:
            children.append(child.pid)
            if child.pid not in known:
                new.add(child.pid)
    if new:
        found: dict[int, WorkerInfo] = {}
        for young in (True, False):  # the young generations first; the whole heap only if they did not hold it
            for it in _iterators(young):
                dataset = type(getattr(it, "_dataset", None)).__name__
                for worker_id, proc in enumerate(getattr(it, "_workers", ()) or ()):
                    if proc.pid is not None:
                        found[proc.pid] = WorkerInfo(proc.pid, worker_id, dataset)
                        if datasets is not None:
                            datasets[proc.pid] = _weak(getattr(it, "_dataset", None))
            if new <= found.keys():
                break
        for pid in children:
            if pid not in known:
                known[pid] = found.get(pid)
    live = set(children)
    workers: list[WorkerInfo] = []
    for pid, worker in list(known.items()):
        if pid not in live:
            del known[pid]
        elif worker is not None:
            workers.append(worker)
    workers.sort(key=lambda w: (w.worker_id if w.worker_id is not None else 1 << 30, w.pid))
    return workers


_PID = operator.attrgetter("pid")


def _weak(obj: Any) -> Any:
    try:
        return weakref.ref(obj)
    except TypeError:
        return None


_INSIDE_FACTOR = 2
"""A worker that grew by more than this many times what its parent's Dataset holds (plus half of
``min_growth_bytes``) grows inside itself: copy on access can copy no more than the parent has. Half, not all:
a worker confirmed at 8 MiB over a Dataset of paths (0.1 MiB) was judged copy on access, then inside."""

_DATASET_BUDGET = 20_000
"""Objects a Dataset's deep size walks at most (once per Dataset, after a worker grew); past it the
Dataset counts as large (copy on access can explain any growth)."""

_COPY_FIX = (
    "Copy on access: a worker starts sharing its parent's pages, and a Dataset ({datasets}) that holds a Python list "
    "(or dict) of objects has every page it reads copied into the worker, because reading an object writes its "
    "reference count (pytorch/pytorch#13246); each worker ends up with its own copy of the data. Fix: keep the data "
    "in NumPy arrays or tensors (one buffer, no per-item reference counts: `np.array(strings, dtype=np.bytes_)`, "
    "offsets into one array), or load it per worker in `worker_init_fn` / lazily from disk; fewer workers bound the "
    "cost meanwhile."
)

_INSIDE_FIX = (
    "It grows inside the workers: their private memory (USS) grew by more than their parent's Dataset "
    "({held}) holds, so it is not the parent's pages being copied but objects each worker makes and keeps, "
    "most often a cache filled in `__getitem__` (each decoded image or tokenized text kept in a dict on the "
    "Dataset: every worker fills its own copy, for the whole epoch or, with persistent workers, the run). Fix: "
    "drop the cache, or bound it (`functools.lru_cache(maxsize=...)` on the decode function), or fill it once "
    "in the parent before the workers start (as NumPy arrays or tensors, shared) or on disk; fewer workers bound "
    "the cost meanwhile."
)


@dataclass
class _Track:
    info: WorkerInfo
    generation: int
    reads: list[tuple[int, int, int]] = field(default_factory=list)
    """(step, uss, pss)"""
    faults: int | None = None
    """Minor faults at the last USS read."""
    first_faults: int | None = None
    """...and at the first (the baseline)."""
    threshold: int = 0
    """Faulted bytes since the last USS read that make the next one due (doubled by each miss)."""
    misses: int = 0
    """Reads the faults asked for that showed no growth."""
    reported: bool = False
    """In a finding: its reads are the budget's again."""
    peak: int = 0
    """Once reported: the highest USS read since (a settled finding re-opens 4 MiB above it)."""
    rise_uss: int = 0
    last_rise_step: int = 0
    """Once reported: its USS at its last counted rise, and that read's step."""
    climb_step: int = 0
    climb_uss: int = 0
    """Once reported: the step and USS of the read before its climb began (its growth's length runs from there)."""
    dataset_bytes: int | None = -1
    """Deep size of its parent's Dataset (None: past the walk's budget; -1: not sized), kept when the worker exits."""
    grew_inside: bool = False
    """It grew by more than copy on access can copy: a cache filled inside it (kept once seen)."""
    cache_attributes: tuple[str, ...] = ()
    """The Dataset's containers that are empty in this process (the cache each worker fills, most likely)."""

    @property
    def growth(self) -> int:
        return self.reads[-1][1] - self.reads[0][1] if self.reads else 0

    def kept_share(self) -> float | None:
        """USS growth over the bytes faulted since the baseline: ~0.9 for copy on access (every fault
        makes a page private) and for a cache (every fault is kept); a few percent where batches are
        mapped and unmapped. None without fault counts."""
        if self.faults is None or self.first_faults is None:
            return None
        faulted = (self.faults - self.first_faults) * PAGE_SIZE
        return self.growth / faulted if faulted > 0 else None

    def keeps(self) -> bool:
        """The worker keeps what it faults in (or its faults are not counted)."""
        share = self.kept_share()
        return share is None or share >= _KEPT_SHARE

    def climb(self) -> int:
        """Index of the read its climb starts from: the last within :data:`_RISE_BYTES` of its baseline (the level it
        came back to, or never left before a step)."""
        floor = self.reads[0][1] + _RISE_BYTES
        return max(i for i, r in enumerate(self.reads) if r[1] < floor)

    def rising(self) -> bool:
        """Growth step over step: its climb's reads are 3 or more over :data:`_SPAN_STEPS` steps or more, most of
        their moves are rises, and the last read is the highest seen (15 -> 18.6 -> 55 MiB then flat, a table
        built at once, climbs over 2 steps). A read within :data:`_FLAT_BYTES` of the one before is no move: read
        every step, each of 2 workers builds every other batch and reads flat in between."""
        reads = self.reads[self.climb():]
        if len(reads) < 3 or reads[-1][0] - reads[0][0] < _SPAN_STEPS:
            return False
        ys = [r[1] for r in reads]
        rises = sum(b - a >= _FLAT_BYTES for a, b in zip(ys, ys[1:]))
        falls = sum(a - b >= _FLAT_BYTES for a, b in zip(ys, ys[1:]))
        return rises >= 2 and rises >= 0.6 * (rises + falls) and ys[-1] >= max(ys) - MiB

    def late(self, min_growth: int) -> bool:
        """Still climbing: its reads in the second half of its climb rose by ``min_growth`` / :data:`_STEP_SHARE`. A
        table built at once (15 -> 24 -> 40 -> 55 MiB in 3 steps, then flat), or a heap copied by one collection, rose
        in the first half; copy on access and a cache rise in both. Its rises there keep the climb's pace (4x its mean
        per step at most): reads mid-build after a long gap and the top (23 -> 46 -> 50 in 2 steps) are a step."""
        reads = self.reads[self.climb():]
        middle = (reads[0][0] + reads[-1][0]) / 2
        second = [r for r in reads if r[0] >= middle]
        pace = (reads[-1][1] - reads[0][1]) / max(reads[-1][0] - reads[0][0], 1)
        fastest = max(((b[1] - a[1]) / max(b[0] - a[0], 1) for a, b in zip(second, second[1:])), default=0.0)
        return second[-1][1] - second[0][1] >= min_growth // _STEP_SHARE and fastest <= 4 * pace

    def grows_on(self, again: int, open_: bool) -> bool:
        """Once reported: while its finding is open, its last read is ``again`` above its last counted rise, reached at
        a quarter of its climb's pace or faster (a filled cache's allocator moves 1 MiB now and then: each such rise
        doubled the wait to settle, and a -n 2 suite run held a cache full by step ~200 open at step 444); once
        settled, ``again`` above the highest read since it was reported (a creep seen while open re-opens nothing)."""
        step, uss = self.reads[-1][:2]
        if not open_:
            return uss >= self.peak + again
        pace = (self.rise_uss - self.climb_uss) / max(self.last_rise_step - self.climb_step, 1)
        return uss >= self.rise_uss + again and (uss - self.rise_uss) / max(step - self.last_rise_step, 1) >= pace / 4

    def report(self) -> None:
        """Named in a finding: its peak so far, and where its climb began."""
        reads = self.reads
        self.climb_step, self.climb_uss = reads[self.climb()][:2]
        self.peak = self.rise_uss = reads[-1][1]
        self.last_rise_step = reads[-1][0]
        self.reported = True


_WARMUP_STEPS = 10
"""A worker's baseline read is this many steps after it was first seen: its first batches (2 a worker
in flight at start) map and keep tens of MiB (22-41 -> 56-88 MiB in 2 steps with batches of
64x3x224x224 floats), which is not growth."""

_SPAN_STEPS = 16
"""The fewest steps a worker's climb spans (from its last read at its baseline's level) for a finding. A worker's
USS swings by the batch it builds (50 -> 88 -> 52 MiB with batches of 64x3x224x224 floats): a baseline in a trough
and reads at the next two peaks, 2-3 steps later, rose by what the worker faulted (kept share 0.83-1.0) and were
reported now and then on a busy machine. Over 16 steps it builds several batches, whose faults the kept share
counts against the swing; a step to a plateau (a table built at once) rises over the few steps it takes."""

_KEPT_SHARE = 0.8
"""A worker grows when its USS growth is this share or more of the bytes it faulted since its baseline.
Measured: copy on access 0.96-1.4, a cache filled in ``__getitem__`` 0.97-1.0; batches of 64x3x224x224
floats 0.12-0.79 while the worker warms up (its USS swings by a batch), a few percent after."""

_CACHE_KEPT_SHARE = 0.3
"""...or this share where its Dataset has a container empty in the parent (:meth:`WorkerWatch._fills_cache`)."""

_STEP_SHARE = 4
"""Over its climb's second half a growing worker rose by ``min_growth_bytes`` over this (2 MiB): copy on access 3-5."""

_FLAT_BYTES = 64 * 1024
"""Two reads of a worker this close are no move (a 4 KiB page is the smallest change a read shows)."""

_RISE_BYTES = MiB
"""Once reported, a worker grows on when a read is this far above its peak (flat, it moves a few hundred KiB)."""

_SETTLE_STEPS = 8
_SETTLE_READS = 2
"""A worker finding settles when none of its workers rose for the longest of as many steps as they grew (from the
read before the climb) and ``_SETTLE_STEPS``, with ``_SETTLE_READS`` reads or more of each live one since."""

_FAULT_FRACTION = 2
"""A USS read is due when the worker's faults since its last one could have made ``min_growth_bytes``
/ this private: a copy-on-access growth of 8 MiB is seen in 3 reads after the baseline."""

_COUNT_EVERY = 4
"""While workers live, a step this many steps after the last update is not quiet (:meth:`WorkerWatch.next_step`)."""

_FAULT_SHARE = 0.5
"""Counting the workers' faults may take this share of ``max_overhead`` (the reads and discovery the rest)."""

_FREE_MISSES = 2
"""Reads asked for by faults that showed no growth, per worker, before the faults need the budget too
(a worker whose allocator maps and unmaps memory faults without growing)."""


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

    @property
    def open(self) -> bool:
        """Whether a descriptor is open (a pid counted and not yet closed)."""
        return bool(self._fds)

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


class WorkerWatch:
    """Reads every DataLoader worker's minor page faults at each update and its USS/PSS when the faults
    say it may have grown (or on a time budget); a ``worker_growth`` finding when workers' private
    memory grows step over step by ``min_growth_bytes`` or more."""

    def __init__(self, *, min_interval_s: float = 0.5, max_overhead: float = 0.005, min_growth_bytes: int = 8 * MiB,
                 max_reads: int = 512, max_gap_steps: int = 32) -> None:
        checks = (
            ("max_gap_steps", max_gap_steps, max_gap_steps >= 1, "use 1 or more steps, e.g. 32"),
            ("min_interval_s", min_interval_s, min_interval_s >= 0, "use 0 or more seconds, e.g. 0.5"),
            ("max_overhead", max_overhead, 0 < max_overhead <= 1, "use a fraction of the wall time in (0, 1], e.g. 0.005"),
            ("min_growth_bytes", min_growth_bytes, min_growth_bytes > 0, "use a positive byte count, e.g. 8 * 2**20"),
            ("max_reads", max_reads, max_reads >= 4, "use 4 or more, e.g. 512"),
        )
        for name, value, ok, fix in checks:
            if not ok:
                raise ValueError(f"WorkerWatch({name}={value!r}) is invalid; {fix}.")
        self.min_interval_s = min_interval_s
        self.max_overhead = max_overhead
        self.min_growth_bytes = min_growth_bytes
        self.max_reads = max_reads
        self.max_gap_steps = max_gap_steps
        self._started: float | None = None
        self.last_time = -float("inf")
        """When the last read was taken (``time.monotonic``), and at which step (None: none yet)."""
        self.last_step: int | None = None
        self.last_call = self._asked = 0  # the step of the last update; the last step next_step asked the session for
        self.next_update_s = -float("inf")
        """Before this ``time.monotonic()``, an update without ``force`` would do nothing unless
        ``max_gap_steps`` steps passed since :attr:`last_step`: a caller may skip the call."""
        self.figures: dict[str, float] = {}
        """The live workers' host cost for the logs and the per-rank gather (kept at each read: read at
        every logged step)."""
        self.tracks: dict[int, _Track] = {}
        self._known: dict[int, WorkerInfo | None] = {}
        self._datasets: dict[int, Any] = {}  # pid -> weak reference to the worker's Dataset (in this process)
        self._held: dict[int, int | None] = {}  # id(Dataset) -> its deep size (None: past the walk's budget)
        self.generation = 0
        self.pids: frozenset[int] = frozenset()  # the latest set of workers seen (kept while none is live)
        self._faults: dict[int, int | None] = {}  # pid -> minor faults at this update
        self._seen: dict[int, int] = {}  # pid -> the step it was first seen at
        self._counter = FaultCounter()
        self.reads = 0
        """Updates that read USS (one or more workers)."""
        self.uss_reads = 0
        """Workers' ``smaps_rollup`` reads."""
        self.fault_reads = 0
        """...of which the faults asked for (the others: a worker's first sight, the time budget)."""
        self.seconds = 0.0
        """Time spent finding and reading workers."""
        self.last_read_s = 0.0
        self.charged = 0.0
        """What the budget counts: finding the workers and counting their faults (wall time),
        and each budgeted or first-sight read's CPU time (the kernel's page-table walk; a read preempted on
        a busy machine is not a slow read)."""
        self.fault_s = 0.0
        """Time counting the workers' faults (part of :attr:`charged`)."""
        self.finding_seconds = 0.0
        """Finding work, like a census after suspicion: the reads the faults asked for outside the budget
        (CPU time; at most ``_FREE_MISSES`` per worker find nothing) and sizing a grown worker's Dataset."""
        self.finding: Finding | None = None
        """The latest ``worker_growth`` finding (open, or settled once its workers stopped growing)."""
        self._cost = ""  # the finding's last sentences: the live workers' memory, the cause and its fix

    def update(self, step: int, *, force: bool = False, now: float | None = None) -> Finding | None:
        """Count the workers' faults; read the USS of those whose faults ask for it, or of all when the time
        budget allows (or ``force``); a Finding while they grow. ``now``: ``time.monotonic()`` as the
        caller read it (default: read here). The caller may skip calls before :attr:`next_update_s`."""
        now = time.monotonic() if now is None else now
        self.last_call = step
        if self._started is None:
            self._started = now
        due = force or self._due(step, now)
        if not due and self.fault_s > _FAULT_SHARE * self.max_overhead * (now - self._started):
            self._plan_next(now)
            return None  # faults counted recently enough (~15 µs a worker: every few steps of a 2 ms loop)
        t0 = time.perf_counter()
        workers = self._workers()
        if due:
            self.last_time, self.last_step = now, step
        # no worker (most runs): no comprehension's frame either
        read = [(w, why) for w in workers if (why := self._why(w, step, due, now)) is not None] if workers else []
        t1 = time.perf_counter()
        self.charged += t1 - t0
        if not read:
            self.seconds += t1 - t0
            self._plan_next(now, bool(workers))
            return None
        for w, why in read:
            c0, w0 = time.thread_time(), time.perf_counter()  # CPU time (the kernel's walk included): not inflated by preemption
            self._read(w, step)
            cost = min(time.thread_time() - c0, time.perf_counter() - w0)
            if why == "free":
                self.fault_reads += 1
                self.finding_seconds += cost
            else:
                self.charged += cost
            self.last_read_s = cost * len(workers)  # what the next read of every worker will cost
        self.seconds += time.perf_counter() - t0
        self.reads += 1
        found = self._check(step)
        totals = self.totals()
        self.figures = {"host_worker_uss_bytes": float(totals["uss_bytes"])} if totals["workers"] else {}
        self._plan_next(now, bool(workers))
        return found

    def next_step(self, step: int) -> int | None:
        """While workers live, the step the quiet stretch ends at (None: none): 50-step stretches gave 3 reads in 160."""
        if not self.pids:
            return None
        if self._asked > step:
            return self._asked
        # the last step asked for did not count (its time share not yet earned): ask again a few steps on
        nxt = self.last_call + _COUNT_EVERY if self.last_call >= self._asked else step + _COUNT_EVERY
        self._asked = max(nxt, step + 1)
        return self._asked

    def _plan_next(self, now: float, watching: bool = True) -> None:
        """:attr:`next_update_s`: when the faults' share of the budget next pays for a count, or, with no
        worker to watch, the next look for one (``min_interval_s`` on)."""
        if not watching:
            self.next_update_s = now + self.min_interval_s
            return
        started = self._started if self._started is not None else now
        self.next_update_s = started + self.fault_s / (_FAULT_SHARE * self.max_overhead)

    def _workers(self) -> list[WorkerInfo]:
        """The live workers, a new generation noted, exited ones that did not grow dropped, faults counted."""
        workers = dataloader_workers(self._known, self._datasets)
        for pid in list(self._datasets):
            if pid not in self._known:
                del self._datasets[pid]
        pids = frozenset(map(_PID, workers))
        if pids and pids != self.pids and not pids & self.pids:
            self.generation += 1  # a fresh set of workers: a new epoch of non-persistent workers
        if pids:
            self.pids = pids
        dead = []
        for pid, track in self.tracks.items():
            if pid not in pids and track.growth < self.min_growth_bytes:
                dead.append(pid)
        for pid in dead[: max(0, len(dead) - _KEEP_DEAD)]:  # epochs of non-persistent workers: keep the memory bounded
            del self.tracks[pid]
        if self._seen:
            for pid in [p for p in self._seen if p not in pids]:
                del self._seen[pid]
        if not workers and not self._counter.open:
            self._faults = {}  # nothing to count and no descriptor to close: a run without workers
            return workers
        c0 = time.thread_time()  # CPU time: a count preempted on a busy machine must not stop the counts for seconds
        self._faults = self._counter.read([w.pid for w in workers])
        self.fault_s += time.thread_time() - c0
        return workers

    def _why(self, w: WorkerInfo, step: int, due: bool, now: float) -> str | None:
        """Why worker ``w`` is read now: ``"first"`` (its baseline), ``"free"`` (its faults, outside the
        budget), ``"budget"`` (the time budget, or its faults where the budget pays); None: not now."""
        track = self.tracks.get(w.pid)
        if track is None or not track.reads:
            # the baseline once the worker has warmed up: its first batches map and keep tens of MiB
            return "first" if step - self._seen.setdefault(w.pid, step) >= _WARMUP_STEPS else None
        faults, last = self._faults.get(w.pid), track.faults
        if faults is None or last is None or (faults - last) * PAGE_SIZE < track.threshold:
            return "budget" if due else None
        if not track.reported and track.misses < _FREE_MISSES:
            return "free"
        return "budget" if due or self._affords(now) else None

    def _affords(self, now: float) -> bool:
        return self.charged + self.last_read_s <= self.max_overhead * (now - (self._started or now))

    def _read(self, w: WorkerInfo, step: int) -> None:
        rollup = smaps_rollup(w.pid)
        if rollup is None:
            return
        track = self.tracks.get(w.pid)
        if track is None:
            track = self.tracks[w.pid] = _Track(w, self.generation, threshold=self.min_growth_bytes // _FAULT_FRACTION)
        faults = self._faults.get(w.pid)
        if track.reads and faults is not None and track.faults is not None:
            faulted = (faults - track.faults) * PAGE_SIZE
            if faulted >= track.threshold and rollup["uss"] - track.reads[-1][1] < faulted // 2:
                track.misses += 1  # faults without growth (memory mapped and unmapped): ask for twice as many
                track.threshold *= 2
        if len(track.reads) >= self.max_reads:
            del track.reads[1:len(track.reads) // 2 + 1]  # keep the first read (the baseline) and recent ones
        track.reads.append((step, rollup["uss"], rollup["pss"]))
        track.faults = faults
        if len(track.reads) == 1:
            track.first_faults = faults
        self.uss_reads += 1

    def _due(self, step: int, now: float) -> bool:
        """A read of every worker now keeps the watch's budgeted cost (discovery, faults, budgeted reads)
        within ``max_overhead`` of the wall time since its first update, and it is ``min_interval_s``
        after the last one or ``max_gap_steps`` steps after it."""
        if not self._affords(now):
            return False
        return now - self.last_time >= self.min_interval_s or step - (self.last_step or 0) >= self.max_gap_steps

    def close(self) -> None:
        """Close the descriptors the fault counts keep open."""
        self._counter.close()

    def live(self) -> list[_Track]:
        return [t for pid, t in self.tracks.items() if pid in self.pids]

    def totals(self) -> dict[str, int]:
        """Private (USS) and proportional (PSS) memory of the live workers, summed: their host cost."""
        workers = uss = pss = 0
        for pid, track in self.tracks.items():  # the live workers (live()) that were read
            if pid in self.pids and track.reads:
                workers += 1
                uss += track.reads[-1][1]
                pss += track.reads[-1][2]
        return {"workers": workers, "uss_bytes": uss, "pss_bytes": pss}

    def _size(self, track: _Track) -> None:
        """Once per worker, while its Dataset lives (its time is the watch's finding work): the deep size of the
        parent's Dataset (once per Dataset), its empty containers, and whether the worker grew past what copy on
        access can copy (sticky: a worker that exited keeps what was seen, so the cause does not flip later)."""
        if track.dataset_bytes == -1:
            ref = self._datasets.get(track.info.pid)
            dataset = ref() if ref is not None else None
            if dataset is None:
                return
            key = id(dataset)
            t0 = time.perf_counter()
            if key not in self._held:
                seen: dict[type, list[int]] = {}
                size = deep_size([dataset], budget=_DATASET_BUDGET, by_type=seen)
                self._held[key] = None if sum(c for c, _ in seen.values()) >= _DATASET_BUDGET else size
            track.dataset_bytes = self._held[key]
            track.cache_attributes = empty_containers(dataset)
            self.seconds += time.perf_counter() - t0
            self.finding_seconds += time.perf_counter() - t0  # after a worker grew: finding work
        held = track.dataset_bytes
        if held is not None and held >= 0 and track.growth > _INSIDE_FACTOR * held + self.min_growth_bytes // 2:
            track.grew_inside = True

    def _fills_cache(self, t: _Track) -> bool:
        """A climb past what copy on access can copy, whose Dataset has a container empty here: a cache filled in
        ``__getitem__``, found without :meth:`_Track.late` (persistent workers fill it in epoch 1, then plateau) at a
        kept share of 0.44-0.62 (each batch it hands over is faulted into shared memory too: docs/host.md)."""
        share = t.kept_share()
        if share is None or share < _CACHE_KEPT_SHARE:
            return False
        self._size(t)
        return t.grew_inside and bool(t.cache_attributes)

    def _check(self, step: int) -> Finding | None:
        """A finding when a worker is newly seen growing or a reported one grows on; else, while one is open,
        whether its workers have stopped growing (settled)."""
        grows = False
        # once settled, a worker grows again by half of min_growth_bytes above its peak (a full cache's last items,
        # read one by one, are no new climb)
        settled = self.finding is not None and self.finding.state == "settled"
        again = self.min_growth_bytes // 2 if settled else _RISE_BYTES
        for t in self.tracks.values():
            if not t.reported:
                if t.growth >= self.min_growth_bytes and t.rising() and (
                        t.keeps() and t.late(self.min_growth_bytes) or self._fills_cache(t)):
                    t.report()
                    grows = True
            elif t.info.pid in self.pids and t.reads:
                if t.grows_on(again, not settled):
                    t.rise_uss, t.last_rise_step = t.reads[-1][1], t.reads[-1][0]
                    grows = True
                t.peak = max(t.peak, t.reads[-1][1])
        if not grows:
            return self._settle(step)
        grown = [t for t in self.tracks.values() if t.reported]
        for t in grown:
            self._size(t)
        finding = self._growth_finding(step, grown)
        old = self.finding
        if old is not None and old.state == "settled":
            finding.message = (f"Re-opened at step {step}: the workers' growth that settled at step "
                               f"{old.details['settled_at_step']} grows again. ") + finding.message
            finding.details["reopened"] = int(old.details.get("reopened", 0)) + 1
        elif old is not None:
            finding.details["reopened"] = old.details.get("reopened", 0)
        self.finding = finding
        return finding

    def _settle(self, step: int) -> Finding | None:
        """The open finding settled when its workers stopped growing (:data:`_SETTLE_STEPS`, :data:`_SETTLE_READS`)."""
        open_ = self.finding
        if open_ is None or open_.state != "open":
            return None
        grown = [t for t in self.tracks.values() if t.reported]
        last_rise = max(t.last_rise_step for t in grown)
        grew = last_rise - min(t.climb_step for t in grown)
        if step - last_rise < max(_SETTLE_STEPS, grew):
            return None
        for t in grown:
            if t.info.pid in self.pids and sum(r[0] > t.last_rise_step for r in t.reads) < _SETTLE_READS:
                return None
        settled = copy.copy(open_)
        settled.step, settled.state, settled.count = step, "settled", 0  # an update of the same cause
        settled.details = {**open_.details, "open": False, "settled_at_step": step, "last_rise_step": last_rise,
                           "grew_steps": grew, "flat_steps": step - last_rise, "settled_bytes": open_.bytes,
                           "floor_bytes": sum(t.peak for t in grown)}
        settled.message = (
            f"Settled: the DataLoader workers' private memory grew until step {last_rise} ({grew} steps), then stayed "
            f"flat for {step - last_rise} steps (to step {step}): growth that stopped (a warm-up, a table or cache "
            f"that filled), not a leak. The plateau is the workers' cost: {self._cost}"
        )
        self.finding = settled
        return settled

    def _growth_finding(self, step: int, grown: list[_Track]) -> Finding:
        totals = self.totals()
        per = "; ".join(
            f"worker {t.info.worker_id} (pid {t.info.pid}{', epoch set ' + str(t.generation) if self.generation > 1 else ''}): "
            f"{format_bytes(t.reads[0][1])} -> {format_bytes(t.reads[-1][1])}" for t in grown[:8]
        )
        datasets = sorted({t.info.dataset for t in grown})
        inside = [t for t in grown if t.grew_inside]
        held = max(int(t.dataset_bytes or 0) for t in inside) if inside else None
        if inside:
            cause = _INSIDE_FIX.format(held=format_bytes(held or 0))
            names = sorted({a for t in inside for a in t.cache_attributes})
            if names:
                cause += (" In the training process, " + ", ".join(f"`{n}`" for n in names[:4])
                          + (" is empty: the cache each worker fills, most likely." if len(names) == 1 else
                             " are empty: one of them is most likely the cache each worker fills."))
        else:
            names = []
            cause = _COPY_FIX.format(datasets=", ".join(datasets))
        self._cost = (f"the {totals['workers']} live workers hold {format_bytes(totals['uss_bytes'])} of private memory in "
                      f"all (PSS {format_bytes(totals['pss_bytes'])}). {cause}")
        return Finding(
            kind="worker_growth",
            step=step,
            key="worker_growth",
            bytes=sum(t.growth for t in grown),
            message=f"DataLoader workers' private memory (USS) grew step over step: {per}. T{self._cost[1:]}",
            details={
                "cause": "inside_workers" if inside else "copy_on_access",
                "dataset_bytes": held,
                "cache_attributes": names[:4],
                "open": True,
                "workers": [
                    {"pid": t.info.pid, "worker_id": t.info.worker_id, "generation": t.generation, "dataset": t.info.dataset,
                     "first_uss_bytes": t.reads[0][1], "uss_bytes": t.reads[-1][1], "pss_bytes": t.reads[-1][2],
                     "growth_bytes": t.growth, "first_step": t.reads[0][0], "reads": len(t.reads),
                     "kept_share": None if (share := t.kept_share()) is None else round(share, 3)}
                    for t in grown
                ],
                "total_uss_bytes": totals["uss_bytes"],
                "total_pss_bytes": totals["pss_bytes"],
                "generations": self.generation,
                "read_cost_s": round(self.last_read_s, 6),
                "watch_cost_s": round(self.seconds, 4),
            },
        )

    def summary(self) -> dict[str, Any]:
        return {**self.totals(), "generations": self.generation, "reads": self.reads, "uss_reads": self.uss_reads,
                "fault_reads": self.fault_reads, "seconds": round(self.seconds, 4), "finding_seconds": round(self.finding_seconds, 4)}
