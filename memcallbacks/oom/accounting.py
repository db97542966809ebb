"""What filled the memory at an OOM: categories from their own sources, adding up to the device total.

- parameters, gradients, optimizer state: the model's and the optimizer's tensors, exactly;
- the batch and this step's activations and temporaries: the tensors the failing call's frames
  hold, and what their autograd graphs saved;
- held from earlier steps: the step-start floor's rise since the first steps (the monitor's history);
- CUDA: reserved by PyTorch but not allocated (cached blocks), memory outside PyTorch's allocator
  (the CUDA context, other processes), the largest free block (``torch.cuda.memory_snapshot``);
- the rest of the device's figure, named for what it is on that device.
"""

from __future__ import annotations

import dataclasses
import mmap
import os
import resource
from types import FrameType
from typing import Any, Iterable

import torch
from torch import nn

from memcallbacks._base.cpu import FIXED_MMAP_THRESHOLD, heap_in_use_bytes
from memcallbacks._base.storage import storage_keys
from memcallbacks.leaks.tensors import graph_tensors, iter_tensors
from memcallbacks.oom.where import Where

__all__ = ["Accounting", "account", "model_state_bytes", "expandable_segments_on", "address_space_left", "heap_kind"]


@dataclasses.dataclass
class Accounting:
    """The device's figure at the failure and what it is made of (``categories``: name -> bytes, adding up to ``figure_bytes``)."""

    device: str
    figure_bytes: int
    figure: str
    """What the figure is: ``"device memory in use (total - free)"``, ``"address space in use (VmSize)"``, ``"resident set"``."""
    categories: dict[str, int]
    capacity_bytes: int | None = None
    capacity_source: str = ""
    requested_bytes: int | None = None
    largest_free_block_bytes: int | None = None
    """CUDA: the largest cached block free for reuse."""
    reserved_unallocated_bytes: int | None = None
    expandable_segments: bool = False
    floor_rise_bytes: int = 0
    floor_steps: tuple[int, int] | None = None
    reserve_held: bool = False
    """CPU: the monitor's address-space reserve was mapped when the figure was read (it is in the process's share)."""
    heap: str = ""
    """CPU: ``"glibc, adaptive mmap threshold"`` (glibc's default: freed blocks under 32 MiB stay in its heap),
    ``"glibc, fixed mmap threshold"``, or ``""`` (another allocator, or not the host)."""
    notes: list[str] = dataclasses.field(default_factory=list)

    @property
    def step_bytes(self) -> int:
        """This step's own memory: its batch, activations and temporaries."""
        return self.categories.get("batch", 0) + self.categories.get("activations and temporaries", 0)

    def to_dict(self) -> dict[str, Any]:
        out = dataclasses.asdict(self)
        out["floor_steps"] = list(self.floor_steps) if self.floor_steps else None
        return out


class _Counter:
    """Distinct storages on one device type, each counted once across categories."""

    def __init__(self, device_type: str) -> None:
        self.device_type = device_type
        self.seen: set[Any] = set()

    def add(self, tensors: Iterable[Any]) -> int:
        total = 0
        for t in tensors:
            if not isinstance(t, torch.Tensor) or t.device.type != self.device_type:
                continue
            for key, nbytes in storage_keys(t):
                if key not in self.seen:
                    self.seen.add(key)
                    total += nbytes
        return total


def _state_tensors(optimizer: Any) -> list[Any]:
    out: list[Any] = []
    for opt in optimizer if isinstance(optimizer, (list, tuple)) else [optimizer]:
        state = getattr(opt, "state", None)
        if isinstance(state, dict):
            for per_param in state.values():
                out += [v for v in (per_param.values() if isinstance(per_param, dict) else ()) if isinstance(v, torch.Tensor)]
    return out


def model_state_bytes(model: nn.Module | None, optimizer: Any, device_type: str, counter: _Counter | None = None) -> dict[str, int]:
    """Parameters (and buffers), gradients and optimizer state on ``device_type``, each storage once."""
    counter = counter or _Counter(device_type)
    params = list(model.parameters()) + list(model.buffers()) if model is not None else []
    out = {"parameters": counter.add(params)}
    out["gradients"] = counter.add(p.grad for p in params if getattr(p, "grad", None) is not None)
    out["optimizer state"] = counter.add(_state_tensors(optimizer)) if optimizer is not None else 0
    return out


