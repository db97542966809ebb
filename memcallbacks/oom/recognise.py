"""Recognise an out-of-memory error from any device, and the bytes it asked for when the message says.

The allocators' own words (torch 2.13's sources):

- CPU, ``c10/core/impl/alloc_cpu.cpp``: ``DefaultCPUAllocator: can't allocate memory: you tried to allocate N bytes.
  Error code 12 (...)`` (``not enough memory`` on Windows and Android), a ``RuntimeError`` that says neither "out of
  memory" nor is an ``OutOfMemoryError``; a C++ container's ``std::bad_alloc`` reaches Python as
  ``RuntimeError("std::bad_alloc")`` (``torch/csrc/Exceptions.h``) or as ``MemoryError`` (pybind11).
- oneDNN (``oneapi/dnnl/dnnl.hpp``): ``could not create a primitive``, ``could not create a memory object``,
  ``could not execute a primitive``. ``dnnl::error`` keeps its status (``dnnl_out_of_memory``) out of the message,
  and the same words also mean an unsupported case (pytorch/pytorch#89104), so they count as out of memory only
  when memory was short when they were raised (:func:`memory_short`).
- CUDA, ``c10/cuda/CUDACachingAllocator.cpp``: ``torch.OutOfMemoryError("CUDA out of memory. Tried to allocate
  2.00 GiB. GPU 0 has a total capacity of ...")`` (``HIP`` on ROCm, ``Tried to allocate more than 1EB memory.``
  for an absurd size); ``CUDAMallocAsyncAllocator.cpp`` (``backend:cudaMallocAsync``): ``torch.OutOfMemoryError(
  "Allocation on device 0 would exceed allowed memory. (out of memory)\\nCurrently allocated : ...\\nRequested : ...")``.
  Outside the allocator: ``CUDA error: out of memory`` (``torch.AcceleratorError``, a ``RuntimeError``: a context,
  a kernel's own allocation), ``CUBLAS_STATUS_ALLOC_FAILED`` (``cublasCreate``), ``CUSOLVER_STATUS_ALLOC_FAILED``,
  ``CUFFT_ALLOC_FAILED``, ``CUDNN_STATUS_ALLOC_FAILED``, NCCL's ``Cuda failure 'out of memory'``.
- XPU (``c10/xpu/XPUCachingAllocator.cpp``): ``torch.OutOfMemoryError("XPU out of memory. Tried to allocate ...")``;
  another ``PrivateUse1`` backend names itself the same way (``MLU out of memory``).
- MPS, ``aten/src/ATen/mps/MPSAllocator.mm``: ``RuntimeError("MPS backend out of memory (MPS allocated: ...,
  other allocations: ..., max allowed: ...). Tried to allocate 256.00 MiB on private pool. ...")``.
"""

from __future__ import annotations

import os
import re

import torch

from memcallbacks.oom.accounting import address_space_left, address_space_limit

__all__ = ["is_oom", "oom_source", "requested_bytes", "memory_short"]

_CPU = re.compile(r"DefaultCPUAllocator: (?:can't allocate memory|not enough memory)", re.IGNORECASE)
_MPS = re.compile(r"MPS backend out of memory", re.IGNORECASE)
_ONEDNN = re.compile(r"^could not (?:create a primitive|create a memory object|execute a primitive)$")
_CUDA_LIBRARIES = re.compile(r"CUBLAS_STATUS_ALLOC_FAILED|CUSOLVER_STATUS_ALLOC_FAILED|CUFFT_ALLOC_FAILED|CUDNN_STATUS_ALLOC_FAILED"
                             r"|CUSPARSE_STATUS_ALLOC_FAILED")
