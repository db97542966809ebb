"""What the monitor's pre-flight runs: each adapter's step as a ``forward_fn``, the batch size, and batches of another size.

Framework-free: the Lightning step calls ``training_step`` by name, the plain-loop step replays
the model call the monitor saw (its positional and keyword arguments).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Callable

import torch
from torch import nn

__all__ = ["call_step", "training_step", "loss_of", "batch_size_of", "resize_batch", "autocast_precision"]

ForwardFn = Callable[[nn.Module, Any], Any]


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
    tensors = [t for t in _tensors(out) if t.is_floating_point() and t.requires_grad]
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


def _tensors(value: Any) -> list[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, Mapping):
        return [t for v in value.values() for t in _tensors(v)]
    if isinstance(value, (list, tuple)):
        return [t for v in value for t in _tensors(v)]
    return []


def batch_size_of(batch: Any) -> int | None:
    """Dimension 0 of the batch's first tensor (None when it has no tensor with a dimension)."""
    for t in _tensors(batch):
        return int(t.shape[0]) if t.dim() > 0 else None
    return None


def resize_batch(batch: Any, old: int, new: int) -> Any:
    """``batch`` with every tensor whose dimension 0 is ``old`` replaced by a meta tensor with ``new`` rows."""
    if isinstance(batch, torch.Tensor):
        if batch.dim() > 0 and batch.shape[0] == old:
            return torch.empty((new, *batch.shape[1:]), dtype=batch.dtype, device="meta")
        return batch
    if isinstance(batch, Mapping):
        return {k: resize_batch(v, old, new) for k, v in batch.items()}
    if isinstance(batch, tuple) and hasattr(batch, "_fields"):
        return type(batch)(*(resize_batch(v, old, new) for v in batch))
    if isinstance(batch, (list, tuple)):
        return type(batch)(resize_batch(v, old, new) for v in batch)
    return batch


def autocast_precision(device_type: str) -> str | None:
    """``"bf16-mixed"``/``"16-mixed"`` when the caller runs under autocast on ``device_type`` now."""
    try:
        if not torch.is_autocast_enabled(device_type):
            return None
        dtype = torch.get_autocast_dtype(device_type)
    except (RuntimeError, TypeError, AttributeError):
        return None
    return {torch.bfloat16: "bf16-mixed", torch.float16: "16-mixed"}.get(dtype)
