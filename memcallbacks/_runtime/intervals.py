"""The cadence's constants and interval arithmetic: dense first steps, the tripwire's period, interval caps, alignment with logged steps.

:mod:`memcallbacks._runtime.cadence` uses them and re-exports the constants."""

from __future__ import annotations

import math
from typing import Any

# Lingering references are checked after every one of the first steps, then after every
# MARK_EVERY_SAMPLES-th sampled step (a loop that keeps the previous step's batch or graph keeps
# them at every step, so any one check finds it; each check costs a step that is not quiet).
LINGERING_EVERY_STEP_UNTIL = 20
MARK_EVERY_SAMPLES = 4
# Steps sampled at the start, before the budget has measurements to choose from.
MEASURE_STEPS = 8
# The watch's memory read is taken at every one of a run's first steps, whatever it costs: a leak in
# the training code leaks from step 0, and growth detection needs about this many steps to confirm a
# leak of 256 KiB/step (docs/benchmarks.md). The budget chooses the interval after them.
DENSE_READ_STEPS = 48
# A read that finds the floor risen by the growth test's minimum since the last few reads makes the
# watch read every step for this many steps (enough for the growth test to confirm a leak of
# 256 KiB/step); each such burst that ends doubles the rise the next one needs.
CONFIRM_STEPS = 24
# The RSS tripwire is checked on the quiet steps whose count is a multiple of this (a power of two:
# the check is ``count & TRIP_MASK == 0``). Its /proc read takes ~1 µs, but it is a system call, and
# the training step after one runs slower (cold caches): +15-19 µs on a 0.5 ms step
# (benchmarks/syscall_cost.py), +6 to +10 µs per step at every 4th step of a 1.3 ms Lightning fit
# (docs/benchmarks.md). Every 8th step halves that, but a late leak of 4 MiB/step was then found
# 13 steps after it began and one of 256 KiB/step 36 (targets 12 and 35); every 4th: 8-9 and 20-28.
TRIP_EVERY = 4
TRIP_MASK = TRIP_EVERY - 1
# Steps before this count are never quiet (see Session.begin_step): they are measured, read and checked.
QUIET_FROM = max(LINGERING_EVERY_STEP_UNTIL, DENSE_READ_STEPS, MEASURE_STEPS)
# The intervals are chosen again every this many steps, from the latest measurements.
CHOOSE_EVERY = 16
MAX_INTERVAL = 1024
# At most this many steps between two reads, whatever a read costs (growth detection needs a few
# reads across a leak's first megabytes), unless the reads ride on logged steps at most 64 apart.
MAX_READ_INTERVAL = 32
# The share of the budget that the reads may take; the logged steps and sampling get the rest.
READ_SHARE = 0.5
# A step the monitor works in costs the training loop more than the monitor's own measured time: its
# reads and its code evict the step's data from the caches, and the step then runs slower. Measured
# with benchmarks/overhead.py on a ~1.4 ms CPU step (docs/benchmarks.md), a read or sampled step
# slowed the fit by 2-3x what the monitor timed in itself; the budget counts twice the measured time.
COLD_FACTOR = 2.0


def aligned_reads(every: int, log_every: int) -> int:
    """The read interval that puts reads on logged steps: the smallest divisor of ``log_every`` at or
    above ``every``, or where the budget's ``every`` is longer than the logging interval the largest
    multiple of ``log_every`` at or below it (a logged step's heap read is not free: the plan takes
    it on the steps it names, ``StepPlan.heap_due``). Not aligned past ``2 * MAX_READ_INTERVAL``."""
    if log_every > 2 * MAX_READ_INTERVAL:
        return every
    return every // log_every * log_every if every >= log_every else _divisor_from(every, log_every)


def _divisor_from(every: int, log_every: int) -> int:
    """The smallest divisor of ``log_every`` at or above ``every`` (at most ``log_every`` itself)."""
    return next(d for d in range(every, log_every + 1) if log_every % d == 0)


def aligned_samples(every: int, log_every: int) -> int:
    """The sampling interval at or above ``every`` that puts the budget's samples on logged steps,
    which are sampled anyway: a multiple of ``log_every`` (no sample besides the logged ones) or a
    divisor of it (samples in phase between them), unless that leaves no sample between logged steps
    where the budget allows two or more (a prime logging interval: the budget's own interval, out
    of phase)."""
    if every >= log_every:
        return -(-every // log_every) * log_every
    divisor = _divisor_from(every, log_every)
    return every if divisor == log_every and 2 * every <= log_every else divisor


def median(values: Any) -> float:
    ordered = sorted(values)
    return float(ordered[len(ordered) // 2]) if ordered else math.nan
