"""DataLoader workers' private memory: real workers, a real copy-on-access Dataset of 200,000 dicts."""

from __future__ import annotations

import gc
import multiprocessing
import os
import time

import pytest
import torch
from torch.utils.data import DataLoader, Dataset

from memcallbacks._base.units import MiB
from memcallbacks.host import WorkerWatch, dataloader_workers
from memcallbacks.host.forked import guard_forked_children, unguard_forked_children
from worker_data import Records

pytestmark = pytest.mark.skipif(not os.path.exists("/proc/self/smaps_rollup"), reason="needs Linux smaps_rollup")


def _stop_live_workers() -> None:
    """Shut down the workers of every DataLoader iterator still alive in this process: a watch sees all of the
    process's workers, and an earlier test's persistent workers (an iterator in a cycle, or a test run before on
    the same xdist worker) made a later test's watch count them (its generation, its settling)."""
    gc.collect()
    for obj in gc.get_objects():
        if type(obj).__name__ == "_MultiProcessingDataLoaderIter":
            obj._shutdown_workers()


@pytest.fixture(autouse=True)
def _alone():
    _stop_live_workers()
    yield
    _stop_live_workers()


class Arrays(Dataset):
    """The fix: one tensor, no per-item objects."""

    def __init__(self, n: int) -> None:
        self.data = torch.arange(2 * n, dtype=torch.float32).reshape(n, 2)

    def __len__(self) -> int:
        return len(self.data)

    def __getitem__(self, i: int) -> torch.Tensor:
        return self.data[i]


class _Run:
    """Stands for the monitored run the watch is part of (a weak reference target)."""


def fit(loader: DataLoader, watch: WorkerWatch, steps: int, epochs: int = 1) -> list:
    """``steps`` steps an epoch. The workers are forked as in a monitored run, their collector started afresh
    (:func:`guard_forked_children`): forked from this xdist worker's heap (every earlier test's objects), a worker's
    first full collection copied that heap at a random step (a cache's finding kept open by a late rise in CI)."""
    torch.manual_seed(0)
    model = torch.nn.Linear(2, 1)
    opt = torch.optim.SGD(model.parameters(), lr=1e-6)
    findings, step, run = [], 0, _Run()
    guard_forked_children(run)
    try:
        for _ in range(epochs):
            for i, batch in enumerate(loader):
                f = watch.update(step)
                if f is not None:
                    findings.append(f)
                loss = model(batch.reshape(len(batch), -1)[:, :2]).pow(2).mean()  # any item shape
                opt.zero_grad()
                loss.backward()
                opt.step()
                step += 1
                if i + 1 >= steps:
                    break
    finally:
        unguard_forked_children(run)
    return findings


def test_persistent_workers_copy_on_access_is_found_with_its_fix():
    loader = DataLoader(Records(200_000), batch_size=64, num_workers=2, persistent_workers=True, shuffle=True)
    watch = WorkerWatch(min_interval_s=0.0, max_overhead=0.5)  # read often: a short test
    findings = fit(loader, watch, 400)
    live = dataloader_workers()
    assert sorted(w.worker_id for w in live) == [0, 1] and {w.dataset for w in live} == {"Records"}
    for track in watch.live():  # the reader sees each worker's USS grow as pages are copied
        usses = [r[1] for r in track.reads]
        assert len(usses) >= 4 and usses[-1] - usses[0] >= 8 * MiB, usses
    assert findings, watch.summary()
    f = findings[-1]
    assert f.kind == "worker_growth" and f.key == "worker_growth"
    assert {w["worker_id"] for w in f.details["workers"]} == {0, 1}
    assert f.details["total_uss_bytes"] >= 2 * 20 * MiB
    assert "pytorch/pytorch#13246" in f.message and "NumPy arrays or tensors" in f.message and "Records" in f.message
    assert f.details["cause"] == "copy_on_access"
    assert f.details["read_cost_s"] > 0 and watch.seconds > 0
    assert watch.figures["host_worker_uss_bytes"] == watch.totals()["uss_bytes"] >= f.details["total_uss_bytes"] - 2 * MiB
    assert f.state == "open" and f.details["open"], f.details  # copy on access goes on: not settled
    del loader


def test_non_persistent_workers_are_tracked_per_epoch():
    loader = DataLoader(Records(200_000), batch_size=64, num_workers=2, persistent_workers=False, shuffle=True)
    watch = WorkerWatch(min_interval_s=0.0, max_overhead=0.5)
    findings = fit(loader, watch, 250, epochs=2)
    assert watch.generation == 2, watch.summary()
    assert len(watch.tracks) == 4 and {t.generation for t in watch.tracks.values()} == {1, 2}
    assert findings and findings[-1].details["generations"] == 2


def test_arrays_do_not_grow():
    loader = DataLoader(Arrays(200_000), batch_size=64, num_workers=2, persistent_workers=True, shuffle=True)
    watch = WorkerWatch(min_interval_s=0.0, max_overhead=0.5)
    findings = fit(loader, watch, 300)
    assert watch.reads >= 4 and findings == [], [f.message for f in findings]


