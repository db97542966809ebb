"""Every private PyTorch API memcallbacks touches lives here, behind one signature each."""

from __future__ import annotations

import logging
from typing import Any, Callable

import torch

log = logging.getLogger(__name__)

__all__ = ["cuda_stats_reader", "cuda_peak_resetter"]


def cuda_stats_reader(index: int) -> Callable[[], dict[str, Any]]:
    """Return a zero-argument callable giving CUDA allocator stats as torch's *nested* dict.

    ``torch.cuda.memory_stats()`` flattens the nested dict in Python on every call (and
    ``torch.cuda.memory_allocated()`` builds that whole flat dict to read one number); the C
    binding returns the nested dict directly, which is several times cheaper. The public API is
    the fallback when the binding is missing or changes name.
    """
    raw = getattr(torch._C, "_cuda_memoryStats", None)
    if raw is not None:
        try:
            stats = raw(index)
            stats["allocated_bytes"]["all"]["current"]
            return lambda: raw(index)
        except Exception:  # pragma: no cover - depends on torch build
            log.debug("torch._C._cuda_memoryStats unusable; using torch.cuda.memory_stats", exc_info=True)
    return lambda: _unflatten(torch.cuda.memory_stats(index))


def cuda_peak_resetter(index: int) -> Callable[[], None]:
    """Return a zero-argument callable resetting the CUDA allocator's peak statistics."""
    raw = getattr(torch._C, "_cuda_resetPeakMemoryStats", None)
    if raw is not None:
        return lambda: raw(index)
    return lambda: torch.cuda.reset_peak_memory_stats(index)


def _unflatten(flat: dict[str, Any]) -> dict[str, Any]:
    nested: dict[str, Any] = {}
    for key, value in flat.items():
        node = nested
        parts = key.split(".")
        for part in parts[:-1]:
            node = node.setdefault(part, {})
        node[parts[-1]] = value
    return nested
