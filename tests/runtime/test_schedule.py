"""The step schedule: the quiet stretch, the watch's read and the RSS tripwire, tested directly.

A real :class:`MonitorConfig`, a real :class:`Schedule` and the real readers
(``heap_in_use_bytes``, ``HwmReader``/``StatmReader`` through :meth:`Schedule.arm` on a real
``CpuBackend``). Where a test needs a controlled value, a plain Python callable stands in for the
memory read or for the tripwire's reader (said so at each place). Expected values are worked out by
hand from the documented constants, never by asking the code under test again:

* ``QUIET_FROM = max(LINGERING_EVERY_STEP_UNTIL 10, DENSE_READ_STEPS 24, MEASURE_STEPS 4) = 24``; ``DENSE_READ_MAX = 48``
* ``TRIP_EVERY = 4`` (the tripwire is checked at counts with ``count & 3 == 0``)
* ``trip_bytes = growth_min_total_bytes // 4 = (4 MiB) // 4 = 1 MiB`` at the default config
* ``next_busy(c)`` = the first count ``b >= c`` with ``(b + 1)`` a multiple of the sampling,
  logging or (with reads) read interval.
"""

from __future__ import annotations

import math
import pickle
from typing import Any

import pytest

from helpers import flat_settings
from memcallbacks._base.devices import CpuBackend, StatmReader, heap_in_use_bytes
from memcallbacks._base.cpu import Tripwire
from memcallbacks._runtime.schedule import DENSE_READ_MAX, DENSE_READ_STEPS, Schedule, StepKind
from memcallbacks.host import HostGrowth

MIB = 1 << 20
TRIP_BYTES = MIB  # 4 MiB (growth_min_total_bytes' default) // 4

needs_mallinfo = pytest.mark.skipif(heap_in_use_bytes() is None, reason="no glibc mallinfo2: no tripwire on this platform")


class Counter:
    """A plain callable standing in for a memory read or the tripwire's reader: returns ``value``
    (settable by the test) and counts its calls."""

    def __init__(self, value: int) -> None:
        self.value = value
        self.calls = 0

    def __call__(self) -> int:
        self.calls += 1
        return self.value


def make_plan(**config: Any) -> Schedule:
    """A schedule for a run that logs every 50 steps (the plain loop's default)."""
    plan = Schedule(flat_settings(**config))
    plan.configure(log_every=50, logs=True, log_first_step=False)
    return plan


def quiet(schedule: Schedule, count: int) -> bool:
    return schedule.step_kind(count) is StepKind.QUIET


@pytest.fixture
def backend():
    b = CpuBackend()
    yield b
    b.close()


# ---------------------------------------------------------------------- arm(): the real readers
def test_arm_on_a_cpu_backend_picks_the_heap_read_and_a_tripwire(backend):
    plan = make_plan()
    plan.arm(backend)
    if heap_in_use_bytes() is None:
        assert plan.trip is None and plan.tripwire is None
        return
    assert plan.read is heap_in_use_bytes
    assert plan.read() > 0
    # a fresh CpuBackend resets the high-water mark: the tripwire reads it through getrusage ("hwm")
    expected = "hwm" if backend.resets_hwm else "rss"
    assert plan.trip is not None and plan.trip.source == expected == plan.tripwire
    assert plan.trip() > 0
    assert plan.trip_at == math.inf  # no read taken yet: nothing to measure a rise from


def test_arm_without_a_backend_has_neither_read_nor_tripwire():
    plan = make_plan()
    plan.arm(None)
    assert plan.read is None and plan.trip is None and plan.tripwire is None
    assert plan.take_read(0) is None


# ---------------------------------------------------------------------- quiet()
def test_quiet_before_quiet_until_and_not_at_or_after_it():
    plan = make_plan()  # no arm(): no tripwire
    assert not quiet(plan, 0)  # nothing planned: quiet_until is 0
    plan.quiet_until = 60
    assert quiet(plan, 50) and quiet(plan, 59)
    assert not quiet(plan, 60) and not quiet(plan, 61) and not quiet(plan, 1000)
    plan.wake()
    assert plan.quiet_until == 0 and not quiet(plan, 50)


