"""memcallbacks: see where training memory goes — per-phase peaks, leaks and their holders, snapshots.

``import memcallbacks`` imports no training framework; the adapters load lazily:
``memcallbacks.MemoryMonitor`` is the Lightning callback from :mod:`memcallbacks.lightning`,
``memcallbacks.Monitor`` the plain-PyTorch monitor from :mod:`memcallbacks.monitor`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from memcallbacks._base.version import __version__

from memcallbacks._base.config import MonitorConfig
from memcallbacks._base.options import AdvancedOptions, LeakOptions, SnapshotOptions
from memcallbacks._base.findings import Finding

if TYPE_CHECKING:  # pragma: no cover
    from memcallbacks.lightning import MemoryMonitor
    from memcallbacks.monitor import Monitor

__all__ = [
    "MonitorConfig", "LeakOptions", "SnapshotOptions", "AdvancedOptions", "Finding",
    "MemoryMonitor", "Monitor", "AccelerateMemoryMonitor", "MemoryMonitorCallback", "__version__",
]

_LAZY = {
    "MemoryMonitor": "memcallbacks.lightning",
    "Monitor": "memcallbacks.monitor",
    "AccelerateMemoryMonitor": "memcallbacks.accelerate",
    "MemoryMonitorCallback": "memcallbacks.transformers",
}


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'memcallbacks' has no attribute {name!r}")
    import importlib

    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
