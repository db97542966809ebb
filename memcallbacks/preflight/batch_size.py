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
    margin: Callable[[Prediction], int] | None = None,
    **predict_kwargs: Any,
) -> BatchFit:
    """Largest ``n`` in ``[low, high]`` with ``predict(model, make_batch(n), ...).peak_bytes <= capacity_bytes``.

    The peak grows about linearly with the batch, so each next size is where the line through two
    predicted sizes meets the capacity (doubling until there are two, halving the bracket when an aim
    did not): 37 took 4 predictions, 1,000 took 8, where doubling and bisecting made ``2 * log2(answer)``.
    Peak memory grows with the batch size, which the search assumes. ``make_batch(n)`` should return
    meta tensors (``torch.empty(..., device="meta")``) so no batch is ever allocated. ``known``: predictions already made with the same settings (an earlier
    search's :attr:`BatchFit.predictions`), not made again. ``margin(prediction)``: bytes to keep free beside a
    size's predicted peak (what the prediction cannot see): ``n`` fits when its peak plus its margin does.
    Other keyword arguments go to :func:`predict`.
    """
    if not isinstance(capacity_bytes, int) or capacity_bytes <= 0:
        raise ValueError(f"max_batch_size(): capacity_bytes={capacity_bytes!r} must be a positive int of bytes, e.g. 80 * 2**30.")
    if not (isinstance(low, int) and isinstance(high, int) and 1 <= low <= high):
        raise ValueError(f"max_batch_size(): low={low!r}, high={high!r} must be ints with 1 <= low <= high.")
    tried: dict[int, int] = {}
    needs: dict[int, int] = {}  # peak and margin: what the search aims with
    predictions: dict[int, Prediction] = {}

    def fits(n: int) -> bool:
        p = known[n] if known and n in known else predict(model, make_batch(n), optimizer, **predict_kwargs)
        tried[n], predictions[n] = p.peak_bytes, p
        needs[n] = p.peak_bytes + (margin(p) if margin is not None else 0)
        return needs[n] <= capacity_bytes

    if not fits(low):
        return BatchFit(0, tried[low], capacity_bytes, predictions[low], tried, predictions)
    good, bad, width, missed = low, None, high + 1 - low, False
    while good < high and (bad is None or bad - good > 1):
        top = high if bad is None else bad - 1
        n = aimed = _aim(needs, good, bad, capacity_bytes)
        # no line yet, a line just proven wrong, or an aim that did not halve the bracket: double, or bisect
        if n is None or (bad is None and missed) or (bad is not None and bad - good > width // 2):
            n = min(good * 2, top) if bad is None else (good + bad) // 2
        n = max(good + 1, min(n, top))
        width = bad - good if bad is not None else width
        if fits(n):
            missed = bad is None and aimed is not None and aimed <= good  # the line said nothing above good fits
            good = n
        else:
            bad = n
    return BatchFit(good, tried[good], capacity_bytes, predictions[good], tried, predictions)


def _aim(tried: dict[int, int], good: int, bad: int | None, capacity: int) -> int | None:
    """The batch size where the line through ``good`` and its nearest other predicted size meets ``capacity``."""
    other = bad if bad is not None else max((n for n in tried if n < good), default=None)
    if other is None:
        return None
    slope = (tried[other] - tried[good]) / (other - good)
    if slope <= 0:
        return None
    return good + int((capacity - tried[good]) // slope)


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