def test_the_tripwire_is_checked_only_on_every_fourth_count():
    plan = make_plan()
    # a stand-in for the resident set: 10 MiB, under the level at which it trips (20 MiB)
    rss = Counter(10 * MIB)
    plan.trip, plan.trip_at = Tripwire(rss, "rss"), 20 * MIB
    plan.quiet_until = 100
    for count in (49, 50, 51, 53, 54, 55, 57, 58, 59):  # no multiple of 4: not checked
        assert quiet(plan, count)
    assert rss.calls == 0
    for n, count in enumerate((52, 56, 60, 64), start=1):  # multiples of 4: checked, not tripped
        assert quiet(plan, count)
        assert rss.calls == n
    assert quiet(plan, 100) is False and rss.calls == 4  # at quiet_until: not quiet, nothing read
    assert quiet(plan, 104) is False and rss.calls == 4
    assert plan.trips == 0 and plan.quiet_until == 100


def test_a_tripped_wire_ends_the_stretch_and_makes_the_step_read():
    plan = make_plan()
    plan.arm(None)
    plan.read = Counter(123 * MIB)  # a stand-in for the watch's memory read
    rss = Counter(20 * MIB)  # a stand-in for the resident set: exactly at trip_at, which trips (>=)
    plan.trip, plan.trip_at = Tripwire(rss, "rss"), 20 * MIB
    plan.read_every = 25
    plan.quiet_until = 100
    assert quiet(plan, 51)  # not a multiple of 4: not checked
    assert plan.trips == 0
    assert quiet(plan, 52) is False  # checked and tripped
    assert rss.calls == 1
    assert plan.trips == 1
    assert plan.quiet_until == 0  # the stretch is over
    assert not quiet(plan, 53)  # and the steps after it are not quiet until a new plan
    # the tripped step takes the watch's read, although 52 is past the dense reads (32) and
    # (52 + 1) % 25 != 0
    assert plan.take_read(52) == 123 * MIB
    assert plan.take_read(53) is None  # only the tripped step
    plan.quiet_until = 200
    assert quiet(plan, 56) is False and plan.trips == 2  # a second trip counts again


def test_a_tripwire_whose_reader_fails_never_trips():
    def broken() -> int:  # a stand-in for a /proc read that stopped answering
        raise OSError("gone")

    plan = make_plan()
    plan.trip, plan.trip_at = Tripwire(broken, "rss"), 0.5  # anything above 0 would trip on a real value
    plan.quiet_until = 100
    assert quiet(plan, 52)  # the wire reads 0: not tripped, and quiet() does not raise
    assert plan.trips == 0 and plan.quiet_until == 100


# ---------------------------------------------------------------------- plan_after()
def test_plan_after_keeps_the_first_steps_busy():
    plan = make_plan(sample_every_n_steps=100)
    plan.plan_after(0, busy=False, reads=False)
    assert plan.quiet_until == 1  # only "the next step is not quiet": nothing before it
    plan.plan_after(22, busy=False, reads=False)
    assert plan.quiet_until == 23  # 23 < QUIET_FROM (24): no stretch


def test_plan_after_plans_up_to_the_next_logged_sampled_or_read_step():
    plan = make_plan(sample_every_n_steps=100)  # sample: counts 99, 199, ...; log: 49, 99, 149, ...
    plan.plan_after(47, busy=False, reads=False)
    # nxt = 48 (past QUIET_FROM, 24): the next logged step is count 49 ((49 + 1) % 50 == 0), the next sampled 99
    assert plan.quiet_until == 49
    plan.plan_after(50, busy=False, reads=False)
    # nxt = 51: logged at 99 ((99 + 1) % 50 == 0), sampled at 99 ((99 + 1) % 100 == 0)
    assert plan.quiet_until == 99
    assert quiet(plan, 51) and quiet(plan, 98) and not quiet(plan, 99)


