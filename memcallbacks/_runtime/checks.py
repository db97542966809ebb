"""The checks a step runs besides its measurement: leak watch, host channel, theory, pre-flight.

One composed part of :class:`~memcallbacks._runtime.session.Session`: the session decides which
steps are watched or sampled and in what order things happen; this object owns the parts that
check a step and hands back what they found. The session's guard is around every call.
"""


from __future__ import annotations

import functools
import logging
from typing import Any, Callable
from memcallbacks._base.config import MonitorConfig
from memcallbacks._base.findings import Finding
from memcallbacks._runtime.forecast import Forecast
from memcallbacks._runtime.preflight_check import PreflightCheck
from memcallbacks._runtime.sampling import MemoryEngine
from memcallbacks._runtime.schedule import DENSE_READ_STEPS, Schedule
from memcallbacks.host.channel import HostChannel
from memcallbacks.host.forked import guard_forked_children, unguard_forked_children
from memcallbacks._base.cpu import own_time
from memcallbacks.leaks.attribution import Attribution
from memcallbacks.leaks.census import format_top_holders
from memcallbacks.leaks.cycles import GarbageCollector
from memcallbacks.leaks.gc_watch import CollectionWatch
from memcallbacks.leaks.growth import GrowthDetector
from memcallbacks.leaks.lingering import LingeringDetector
from memcallbacks.leaks.search_failure import search_or_note
from memcallbacks._base.columns import ALLOCATED, STEP
from memcallbacks._base.units import GiB, format_bytes
from memcallbacks.estimate.measure import estimate_for, hidden_state_bytes, measure_model_states
from memcallbacks.leaks.tensors import batch_bytes
from memcallbacks.oom.accounting import hold_reserve, release_reserve

__all__ = ["StepChecks", "LeakWatch", "StateCheck"]

log = logging.getLogger(__name__)


