"""The monitor's own time, split by part, and the budget's guard that backs off the costliest part when a window goes over ``overhead_budget``.

Both are parts of :class:`~memcallbacks._runtime.cadence.Cadence`: the :class:`Ledger` is where the
leak watch books its lingering checks and finding work (so a step's charge is split by part), and
the :class:`BudgetGuard` checks the measured own time over windows of steps and doubles an
interval when the budget is exceeded.
"""

from __future__ import annotations

import collections
import logging
import time
from typing import Any, Callable

__all__ = ["Ledger", "BudgetGuard", "HookMeter", "LINGERING_SHARE", "CONTROL_STEPS", "MAX_BACKOFF", "PARTS", "PART_NAMES"]

# The share of the budget the lingering check may take (its checks come after every
# ``mark_every``-th sampled step: the budget widens that interval when a check is costly).
LINGERING_SHARE = 0.25
# The budget's guard: the monitor's measured own time over windows of at least this many steps
# (after the first QUIET_FROM, whose every-step reads are taken whatever they cost). A window over
# the budget doubles the interval of its most expensive part (the lingering check, sampling or the
# reads), whichever it is: the intervals chosen from medians miss a cost that only some steps pay.
CONTROL_STEPS = 32
MAX_BACKOFF = 1024
# what each part of the monitor's own time is called in report.json (summary.cadence.own_time_by_part_s)
PARTS = ("read", "sample", "watch", "lingering", "tripwire", "gc", "findings", "hooks")
# the parts whose interval the guard widens, as its log line names them
PART_NAMES = {"lingering": "the lingering check", "read": "the memory reads", "sample": "sampled steps"}


