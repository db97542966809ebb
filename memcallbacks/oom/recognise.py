"""Recognise an out-of-memory error from any device, and the bytes it asked for when the message says."""

from __future__ import annotations

import re

import torch

__all__ = ["is_oom", "oom_source", "requested_bytes"]

# the allocators' own words (torch 2.13): c10/core/impl/alloc_cpu.cpp, c10/cuda/CUDACachingAllocator.cpp,
# aten/src/ATen/mps/MPSAllocator.mm; the CPU one says neither "out of memory" nor raises OutOfMemoryError
_CPU = re.compile(r"DefaultCPUAllocator: (?:can't|not enough memory)", re.IGNORECASE)
_MPS = re.compile(r"MPS backend out of memory", re.IGNORECASE)
_SIZES = (
    re.compile(r"you tried to allocate (\d+) bytes", re.IGNORECASE),  # CPU: exact bytes
    re.compile(r"Tried to allocate ([0-9.]+) ?([KMGT]i?B|bytes)", re.IGNORECASE),  # CUDA, XPU, MPS: rounded by format_size
)
_UNITS = {"bytes": 1, "b": 1, "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40, "kb": 2**10, "mb": 2**20, "gb": 2**30, "tb": 2**40}


def _text(exc: BaseException) -> str:
    try:
        return str(exc)
    except Exception:  # a user exception whose __str__ raises is not an OOM either
        return ""


def oom_source(exc: BaseException) -> str | None:
    """Which allocator ran out (``"cuda"``, ``"xpu"``, ``"mps"``, ``"cpu"``, ``"host"`` for ``MemoryError``), or None."""
    text = _text(exc)
    oom_type = getattr(torch, "OutOfMemoryError", None)
    if oom_type is not None and isinstance(exc, oom_type):
        return "xpu" if "XPU" in text else "cuda"
    if isinstance(exc, MemoryError):
        return "host"
    if not isinstance(exc, RuntimeError):
        return None
    if _CPU.search(text):
        return "cpu"
    if _MPS.search(text):
        return "mps"
    return "device" if "out of memory" in text.lower() else None


def is_oom(exc: BaseException) -> bool:
    """True for torch's ``OutOfMemoryError`` (CUDA, XPU), ``MemoryError``, and the CPU and MPS allocators' errors."""
    return oom_source(exc) is not None


def requested_bytes(exc: BaseException) -> int | None:
    """The allocation that failed, when the message gives it (exact on CPU, 2 decimals of a unit elsewhere)."""
    text = _text(exc)
    for pattern in _SIZES:
        match = pattern.search(text)
        if match is None:
            continue
        if len(match.groups()) == 1:
            return int(match.group(1))
        return int(float(match.group(1)) * _UNITS[match.group(2).lower()])
    return None
