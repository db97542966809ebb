"""A sampled step's ``allocated`` read (glibc's heap on CPU) on the steps the schedule names.

``mallinfo2`` walks every free chunk: 100-300 µs in a real Lightning fit, ~1 µs in a small test
process. The gating therefore never shows by itself here: every test forces the read's cost, by a
stand-in backend whose ``heap_cost_s`` the test sets (the schedule's decision), or by pinning the real
``CpuBackend``'s running estimate (the Lightning fit). Expected steps are worked out by hand from the
documented rules, never by asking the code under test again:

* allowance per step = ``overhead_budget`` (0.01) x median step time (1 ms here) = 10 µs;
* a 100 µs read is therefore taken once its cost spread over the steps since the last heap read
  fits: 10 steps after it;
* the watch's reads (``Schedule.wants_read``): every one of the first 32 steps, then every
  ``read_every`` steps (``(count + 1) % read_every == 0``).
"""

from __future__ import annotations

import math

import lightning.pytorch as L
import pytest
from lightning.pytorch.loggers import CSVLogger

from helpers import MIB, BoringModel, RandomDataModule, flat_settings, trainer_kwargs
from memcallbacks import MemoryMonitor
from memcallbacks._base.cpu import CpuBackend
from memcallbacks._runtime import schedule as C
from memcallbacks._runtime.schedule import Schedule
from schedule_feed import feed

pytestmark = pytest.mark.usefixtures("one_thread")

STEP_S = 1e-3
COST_S = 100e-6  # 10 steps of the 10 µs/step allowance


class StandInBackend:
    """Stands in for a backend: only the measured cost of its ``allocated`` read, set by the test."""

    kind = "cpu"

    def __init__(self, cost: float) -> None:
        self.heap_cost_s = cost


def heap_plan(log_every: int, cost: float = COST_S) -> Schedule:
    """A schedule that has measured 1 ms steps and ``cost`` per read, and chosen its intervals."""
    plan = Schedule(flat_settings())
    plan.configure(log_every=log_every, logs=True, log_first_step=False)
    plan.backend = StandInBackend(cost)
    return feed(plan, step_s=STEP_S, steps=16, read_s=cost)


def test_log_1_reads_the_heap_every_tenth_step_and_on_every_watch_read():
    plan = heap_plan(log_every=1)
    # a read at twice 100 µs (cold caches) may take half of 10 µs/step: every 40 steps, capped at 32;
    # at log 1 the logged steps are no longer where reads are free, so the interval is kept
    assert plan.read_every == 32
    dense = C.DENSE_READ_STEPS
    taken = [n for n in range(300) if plan.heap_due(n)]  # at log 1 every step is sampled
    assert taken[:dense] == list(range(dense))  # the watch's dense reads
    watch_reads = [n for n in range(dense, 300) if (n + 1) % 32 == 0]
    assert watch_reads == [n for n in (31, 63, 95, 127, 159, 191, 223, 255, 287) if n >= dense]
    assert set(watch_reads) <= set(taken)
    for before, after in zip(taken[dense - 1:], taken[dense:]):
        # ten steps after the last heap read, or sooner where the watch's read is due
        assert after - before == 10 or (after in watch_reads and after - before < 10), (before, after)
    assert (298 - dense) // 10 <= len(taken) - dense <= (298 - dense) // 10 + len(watch_reads)


def test_log_50_reads_the_heap_on_every_logged_step():
    plan = heap_plan(log_every=50)
    assert plan.read_every == 50  # the budget's 32, on the logged steps (unchanged by this issue)
    logged = [n for n in range(48, 600) if plan.will_log(n)]
    assert all(plan.heap_due(n) for n in logged)
    # without the watch's read there (a read interval off the logged steps), the spread cost alone
    # takes it: 100 µs / 50 steps = 2 µs/step, within 10
    plan = heap_plan(log_every=50)
    plan.read_every = 1000
    assert all(plan.heap_due(n) for n in logged)


def test_cheap_reads_wanted_reads_and_the_budgets_first_steps():
    plan = heap_plan(log_every=1, cost=1e-6)  # a small heap (~1 µs): every step
    assert all(plan.heap_due(n) for n in range(48, 200))
    plan = heap_plan(log_every=1, cost=0.0)  # an allocator's counter (CUDA, XPU): every step
    assert all(plan.heap_due(n) for n in range(48, 200))
    plan = heap_plan(log_every=1)
    assert plan.heap_due(100) and not plan.heap_due(101)
    assert plan.heap_due(102, wanted=True)  # the theory check compares this step's baseline
    fresh = Schedule(flat_settings())  # no median step yet: only the watch's reads (every one of the first steps)
    fresh.configure(log_every=1, logs=True, log_first_step=False)
    fresh.backend = StandInBackend(COST_S)
    fresh.read_every = 32
    dense = C.DENSE_READ_STEPS
    assert all(fresh.heap_due(n) for n in range(dense)) and not any(fresh.heap_due(n) for n in range(dense, 31))


