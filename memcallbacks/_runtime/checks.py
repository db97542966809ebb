"""The checks a step runs besides its measurement: the leak watch, the host channel, the theory check and the pre-flight.

One composed part of :class:`~memcallbacks._runtime.session.Session`: the session decides which
steps are watched or sampled and in what order things happen; this object owns the parts that
check a step and hands back what they found. The session's guard is around every call.
"""

from __future__ import annotations

import logging
from typing import Any, Callable

from memcallbacks._base.config import MonitorConfig
from memcallbacks._base.findings import Finding
from memcallbacks._runtime.leak_watch import LeakWatch
from memcallbacks._runtime.plan import StepPlan
from memcallbacks._runtime.preflight_check import PreflightCheck
from memcallbacks._runtime.sampling import MemoryEngine
from memcallbacks._runtime.state_check import StateCheck
from memcallbacks.host.channel import HostChannel
from memcallbacks.leaks.census import format_top_holders
from memcallbacks.leaks.search_failure import search_or_note

__all__ = ["StepChecks"]


class StepChecks:
    """The leak watch (:attr:`watch`), the host channel (:attr:`host`), the live theory check
    (:attr:`state`) and the pre-flight (:attr:`preflight`) of one session."""

    def __init__(
        self, config: MonitorConfig, engine: MemoryEngine, plan: StepPlan, owner: str, logger: logging.Logger,
        add_finding: Callable[[Finding], None], current_step: Callable[[], int],
    ) -> None:
        self.config = config
        self.engine = engine
        self.plan = plan
        self.owner = owner
        self.log = logger
        self.watch: LeakWatch | None = None
        self.host: HostChannel | None = None  # the host channel: Python objects, private memory, DataLoader workers
        self.state = StateCheck(config)
        # preflight=True: the first batch's step predicted, then compared
        self.preflight = PreflightCheck(config, engine, owner, logger, add_finding, current_step)

    def __getstate__(self) -> dict[str, Any]:
        state = dict(self.__dict__)
        state["watch"] = None  # detectors hold weak references; start() builds new ones
        state["host"] = None
        return state

    def reset(self) -> None:
        self.state = StateCheck(self.config)
        self.preflight.reset()

    def start(self, ignore: list[Any], device_is_host: bool, keep_host: bool = False) -> None:
        """A new leak watch (``ignore``: the monitor's own objects, never holders) and host channel;
        ``keep_host``: a later stage of the same run (fit, then test) keeps the fit's host channel."""
        if self.watch is not None:
            self.watch.stop()
        cadence = self.plan.cadence
        self.watch = LeakWatch(self.config, self.allocated_now, ignore=ignore, charge=cadence.charge_other, wake=self.plan.wake,
                               ledger=cadence.ledger)
        self.watch.start()
        growth = self.watch.growth
        device_growth = lambda: growth.last if growth is not None else None  # noqa: E731
        if keep_host and self.host is not None:
            self.host.growth.device_growth = device_growth
            return
        if self.host is not None:
            self.host.close()
        self.host = HostChannel(device_is_host=device_is_host, device_growth=device_growth) if self.config.watch_host else None

    def set_objects(
        self, model: Any, optimizer: Any, *, precision: str | None = None, strategy: str | None = None, world_size: int | None = None
    ) -> None:
        """What the census and the theory check look at (see ``Session.attach``)."""
        if self.watch is not None:
            self.watch.model, self.watch.optimizer = model, optimizer
        self.preflight.set_objects(model, optimizer, precision=precision, strategy=strategy, world_size=world_size)
        try:
            self.state.set_objects(
                model, optimizer, precision=precision, strategy=strategy, world_size=world_size, allocated_now=self.allocated_now
            )
        except Exception as exc:
            self.log.info("%s: model-state estimate unavailable (%s)", self.owner, exc)
            self.state.model = None

    def explain(self, batch: Any, ignore: list[Any]) -> Any:
        """Take a census now: live tensors by category, and who holds the suspicious ones."""
        watch = self.watch or LeakWatch(self.config, lambda: None, ignore=ignore)
        return watch.census(batch)

    def allocated_now(self) -> int | None:
        # the watch's read where there is one: the same number as backend.current()[0], without the
        # RSS read that comes with it on CPU
        now = self.plan.allocated_now()
        if now is not None or self.plan.read is not None:
            return now
        backend = self.engine.backend
        return backend.current()[0] if backend is not None else None

    # ------------------------------------------------------------------ at a step's start
    def state_finding(self, step: int, baseline: int, batch: Any) -> Finding | None:
        """The theory check, isolated: an estimate that cannot be made is logged, never fatal."""
        try:
            finding = self.state.check(step, baseline, self.engine.start_allocated, self.engine.backend.kind, batch)  # type: ignore[union-attr]
        except Exception as exc:
            self.state.done = True
            self.log.info("%s: no model-state estimate for this run (%s: %s); the rest of the monitor goes on.", self.owner, type(exc).__name__, exc)
            return None
        watch = self.watch
        census = search_or_note(finding, lambda: watch.census(batch), None) if finding is not None and watch is not None else None
        if census is not None:  # a census that fails costs the holders only (the finding says why)
            finding.holders = format_top_holders(census, 5)  # type: ignore[union-attr]
            finding.details["census"] = {k: int(v) for k, v in census.bytes_by_category.items()}  # type: ignore[union-attr]
        return finding

    def read(self, count: int, batch: Any, value: int | None = None) -> list[Finding]:
        """Growth detection fed with ``value`` (a sampled step's baseline) or, on the steps the plan
        reads memory, with the watch's own read."""
        plan = self.plan
        if self.watch is None or plan.read is None:
            return []
        if value is None:
            value = plan.take_read(count)
            if value is None:
                return []
        plan.after_read(count, value)
        return self.watch.after_baseline(count, value, batch)

    def host_read(self, step: int) -> list[Finding]:
        """The host channel at a step that is not quiet (docs/host.md): its read is part of the
        step's own time; a census after suspicion is reported apart, with the other censuses."""
        host = self.host
        if host is None:
            return []
        census_s = host.census_seconds
        found = host.on_read(step)
        self.plan.cadence.ledger.finding(host.census_seconds - census_s)  # split out of the step's charge, as the watch's censuses
        return found

    # ------------------------------------------------------------------ what the session asks
    @property
    def lingering_wants_mark(self) -> bool:
        """The last lingering check could not tell yet: the open step leaves marks for the next one."""
        lingering = self.watch.lingering if self.watch is not None else None
        return lingering is not None and lingering.wants_mark

    @property
    def lingering_pending(self) -> bool:
        """The previous step left marks (batch references, a marked graph) for the lingering check."""
        lingering = self.watch.lingering if self.watch is not None else None
        return lingering is not None and lingering.pending

    def host_figures(self) -> dict[str, float] | None:
        """The host channel's figures for the logs and the per-rank comparison (None without one)."""
        host = self.host
        return {**host.growth.figures(), **host.workers.figures()} if host is not None else None

    # ------------------------------------------------------------------ at the run's end
    def report(self) -> dict[str, Any]:
        """This part's share of ``report.json``."""
        return {
            "model_states": dict(self.state.info),
            "preflight": self.preflight.report(),
            "gc": list(self.watch.gc_results) if self.watch is not None else [],
            "host": self.host.summary() if self.host is not None else None,
        }

    def stop(self, snap: Any) -> None:
        """Undo what the checks changed (``snap``, the session's snapshots, stops in between as it always did)."""
        if self.host is not None:
            try:
                self.host.close()
            except Exception:
                self.log.exception("%s: could not close its host channel; continuing.", self.owner)
        parts: list[tuple[str, Any]] = [("snapshots", snap), ("leak watch", self.watch)]
        for what, part in parts:
            if part is None:
                continue
            try:
                part.stop()
            except Exception:
                self.log.exception("%s: could not stop its %s; continuing.", self.owner, what)
        if self.watch is not None:
            self.watch.model = self.watch.optimizer = None
        self.state.model = self.state.optimizer = None
        try:
            self.preflight.release()
        except Exception:
            self.log.exception("%s: could not release the pre-flight model copy; continuing.", self.owner)
