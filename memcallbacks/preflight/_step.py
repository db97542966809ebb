"""One tracked training step on fake tensors: forward_fn, backward, optimizer.step(), zero_grad()."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch import nn

from memcallbacks.preflight._fake import batch_tensors
from memcallbacks.preflight._tracking import GRADS, INPUTS, OPTIMIZER, PARAMS, StorageTracker

__all__ = ["PreflightError", "call_step", "default_forward_fn", "loss_of", "run_step", "training_step"]

ForwardFn = Callable[[nn.Module, Any], Any]


class PreflightError(RuntimeError):
    """The step could not run on fake tensors; the message names the op and what to do."""

    def __init__(self, message: str, op: str | None = None) -> None:
        super().__init__(message)
        self.op = op


def _ignore(*args: Any, **kwargs: Any) -> None:
    return None


def loss_of(out: Any) -> Any:
    """The loss a model call stands for: ``out.loss`` (Transformers), ``out["loss"]``, a tensor, or the
    sum of the output's floating tensors (a loss computed outside the model takes about as little)."""
    loss = getattr(out, "loss", None)
    if isinstance(loss, torch.Tensor):
        return loss
    if isinstance(out, Mapping) and isinstance(out.get("loss"), torch.Tensor):
        return out["loss"]
    if isinstance(out, torch.Tensor):
        return out
    tensors = [t for t in batch_tensors(out) if t.is_floating_point() and t.requires_grad]
    if not tensors:
        return out  # predict() names what it got instead of a loss
    return torch.stack([t.float().sum() for t in tensors]).sum()


def call_step(model: nn.Module, batch: tuple[tuple[Any, ...], dict[str, Any]]) -> Any:
    """The plain-loop step: the model called as the loop called it (``batch`` is ``(args, kwargs)``)."""
    args, kwargs = batch
    return loss_of(model(*args, **kwargs))


def training_step(batch_idx: int) -> ForwardFn:
    """A LightningModule's step: ``training_step(batch, batch_idx)`` on the fake copy, whose ``self.log``
    goes nowhere (the copy shares the real trainer, whose logged results must not see fake tensors)."""

    def forward(model: nn.Module, batch: Any) -> Any:
        object.__setattr__(model, "log", _ignore)
        object.__setattr__(model, "log_dict", _ignore)
        return model.training_step(batch, batch_idx)

    return forward


def default_forward_fn(loss_fn: Callable[..., torch.Tensor] | None) -> ForwardFn:
    """A dict batch: ``model(**batch).loss``; ``(x, y)`` with ``loss_fn``: ``loss_fn(model(x), y)``;
    a tensor: ``model(x)`` (summed when not a scalar, or ``loss_fn(model(x))``)."""

    def forward(model: nn.Module, batch: Any) -> Any:
        if isinstance(batch, Mapping):
            return model(**batch)
        if isinstance(batch, (list, tuple)) and len(batch) == 2 and loss_fn is not None:
            x, y = batch
            return loss_fn(model(x), y)
        if isinstance(batch, torch.Tensor):
            out = model(batch)
            return loss_fn(out) if loss_fn is not None else out
        raise ValueError(
            f"predict(): batch of type {type(batch).__name__} has no default step; pass forward_fn=lambda model, batch: "
            "loss (or a dict batch for model(**batch).loss, or an (x, y) batch with loss_fn=)."
        )

    return forward


def _as_loss(out: Any) -> torch.Tensor:
    loss = out
    if isinstance(out, Mapping) and "loss" in out:
        loss = out["loss"]
    elif not isinstance(out, torch.Tensor) and getattr(out, "loss", None) is not None:
        loss = out.loss
    if not isinstance(loss, torch.Tensor):
        raise ValueError(
            f"predict(): forward_fn returned {type(out).__name__} with no loss tensor (a dict batch needs labels so "
            "model(**batch).loss is set); pass forward_fn=lambda model, batch: loss."
        )
    # a non-scalar output stands for a loss that reduces it: the reduction's memory is negligible
    return loss if loss.dim() == 0 else loss.float().sum()


def _register_existing(tracker: StorageTracker, model: nn.Module, optimizer: Any, batch: Any) -> None:
    for p in model.parameters():
        tracker.add(p, PARAMS)
        if p.grad is not None:
            tracker.add(p.grad, GRADS)
    for b in model.buffers():
        tracker.add(b, PARAMS)
    if optimizer is not None:
        _tag_state(tracker, optimizer)
    for t in batch_tensors(batch):
        tracker.add(t, INPUTS)


def _tag_state(tracker: StorageTracker, optimizer: torch.optim.Optimizer) -> None:
    for state in optimizer.state.values():
        for value in state.values():
            if isinstance(value, torch.Tensor):
                tracker.tag(value, OPTIMIZER)


def run_step(
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None,
    batch: Any,
    forward_fn: ForwardFn,
    autocast: Callable[[], contextlib.AbstractContextManager[Any]],
) -> tuple[StorageTracker, list[int]]:
    """Run one step on the fake model and return the tracker and its phase bounds (event counts)."""
    tracker = StorageTracker()
    _register_existing(tracker, model, optimizer, batch)
    bounds = [len(tracker.events)]
    handles = tracker.install_module_hooks(model)
    for p in model.parameters():
        if p.requires_grad:
            handles.append(p.register_post_accumulate_grad_hook(lambda q: tracker.tag(q.grad, GRADS)))
    try:
        with tracker:
            tracker.phase = "forward"
            with autocast():
                loss = _as_loss(forward_fn(model, batch))
            tracker.module_stack.clear()
            bounds.append(len(tracker.events))
            tracker.phase = "backward"
            loss.backward()
            bounds.append(len(tracker.events))
            tracker.phase = "optimizer"
            if optimizer is not None:
                optimizer.step()
                _tag_state(tracker, optimizer)
                optimizer.zero_grad(set_to_none=True)
            else:
                for p in model.parameters():
                    p.grad = None
            del loss
            bounds.append(len(tracker.events))
    except PreflightError:
        raise
    except ValueError:
        raise
    except Exception as exc:
        raise _translate(exc, tracker) from exc
    finally:
        for handle in handles:
            handle.remove()
        tracker.detach()
    return tracker, bounds


def _translate(exc: Exception, tracker: StorageTracker) -> PreflightError:
    from torch._subclasses.fake_tensor import (
        DataDependentOutputException,
        DynamicOutputShapeException,
        UnsupportedOperatorException,
    )

    op = str(getattr(exc, "func", "") or tracker.last_op or "unknown op")
    where = f" in module {tracker.module_stack[-1]!r}" if tracker.module_stack else ""
    phase = tracker.phase
    if isinstance(exc, DataDependentOutputException):
        why = f"{op} needs tensor values (.item(), a Python branch on a tensor, or printing one)"
    elif isinstance(exc, DynamicOutputShapeException):
        why = f"{op} has an output shape that depends on tensor values (nonzero, masked_select, unique)"
    elif isinstance(exc, UnsupportedOperatorException):
        why = f"{op} has no fake/meta kernel (a custom op: register one with torch.library.register_fake)"
    else:
        why = f"{type(exc).__name__} at or after {op}: {exc}"
    return PreflightError(
        f"predict(): the step cannot run on fake tensors during {phase}{where}: {why}. Pass a forward_fn that "
        "avoids it; training itself is not affected.",
        op=op,
    )