def test_a_risen_resident_set_takes_the_read_after_all():
    plan = heap_plan(log_every=1)
    plan.read = lambda: 123  # stands in for the watch's heap read
    assert plan.heap_due(100)
    plan.heap_rss = 500 * MIB
    assert not plan.heap_due(101) and not plan.heap_skipped(101, 500 * MIB + plan.trip_bytes - 1)
    assert not plan.wants_read(102)
    assert plan.heap_skipped(102, 500 * MIB + plan.trip_bytes)  # the tripwire's rise: 1 MiB
    assert plan.wants_read(102) and plan.take_read(102) == 123 and plan.trips == 1
    assert plan.heap_rss == 500 * MIB + plan.trip_bytes and plan.heap_at == 102


# ---------------------------------------------------------------------- a real fit, metrics.csv read back
def test_lightning_log_1_logs_allocated_on_the_steps_that_read_it(tmp_path, monkeypatch):
    # the real CpuBackend, its running estimate pinned at 1 ms a read (a fragmented heap's cost, many
    # times what this small process's heap costs): with test steps of a few ms, a read every 10-30 steps
    monkeypatch.setattr(CpuBackend, "observe_heap_cost", lambda self, seconds: setattr(self, "heap_cost_s", 1e-3))
    monitor = MemoryMonitor(output_dir=str(tmp_path / "mem"), plot=False)
    steps = 96
    trainer = L.Trainer(**trainer_kwargs(tmp_path, max_steps=steps, log_every_n_steps=1, callbacks=[monitor],
                                         logger=CSVLogger(str(tmp_path), name="csv", version=0)))
    trainer.fit(BoringModel(), RandomDataModule(batches=steps))

    text = (tmp_path / "csv" / "version_0" / "metrics.csv").read_text()
    assert "nan" not in text.lower()  # an unread figure is left out, never written as NaN
    import pandas as pd

    csv = pd.read_csv(tmp_path / "csv" / "version_0" / "metrics.csv")
    rows = csv[csv["memory/reserved_GiB"].notna()]
    assert sorted(rows["step"]) == list(range(steps))  # reserved (the RSS): on every step
    allocated = rows[rows["memory/allocated_GiB"].notna()]["step"].tolist()
    assert set(range(C.DENSE_READ_STEPS)) <= set(allocated)  # the watch reads every one of the first steps
    later = [s for s in range(C.DENSE_READ_STEPS, steps)]
    assert 0 < len(set(later) & set(allocated)) < len(later), allocated  # then on some steps only

    history = monitor.history
    assert list(history["step"]) == list(range(steps))
    read = history["allocated"].notna()
    assert sorted(history.loc[read, "step"]) == sorted(allocated)
    assert (history.loc[read, "allocated"] > 1 * MIB).all()
    summary = monitor.report()["summary"]
    assert summary["last_allocated_bytes"] == int(history.loc[read, "allocated"].iloc[-1])
    assert not math.isnan(summary["first_allocated_bytes"])


def test_the_plot_draws_allocated_as_a_line_through_the_steps_that_read_it():
    pytest.importorskip("matplotlib")
    import pandas as pd

    from memcallbacks._files.outputs import history_figure

    steps = list(range(10))
    allocated = [100 * MIB if s % 3 == 0 else math.nan for s in steps]  # read on steps 0, 3, 6, 9
    history = pd.DataFrame({"step": steps, "allocated": allocated, "reserved": [200 * MIB] * 10, "host_rss": [200 * MIB] * 10,
                            "peak_forward": [250 * MIB] * 10, "peak_backward": [260 * MIB] * 10, "peak_optimizer": [240 * MIB] * 10})
    # sampled (a GPU-like device): the floor is allocated, one line through the four steps that read it
    top, bottom = history_figure(history, peak_source="sampled").axes
    line = next(line for line in top.get_lines() if line.get_label() == "allocated at step start (floor)")
    assert list(line.get_xdata()) == [0, 3, 6, 9]  # one line through four points, not four dots
    forward = next(line for line in bottom.get_lines() if line.get_label() == "forward")
    assert len(forward.get_xdata()) == 4
    # CPU: the floor and the peaks are resident memory; the heap is drawn as its change, never beside RSS
    top, bottom = history_figure(history, peak_source="rss_high_water_mark").axes
    labels = [line.get_label() for line in top.get_lines()]
    assert "resident memory at step start (floor)" in labels and not [x for x in labels if "allocated" in x or "heap" in x], labels
    heap = next(line for line in bottom.get_lines() if line.get_label().startswith("heap in use"))
    assert list(heap.get_xdata()) == [0, 3, 6, 9] and list(heap.get_ydata()) == [0, 0, 0, 0]
    forward = next(line for line in bottom.get_lines() if line.get_label() == "forward")
    assert len(forward.get_xdata()) == 10 and min(forward.get_ydata()) >= 0