def _frame_tensors(frames: Iterable[FrameType]) -> list[Any]:
    """Tensors in the frames' locals (containers followed) and what their autograd graphs saved."""
    found: list[Any] = []
    for frame in frames:
        for value in list(frame.f_locals.values()):
            if isinstance(value, nn.Module):
                continue  # its parameters are counted; its attributes are not this step's
            found.extend(iter_tensors(value, max_depth=4, max_items=10_000))
    graphs = [t for t in found if getattr(t, "grad_fn", None) is not None]
    found.extend(t for t, _how in graph_tensors(graphs))
    return found


def _step_frames(exc: BaseException) -> list[FrameType]:
    """The traceback's frames from the step's own call down: the outermost module call (forward), or
    ``Tensor.backward``, or the optimizer's ``step``. The training loop's frame above them is left out:
    what it holds from earlier steps is the floor's rise, not this step's memory."""
    frames, tb = [], exc.__traceback__
    while tb is not None:
        frames.append(tb.tb_frame)
        tb = tb.tb_next
    for i, frame in enumerate(frames):
        code = frame.f_code
        owner = frame.f_locals.get("self")
        if (code.co_name in ("_call_impl", "_wrapped_call_impl") and isinstance(owner, nn.Module)) or (
                code.co_name == "backward" and isinstance(owner, torch.Tensor)) or (
                code.co_name == "step" and isinstance(owner, torch.optim.Optimizer)):
            return frames[i:]
    # none (the loop's own code failed, or a training_step's outside the model's call): a LightningModule's step method
    # and what it called, else only torch's own frames innermost (a torch function's operands); never the loop's frame
    for i, frame in enumerate(frames):
        if isinstance(frame.f_locals.get("self"), nn.Module):
            return frames[i:]
    inner = len(frames)
    while inner > 0 and f"{os.sep}torch{os.sep}" in frames[inner - 1].f_code.co_filename:
        inner -= 1
    return frames[inner:]


