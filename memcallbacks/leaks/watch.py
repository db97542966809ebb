"""Leak watching and the theory check, wired to step boundaries: what MonitorCore calls around each step.

``LeakWatch`` runs the detectors of :mod:`memcallbacks.leaks.detectors` (lingering references, baseline
growth, periodic garbage collection) and, when one fires, the census of :mod:`memcallbacks.leaks.census`
to name the holders. ``StateCheck`` compares the step-start baseline with what
:mod:`memcallbacks.estimate` says params, grads and optimizer state should take. Both are
framework-free; adapters hand over the batch, the loss and the training objects.
"""

from __future__ import annotations

import copy
import logging
from typing import Any, Callable

from memcallbacks._config import MonitorConfig
from memcallbacks._findings import Finding, format_bytes

log = logging.getLogger(__name__)

__all__ = ["LeakWatch", "StateCheck", "batch_bytes", "hidden_state_bytes"]

# A growth finding names what grew between a census at detection and one this many sampled steps later.
GROWTH_CENSUS_GAP = 16


def batch_bytes(batch: Any) -> int:
    """Bytes of the distinct storages of the tensors in ``batch`` (nested containers)."""
    from memcallbacks.leaks.census import iter_tensors, storage_keys

    seen: dict[Any, int] = {}
    for tensor in iter_tensors(batch):
        for key, nbytes in storage_keys(tensor):
            seen[key] = nbytes
    return sum(seen.values())


class LeakWatch:
    """Per-step leak detection. Each method is cheap unless something is wrong."""

    def __init__(self, config: MonitorConfig, allocated_now: Callable[[], int | None], ignore: list[Any]) -> None:
        from memcallbacks.leaks.detectors import GarbageCollector, GrowthDetector, LingeringDetector

        self.config = config
        self._ignore = ignore  # our own objects, never reported as holders
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
        self.gc_results: list[dict[str, Any]] = []
        self._growth_census: Any = None
        self._growth_census_countdown = -1
        self._growth_finding: Finding | None = None
        self.model: Any = None
        self.optimizer: Any = None

    def start(self) -> None:
        if self.gc is not None:
            self.gc.start()

    def stop(self) -> None:
        if self.gc is not None:
            self.gc.stop()

    # ------------------------------------------------------------------ at step start, before the baseline
    def check_lingering(self, step: int, batch: Any) -> list[Finding]:
        if self.lingering is None:
            return []
        finding = self.lingering.check(step, current_batch=batch)
        if finding is None:
            return []
        finding.holders = self.lingering_holders()
        return [finding]

    def before_baseline(self, step: int, batch: Any, *, lingering: bool = True) -> list[Finding]:
        found: list[Finding] = self.check_lingering(step, batch) if lingering else []
        if self.gc is not None:
            result = self.gc.maybe_collect(step)
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

    @property
    def last_gc(self) -> dict[str, Any] | None:
        return self.gc_results[-1] if self.gc_results else None

    # ------------------------------------------------------------------ on sampled steps, after the baseline
    def after_baseline(self, step: int, baseline: int, batch: Any) -> list[Finding]:
        if self.growth is None:
            return []
        finding = self.growth.update(step, baseline)
        if finding is None:
            if self._growth_census_countdown > 0:
                self._growth_census_countdown -= 1
            if self._growth_census_countdown == 0:
                # the holders arrive on a step the detector did not report: an update, not a new sighting
                return self._name_growth(step, batch, sighting=False)
            return []
        first = self._growth_finding is None
        self._growth_finding = finding
        if first:
            # census A now; census B some sampled steps later tells what grew, by holder
            self._growth_census = self._census(batch)
            self._growth_census_countdown = GROWTH_CENSUS_GAP
        elif self._growth_census_countdown > 0:
            self._growth_census_countdown -= 1
        if self._growth_census_countdown == 0:
            return self._name_growth(step, batch)
        return [finding]

    def _name_growth(self, step: int, batch: Any, sighting: bool = True) -> list[Finding]:
        self._growth_census_countdown = -1
        finding, before = self._growth_finding, self._growth_census
        self._growth_census = None
        if finding is None or before is None:
            return []
        after = self._census(batch)
        if after is None:
            return [finding]
        deltas = [d for d in after.diff(before) if d.bytes > 0]
        finding.holders = [str(d) for d in deltas[:5]]
        finding.details["census_cost_s"] = round(before.seconds + after.seconds, 3)
        if not sighting:
            finding = copy.copy(finding)
            finding.count = 0  # FindingLog.add: merge the holders, leave the count alone
        return [finding]

    # ------------------------------------------------------------------ at step end
    def end_step(self, step: int, batch: Any, loss: Any) -> None:
        if self.lingering is not None:
            self.lingering.end_step(step, batch, loss)

    # ------------------------------------------------------------------ attribution
    def lingering_holders(self) -> list[str]:
        """Who keeps the previous step alive: the reference to the graph first (the cause — a kept
        loss), rendered through the autograd graph to the leaves it holds; then the other paths."""
        from memcallbacks.leaks.census import describe_tensor, find_holders

        assert self.lingering is not None
        targets = self.lingering.alive_tensors()
        holders: list[str] = []
        root = self.lingering.graph_root()
        if root is not None:
            leaves = [t for t in targets if getattr(t, "is_leaf", False) and t.requires_grad]
            tail = ", ".join(f"leaf tensor {describe_tensor(t)}" for t in leaves[:3]) or "its saved tensors"
            if any(t.grad is not None for t in leaves[:3]):
                tail += " (and its .grad)"
            search = find_holders([root], time_budget_s=self.config.census_time_budget_s, ignore=self._ignore)
            holders += [f"{p.path} -> autograd graph -> {tail}" for p in search.paths[:2]]
            del root
        return holders + self.holders_of(targets)[: max(0, 5 - len(holders))]

    def holders_of(self, tensors: list[Any]) -> list[str]:
        from memcallbacks.leaks.census import find_holders

        if not tensors:
            return []
        search = find_holders(tensors, time_budget_s=self.config.census_time_budget_s, ignore=self._ignore)
        return [str(p) for p in search.paths[:5]]

    def _census(self, batch: Any) -> Any:
        """:meth:`census` for the detectors' own use: a failure only costs the holders."""
        try:
            return self.census(batch)
        except Exception:
            log.debug("census failed", exc_info=True)
            return None

    def census(self, batch: Any = None) -> Any:
        """A census now (for ``explain()``)."""
        from memcallbacks.leaks.census import take_census

        return take_census(
            model=self.model,
            optimizer=self.optimizer,
            current_batch=batch,
            time_budget_s=self.config.census_time_budget_s,
            ignore=self._ignore,
        )


