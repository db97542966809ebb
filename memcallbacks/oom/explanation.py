"""One OOM explained: where it struck, what filled the memory, and the changes that make the step fit."""

from __future__ import annotations

import dataclasses
import logging
import time
from pathlib import Path
from typing import Any

import torch
from torch import nn

from memcallbacks._base.units import format_bytes
from memcallbacks.oom.accounting import RESERVE_BYTES, Accounting, account, release_reserve
from memcallbacks.oom.recognise import oom_source, requested_bytes
from memcallbacks.oom.remedies import Remedy, StepModel, rank_remedies
from memcallbacks.oom.where import Where, locate

log = logging.getLogger(__name__)

__all__ = ["OomExplanation", "explain_oom", "explain_prediction", "oom_file_name", "write_oom_json"]


PHASE_WORDS = {"loop": "the training loop's own code (outside the model's forward, backward and the optimizer step)",
               "unknown": "an unknown phase (the error has no traceback)"}
"""How the headline says a phase that is not a step's (forward, backward, optimizer, evaluation)."""


@dataclasses.dataclass
class OomExplanation:
    """Everything said about one OOM; :meth:`text` is what is logged, :meth:`to_dict` is ``oom.json``."""

    step: int
    rank: int
    error: str
    source: str
    """The allocator that ran out: ``cuda``, ``xpu``, ``mps``, ``cpu``, ``host`` (``MemoryError``) or ``device``."""
    where: Where
    accounting: Accounting
    remedies: list[Remedy]
    batch_size: int | None = None
    last_good: dict[str, Any] | None = None
    """The last measured step's number and per-phase peaks (bytes), for comparison."""
    predicted: dict[str, Any] | None = None
    """The pre-flight's prediction of the failed step: per-phase peaks, the peak, the top modules by activations."""
    snapshot: str | None = None
    """The allocator snapshot taken at the OOM (CUDA), when one was written."""
    holders: list[str] = dataclasses.field(default_factory=list)
    seconds: float = 0.0
    """How long explaining took (the pre-flight's fake steps, mostly)."""

    def to_dict(self) -> dict[str, Any]:
        return {
            "step": self.step, "rank": self.rank, "error": self.error, "source": self.source, "batch_size": self.batch_size,
            "where": self.where.to_dict(), "memory": self.accounting.to_dict(),
            "remedies": [dataclasses.asdict(r) for r in self.remedies], "last_good_step": self.last_good,
            "predicted": self.predicted, "snapshot": self.snapshot, "holders": list(self.holders), "seconds": round(self.seconds, 3),
            "text": self.text(),
        }

    def headline(self) -> str:
        if self.source == "pre-flight":
            acc = self.accounting
            return (f"the step would run out of memory: predicted peak {format_bytes(acc.figure_bytes)} in {self.where.phase}, "
                    f"above the {format_bytes(acc.capacity_bytes)} of {acc.capacity_source}"
                    + (f", batch size {self.batch_size}" if self.batch_size is not None else ""))
        module = self.where.module
        at = f", in {module or '(the model)'} ({self.where.module_type})" if module is not None else ""
        batch = f", batch size {self.batch_size}" if self.batch_size is not None else ""
        return f"out of memory at step {self.step} on rank {self.rank}, in {PHASE_WORDS.get(self.where.phase, self.where.phase)}{at}{batch}"

    def text(self) -> str:
        acc = self.accounting
        asked = f"asked for {format_bytes(acc.requested_bytes)}; " if acc.requested_bytes is not None else ""
        cap = f" of {format_bytes(acc.capacity_bytes)} ({acc.capacity_source})" if acc.capacity_bytes else ""
        lines = [self.headline()]
        if self.source != "pre-flight":
            lines.append(f"  {self.source} allocator {asked}{acc.figure} {format_bytes(acc.figure_bytes)}{cap}")
        lines.append("  what fills it at the peak:" if self.source == "pre-flight" else "  what filled it:")
        for name, nbytes in sorted(acc.categories.items(), key=lambda kv: -kv[1]):
            lines.append(f"    {format_bytes(nbytes):>10}  {name}")
        if acc.largest_free_block_bytes is not None:
            lines.append(f"  largest free cached block {format_bytes(acc.largest_free_block_bytes)}; expandable_segments "
                         f"{'on' if acc.expandable_segments else 'off'}")
        if self.last_good:
            peaks = ", ".join(f"{k} {format_bytes(v)}" for k, v in self.last_good.get("peaks", {}).items())
            lines.append(f"  last measured step ({self.last_good.get('step')}): peaks {peaks}")
        if self.predicted and self.source != "pre-flight":
            lines.append(f"  pre-flight of this step: peak {format_bytes(self.predicted['peak_bytes'])} in {self.predicted['peak_phase']}"
                         f"; activations {format_bytes(self.predicted['activation_bytes'])}")
        if self.remedies:
            lines.append("  what makes it fit, largest predicted saving first:")
            lines.extend(f"    {i}. {r}" for i, r in enumerate(self.remedies, 1))
        lines.extend(f"  note: {n}" for n in acc.notes)
        if self.snapshot:
            lines.append(f"  allocator snapshot at the OOM: {self.snapshot}")
        return "\n".join(lines)

    __str__ = text