class DecodedCache(Dataset):
    """1,600 path strings in the parent (~0.1 MiB); each worker decodes an item to 64 KiB and keeps it in a dict
    filled in ``__getitem__``: growth inside the workers, far more than the parent's Dataset holds."""

    def __init__(self, n: int = 1600) -> None:
        self.paths = [f"images/{i:05d}.jpg" for i in range(n)]
        self.cache: dict[int, torch.Tensor] = {}

    def __len__(self) -> int:
        return len(self.paths)

    def __getitem__(self, i: int) -> torch.Tensor:
        if i not in self.cache:
            self.cache[i] = torch.full((16384,), float(len(self.paths[i])))  # the "decoded image": 64 KiB
        return self.cache[i][:2].clone()


def test_a_cache_filled_in_getitem_grows_inside_the_workers_not_by_copy_on_access():
    loader = DataLoader(DecodedCache(), batch_size=16, num_workers=2, persistent_workers=True, shuffle=True)
    watch = WorkerWatch(min_interval_s=0.0, max_overhead=0.5)
    findings = fit(loader, watch, 100)  # 1,600 items: each worker caches ~800 x 64 KiB = ~50 MiB
    assert findings, watch.summary()
    f = findings[-1]
    assert f.details["cause"] == "inside_workers" and f.details["dataset_bytes"] < 1 * MiB, f.details
    assert "grows inside the workers" in f.message and "__getitem__" in f.message and "lru_cache(maxsize=...)" in f.message
    assert "pytorch/pytorch#13246" not in f.message  # not copy on access
    del loader


def test_copy_on_access_is_found_within_200_fast_steps_at_defaults():
    # steps of ~1 ms: the 1% time budget alone pays for no read here; the workers' page faults ask for them
    loader = DataLoader(Records(200_000), batch_size=64, num_workers=2, persistent_workers=True, shuffle=True)
    watch = WorkerWatch()
    findings = fit(loader, watch, 200)
    assert findings, watch.summary()
    f = findings[0]
    assert f.step <= 200 and f.details["cause"] == "copy_on_access", f.details
    assert all(w["kept_share"] >= 0.8 for w in f.details["workers"]), f.details  # what faulted was kept
    assert watch.fault_reads >= 2 and watch.finding_seconds > 0, watch.summary()
    del loader


class Images(Dataset):
    """A 3x224x224 float image an item: batches of 64 are 38.5 MB, mapped and unmapped by every worker."""

    def __len__(self) -> int:
        return 100_000

    def __getitem__(self, i: int) -> torch.Tensor:
        return torch.full((3, 224, 224), float(i % 7))


def test_large_batches_fault_without_a_finding():
    loader = DataLoader(Images(), batch_size=64, num_workers=2, persistent_workers=True, shuffle=True)
    watch = WorkerWatch()
    findings = fit(loader, watch, 120)
    assert findings == [], [f.message for f in findings]
    # the faults asked for reads that found no growth, and the watch backed off (a doubled threshold each)
    assert watch.fault_reads >= 2 and any(t.misses >= 1 for t in watch.live()), watch.summary()
    del loader


class Swing(Dataset):
    """A worker that builds its batch in two halves of 40 MiB and frees both on the third item, as a worker
    building and handing over large batches does: its USS swings 0 -> 40 -> 80 MiB and back, and never grows."""

    def __init__(self) -> None:
        self.held: list[torch.Tensor] = []

    def __len__(self) -> int:
        return 10_000

    def __getitem__(self, i: int) -> torch.Tensor:
        if i % 3 == 2:
            self.held.clear()
        else:
            self.held.append(torch.ones(10 * MiB))  # 40 MiB, touched: above malloc's mmap threshold, unmapped when freed
        return torch.zeros(2)


def test_a_swing_from_a_trough_to_two_peaks_is_no_growth():
    """The baseline (step 10) sees the worker empty, the next two reads its two halves: three rising reads,
    80 MiB kept of 80 faulted, which the watch took for growth (seen in a -n 2 suite run of the test above).
    A finding now needs reads over 16 steps, over which the worker's faults (80 MiB every 3 items) far outweigh
    what it keeps: no finding, then or later."""
    loader = DataLoader(Swing(), batch_size=1, num_workers=1, prefetch_factor=1, persistent_workers=True)
    watch = WorkerWatch()
    findings = []
    for step, _ in enumerate(loader):
        time.sleep(0.1)  # the worker has built the next item (prefetch 1): its state at a read is that item's
        finding = watch.update(step)
        if finding is not None:
            findings.append(finding)
        if step == 20:
            break
    usses = [round(r[1] / MiB) for t in watch.live() for r in t.reads]
    assert findings == [], ([f.message for f in findings], usses)
    assert len(usses) >= 4 and max(usses) - usses[0] >= 60, usses  # it swung, read from its trough
    del loader


