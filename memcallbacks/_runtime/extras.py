"""The logged keys a run adds to the engine's: findings, the monitor's overhead, the theory check,
snapshots and garbage collection, with the same keys on every rank and every logged step."""

from __future__ import annotations

from typing import Any

from memcallbacks._base.columns import ALLOCATED
from memcallbacks._base.units import GiB

__all__ = ["extra_metrics"]


def extra_metrics(
    config: Any, row: list[Any] | None, *, findings: int, overhead: float, preflight: Any, capacity: float | None,
    state: Any, snap: Any, last_gc: dict[str, Any] | None, host: dict[str, float] | None = None,
) -> dict[str, float]:
    """``capacity``: the device's bytes where the dashboard shows a capacity line (else None);
    ``preflight``/``state``/``snap``: the run's pre-flight check, theory check and snapshot policy;
    ``host``: the host channel's latest figures (docs/host.md), None where it is off."""
    p = config.prefix
    nan = float("nan")
    extra = {f"{p}/findings": float(findings), f"{p}/overhead": overhead}
    extra.update(preflight.metrics(row))
    if capacity is not None:
        extra[f"{p}/capacity_GiB"] = float(capacity or 0) / GiB
    if config.estimate_model_states:
        unexplained = state.unexplained(float(row[ALLOCATED])) if row is not None else None
        extra[f"{p}/expected_GiB"] = state.expected_states / GiB if state.expected_level is not None else nan
        extra[f"{p}/unexplained_GiB"] = unexplained / GiB if unexplained is not None else nan
    if snap is not None or config.auto_snapshot:
        extra[f"{p}/snapshots"] = float(len(snap.records)) if snap is not None else nan
    if config.watch_host:  # off: no host keys at all (rather than NaN columns)
        host = host or {}
        for key, name in (("host_python_bytes", "host_python_GiB"), ("host_private_bytes", "host_private_GiB"),
                          ("host_worker_uss_bytes", "host_workers_GiB")):
            value = host.get(key)
            extra[f"{p}/{name}"] = value / GiB if value is not None else nan
    if config.gc_every_n_steps:
        extra[f"{p}/gc_time_ms"] = last_gc["seconds"] * 1e3 if last_gc else nan
        extra[f"{p}/gc_collected"] = float(last_gc["collected"]) if last_gc else nan
        extra[f"{p}/gc_freed_GiB"] = (last_gc["bytes_freed"] or 0) / GiB if last_gc else nan
    return extra