_LIGHTNING_STRATEGIES = {
    "SingleDeviceStrategy": "single",
    "SingleDeviceXLAStrategy": "single",
    "DDPStrategy": "ddp",
    "FSDPStrategy": "fsdp",
    "ModelParallelStrategy": "fsdp2",
}


def strategy_name(strategy: Any) -> str | None:
    """Map a Lightning strategy object to :func:`memcallbacks.estimate.estimate`'s names (None: detect from the model)."""
    name = type(strategy).__name__
    if name in _LIGHTNING_STRATEGIES:
        return _LIGHTNING_STRATEGIES[name]
    if name == "DeepSpeedStrategy":
        stage = (getattr(strategy, "config", None) or {}).get("zero_optimization", {}).get("stage", 0)
        return f"zero{stage}" if stage in (1, 2, 3) else "ddp"
    return None


def hidden_state_bytes(model: Any) -> int:
    """Bytes of model state that exist once the model is wrapped but that no parameter, ``.grad`` or
    optimizer state shows: DDP's gradient buckets (one per trainable gradient, allocated by the
    reducer when ``DistributedDataParallel`` is built; with ``gradient_as_bucket_view`` the grads
    become views of them later)."""
    if type(model).__name__ != "DistributedDataParallel":
        return 0
    return sum(p.numel() * p.element_size() for p in model.parameters() if p.requires_grad)


class StateCheck:
    """Measured baseline against theory, once, at the first step after the first optimizer step."""

    def __init__(self, config: MonitorConfig) -> None:
        self.config = config
        self.model: Any = None
        self.optimizer: Any = None
        self.precision: str | None = None
        self.strategy: str | None = None
        self.world_size: int | None = None
        self.done = False
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
        from memcallbacks.estimate import measure_model_states

        self.model, self.optimizer = model, optimizer
        self.precision, self.strategy, self.world_size = precision, strategy, world_size
        self.done = False
        self._start_allocated = None
        if model is not None:
            # what already existed when measuring started (params, and state of a resumed run)
            self._start_states = measure_model_states(model, optimizer).get("total", 0) + hidden_state_bytes(model)
            self._start_allocated = allocated_now() if allocated_now is not None else None

    @property
    def wanted(self) -> bool:
        return self.config.estimate_model_states and not self.done and self.model is not None

    def check(self, step: int, baseline: int, start_allocated: int, device_kind: str, batch: Any) -> Finding | None:
        from memcallbacks.estimate import estimate_for, measure_model_states

        self.done = True
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
        expected["buffers"] = int(est.device_buffers)
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

    def unexplained(self, baseline: float) -> float | None:
        if self.expected_level is None or baseline != baseline:
            return None
        return baseline - self.expected_level - self.batch_bytes
