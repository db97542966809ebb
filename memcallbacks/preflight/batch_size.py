"""``max_batch_size()``: the largest batch whose predicted peak fits a capacity (fake runs only)."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch import nn

from memcallbacks.preflight._fake import batch_tensors
from memcallbacks.preflight.predict import predict
from memcallbacks.preflight.prediction import Prediction

__all__ = ["BatchFit", "batch_size_of", "max_batch_size", "resize_batch"]


@dataclasses.dataclass(frozen=True)
class BatchFit:
    """The answer of :func:`max_batch_size`."""

    batch_size: int
    """The largest batch size that fits; 0 when even ``low`` does not."""
    peak_bytes: int
    """Predicted peak at :attr:`batch_size` (at ``low`` when nothing fits)."""
    capacity_bytes: int
    """The capacity searched against."""
    prediction: Prediction
    """The full prediction at :attr:`batch_size` (at ``low`` when nothing fits)."""
    tried: dict[int, int]
    """Every batch size predicted and its peak bytes."""
    predictions: dict[int, Prediction] = dataclasses.field(default_factory=dict, repr=False, compare=False)
    """Every batch size predicted and its prediction (a later search can start from them: ``known``)."""

    def __str__(self) -> str:
        from memcallbacks._base.units import format_bytes

        if self.batch_size == 0:
            return (f"no batch fits {format_bytes(self.capacity_bytes)}: the smallest tried peaks at "
                    f"{format_bytes(self.peak_bytes)} in {self.prediction.peak_phase}")
        return (f"batch size {self.batch_size} fits {format_bytes(self.capacity_bytes)}: predicted peak "
                f"{format_bytes(self.peak_bytes)} in {self.prediction.peak_phase}")


def max_batch_size(
    model: nn.Module,
    make_batch: Callable[[int], Any],
    capacity_bytes: int,
    optimizer: Any = None,
    *,
    low: int = 1,
    high: int = 1 << 16,
    known: dict[int, Prediction] | None = None,
    **predict_kwargs: Any,
) -> BatchFit:
    """Largest ``n`` in ``[low, high]`` with ``predict(model, make_batch(n), ...).peak_bytes <= capacity_bytes``.

    Doubles from ``low`` until a batch does not fit, then bisects, so it makes about
    ``2 * log2(answer)`` predictions. Peak memory grows with the batch size, which the search
    assumes. ``make_batch(n)`` should return meta tensors (``torch.empty(..., device="meta")``) so
    no batch is ever allocated. ``known``: predictions already made with the same settings (an earlier
    search's :attr:`BatchFit.predictions`), not made again. Other keyword arguments go to :func:`predict`.
    """
    if not isinstance(capacity_bytes, int) or capacity_bytes <= 0:
        raise ValueError(f"max_batch_size(): capacity_bytes={capacity_bytes!r} must be a positive int of bytes, e.g. 80 * 2**30.")
    if not (isinstance(low, int) and isinstance(high, int) and 1 <= low <= high):
        raise ValueError(f"max_batch_size(): low={low!r}, high={high!r} must be ints with 1 <= low <= high.")
    tried: dict[int, int] = {}
    predictions: dict[int, Prediction] = {}

    def fits(n: int) -> bool:
        p = known[n] if known and n in known else predict(model, make_batch(n), optimizer, **predict_kwargs)
        tried[n], predictions[n] = p.peak_bytes, p
        return p.peak_bytes <= capacity_bytes

    if not fits(low):
        return BatchFit(0, tried[low], capacity_bytes, predictions[low], tried, predictions)
    good, bad = low, None
    while bad is None and good < high:
        n = min(good * 2, high)
        if fits(n):
            good = n
        else:
            bad = n
    while bad is not None and bad - good > 1:
        mid = (good + bad) // 2
        if fits(mid):
            good = mid
        else:
            bad = mid
    return BatchFit(good, tried[good], capacity_bytes, predictions[good], tried, predictions)


def batch_size_of(batch: Any) -> int | None:
    """Dimension 0 of the batch's first tensor (None when it has no tensor with a dimension)."""
    for t in batch_tensors(batch):
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
