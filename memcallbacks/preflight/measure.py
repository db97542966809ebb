"""Ground truth on CPU: one real step's allocated bytes per phase, from torch.profiler's events."""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from memcallbacks._base import torch_private as _tp
from memcallbacks.preflight._fake import batch_tensors

__all__ = ["measure_step", "live_bytes"]

_MARK = "memcallbacks.preflight.phase"


def live_bytes(model: nn.Module, optimizer: torch.optim.Optimizer | None, batch: Any) -> int:
    """Bytes of the distinct storages behind params, buffers, grads, optimizer state and the batch."""
    seen: dict[int, int] = {}

    def add(t: Any) -> None:
        if isinstance(t, torch.Tensor) and t.device.type != "meta":
            st = t.untyped_storage()
            seen[st.data_ptr()] = max(seen.get(st.data_ptr(), 0), st.nbytes())

    for p in model.parameters():
        add(p)
        add(p.grad)
    for b in model.buffers():
        add(b)
    if optimizer is not None:
        for state in optimizer.state.values():
            for v in state.values():
                add(v)
    for t in batch_tensors(batch):
        add(t)
    return sum(seen.values())


def measure_step(
    model: nn.Module,
    batch: Any,
    optimizer: torch.optim.Optimizer | None,
    forward_fn: Callable[[nn.Module, Any], torch.Tensor],
    *,
    autocast_dtype: torch.dtype | None = None,
    warmup_steps: int = 1,
) -> dict[str, int]:
    """Run ``warmup_steps`` real steps, then profile one: ``{"start", "forward", "backward", "optimizer"}`` bytes.

    A phase's value is its peak: the bytes alive at the step's start (counted from the objects, the
    profiler cannot see allocations made before it started) plus the largest running sum of the
    profiler's allocation events inside the phase. CPU only: the CPU allocator reports exact sizes.
    """
    from torch.profiler import ProfilerActivity, profile

    def autocast() -> contextlib.AbstractContextManager[Any]:
        return torch.autocast("cpu", dtype=autocast_dtype) if autocast_dtype is not None else contextlib.nullcontext()

    def step(mark: Callable[[], None]) -> None:
        mark()
        with autocast():
            loss = forward_fn(model, batch)
        mark()
        loss.backward()
        mark()
        if optimizer is not None:
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
        else:
            for p in model.parameters():
                p.grad = None
        del loss
        mark()

    def record() -> None:
        with torch.profiler.record_function(_MARK):
            pass

    for _ in range(warmup_steps):
        step(lambda: None)
    start = live_bytes(model, optimizer, batch)
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        step(record)
    events, marks = _tp.profiler_memory_events(prof, _MARK)
    if len(marks) != 4:
        raise RuntimeError(f"measure_step(): expected 4 phase marks in the profile, found {len(marks)}")
    out = {"start": start}
    running = 0
    i = 0
    events = [e for e in events if e.device_type == "cpu"]
    for phase, (lo, hi) in zip(("forward", "backward", "optimizer"), zip(marks, marks[1:])):
        while i < len(events) and events[i].time_ns < lo:
            running += events[i].nbytes
            i += 1
        peak = running
        while i < len(events) and events[i].time_ns < hi:
            running += events[i].nbytes
            peak = max(peak, running)
            i += 1
        out[phase] = start + peak
    return out