def test_plan_after_stops_at_the_next_read_only_when_the_watch_reads():
    plan = make_plan(sample_every_n_steps=100)
    plan.read_every = 25
    plan.plan_after(50, busy=False, reads=True)
    assert plan.quiet_until == 99  # reads=True but no read armed (plan.read is None): reads do not count
    plan.read = Counter(0)  # a stand-in for the watch's memory read
    plan.plan_after(50, busy=False, reads=True)
    assert plan.quiet_until == 74  # (74 + 1) % 25 == 0
    plan.plan_after(50, busy=False, reads=False)
    assert plan.quiet_until == 99


def test_plan_after_a_busy_step_plans_nothing():
    plan = make_plan(sample_every_n_steps=100)
    plan.plan_after(50, busy=True, reads=False)
    assert plan.quiet_until == 51
    assert not quiet(plan, 51)


def test_plan_after_with_gc_every_n_steps_plans_nothing():
    plan = make_plan(sample_every_n_steps=100, gc_every_n_steps=10)
    plan.plan_after(50, busy=False, reads=False)
    assert plan.quiet_until == 51
    plan.plan_after(60, busy=False, reads=False)
    assert plan.quiet_until == 61


def test_plan_after_inside_a_read_burst_plans_nothing():
    plan = make_plan(sample_every_n_steps=100)
    plan.dense_until = 80  # a burst of every-step reads up to count 80
    plan.plan_after(50, busy=False, reads=False)
    assert plan.quiet_until == 51


# ---------------------------------------------------------------------- rebase()
def test_rebase_moves_an_hwm_tripwire_to_the_step_peak_plus_the_threshold():
    plan = make_plan()
    mark = Counter(150 * MIB)  # a stand-in for getrusage's high-water mark
    plan.trip = Tripwire(mark, "hwm")
    assert plan.rebase(200 * MIB, pinned=False) is False  # not switched
    assert plan.trip_at == 200 * MIB + TRIP_BYTES  # max(150, 200) MiB + 1 MiB
    assert plan.rebase(100 * MIB, pinned=False) is False
    assert plan.trip_at == 150 * MIB + TRIP_BYTES  # max(150, 100) MiB + 1 MiB
    assert plan.rebase(0, pinned=False) is False
    assert plan.trip_at == 150 * MIB + TRIP_BYTES  # no peak measured: the mark now
    assert plan.trip.source == "hwm" and mark.calls == 3


def test_rebase_leaves_an_rss_tripwire_and_no_tripwire_alone():
    plan = make_plan()
    assert plan.rebase(200 * MIB, pinned=True) is False and plan.trip is None
    rss = Counter(150 * MIB)  # a stand-in for statm
    plan.trip, plan.trip_at = Tripwire(rss, "rss"), 7.0
    assert plan.rebase(200 * MIB, pinned=False) is False
    assert plan.rebase(200 * MIB, pinned=True) is False
    assert plan.trip_at == 7.0 and rss.calls == 0 and plan.trip.source == "rss"


@needs_mallinfo
def test_rebase_switches_a_pinned_hwm_tripwire_to_statm(backend):
    plan = make_plan()
    plan.arm(backend)  # the real heap read and the real tripwire
    plan.trip = Tripwire(Counter(10 << 30), "hwm")  # a stand-in for a mark pinned at 10 GiB
    plan.tripwire = "hwm"
    before = StatmReader()()
    assert plan.rebase(200 * MIB, pinned=True) is True
    after = StatmReader()()
    assert plan.trip is not None and plan.trip.source == "rss" and plan.tripwire == "rss"
    assert isinstance(plan.trip.reader, StatmReader)
    # statm now plus 1 MiB, not the pinned mark or the step's peak
    assert before + TRIP_BYTES - 8 * MIB <= plan.trip_at <= after + TRIP_BYTES + 8 * MIB
    assert plan.trip_at < 10 << 30
    # from now on it is an "rss" tripwire: rebase leaves it alone
    trip_at = plan.trip_at
    assert plan.rebase(20 << 30, pinned=False) is False and plan.trip_at == trip_at


