"""Where an OOM struck, from its traceback: the phase, the innermost module, the model call."""

from __future__ import annotations

import dataclasses
import os
import sys
from types import FrameType, TracebackType
from typing import Any

import torch
from torch import nn

__all__ = ["Where", "locate"]

_SEP = os.sep
# the innermost of these frames names the phase (the C++ autograd engine and the optimizers' kernels
# leave no module frame behind; a module's forward run again by checkpointing in backward is backward)
_BACKWARD = ((f"{_SEP}torch{_SEP}_tensor.py", "backward"), (f"{_SEP}torch{_SEP}autograd{_SEP}", "backward"),
             (f"{_SEP}torch{_SEP}autograd{_SEP}", "_engine_run_backward"))
_OPTIMIZER = f"{_SEP}torch{_SEP}optim{_SEP}"
_CALL_NAMES = ("_call_impl", "_wrapped_call_impl")


@dataclasses.dataclass
class Where:
    """The failing point: ``phase`` is forward, backward, optimizer, evaluation, or ``loop``: the training loop's own code,
    outside the model's calls, backward and the optimizer step (a list it appends to, a loss computed outside the model,
    the batch being loaded); ``unknown`` when the error has no traceback."""

    phase: str = "unknown"
    module: str | None = None
    """The innermost module whose ``forward`` was running, by its qualified name in the model (``""``: the model itself)."""
    module_type: str | None = None
    call: Any = None
    """What replays the step: the outermost module call's ``(args, kwargs)`` (the batch as the model received it,
    never copied), or with ``step_fn == "training_step"`` the batch as the loader gave it."""
    step_fn: str = "call"
    """``"call"``: ``module(*args, **kwargs)``; ``"training_step"``: ``module.training_step(batch, 0)`` (Lightning)."""
    call_module: nn.Module | None = None
    """The module that call went to (the model, or its wrapper's inner module)."""
    frames: list[str] = dataclasses.field(default_factory=list)
    """``file:line in function`` of the traceback's last frames, innermost last (at most 8)."""

    def to_dict(self) -> dict[str, Any]:
        return {"phase": self.phase, "module": self.module, "module_type": self.module_type, "frames": list(self.frames)}


def _frames(tb: TracebackType | None) -> list[FrameType]:
    out = []
    while tb is not None:
        out.append(tb.tb_frame)
        tb = tb.tb_next
    return out


def _stack() -> list[FrameType]:
    """The frames still running above the handler (the training loop's, when it caught nothing)."""
    out, frame = [], sys._getframe(2)
    while frame is not None:
        out.append(frame)
        frame = frame.f_back
    return out


def _module_names(model: nn.Module | None) -> dict[int, str]:
    if model is None:
        return {}
    try:
        return {id(m): name for name, m in model.named_modules(remove_duplicate=False)}
    except Exception:
        return {}


def locate(exc: BaseException, model: nn.Module | None) -> Where:
    """Read ``exc.__traceback__``: nothing runs per step for this, the frames are still alive while it unwinds."""
    frames = _frames(exc.__traceback__)
    names = _module_names(model)
    where = Where()
    innermost: nn.Module | None = None
    backward_seen = False
    for frame in frames:  # outermost first: the innermost frame that names a phase wins
        path, name = frame.f_code.co_filename, frame.f_code.co_name
        if any(part in path and name == fn for part, fn in _BACKWARD):
            where.phase, backward_seen = "backward", True
        elif _OPTIMIZER in path:
            where.phase = "optimizer"
        owner = frame.f_locals.get("self")
        if not isinstance(owner, nn.Module):
            continue
        if where.phase == "optimizer":  # the model's code inside optimizer.step: its closure's step (Lightning)
            where.phase = "forward" if owner.training else "evaluation"
        if name in _CALL_NAMES and where.call is None:
            args, kwargs = frame.f_locals.get("args", ()), frame.f_locals.get("kwargs", {})
            where.call, where.call_module = (tuple(args), dict(kwargs or {})), owner
        elif name == "forward":
            innermost = owner
            if not backward_seen:  # a forward inside backward is checkpointing's recomputation
                where.phase = "forward" if owner.training else "evaluation"
    if innermost is not None:
        where.module_type = type(innermost).__name__
        names = names or _module_names(where.call_module)
        where.module = names.get(id(innermost))
    if where.phase == "unknown" and frames and innermost is None and where.call is None:
        where.phase = "loop"  # no frame of a module's forward, of backward or of an optimizer: the loop's own code
    if where.call is None and where.phase in ("backward", "optimizer"):
        find_call(exc, where, model, frames + _stack())
    where.frames = [f"{os.path.basename(f.f_code.co_filename)}:{f.f_lineno} in {f.f_code.co_name}" for f in frames[-8:]]
    return where


def _graph_inputs(exc: BaseException) -> dict[Any, Any]:
    """Storages the autograd graph under ``Tensor.backward`` saved that no op made: the batch's tensors (a first layer's input)."""
    from memcallbacks._base.storage import storage_keys
    from memcallbacks.leaks.tensors import graph_tensors, is_parameter

    out: dict[Any, Any] = {}
    for frame in _frames(exc.__traceback__):
        loss = frame.f_locals.get("self") if frame.f_code.co_name == "backward" else None
        if isinstance(loss, torch.Tensor) and loss.grad_fn is not None:
            for t, how in graph_tensors([loss]):
                if how == "saved" and t.grad_fn is None and not t.requires_grad and not is_parameter(t):
                    out.update((k, t) for k, _ in storage_keys(t))
            break
    return out


def _own_forward(model: nn.Module) -> bool:
    """A ``forward`` of the model's own class (a LightningModule's inherited one only passes to ``nn.Module``'s)."""
    qualname = getattr(type(model).forward, "__qualname__", "")
    return qualname not in ("Module._forward_unimplemented", "LightningModule.forward")


def find_call(exc: BaseException, where: Where, model: nn.Module | None, frames: list[FrameType]) -> None:
    """Backward and optimizer OOMs have no model call left in the traceback: find the batch among the
    training loop's locals by a tensor the graph saved (``model(x)``, ``model(**batch)`` for a mapping,
    a Lightning module's ``training_step(batch)`` when it has no ``forward`` of its own)."""
    from memcallbacks._base.storage import storage_keys

    inputs = _graph_inputs(exc)
    if not inputs or model is None:
        return

    def ours(t: Any) -> bool:
        return isinstance(t, torch.Tensor) and any(k in inputs for k, _ in storage_keys(t))

    def holds(value: Any) -> Any:
        if isinstance(value, dict):
            return next((v for v in value.values() if ours(v)), None)
        if isinstance(value, (list, tuple)) and not isinstance(value, torch.Size):
            return next((v for v in value if ours(v)), None)
        return None

    by_step = not _own_forward(model) and callable(getattr(model, "training_step", None))
    for frame in frames:
        for value in list(frame.f_locals.values()):
            nested = [v for v in value.values() if isinstance(v, (list, tuple, dict))] if isinstance(value, dict) else []
            for candidate in [value, *nested]:
                hit = candidate if ours(candidate) else holds(candidate)
                if hit is None:
                    continue
                where.call_module = model
                if by_step:
                    where.call, where.step_fn = candidate, "training_step"
                elif isinstance(candidate, dict):
                    where.call = ((), dict(candidate))
                else:
                    where.call = ((hit,), {})
                return