class HookMeter:
    """Times a hook call whole, from torch's call to the return, and books what the step's own timers
    inside it did not see as the cadence's ``hooks`` part: the call's frames, the guard, the checks
    of a step that does nothing, and the cold caches they run in after the step's compute (20-30 µs
    a call in the nanoGPT-style loop, where the timers inside saw a fifth of the excess a bare run
    measured). ``plan``: the session's :class:`~memcallbacks._runtime.plan.StepPlan` (its cadence
    is replaced when a run starts). The part is right over the run, not call by call (see below)."""

    __slots__ = ("plan",)

    def __init__(self, plan: Any) -> None:
        self.plan = plan

    def call(self, fn: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        cadence = self.plan.cadence
        before = cadence.own_s
        t0 = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            # Not clamped at 0: a step's own time is timed in one hook call (its start, in the forward
            # pre-hook) and charged in a later one (its end): the later call's difference is negative by
            # what the earlier one counted twice, so over the run the hooks' part is each call's time
            # less what the timers inside it measured (a census in a step's start: once, not twice)
            extra = time.perf_counter() - t0 - (cadence.own_s - before)
            cadence.own_s += extra
            cadence.parts["hooks"] += extra


class Ledger:
    """What the leak watch spends apart from the step's other work, for the cadence to split a
    step's own time by part: its lingering checks (each check's cost, for the interval between them)
    and the censuses and holder searches that name a finding's holders. Picklable."""

    __slots__ = ("lingering_s", "finding_s", "checks", "heap_scans", "check_costs", "budget", "step_s")

    def __init__(self, budget: float = 0.01) -> None:
        self.budget = budget
        self.step_s = 0.0  # the median step time, once the cadence has measured it
        self.lingering_s = 0.0
        self.finding_s = 0.0
        self.checks = 0
        self.heap_scans = 0  # lingering checks that scanned the heap for a graph's root
        self.check_costs: collections.deque[float] = collections.deque(maxlen=16)

    def __getstate__(self) -> dict[str, Any]:
        return {k: getattr(self, k) for k in self.__slots__}

    def __setstate__(self, state: dict[str, Any]) -> None:
        for k in self.__slots__:
            setattr(self, k, state[k])

    def lingering(self, seconds: float) -> None:
        """One lingering check that found something alive, its holder searches excepted."""
        self.lingering_s += seconds
        self.checks += 1
        self.check_costs.append(seconds)

    def finding(self, seconds: float) -> None:
        """A census or a holder search for a finding."""
        self.finding_s += seconds

    def affords(self, seconds: float, steps: int) -> bool:
        """Whether ``seconds`` of work spread over ``steps`` steps fits the lingering check's share of
        the budget (False while the step time is not measured yet)."""
        return self.step_s > 0 and seconds <= steps * self.step_s * self.budget * LINGERING_SHARE


class BudgetGuard:
    """The budget's guard: over a window of at least :data:`CONTROL_STEPS` steps after the first
    ``QUIET_FROM``, the own time measured (finding work excepted: it is once per cause and
    bounded by ``census_time_budget_s``) against the budget; over it, the most expensive part
    that has an interval (the lingering check, sampling, the reads) backs off: its interval
    doubles. Said once in the log; every back-off is in report.json. Picklable."""

    def __init__(self, budget: float, first: int, max_interval: int) -> None:
        self.budget = budget
        self.max_interval = max_interval  # an interval at this is not widened further
        self.backoff = {"read": 1, "sample": 1, "lingering": 1}  # the multipliers of the cadence's intervals
        self.backoffs: list[dict[str, Any]] = []  # each time the guard widened an interval
        self.over_budget_windows = 0  # windows whose own time was above the budget
        self.said: set[str] = set()  # what the guard has said in the log (each once)
        self.announce: tuple[logging.Logger, str] | None = None  # (logger, owner): where the back-off is said, once
        self.window: tuple[int, float, float, dict[str, float]] = (first, 0.0, 0.0, {})

    def check(self, cadence: Any) -> None:
        """One window's check (``cadence``: the :class:`~memcallbacks._runtime.cadence.Cadence` whose
        totals it reads and whose intervals its back-offs widen, once the first steps are over)."""
        start, own0, step0, parts0 = self.window
        steps = cadence.steps
        if steps < start + CONTROL_STEPS:
            return
        own = cadence.own_s - cadence.finding_s
        elapsed = cadence.step_s - step0
        spent = {k: cadence.parts[k] - parts0.get(k, 0.0) for k in cadence.parts}
        self.window = (steps, own, cadence.step_s, dict(cadence.parts))
        if elapsed <= 0:
            return
        rate = (own - own0) / elapsed
        if rate <= self.budget:
            return
        # the parts whose interval the guard can widen (sampled steps beyond the logged ones, which are
        # sampled whatever the interval; the reads between sampled steps; the lingering checks)
        controllable = {"lingering": spent["lingering"]}
        if cadence.read_every < self.max_interval:
            controllable["read"] = spent["read"]
        if not cadence.explicit and (not cadence.logs or cadence.sample_every < cadence.log_every):
            controllable["sample"] = spent["sample"]
        part = max(controllable, key=lambda k: controllable[k])
        self.over_budget_windows += 1
        if controllable[part] <= 0 or self.backoff[part] >= MAX_BACKOFF:
            # what is left is the logged steps (sampled whatever the budget) and the tripwire
            if self.say("floor"):
                logger, owner = self.announce  # type: ignore[misc]
                logger.info(
                    "%s: its own time was %.2f%% of step time over the last %d steps, above overhead_budget=%g, "
                    "and nothing it can sample less often is left: the rest is the logged steps (every %s), which "
                    "log_every_n_steps sets, and its hooks' calls (%.3g s of %.3g s), which every step makes.",
                    owner, 100 * rate, steps - start, self.budget, cadence.log_every if cadence.logs else "-",
                    spent.get("hooks", 0.0), own - own0,
                )
            return
        self.backoff[part] *= 2
        self.backoffs.append({"step": steps, "part": part, "own_time": round(rate, 5), "factor": self.backoff[part]})
        if len(self.backoffs) > 64:
            del self.backoffs[:32]
        if self.say("backoff"):
            logger, owner = self.announce  # type: ignore[misc]
            logger.info(
                "%s: its own time was %.2f%% of step time over the last %d steps, above overhead_budget=%g; "
                "the costliest part (%s: %.3g s of %.3g s) now runs half as often. Later back-offs are listed "
                "in report.json (summary.cadence.backoffs).",
                owner, 100 * rate, steps - start, self.budget, PART_NAMES[part], spent[part], own - own0,
            )

    def say(self, what: str) -> bool:
        """Whether to say ``what`` now: once per run, on rank zero (where :attr:`announce` is set)."""
        if self.announce is None or what in self.said:
            return False
        self.said.add(what)
        return True