# ---------------------------------------------------------------------- take_read() and after_read()
def test_take_read_reads_only_on_the_steps_the_schedule_names():
    plan = make_plan()
    read = Counter(64 * MIB)  # a stand-in for the watch's memory read
    plan.read = read
    plan.read_every = 25
    dense = DENSE_READ_STEPS
    for count in (0, 1, dense - 4, dense - 1):  # the first counts: every one reads
        assert plan.take_read(count) == 64 * MIB
    assert read.calls == 4
    for count in (dense + 1, 47, 48, 50, 73, 75, 98):  # past them, (count + 1) % 25 != 0: no read
        assert plan.take_read(count) is None
    assert read.calls == 4
    for count in (49, 74, 99):  # (count + 1) % 25 == 0
        assert plan.take_read(count) == 64 * MIB
    assert read.calls == 7
    plan.dense_until = 110  # a burst: every count below 110 reads
    assert plan.take_read(105) == 64 * MIB and plan.take_read(110) is None
    assert read.calls == 8
    # each read charged to the budget
    assert plan.step_read_s >= 0 and plan.own_s == plan.parts["read"] and plan.summary()["read_cost_median_us"] is not None


@needs_mallinfo
def test_take_read_with_the_real_heap_read(backend):
    plan = make_plan()
    plan.arm(backend)
    value = plan.take_read(0)
    assert isinstance(value, int) and value > 0
    assert plan.step_read_s > 0 and plan.own_s >= plan.step_read_s


def test_after_read_sets_trip_at_from_the_tripwire():
    plan = make_plan()
    rss = Counter(300 * MIB)  # a stand-in for the resident set
    plan.trip = Tripwire(rss, "rss")
    plan.after_read(10, 100 * MIB)
    assert plan.trip_at == 300 * MIB + TRIP_BYTES
    rss.value = 310 * MIB
    plan.after_read(60, 100 * MIB)
    assert plan.trip_at == 310 * MIB + TRIP_BYTES
    # past the dense reads (32) the schedule keeps the value for its burst test: a floor 4 MiB above it starts one
    plan.after_read(74, 104 * MIB)
    assert plan.bursts == 1 and plan.dense_until == 75 + 24  # CONFIRM_STEPS


def test_after_read_without_a_tripwire_leaves_trip_at():
    plan = make_plan()
    plan.after_read(60, 100 * MIB)
    assert plan.trip_at == math.inf


