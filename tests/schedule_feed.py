"""Drive a real :class:`~memcallbacks._runtime.schedule.Schedule` through its public methods with chosen
measurements: its step clock stepped by the test, and costs charged as a run's steps charge them."""

from __future__ import annotations

from memcallbacks._runtime.schedule import Schedule


class SteppedClock:
    """The schedule's step clock, moved by the test (``now``, seconds)."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def feed(schedule: Schedule, *, step_s: float, steps: int = 8, read_s: float | None = None, watch_s: float | None = None,
         sample_s: float | None = None, first: int = 0, debt: bool = False) -> Schedule:
    """Charge eight of each cost given (a watch read's ``read_s``, a watched step's ``watch_s``, a
    sampled step's ``sample_s``), then time ``steps`` steps of ``step_s`` each from count ``first``,
    and choose the intervals. ``debt``: the charges are what those few steps cost, past the budget (a
    run's dense first steps), which sampling pays back; otherwise they came with the step time that keeps
    them within it (the intervals' arithmetic alone)."""
    own = schedule.own_s
    for _ in range(8):
        if read_s is not None:
            schedule.charge_read(read_s)
        if watch_s is not None:
            schedule.charge(watch_s, sampled=False)
        if sample_s is not None:
            schedule.charge(sample_s, sampled=True)
    if not debt:
        schedule.timed_s += (schedule.own_s - own) / schedule.budget
    clock = schedule.clock if isinstance(schedule.clock, SteppedClock) else SteppedClock()
    schedule.clock = clock
    for count in range(first, first + steps + 1):
        schedule.step_started(count)
        clock.now += step_s
    schedule.choose()
    return schedule