def _proc_status(field: str) -> int | None:
    try:
        with open("/proc/self/status") as fh:
            for line in fh:
                if line.startswith(field + ":"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def address_space_limit() -> int | None:
    """``RLIMIT_AS``'s soft limit when one is set (where a CPU allocation fails first), else None."""
    try:
        soft = resource.getrlimit(resource.RLIMIT_AS)[0]
    except (OSError, ValueError, AttributeError):
        return None
    return None if soft == resource.RLIM_INFINITY else int(soft)


def _address_space() -> tuple[int, int] | None:
    """``(in use (VmSize), RLIMIT_AS)`` in bytes; None without a limit, or where ``/proc`` cannot say."""
    limit = address_space_limit()
    vm = _proc_status("VmSize") if limit is not None else None
    return None if vm is None or limit is None else (vm, limit)


def address_space_left() -> int | None:
    """Bytes of address space left under ``RLIMIT_AS`` (None without a limit, or where ``/proc`` cannot say)."""
    space = _address_space()
    return None if space is None else max(0, space[1] - space[0])


#: Address space a CPU run's monitor keeps under an ``RLIMIT_AS`` (mapped, never touched: no resident memory) and
#: releases when an OOM unwinds: the explanation's own objects (the fake step's replay) need room the failed step left none of.
RESERVE_BYTES = 32 << 20
_reserve: list[mmap.mmap] = []
_holds = [0]  # the runs holding the reserve: two monitors in one process share one mapping


def hold_reserve() -> None:
    """Keep :data:`RESERVE_BYTES` of address space under an address-space limit (one mapping per process)."""
    _holds[0] += 1
    if _reserve or address_space_limit() is None:
        return
    try:
        _reserve.append(mmap.mmap(-1, RESERVE_BYTES, flags=mmap.MAP_PRIVATE))
    except (OSError, ValueError):  # no room even for that: the explanation does without
        pass


def release_reserve(*, now: bool = False) -> int:
    """A run's hold given back (the mapping goes with the last hold); ``now``: unmapped at once, for an OOM's
    explanation. Returns the bytes unmapped (0 when none were)."""
    if not now:
        _holds[0] = max(0, _holds[0] - 1)
        if _holds[0]:
            return 0
    if not _reserve:
        return 0
    _reserve.pop().close()
    return RESERVE_BYTES


def expandable_segments_on() -> bool:
    """Whether the CUDA caching allocator was configured with ``expandable_segments:True``."""
    conf = (os.environ.get("PYTORCH_CUDA_ALLOC_CONF", "") + "," + os.environ.get("PYTORCH_ALLOC_CONF", "")).replace(" ", "")
    return "expandable_segments:True" in conf or "expandable_segments:true" in conf


def _largest_free_block(index: int) -> int | None:
    """The largest ``inactive`` block of the caching allocator's segments on device ``index`` (torch/cuda/memory.py)."""
    try:
        try:
            segments = torch.cuda.memory_snapshot(include_traces=False)
        except TypeError:  # torch before include_traces
            segments = torch.cuda.memory_snapshot()
    except Exception:
        return None
    sizes = [b.get("size", 0) for s in segments if s.get("device", index) == index
             for b in s.get("blocks", ()) if b.get("state") == "inactive"]
    return int(max(sizes)) if sizes else 0


def _floor(floor: tuple[int, int, int, int] | None, batch: int, acc: Accounting, now: int | None = None) -> int:
    """Held from earlier steps: the step-start floor's rise, less this step's batch (alive at step start too).
    ``now``: the allocator's count less this step's own tensors, where the step's start was not read (a step the
    monitor did not measure): a leak keeps growing after the last measured step, up to the failure."""
    if floor is None:
        return 0
    then_step, then_bytes, now_step, now_bytes = floor
    if now is not None and now + batch > now_bytes:  # ``now`` holds no batch, a step start's does: the same footing
        now_bytes = now + batch
    acc.floor_steps = (then_step, now_step)
    acc.floor_rise_bytes = max(0, now_bytes - then_bytes)
    return max(0, acc.floor_rise_bytes - batch)


def account(
    exc: BaseException, where: Where, *, model: nn.Module | None, optimizer: Any, device: torch.device | None,
    floor: tuple[int, int, int, int] | None = None, capacity: int | None = None, capacity_source: str = "",
    requested: int | None = None, step_start: int | None = None, device_capacity: int | None = None,
) -> Accounting:
    """The categories at the failure. ``step_start``: the allocator's count when this step (or the one before) started, when
    measured; ``floor``: ``(step, bytes)`` at the first steps' start and at the
    latest step's start, from the monitor's history; ``capacity``: what the device holds (or the user says)."""
    device = device or torch.device("cpu")
    counter = _Counter(device.type)
    cats = model_state_bytes(model, optimizer, device.type, counter)
    cats["batch"] = counter.add(iter_tensors(where.call)) if where.call is not None else 0
    walked = counter.add(_frame_tensors(_step_frames(exc)))
    acc = Accounting(device=device.type, figure_bytes=0, figure="", categories=cats, requested_bytes=requested)
    # the allocator's own count since this step started (a measured step) also sees what no frame
    # reaches: gradients in flight in the autograd engine, a kernel's workspace
    # (a temporary of an expression, ``a.softmax(-1) @ v``, is on no frame and in no graph yet)
    rise = _allocated_now(device) - step_start - cats["batch"] if step_start is not None else None
    if rise is not None and rise > walked:
        acc.notes.append(f"this step's activations and temporaries are the allocator's rise since the step started "
                         f"({rise} bytes); its frames and autograd graph reach {walked} bytes of them")
    cats["activations and temporaries"] = max(walked, rise or 0)
    unread = step_start is None and where.phase != "backward"  # backward: autograd's buffers in flight are on no frame
    now = _allocated_now(device) - sum(cats.values()) + cats["parameters"] + cats["optimizer state"] if unread else None
    cats["held from earlier steps"] = _floor(floor, cats["batch"], acc, now)
    if device.type == "cuda":
        _cuda_figure(acc, device)
    else:
        _host_figure(acc)
    if capacity is not None:
        acc.capacity_bytes, acc.capacity_source = int(capacity), capacity_source
    elif acc.capacity_bytes is None and device_capacity:
        acc.capacity_bytes, acc.capacity_source = int(device_capacity), "host RAM" if device.type == "cpu" else "device capacity"
    return acc


def _allocated_now(device: torch.device) -> int:
    if device.type == "cuda":
        return int(torch.cuda.memory_allocated(device))
    return heap_in_use_bytes() or 0


def _rest(acc: Accounting, name: str) -> None:
    counted = sum(acc.categories.values())
    if counted > acc.figure_bytes:
        acc.notes.append(f"the categories count {counted - acc.figure_bytes} bytes more than the figure: "
                         "the floor's rise overlaps memory counted in this step")
    acc.categories[name] = max(0, acc.figure_bytes - counted)


def heap_kind() -> str:
    """How glibc's malloc places freed memory: ``"glibc, fixed mmap threshold"`` (``mallopt``, ``cpu_mmap_threshold``,
    ``MALLOC_MMAP_THRESHOLD_`` or its tunable), ``"glibc, adaptive mmap threshold"``, or ``""`` where there is no glibc."""
    if heap_in_use_bytes() is None:
        return ""
    fixed = FIXED_MMAP_THRESHOLD[0] is not None or "MALLOC_MMAP_THRESHOLD_" in os.environ or \
        "malloc.mmap_threshold" in os.environ.get("GLIBC_TUNABLES", "")
    return "glibc, fixed mmap threshold" if fixed else "glibc, adaptive mmap threshold"


def _host_figure(acc: Accounting) -> None:
    """CPU: under an address-space limit the figure that hit it (``VmSize``) and the limit; else the resident set."""
    acc.reserve_held, acc.heap = bool(_reserve), heap_kind()
    space = _address_space()
    if space is not None:
        vm, limit = space
        acc.figure_bytes, acc.figure = vm, "address space in use (VmSize)"
        acc.capacity_bytes, acc.capacity_source = limit, "RLIMIT_AS"
        _rest(acc, "the process (interpreter, libraries, allocator's free lists, thread stacks)")
        return
    rss = _proc_status("VmRSS")
    acc.figure_bytes, acc.figure = rss or sum(acc.categories.values()), "resident set (VmRSS)"
    _rest(acc, "the process (interpreter, libraries, allocator's free lists)")


def _cuda_figure(acc: Accounting, device: torch.device) -> None:
    """CUDA (torch/cuda/memory.py): ``mem_get_info``'s total - free, split by ``memory_stats``' allocated and reserved.

    Under ``set_per_process_memory_fraction`` the allocator fails at the fraction of the total, counted
    in reserved bytes: then the figure is PyTorch's reserved memory and the capacity the fraction."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    free, total = torch.cuda.mem_get_info(index)
    stats = torch.cuda.memory_stats(index)
    allocated, reserved = int(stats.get("allocated_bytes.all.current", 0)), int(stats.get("reserved_bytes.all.current", 0))
    fraction = _memory_fraction(index)
    counted = sum(acc.categories.values())
    acc.categories["allocated, not reached from the failing step (autograd's buffers in flight, C++-held)"] = max(0, allocated - counted)
    acc.reserved_unallocated_bytes = max(0, reserved - allocated)
    acc.categories["reserved by PyTorch, not allocated (cached blocks)"] = acc.reserved_unallocated_bytes
    if fraction < 1.0:
        acc.figure_bytes, acc.figure = reserved, "reserved by PyTorch"
        acc.capacity_bytes, acc.capacity_source = int(total * fraction), f"per-process memory fraction {fraction:g}"
        acc.notes.append(f"outside PyTorch's allocator (CUDA context, other processes): {int(total - free) - reserved} bytes, "
                         "not under the fraction")
    else:
        acc.figure_bytes, acc.figure = int(total - free), "device memory in use (total - free)"
        acc.capacity_bytes, acc.capacity_source = int(total), "device total"
        acc.categories["outside PyTorch's allocator (CUDA context, other processes)"] = max(0, int(total - free) - reserved)
    acc.largest_free_block_bytes = _largest_free_block(index)
    acc.expandable_segments = expandable_segments_on()


def _memory_fraction(index: int) -> float:
    getter = getattr(torch.cuda, "get_per_process_memory_fraction", None)  # torch >= 2.8
    try:
        return float(getter(index)) if getter is not None else 1.0
    except Exception:
        return 1.0