def test_after_read_on_a_tripped_read_uses_a_quarter_of_the_rise():
    """The trip threshold after a burst: 4 MiB doubled to 8 MiB, a quarter is 2 MiB."""
    plan = make_plan()
    rss = Counter(500 * MIB)  # a stand-in for the resident set
    plan.trip = Tripwire(rss, "rss")
    plan.after_read(49, 100 * MIB)
    plan.after_read(74, 100 * MIB)
    plan.quiet_until, plan.trip_at = 100, 0  # the wire trips at the next check (count 80: a multiple of 4)
    assert not quiet(plan, 80) and plan.trips == 1
    plan.after_read(80, 101 * MIB + MIB // 2)  # +1.5 MiB >= 1 MiB on a tripped read: a burst
    assert plan.bursts == 1 and plan.dense_until == 81 + 24  # CONFIRM_STEPS
    # trip_at is set before the schedule doubles the threshold: 500 MiB + 1 MiB
    assert plan.trip_at == 500 * MIB + TRIP_BYTES
    plan.after_read(200, 100 * MIB)
    assert plan.trip_at == 500 * MIB + 2 * MIB  # (4 MiB * 2) // 4


# ---------------------------------------------------------------------- configure() and pickling
def test_configure_starts_fresh_intervals_and_no_stretch():
    plan = make_plan()
    plan.trip, plan.trip_at, plan.quiet_until = Tripwire(Counter(MIB), "rss"), 0, 90  # a stand-in that trips
    assert not quiet(plan, 52) and plan.trips == 1
    plan.quiet_until = 90
    plan.configure(log_every=10, logs=True, log_first_step=True)
    assert plan.trips == 0 and plan.quiet_until == 0
    assert plan.will_log(0) and plan.will_log(9) and not plan.will_log(10) and plan.will_log(19)
    plan.configure(log_every=10, logs=False, log_first_step=True)
    assert not plan.will_log(0) and not plan.will_log(9)


@needs_mallinfo
def test_pickling_a_plan_drops_its_readers(backend):
    plan = make_plan()
    plan.arm(backend)
    plan.quiet_until = 77
    plan.read_every = 25
    assert plan.read is not None and plan.trip is not None
    copy = pickle.loads(pickle.dumps(plan))
    assert copy.read is None and copy.trip is None
    assert copy.quiet_until == 77 and copy.read_every == 25 and copy.log_every == 50
    assert plan.read is heap_in_use_bytes and plan.trip is not None  # the original keeps them
    # a copy with no tripwire never checks one: quiet on every count below 77
    assert all(quiet(copy, c) for c in range(48, 77))
    copy.arm(backend)  # arm() rebuilds them
    assert copy.read is heap_in_use_bytes and copy.trip is not None


# ---------------------------------------------------------------------- the dense reads' window
def test_the_dense_reads_go_on_to_48_steps_when_the_floor_rose_in_their_second_half():
    """The first DENSE_READ_STEPS steps read memory at every step; a floor that rose by the tripwire's rise (1 MiB)
    over their second half (a slow leak the growth test has not confirmed yet) keeps the reads dense to DENSE_READ_MAX.
    A rise in the first half only (the run's warm-up: optimizer state, loggers) does not."""
    dense, half = DENSE_READ_STEPS, DENSE_READ_STEPS // 2
    plan = make_plan()
    plan.read_every = 25
    for count in range(dense):  # a 256 KiB/step climb from the second half's start: +1.75 MiB or more by its end
        plan.after_read(count, 100 * MIB + max(0, count - half) * (256 << 10))
    assert plan.dense_until == DENSE_READ_MAX and plan.bursts == 0
    assert all(plan.wants_read(n) for n in range(dense, DENSE_READ_MAX)) and not plan.wants_read(DENSE_READ_MAX)
    warm = make_plan()
    warm.read_every = 25
    for count in range(dense):  # 40 MiB in the first steps, then flat
        warm.after_read(count, 100 * MIB + min(count, half) * 5 * MIB)
    assert warm.dense_until == 0 and not warm.wants_read(dense + 1)  # (dense + 2) % 25 != 0


def test_a_host_rise_over_the_dense_reads_second_half_keeps_them_dense():
    """A Python-object leak is not in the heap the watch reads: the host's Python objects risen by the
    tripwire's rise (1 MiB) over the dense reads' second half keep them dense to 48 too (the session
    counts them at both ends, counts 16 and 31, and asks with :meth:`HostGrowth.python_rise`)."""
    plan = make_plan()
    plan.read_every = 25
    plan.extend_dense(TRIP_BYTES - 1)
    assert plan.dense_until == 0 and not plan.wants_read(32)
    plan.extend_dense(TRIP_BYTES)
    assert plan.dense_until == 48 and plan.wants_read(47) and not plan.wants_read(48)
    growth = HostGrowth()
    # stand-ins for the block counts (in bytes): one at step 0, then at both ends of the second half;
    # 300 KiB/step of Python objects from step 20
    for step in (0, 16, 31):
        growth.python.reads.append((step, 90 * MIB + max(0, step - 20) * 300 * 1024))
    assert growth.python_rise(16) == 11 * 300 * 1024
    assert growth.python_rise(31) == 0 and HostGrowth().python_rise(0) == 0  # fewer than two counts
