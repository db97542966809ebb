"""Several estimates side by side (``compare``), one per strategy and world size (``estimate_grid``)."""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

from torch import nn

from memcallbacks.estimate.compute import estimate
from memcallbacks.estimate.result import MemoryEstimate
from memcallbacks.estimate.tables import unit_scale, canonical_strategy

if TYPE_CHECKING:  # pragma: no cover
    import pandas as pd

__all__ = ["compare", "estimate_grid"]


_COMPARE_ROWS = (
    ("device/params", lambda e: e.device_params),
    ("device/grads", lambda e: e.device_grads),
    ("device/optimizer", lambda e: e.device_optimizer),
    ("device/comm_buffers", lambda e: e.device_comm_buffers),
    ("device/steady", lambda e: e.device_steady),
    ("device/forward_peak", lambda e: e.device_forward_peak),
    ("device/backward_peak", lambda e: e.device_backward_peak),
    ("device/optimizer_peak", lambda e: e.device_optimizer_peak),
    ("device/peak", lambda e: e.device_peak),
    ("host/params", lambda e: e.host_params),
    ("host/grads", lambda e: e.host_grads),
    ("host/optimizer", lambda e: e.host_optimizer),
    ("host/init", lambda e: e.host_init),
    ("host/steady", lambda e: e.host_steady),
    ("host/peak", lambda e: e.host_peak),
    ("host/peak_per_node", lambda e: e.host_peak_per_node),
)


def compare(estimates: Iterable[MemoryEstimate] | Mapping[str, MemoryEstimate], *, unit: str = "GiB") -> pd.DataFrame:
    """Several estimates side by side: one column per configuration, one row per quantity.

    Row names carry the unit (``"device/steady (GiB)"``). Columns are the estimates' labels, or
    the mapping's keys.
    """
    import pandas as pd

    scale = unit_scale(unit, "compare")
    items = list(estimates.items()) if isinstance(estimates, Mapping) else [(e.label, e) for e in estimates]
    columns: dict[str, list[float]] = {}
    for label, est in items:
        name, n = label, 2
        while name in columns:
            name, n = f"{label} #{n}", n + 1
        columns[name] = [getter(est) if scale == 1 else getter(est) / scale for _, getter in _COMPARE_ROWS]
    return pd.DataFrame(columns, index=[f"{row} ({unit})" for row, _ in _COMPARE_ROWS])


def estimate_grid(
    model: nn.Module | None = None,
    *,
    strategies: Sequence[str],
    world_sizes: Sequence[int],
    **kwargs: Any,
) -> list[MemoryEstimate]:
    """One :func:`estimate` per strategy and world size (``"single"`` once, at world size 1).

    ``offload_optimizer`` / ``offload_param`` in ``kwargs`` apply only to the strategies that
    support them, so a grid can mix ``"ddp"`` with ``"zero3"`` and offload.
    """
    out: list[MemoryEstimate] = []
    offload_optimizer = kwargs.pop("offload_optimizer", False)
    offload_param = kwargs.pop("offload_param", False)
    for strategy in strategies:
        canonical = canonical_strategy(strategy, "estimate_grid")
        sizes = [1] if canonical == "single" else list(world_sizes)
        for size in sizes:
            extra = dict(kwargs)
            if canonical.startswith("zero"):
                extra["offload_optimizer"] = offload_optimizer
            if offload_param and canonical in ("zero3", "fsdp", "fsdp2"):
                extra["offload_param"] = True
            if canonical == "single":
                extra.pop("ranks_per_node", None)
            out.append(estimate(model, strategy=canonical, world_size=size, **extra))
    return out