class OneTable(Dataset):
    """Each worker builds a 40 MiB table once, at its 60th item, and keeps it: a step to a plateau (a lookup
    built lazily, a worker collecting the heap it inherited once), not growth step over step."""

    def __init__(self) -> None:
        self.seen = 0
        self.table: torch.Tensor | None = None

    def __len__(self) -> int:
        return 100_000

    def __getitem__(self, i: int) -> torch.Tensor:
        self.seen += 1
        if self.seen == 60:
            self.table = torch.ones(10 * MiB)  # 40 MiB, touched
        return torch.zeros(2)


def test_a_step_to_a_plateau_is_not_worker_growth():
    loader = DataLoader(OneTable(), batch_size=4, num_workers=2, persistent_workers=True)
    watch = WorkerWatch(min_interval_s=0.0, max_overhead=1.0)  # read every step, busy machine too: the plateau seen read by read
    findings = fit(loader, watch, 150)
    usses = [[round(r[1] / MiB) for r in t.reads] for t in watch.live()]
    assert all(max(u) - u[0] >= 30 for u in usses), usses  # each worker jumped by its table
    reads = str([[(r[0], round(r[1] / MiB, 1)) for r in t.reads] for t in watch.live()])
    assert findings == [], ([f.step for f in findings], reads, [f.message[:300] for f in findings], [f.details.get("workers") for f in findings])
    del loader


def _moves(reads: list) -> str:
    """``step:MiB`` of the first read and of each that moved by a quarter MiB or more: a failure shows every rise."""
    kept = [reads[0]] + [b for a, b in zip(reads, reads[1:]) if abs(b[1] - a[1]) >= MiB // 4]
    return " ".join(f"{r[0]}:{r[1] / MiB:.2f}" for r in kept)


def test_a_cache_that_fills_is_found_then_settles_naming_its_attribute():
    loader = DataLoader(DecodedCache(320), batch_size=16, num_workers=2, persistent_workers=True, shuffle=True)
    watch = WorkerWatch(min_interval_s=0.0, max_overhead=1.0)  # read every step, on a busy machine too
    findings = fit(loader, watch, 20, epochs=30)  # 320 items of 64 KiB: full by epoch ~8; a late rise (step 326 in a full suite) settles by 600
    assert findings, [[(r[0], round(r[1] / MiB, 1)) for r in t.reads] for t in watch.live()]
    first, last = findings[0], findings[-1]
    assert first.state == "open" and first.details["cause"] == "inside_workers", first.details
    assert first.details["cache_attributes"] == ["DecodedCache.cache"], first.details
    assert "`DecodedCache.cache` is empty: the cache each worker fills" in first.message, first.message
    moves = "; ".join(f"worker {t.info.worker_id}: {_moves(t.reads)}" for t in watch.live())
    assert last.state == "settled" and not last.details["open"] and last.count == 0, f"{[(f.step, f.state) for f in findings]} {moves}"
    assert last.details["cause"] == "inside_workers" and last.message.startswith("Settled:"), last.message
    assert last.details["flat_steps"] >= max(8, last.details["grew_steps"]), last.details
    del loader


def test_the_cause_stays_inside_the_workers_after_they_exit():
    """Non-persistent workers filling a cache (Accelerate's cv_example with a cache): the first epoch's workers
    exit, and the finding updated by the second epoch's must not flip to copy on access."""
    loader = DataLoader(DecodedCache(), batch_size=16, num_workers=2, persistent_workers=False, shuffle=True)
    watch = WorkerWatch(min_interval_s=0.0, max_overhead=0.5)
    findings = fit(loader, watch, 100, epochs=2)
    assert watch.generation == 2 and findings, watch.summary()
    assert any(w["generation"] == 2 for w in findings[-1].details["workers"]), findings[-1].details
    assert [f.details["cause"] for f in findings] == ["inside_workers"] * len(findings)
    del loader


class _Run:
    """Stands for a monitored run (what the session's checks pass)."""


def _child_counts(conn) -> None:
    conn.send(gc.get_count())
    conn.close()


def _counts_in_a_forked_child() -> tuple[int, int, int]:
    ctx = multiprocessing.get_context("fork")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=_child_counts, args=(child,))
    proc.start()
    counts = parent.recv()
    proc.join(30)
    return counts


def test_a_child_forked_during_a_run_starts_its_collector_afresh():
    """A forked child inherits the collector's counts: past 10 in the oldest generation, its first collection of
    the middle one may collect its whole inherited heap (and copy it: docs/host.md). While a run is monitored a
    child's counts start at zero; before and after, they are inherited."""
    run = _Run()
    for _ in range(11):
        gc.collect(1)
    assert _counts_in_a_forked_child()[2] >= 11
    guard_forked_children(run)
    guard_forked_children(run)  # twice: one run
    try:
        assert gc.get_count()[2] >= 11  # the parent's own collector is not touched
        assert _counts_in_a_forked_child()[2] == 0
    finally:
        unguard_forked_children(run)
    unguard_forked_children(run)
    for _ in range(11):
        gc.collect(1)
    assert _counts_in_a_forked_child()[2] >= 11


def test_bad_parameters_name_the_parameter_and_the_fix():
    with pytest.raises(ValueError, match=r"WorkerWatch\(max_overhead=0\) is invalid; use a fraction"):
        WorkerWatch(max_overhead=0)