class StepChecks:
    """The leak watch (:attr:`watch`), the host channel (:attr:`host`), the live theory check
    (:attr:`state`) and the pre-flight (:attr:`preflight`) of one session."""

    def __init__(
        self, config: MonitorConfig, engine: MemoryEngine, schedule: Schedule, *, owner: str, logger: logging.Logger,
        add_finding: Callable[[Finding], None], current_step: Callable[[], int],
    ) -> None:
        self.config = config
        self.engine = engine
        self.schedule = schedule
        self.owner = owner
        self.log = logger
        self.watch: LeakWatch | None = None
        self.host: HostChannel | None = None  # the host channel: Python objects, private memory, DataLoader workers
        self.state = StateCheck(config)
        # when memory runs out: the growth findings' forecasts (nothing runs while none is open)
        self.forecast = Forecast(engine, schedule, owner=owner, logger=logger)
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
        self.forecast.reset()

    def start(self, ignore: list[Any], device_is_host: bool, keep_host: bool = False) -> None:
        """A new leak watch (``ignore``: the monitor's own objects, never holders) and host channel;
        ``keep_host``: a later stage of the same run (fit, then test) keeps the fit's host channel."""
        if self.watch is not None:
            self.watch.stop()
        guard_forked_children(self)  # DataLoader workers forked from now on do not copy the heap (docs/host.md)
        schedule = self.schedule
        self.watch = LeakWatch(self.config, self.allocated_now, ignore=ignore, charge=schedule.charge_other, wake=schedule.wake,
                               schedule=schedule)
        self.watch.start()
        if self.watch.growth is not None:
            self.watch.growth.forecast = self.forecast.device
        if device_is_host:  # under an address-space limit: room to explain an OOM (memcallbacks/oom)
            hold_reserve()
        growth = self.watch.growth
        # the device growth test's latest finding (a partial of a builtin: no frame of ours at each host read)
        device_growth = functools.partial(getattr, growth, "last") if growth is not None else None
        if keep_host and self.host is not None:
            self.host.growth.device_growth = device_growth
            return
        if self.host is not None:
            self.host.close()
        self.host = HostChannel(device_is_host=device_is_host, device_growth=device_growth) if self.config.watch_host else None
        if self.host is not None:
            self.host.growth.forecast = self.forecast.host

    def set_objects(
        self, model: Any, optimizer: Any, *, precision: str | None = None, strategy: str | None = None, world_size: int | None = None
    ) -> None:
        """What the census and the theory check look at (see ``Session.attach``)."""
        if self.watch is not None:
            self.watch.attribution.model, self.watch.attribution.optimizer = model, optimizer
        self.preflight.set_objects(model, optimizer, precision=precision, strategy=strategy, world_size=world_size)
        try:
            self.state.set_objects(
                model, optimizer, precision=precision, strategy=strategy, world_size=world_size, allocated_now=self.allocated_now
            )
        except Exception as exc:
            self.log.info("%s: model-state estimate unavailable (%s)", self.owner, exc)
            self.state.model = None
            self.state.wanted = False

    def explain(self, batch: Any, ignore: list[Any]) -> Any:
        """Take a census now: live tensors by category, and who holds the suspicious ones."""
        watch = self.watch or LeakWatch(self.config, lambda: None, ignore=ignore)
        return watch.attribution.census(batch)

    def allocated_now(self) -> int | None:
        # the watch's read where there is one: the same number as backend.current()[0], without the
        # RSS read that comes with it on CPU
        read = self.schedule.read
        if read is not None:
            return read()
        backend = self.engine.backend
        return backend.current()[0] if backend is not None else None

    # ------------------------------------------------------------------ at a step's start
    def state_finding(self, step: int, baseline: int, batch: Any) -> Finding | None:
        """The theory check, isolated: an estimate that cannot be made is logged, never fatal."""
        try:
            finding = self.state.check(step, baseline, self.engine.start_allocated, self.engine.backend.kind, batch)  # type: ignore[union-attr]
        except Exception as exc:
            self.state.wanted = False
            self.log.info("%s: no model-state estimate for this run (%s: %s); the rest of the monitor goes on.", self.owner, type(exc).__name__, exc)
            return None
        watch = self.watch
        census = search_or_note(finding, lambda: watch.attribution.census(batch), None) if finding is not None and watch is not None else None
        if census is not None:  # a census that fails costs the holders only (the finding says why)
            finding.holders = format_top_holders(census, 5)  # type: ignore[union-attr]
            finding.details["census"] = {k: int(v) for k, v in census.bytes_by_category.items()}  # type: ignore[union-attr]
        return finding

    def detect_growth(self, count: int, batch: Any, value: int | None = None) -> list[Finding]:
        """Growth detection fed with ``value`` (a sampled step's baseline) or, on the steps the schedule
        reads memory, with the watch's own read: the growth finding, and its holders once the second
        census is due."""
        schedule, watch = self.schedule, self.watch
        if watch is None or schedule.read is None:
            return []
        if value is None:
            value = schedule.take_read(count)
            if value is None:
                return []
        schedule.after_read(count, value)
        if watch.growth is None:
            return []
        finding = watch.growth.update(count, value)
        if self.forecast.open:  # a growth open: the snapshot before memory runs out, whether or not its finding updated
            self.forecast.near(count)
        due = watch.attribution.census_due
        if finding is None and (due is None or count < due):
            return []
        return watch.attribution.growth(count, finding, batch)

    def host_read(self, step: int, count: int) -> list[Finding]:
        """The host channel at a step that is not quiet (docs/host.md): its read is part of the
        step's own time; a census after suspicion, or a worker read its faults asked for, is reported apart
        (finding work), with the other censuses. The Python objects are counted at both ends of the dense reads'
        second half whatever the block count's stride: risen there by the tripwire's rise, they keep the reads
        dense, as a risen heap floor does (:meth:`Schedule.after_read`; a Python-object leak is not in the heap
        the watch reads). Not private memory: a clean loop's rises 4-12 MiB over those steps as it warms up."""
        host = self.host
        if host is None:
            return []
        finding_s = host.finding_seconds
        half, last = count == DENSE_READ_STEPS // 2, count == DENSE_READ_STEPS - 1
        if half or last:  # the Python objects counted at both ends of the dense reads' second half, whatever the stride
            host.reader.blocks_now = True
        found = host.on_read(step)
        if last and host.enabled:
            self.schedule.extend_dense(host.growth.python_rise(step - (DENSE_READ_STEPS - 1 - DENSE_READ_STEPS // 2)))
        if self.forecast.open:  # a host growth open (a GPU run's): its snapshot before the end, as detect_growth's
            self.forecast.near(step)
        if host.finding_seconds != finding_s:  # censuses and the worker reads their faults asked for: split out of the step's charge
            self.schedule.book_finding(host.finding_seconds - finding_s)
        return found

    def plan_after(self, schedule: Any, count: int, **plan: bool) -> None:
        """:meth:`Schedule.plan_after`, its quiet stretch ended where the DataLoader workers' watch asks for a step
        (their faults counted every few steps while they live: docs/host.md)."""
        schedule.plan_after(count, **plan)
        host = self.host
        # no worker seen (most runs): not a call into the watch's module either
        workers = host.workers.next_step(count) if host is not None and host.enabled and host.workers.pids else None
        if workers is not None and workers < schedule.quiet_until:
            schedule.quiet_until = workers

    # ------------------------------------------------------------------ what the session asks
    @property
    def lingering_wants_mark(self) -> bool:
        """The last lingering check could not tell yet: the open step leaves marks for the next one."""
        lingering = self.watch.lingering if self.watch is not None else None
        return lingering is not None and lingering.wants_mark

    def host_figures(self) -> dict[str, float]:
        """The host channel's figures for the logs and the per-rank comparison (none without one)."""
        host = self.host
        return {**host.growth.figures(), **host.workers.figures} if host is not None else {}

    def logged_keys(self, row: list[Any] | None, *, findings: int, capacity: float | None, snap: Any) -> dict[str, float]:
        """The keys a logged step adds to the engine's: findings, overhead, pre-flight, theory, snapshots,
        host, gc; each computed only where it is logged (``log_keys``: the host figures walk pymalloc's
        pools). ``capacity``: the device's bytes where the dashboard shows a capacity line (else None);
        ``snap``: the session's snapshot policy."""
        config = self.config
        p = config.prefix
        keep = config.logged_keys  # None: every key
        nan = float("nan")
        extra = {f"{p}/findings": float(findings)}
        if keep is None or f"{p}/overhead" in keep:
            extra[f"{p}/overhead"] = self.schedule.overhead
        if config.preflight:  # its keys join the default list with the option
            extra.update(self.preflight.metrics(row))
        if capacity is not None and (keep is None or f"{p}/capacity_GiB" in keep):
            extra[f"{p}/capacity_GiB"] = float(capacity or 0) / GiB
        if config.estimate_model_states and (keep is None or f"{p}/unexplained_GiB" in keep or f"{p}/expected_GiB" in keep):
            state = self.state  # the step-start baseline against the theory check's expected level
            baseline = float(row[ALLOCATED]) if row is not None else nan
            known = state.expected_level is not None
            extra[f"{p}/expected_GiB"] = state.expected_states / GiB if known else nan
            extra[f"{p}/unexplained_GiB"] = (
                (baseline - state.expected_level - state.batch_bytes) / GiB if known and baseline == baseline else nan  # type: ignore[operator]
            )
        if keep is None or f"{p}/runs_out_in_steps" in keep:  # an attribute read: no forecast runs on a logged step
            out = self.forecast.steps_out
            extra[f"{p}/runs_out_in_steps"] = max(0.0, out - row[STEP]) if out == out and row is not None else nan
        if snap is not None or config.auto_snapshot:  # its key joins the default list with the option
            extra[f"{p}/snapshots"] = float(len(snap.records)) if snap is not None else nan
        if config.watch_host:  # off: no host keys at all (rather than NaN columns)
            host: dict[str, float] | None = None
            for key, name in (("host_python_bytes", "host_python_GiB"), ("host_private_bytes", "host_private_GiB"),
                              ("host_worker_uss_bytes", "host_workers_GiB")):
                full = f"{p}/{name}"
                if keep is None or full in keep:
                    host = self.host_figures() if host is None else host
                    value = host.get(key)
                    extra[full] = value / GiB if value is not None else nan
        if config.gc_every_n_steps:  # its keys join the default list with the option
            gc_results = self.watch.gc_results if self.watch is not None else None
            last_gc = gc_results[-1] if gc_results else None
            extra[f"{p}/gc_time_ms"] = last_gc["seconds"] * 1e3 if last_gc else nan
            extra[f"{p}/gc_collected"] = float(last_gc["collected"]) if last_gc else nan
            extra[f"{p}/gc_freed_GiB"] = (last_gc["bytes_freed"] or 0) / GiB if last_gc else nan
        return extra

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
        unguard_forked_children(self)
        self.forecast.snap = None
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
            self.watch.attribution.model = self.watch.attribution.optimizer = None
        self.state.model = self.state.optimizer = None
        self.state.wanted = False
        release_reserve()
        try:
            self.preflight.release()
        except Exception:
            self.log.exception("%s: could not release the pre-flight model copy; continuing.", self.owner)


# ---------------------------------------------------------------------- the leak watch
class LeakWatch:
    """Per-step leak detection: lingering references, growth, Python's collections and the periodic
    collection. Each method is cheap unless something is found; :attr:`attribution` names the holders."""

    def __init__(
        self,
        config: MonitorConfig,
        allocated_now: Callable[[], int | None],
        ignore: list[Any],
        *,
        charge: Callable[[float], None] | None = None,
        wake: Callable[[], None] | None = None,
        schedule: Schedule | None = None,
    ) -> None:
        """``charge``: told the seconds the garbage-collection callback spends reading memory;
        ``wake``: called when a large automatic collection makes the next step inspect the garbage;
        ``schedule``: booked the seconds of each lingering check and of each census and holder search,
        so that the budget sees every part."""
        self.config = config
        self.schedule = schedule
        self.lingering = (
            LingeringDetector(min_bytes=config.lingering_min_bytes) if config.detect_leaks else None
        )
        self.growth = (
            GrowthDetector(
                warmup_steps=config.growth_warmup_steps,
                min_rate_bytes=config.growth_min_bytes_per_step,
                min_growth_bytes=config.growth_min_total_bytes,
            )
            if config.detect_leaks
            else None
        )
        self.gc = (
            GarbageCollector(
                every_n_steps=config.gc_every_n_steps,
                disable_automatic=config.gc_disable_automatic,
                allocated_bytes=allocated_now,
            )
            if config.gc_every_n_steps
            else None
        )
        # Python's automatic collections, measured through gc.callbacks (a `cycle` finding needs no
        # configuration); off when the periodic collection has turned them off anyway
        self.collections = (
            CollectionWatch(allocated_now, min_bytes=config.lingering_min_bytes, charge=charge, wake=wake)
            if config.detect_leaks and not config.gc_disable_automatic
            else None
        )
        # who holds what is found: holder searches and censuses, booked as finding work
        self.attribution = Attribution(config.census_time_budget_s, ignore, collections=self.collections,
                                       book=schedule.book_finding if schedule is not None else None, allocated_now=allocated_now)
        self.gc_results: list[dict[str, Any]] = []
        self._last_scan: tuple[int, float] | None = None  # (step, seconds) of the last check that scanned the heap

    def start(self) -> None:
        if self.gc is not None:
            self.gc.start()
        if self.collections is not None:
            self.collections.start()

    def stop(self) -> None:
        if self.gc is not None:
            self.gc.stop()
        if self.collections is not None:
            self.collections.stop()

    # ------------------------------------------------------------------ at step start, before the baseline
    def check_lingering(self, step: int, batch: Any) -> list[Finding]:
        """The lingering check on the previous step's marks, then the graph chains. A check with marks
        to look at is timed and booked with the schedule (its holder searches as finding work)."""
        lingering, schedule = self.lingering, self.schedule
        if lingering is None:
            return []
        timed = schedule is not None and lingering.pending
        if timed:
            t0, f0 = own_time(), schedule.booked_finding_s  # type: ignore[union-attr]
            scans = lingering.heap_scans
            # a heap scan (a graph root no variable reaches) is taken when the budget has paid for the last one
            last = self._last_scan
            lingering.heap_allowed = last is None or schedule.affords(last[1], step - last[0])  # type: ignore[union-attr]
        try:
            found = []
            finding = lingering.check(step, current_batch=batch)
            if finding is not None:  # who keeps it, and the fix for that holder (or the cycle that does)
                found.append(self.attribution.explain_lingering(finding, lingering))
            chain = lingering.chains.check(step)
            if chain is not None:
                finding = self.attribution.chain(step, chain)  # booked as finding work there
                if finding is not None:
                    found.append(finding)
            return found
        finally:
            if timed:
                spent = own_time() - t0 - (schedule.booked_finding_s - f0)  # type: ignore[union-attr]
                if lingering.heap_scans > scans:
                    schedule.heap_scans += lingering.heap_scans - scans  # type: ignore[union-attr]
                    self._last_scan = (step, spent)
                schedule.book_lingering(spent)  # type: ignore[union-attr]

    def before_baseline(self, step: int, batch: Any, *, lingering: bool = True) -> list[Finding]:
        found: list[Finding] = self.check_lingering(step, batch) if lingering else []
        collections = self.collections
        if collections is not None and collections.due:
            finding = self._inspect_collections(collections, step)
            if finding is not None:
                found.append(finding)
        if self.gc is not None:
            if collections is not None:
                collections.own = True
            try:
                result = self.gc.maybe_collect(step)
            finally:
                if collections is not None:
                    collections.own = False
            if result is not None:
                self.gc_results.append(
                    {"step": step, "seconds": result.seconds, "collected": result.collected, "bytes_freed": result.bytes_freed}
                )
                if len(self.gc_results) > 1000:
                    del self.gc_results[: len(self.gc_results) // 2]
                finding = result.to_finding()
                if finding is not None:
                    found.append(finding)
        return found

    def _inspect_collections(self, collections: CollectionWatch, step: int) -> Finding | None:
        try:
            return collections.inspect(step)
        except Exception:
            log.debug("could not inspect the garbage", exc_info=True)
            return None



# ---------------------------------------------------------------------- the live theory check: the step-start baseline against params, grads and optimizer state
class StateCheck:
    """Measured baseline against theory, once, at the first step after the first optimizer step."""

    def __init__(self, config: MonitorConfig) -> None:
        self.config = config
        self.model: Any = None
        self.optimizer: Any = None
        self.precision: str | None = None
        self.strategy: str | None = None
        self.world_size: int | None = None
        # the check is still to run (estimate_model_states, a model, not done yet): a field, read at
        # every step that is not quiet
        self.wanted = False
        self.expected_level: float | None = None  # allocated bytes the baseline should show, batch excluded
        self.expected_states = 0
        self.batch_bytes = 0
        self.info: dict[str, Any] = {}
        self._start_states = 0
        self._start_allocated: int | None = None

    def set_objects(
        self, model: Any, optimizer: Any, *, precision: str | None = None, strategy: str | None = None,
        world_size: int | None = None, allocated_now: Callable[[], int | None] | None = None,
    ) -> None:
        """``allocated_now()``: the allocator's bytes, read right after the model states are measured
        as the CPU comparison's reference. Not the heap at monitor start: Lightning builds, wraps or
        shards the model (``configure_model``, DDP, ``fully_shard``) in between, which would offset
        the check by the change in model size."""
        self.model, self.optimizer = model, optimizer
        self.precision, self.strategy, self.world_size = precision, strategy, world_size
        self.wanted = False
        if model is not None:
            # what already existed when measuring started (params, and state of a resumed run)
            self._start_states = measure_model_states(model, optimizer).get("total", 0) + hidden_state_bytes(model)
            self._start_allocated = allocated_now() if allocated_now is not None else None
            self.wanted = self.config.estimate_model_states

    def check(self, step: int, baseline: int, start_allocated: int, device_kind: str, batch: Any) -> Finding | None:
        self.wanted = False
        model, optimizer = self.model, self.optimizer
        grads_alive = any(p.grad is not None for p in model.parameters())
        est = estimate_for(
            model,
            optimizer,
            precision=self.precision,
            strategy=self.strategy,
            world_size=self.world_size,
            set_to_none=not grads_alive,
        )
        measured = measure_model_states(model, optimizer)
        self.batch_bytes = batch_bytes(batch) if batch is not None else 0
        expected_parts = est.expected_measurement()
        if device_kind == "cpu":
            # training on the host: "device" and "host" state (e.g. Adam's step counters) share the heap;
            # the heap also holds the interpreter and libraries, so compare growth since the start
            self.expected_states = int(est.device_steady + est.host_steady)
            reference = start_allocated if self._start_allocated is None else self._start_allocated
            self.expected_level = reference - self._start_states + self.expected_states
            expected = {k: int(expected_parts.get(f"device_{k}", 0) + expected_parts.get(f"host_{k}", 0)) for k in ("params", "grads", "optimizer")}
        else:
            self.expected_states = int(est.device_steady)
            self.expected_level = float(est.device_steady)
            expected = {k: int(expected_parts.get(f"device_{k}", 0)) for k in ("params", "grads", "optimizer")}
        expected["comm_buffers"] = int(est.device_comm_buffers)
        unexplained = int(baseline - self.expected_level - self.batch_bytes)
        self.info = {
            "step": step,
            "strategy": est.strategy,
            "precision": est.precision,
            "world_size": est.world_size,
            "expected_steady_bytes": self.expected_states,
            "expected": expected,
            "measured_model_states": {k: int(v) for k, v in measured.items()},
            "baseline_bytes": int(baseline),
            "batch_bytes": self.batch_bytes,
            "unexplained_bytes": unexplained,
            "margin_bytes": self.config.unexplained_margin_bytes,
        }
        if unexplained <= self.config.unexplained_margin_bytes:
            return None
        message = (
            f"At the start of step {step}, {format_bytes(baseline)} was allocated, but params, grads and optimizer "
            f"state should take {format_bytes(self.expected_states)} ({est.strategy}, {est.precision}, world size "
            f"{est.world_size}) and the batch {format_bytes(self.batch_bytes)}: {format_bytes(unexplained)} is "
            f"unexplained (margin {format_bytes(self.config.unexplained_margin_bytes)}). Look for tensors kept "
            "between steps: caches on the model, outputs or losses stored for logging without .detach()/.item(), "
            "a previous batch, or other models on the device. The census below says which categories hold it."
        )
        return Finding(kind="unexplained", step=step, message=message, bytes=unexplained, details=dict(self.info))