_DEVICE = re.compile(r"\b([A-Z][A-Z0-9]*)(?: error:)? out of memory")  # "CUDA out of memory", "CUDA error: out of memory", "XPU ..."
_SIZES = (
    re.compile(r"you tried to allocate (\d+) bytes", re.IGNORECASE),  # CPU: exact bytes
    re.compile(r"Tried to allocate ([0-9.]+) ?([KMGT]i?B|bytes)", re.IGNORECASE),  # CUDA, XPU, MPS: rounded by format_size
    re.compile(r"Requested\s*: ([0-9.]+) ?([KMGT]i?B|bytes)"),  # cudaMallocAsync
)
_UNITS = {"bytes": 1, "b": 1, "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40, "kb": 2**10, "mb": 2**20, "gb": 2**30, "tb": 2**40}
_SHORT_SHARE = 0.10  # memory_short(): less than this share of the limit left
_SHORT_BYTES = 256 << 20  # ... or less than this


def _text(exc: BaseException) -> str:
    try:
        return str(exc)
    except Exception:  # a user exception whose __str__ raises is not an OOM either
        return ""


def oom_source(exc: BaseException) -> str | None:
    """Which allocator ran out, or None: ``"cuda"``, ``"xpu"``, ``"hip"`` and other accelerators by the name their
    message gives, ``"mps"``, ``"cpu"`` (the CPU allocator, ``std::bad_alloc``), ``"onednn"`` (its allocation
    failures, while memory is short), ``"host"`` for ``MemoryError``, ``"device"`` for another "out of memory"."""
    text = _text(exc)
    oom_type = getattr(torch, "OutOfMemoryError", None)
    if oom_type is not None and isinstance(exc, oom_type):
        named = _DEVICE.search(text)
        return named.group(1).lower() if named else "cuda"  # cudaMallocAsync's message names no device type
    if isinstance(exc, MemoryError):
        return "host"
    if not isinstance(exc, RuntimeError):
        return None
    if _CPU.search(text) or text.strip() == "std::bad_alloc":
        return "cpu"
    if _MPS.search(text):
        return "mps"
    if _CUDA_LIBRARIES.search(text):
        return "cuda"
    if _ONEDNN.match(text.strip()) and memory_short():
        return "onednn"
    if "out of memory" in text.lower():
        named = _DEVICE.search(text)
        return named.group(1).lower() if named else "device"
    return None


def is_oom(exc: BaseException) -> bool:
    """True for torch's ``OutOfMemoryError`` (CUDA, XPU, ...), ``MemoryError``, and the CPU, MPS, oneDNN and CUDA
    libraries' allocation failures (the module's docstring lists their words)."""
    return oom_source(exc) is not None


def memory_short() -> bool:
    """Whether the host is close to a limit now: under ``RLIMIT_AS`` little address space left, the memory cgroup
    (v2) near its ``memory.max``, or little ``MemAvailable``: less than 10% of the limit, or than 256 MiB, left.
    Read while the error unwinds, when the failed step's memory is still held."""
    for used, limit in (_address_space(), _cgroup(), _meminfo()):
        if used is not None and limit:
            left = limit - used
            if left < max(_SHORT_BYTES, int(_SHORT_SHARE * limit)):
                return True
    return False


def _address_space() -> tuple[int | None, int | None]:
    limit, left = address_space_limit(), address_space_left()
    return (None, None) if limit is None or left is None else (limit - left, limit)


def _read_int(path: str) -> int | None:
    try:
        with open(path) as fh:
            text = fh.read().strip()
    except OSError:
        return None
    return int(text) if text.isdigit() else None


def _cgroup() -> tuple[int | None, int | None]:
    """This process's memory cgroup: usage and limit (v2 ``memory.current``/``memory.max``, v1 ``memory.usage_in_bytes``/
    ``memory.limit_in_bytes``); None where unlimited or unknown."""
    try:
        with open("/proc/self/cgroup") as fh:
            lines = [line.strip().split(":", 2) for line in fh]
    except OSError:
        return None, None
    for _, controllers, path in (parts for parts in lines if len(parts) == 3):
        if controllers == "":
            folder, files = os.path.join("/sys/fs/cgroup", path.lstrip("/")), ("memory.current", "memory.max")
        elif "memory" in controllers.split(","):
            folder, files = os.path.join("/sys/fs/cgroup/memory", path.lstrip("/")), ("memory.usage_in_bytes", "memory.limit_in_bytes")
        else:
            continue
        used, limit = (_read_int(os.path.join(folder, name)) for name in files)
        if used is not None and limit is not None and limit < 1 << 60:  # v1 writes "unlimited" as a huge number
            return used, limit
    return None, None


def _meminfo() -> tuple[int | None, int | None]:
    fields: dict[str, int] = {}
    try:
        with open("/proc/meminfo") as fh:
            for line in fh:
                name, _, rest = line.partition(":")
                if name in ("MemTotal", "MemAvailable"):
                    fields[name] = int(rest.split()[0]) * 1024
    except (OSError, ValueError, IndexError):
        return None, None
    total, available = fields.get("MemTotal"), fields.get("MemAvailable")
    return (None, None) if total is None or available is None else (total - available, total)


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