def _last_good(rows: list[list[Any]]) -> dict[str, Any] | None:
    from memcallbacks._base.columns import PEAK_BACKWARD, PEAK_FORWARD, PEAK_OPTIMIZER, STEP

    for row in reversed(rows):  # the failed step's own row, open when memory ran out, has no peak yet
        peaks = {ph: int(row[col]) for ph, col in (("forward", PEAK_FORWARD), ("backward", PEAK_BACKWARD), ("optimizer", PEAK_OPTIMIZER))
                 if row[col] == row[col]}
        if peaks:
            return {"step": int(row[STEP]), "peaks": peaks}
    return None


def floor_of(rows: list[list[Any]], baseline_now: int | None, step_now: int,
             read_now: tuple[int, int] | None = None) -> tuple[int, int, int, int] | None:
    """``(step, bytes)`` at the start of the first steady steps (the lowest of the first three from step 1) and now:
    this step's start where it was read, else the latest of the history's rows and the watch's read ``read_now``
    (``(step, bytes)``; the watch reads steps the history does not sample: a leak's floor up to the failure)."""
    from memcallbacks._base.columns import ALLOCATED, STEP

    # from step 1 on: the optimizer's state exists from the first step's end
    known = [(int(r[STEP]), int(r[ALLOCATED])) for r in rows if r[ALLOCATED] == r[ALLOCATED] and r[STEP] >= 1]
    latest = [sb for sb in (known[-1] if known else None, read_now) if sb is not None and sb[0] <= step_now]
    now = (step_now, baseline_now) if baseline_now is not None else (max(latest) if latest else None)
    early = [sb for sb in known[:3] if now is not None and sb[0] < now[0]]
    if not early or now is None:
        return None
    then = min(early, key=lambda sb: sb[1])
    return (then[0], then[1], now[0], now[1])


def recent_start(rows: list[list[Any]], baseline_now: int | None, step_now: int,
                 read_now: tuple[int, int] | None = None) -> int | None:
    """The allocator's count when this step started; else when the previous one did (the monitor reads it
    on the steps it measures, and the watch on the steps it reads, up to two steps back): a floor that leaves out
    this step's own memory, batch aside."""
    from memcallbacks._base.columns import ALLOCATED, STEP

    if baseline_now is not None:
        return baseline_now
    known = [(int(r[STEP]), int(r[ALLOCATED])) for r in rows[-3:] if r[ALLOCATED] == r[ALLOCATED] and 0 <= step_now - r[STEP] <= 2]
    if read_now is not None and 0 <= step_now - read_now[0] <= 2:
        known.append(read_now)
    return max(known)[1] if known else None


