"""The live theory check: the step-start baseline against what params, grads and optimizer state should take."""

from __future__ import annotations

from typing import Any, Callable

from memcallbacks._base.config import MonitorConfig
from memcallbacks._base.findings import Finding
from memcallbacks._base.units import format_bytes
from memcallbacks.estimate.measure import estimate_for, hidden_state_bytes, measure_model_states
from memcallbacks.leaks.tensors import batch_bytes

__all__ = ["StateCheck"]


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
        self.model, self.optimizer = model, optimizer
        self.precision, self.strategy, self.world_size = precision, strategy, world_size
        self.done = False
        if model is not None:
            # what already existed when measuring started (params, and state of a resumed run)
            self._start_states = measure_model_states(model, optimizer).get("total", 0) + hidden_state_bytes(model)
            self._start_allocated = allocated_now() if allocated_now is not None else None

    @property
    def wanted(self) -> bool:
        return self.config.estimate_model_states and not self.done and self.model is not None

    def check(self, step: int, baseline: int, start_allocated: int, device_kind: str, batch: Any) -> Finding | None:
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

    def unexplained(self, baseline: float) -> float | None:
        if self.expected_level is None or baseline != baseline:
            return None
        return baseline - self.expected_level - self.batch_bytes
