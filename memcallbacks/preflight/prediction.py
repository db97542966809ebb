"""The ``Prediction`` a pre-flight returns: per-phase peaks, the breakdown at each, top modules."""

from __future__ import annotations

import dataclasses
from typing import Any

from memcallbacks._base.units import format_bytes

__all__ = ["Prediction"]

_PHASE_FIELDS = {"forward": "forward_peak_bytes", "backward": "backward_peak_bytes", "optimizer": "optimizer_peak_bytes"}


@dataclasses.dataclass(frozen=True, kw_only=True)
class Prediction:
    """Predicted device bytes of one training step, everything alive counted (params, optimizer state, batch).

    Bytes are what ``torch.cuda.memory_allocated()`` would read on a CUDA target (blocks rounded as
    the caching allocator rounds them, cuBLAS workspace included) and the exact allocated bytes on a
    CPU target. The step is the steady-state one: after the optimizer's first step, optimizer state
    present, grads ``None`` at its start. :attr:`first_step` predicts the very first step.
    """

    device: str
    """Target device type (``"cuda"``, ``"cpu"``)."""
    precision: str
    """Canonical precision (``"fp32"``, ``"bf16-mixed"``, ...)."""
    strategy: str
    """Canonical strategy; model states are per rank for sharded strategies."""
    world_size: int
    """Data-parallel ranks (the batch is one rank's micro-batch)."""
    start_bytes: int
    """Alive when the step starts: params, buffers, optimizer state, the batch."""
    forward_peak_bytes: int
    """Peak during ``forward_fn`` (forward and loss)."""
    backward_peak_bytes: int
    """Peak during ``loss.backward()``."""
    optimizer_peak_bytes: int
    """Peak during ``optimizer.step()`` and ``zero_grad()``."""
    breakdown: dict[str, dict[str, int]]
    """Phase -> category -> bytes alive at that phase's peak. Categories: params (and buffers),
    grads, optimizer_state, inputs (the batch), activations (made in forward and kept for backward),
    temporaries (everything else), workspace (cuBLAS, CUDA targets)."""
    top_modules: tuple[tuple[str, int], ...]
    """Modules by activation bytes alive at the end of forward (the innermost module that made them)."""
    activation_bytes: int
    """All activation bytes alive at the end of forward."""
    notes: tuple[str, ...] = ()
    """Assumptions that applied, in words."""
    first_step: Prediction | None = None
    """The first step (no optimizer state yet: it is allocated during its ``optimizer.step()``)."""

    @property
    def peak_bytes(self) -> int:
        """The largest of the three phase peaks."""
        return max(self.forward_peak_bytes, self.backward_peak_bytes, self.optimizer_peak_bytes)

    @property
    def peak_phase(self) -> str:
        """The phase holding :attr:`peak_bytes` (the first one on a tie)."""
        return max(_PHASE_FIELDS, key=lambda p: getattr(self, _PHASE_FIELDS[p]))

    def phase_peaks(self) -> dict[str, int]:
        """``{"forward": ..., "backward": ..., "optimizer": ...}``."""
        return {phase: getattr(self, name) for phase, name in _PHASE_FIELDS.items()}

    def biggest_holders(self, n: int = 3) -> list[tuple[str, int]]:
        """The largest categories at the overall peak, then the top activation modules."""
        at_peak = sorted(self.breakdown[self.peak_phase].items(), key=lambda kv: kv[1], reverse=True)
        return [kv for kv in at_peak if kv[1] > 0][:n]

    def to_dict(self) -> dict[str, Any]:
        """Plain JSON-ready dict (``first_step`` nested, ``peak_bytes`` and ``peak_phase`` included)."""
        out = dataclasses.asdict(self)
        out["top_modules"] = [list(kv) for kv in self.top_modules]
        out["peak_bytes"] = self.peak_bytes
        out["peak_phase"] = self.peak_phase
        out["first_step"] = self.first_step.to_dict() if self.first_step is not None else None
        out["notes"] = list(self.notes)
        return out

    def __str__(self) -> str:
        head = f"Pre-flight: {self.device}, {self.precision}, {self.strategy}"
        head += f" x{self.world_size}" if self.world_size > 1 else ""
        categories = [c for c in next(iter(self.breakdown.values())) if any(b[c] for b in self.breakdown.values())]
        widths = [max(len(c), 10) for c in categories]
        lines = [head, f"  {'phase':<10} {'peak':>10}  " + "  ".join(f"{c:>{w}}" for c, w in zip(categories, widths))]
        lines.append(f"  {'start':<10} {format_bytes(self.start_bytes):>10}")
        for phase, peak in self.phase_peaks().items():
            cells = "  ".join(f"{format_bytes(self.breakdown[phase][c]):>{w}}" for c, w in zip(categories, widths))
            mark = " <- peak" if phase == self.peak_phase else ""
            lines.append(f"  {phase:<10} {format_bytes(peak):>10}  {cells}{mark}")
        if self.first_step is not None:
            first = self.first_step
            lines.append(f"  first step: peak {format_bytes(first.peak_bytes)} in {first.peak_phase}")
        if self.top_modules:
            lines.append(f"  top modules by activation bytes (of {format_bytes(self.activation_bytes)}):")
            lines.extend(f"    {format_bytes(b):>10}  {name}" for name, b in self.top_modules)
        lines.extend(f"  note: {n}" for n in self.notes)
        return "\n".join(lines)