def explain_oom(
    exc: BaseException, *, model: nn.Module | None, optimizer: Any, step: int, rank: int = 0, device: torch.device | None = None,
    rows: list[list[Any]] | None = None, baseline_now: int | None = None, holders: list[str] | None = None,
    capacity: int | None = None, capacity_source: str = "", device_capacity: int | None = None, precision: str | None = None,
    remedies: bool = True, read_now: tuple[int, int] | None = None,
) -> OomExplanation:
    """Explain ``exc`` (an OOM, :func:`~memcallbacks.oom.is_oom`) while it unwinds: its frames still hold the step's tensors.

    ``rows``: the monitor's history (the step-start floor, the last good step); ``holders``: the leak
    findings' holders; ``capacity``: a capacity to explain against instead of the device's (``device_capacity``:
    the device's, where the device itself reports none at the failure); ``baseline_now``: the allocator's
    count when the failing step started, when the monitor measured it; ``read_now``: ``(step, bytes)``, the watch's
    latest read of the allocator's count at a step's start (it reads steps the history does not sample)."""
    t0 = time.perf_counter()
    rows = rows or []
    where = locate(exc, model)
    source = oom_source(exc) or "device"
    dev = torch.device("cpu") if source in ("cpu", "host", "onednn") else (device or torch.device("cpu"))
    acc = account(exc, where, model=model, optimizer=optimizer, device=dev, floor=floor_of(rows, baseline_now, step, read_now),
                  capacity=capacity, capacity_source=capacity_source, requested=requested_bytes(exc),
                  step_start=recent_start(rows, baseline_now, step, read_now), device_capacity=device_capacity)
    if source == "onednn":
        acc.notes.append("oneDNN says only that it could not create or run a primitive (its status, out of memory, is not in the "
                         "message); it is explained as an out-of-memory error because memory was short when it was raised")
    if dev.type == "cpu" and release_reserve(now=True):  # counted above, in the figure that hit the limit: now room to replay the step
        acc.notes.append(f"the monitor's {format_bytes(RESERVE_BYTES)} address-space reserve (in the process's share) was "
                         "released to explain this error")
    from memcallbacks.preflight.batch_size import batch_size_of

    size = batch_size_of(where.call) if where.call is not None else None
    step_model = None
    if remedies and where.call is not None and where.call_module is not None and where.phase != "evaluation":
        step_model = StepModel(where.call_module, where.call, optimizer, precision or "fp32", dev, where.step_fn)
    no_call = ("it failed in the training loop's own code, outside the model's call: no change to the model's step is "
               "predicted to help") if where.phase == "loop" else ""
    ranked, base = rank_remedies(step_model, acc, list(holders or []), no_call=no_call) if remedies else ([], None)
    predicted = None
    if base is not None:
        predicted = {"peak_bytes": base.peak_bytes, "peak_phase": base.peak_phase, "phase_peaks": base.phase_peaks(),
                     "activation_bytes": base.activation_bytes, "top_modules": [list(kv) for kv in base.top_modules[:5]]}
    return OomExplanation(step=int(step), rank=int(rank), error=f"{type(exc).__name__}: {exc}"[:2000], source=source, where=where,
                          accounting=acc, remedies=ranked, batch_size=size, last_good=_last_good(rows), predicted=predicted,
                          holders=list(holders or []), seconds=time.perf_counter() - t0)


def oom_file_name(rank: int, world_size: int) -> str:
    """``oom.json``, or ``oom.rank{r}.json`` on every rank but zero of a distributed run."""
    return "oom.json" if world_size <= 1 or rank == 0 else f"oom.rank{rank}.json"


def write_oom_json(explanation: OomExplanation, folder: str | Path, world_size: int = 1) -> Path:
    """Write ``oom.json`` (atomically, as every other file of the run) into ``folder``; returns its path."""
    from memcallbacks._files.outputs import write_json

    return write_json(Path(folder) / oom_file_name(explanation.rank, world_size), explanation.to_dict())


_PREDICTED_NAMES = {"params": "parameters", "grads": "gradients", "optimizer_state": "optimizer state", "inputs": "batch",
                    "activations": "activations", "temporaries": "temporaries", "workspace": "cuBLAS workspace"}


def explain_prediction(step: StepModel, prediction: Any, capacity: int, capacity_source: str = "capacity") -> OomExplanation | None:
    """Before the step runs: the same explanation for a pre-flight ``prediction`` whose peak is above ``capacity``
    (None when it fits). The categories are the prediction's breakdown at its peak; the remedies are predicted alike."""
    t0 = time.perf_counter()
    phase = prediction.peak_phase
    if prediction.peak_bytes <= capacity:
        return None
    cats = {_PREDICTED_NAMES.get(k, k): int(v) for k, v in prediction.breakdown[phase].items()}
    acc = Accounting(device=str(getattr(step.device, "type", step.device)), figure_bytes=int(prediction.peak_bytes),
                     figure=f"predicted peak in {phase}", categories=cats, capacity_bytes=int(capacity), capacity_source=capacity_source)
    ranked, _ = rank_remedies(step, acc, [], base=prediction)
    top = prediction.top_modules[0][0] if prediction.top_modules else None
    where = Where(phase=phase, module=top, module_type="largest saved activations" if top is not None else None)
    from memcallbacks.preflight.batch_size import batch_size_of

    predicted = {"peak_bytes": prediction.peak_bytes, "peak_phase": phase, "phase_peaks": prediction.phase_peaks(),
                 "activation_bytes": prediction.activation_bytes, "top_modules": [list(kv) for kv in prediction.top_modules[:5]]}
    return OomExplanation(step=-1, rank=0, error="", source="pre-flight", where=where, accounting=acc, remedies=ranked,
                          batch_size=batch_size_of(step.call), predicted=predicted, seconds=time.perf_counter() - t0)
