"""The history row layout: phase ids, column names and the index of each column."""

from __future__ import annotations

import enum


class Phase(enum.IntEnum):
    """The phases of a training step, in order; each is also its offset from ``PEAK_FORWARD`` in a row.
    ``OTHER``: what no other phase covers (between micro-batches, before the optimizer step's start)."""

    FORWARD = 0
    BACKWARD = 1
    OPTIMIZER = 2
    OTHER = 3


FORWARD, BACKWARD, OPTIMIZER, OTHER = Phase
PHASES = tuple(p.name.lower() for p in Phase)
"""The phase names, ``Phase``'s order: ``("forward", "backward", "optimizer", "other")``."""
TRAINING_PHASES = PHASES[:3]
"""The phases a step is predicted and compared in (``other`` has no prediction)."""

COLUMNS = (
    "step",  # optimizer steps completed before this row's step (Lightning's global_step)
    "epoch",
    "batch_idx",  # index of the first batch of the step
    "micro_batches",  # batches in the step (> 1 under gradient accumulation)
    "optimizer_steps",  # optimizer.step() calls seen in the step
    "allocated",  # bytes allocated at step start (the baseline)
    "reserved",
    "host_rss",
    "peak_forward",
    "peak_backward",
    "peak_optimizer",
    "peak_other",
    "peak_allocated",  # max over the step's phases
    "peak_reserved",
    "alloc_retries",  # cumulative allocator counters (CUDA/XPU), -1 where the device has none
    "ooms",
    "inactive_split",
    "step_time_s",
    "monitor_time_s",
)
_C = {name: i for i, name in enumerate(COLUMNS)}
(STEP, EPOCH, BATCH_IDX, MICRO_BATCHES, OPTIMIZER_STEPS, ALLOCATED, RESERVED, HOST_RSS, PEAK_FORWARD, PEAK_BACKWARD, PEAK_OPTIMIZER, PEAK_OTHER, PEAK_ALLOCATED, PEAK_RESERVED, ALLOC_RETRIES, OOMS, INACTIVE_SPLIT, STEP_TIME_S, MONITOR_TIME_S) = range(len(COLUMNS))
"""Indices of the history row's columns (rows are lists: the hot path appends no dicts)."""

EVAL_COLUMNS = ("stage", "step", "epoch", "batches", "allocated", "peak_allocated", "peak_reserved", "allocated_after", "host_rss")
(E_STAGE, E_STEP, E_EPOCH, E_BATCHES, E_ALLOCATED, E_PEAK_ALLOCATED, E_PEAK_RESERVED, E_ALLOCATED_AFTER, E_HOST_RSS) = range(len(EVAL_COLUMNS))

__all__ = ["Phase", "TRAINING_PHASES", "file_column", "frame_column", "FORWARD", "BACKWARD", "OPTIMIZER", "OTHER", "PHASES", "COLUMNS", "EVAL_COLUMNS", *(n.upper() for n in COLUMNS), *("E_" + n.upper() for n in EVAL_COLUMNS)]


_NOT_BYTES = frozenset({"step", "epoch", "batch_idx", "micro_batches", "optimizer_steps", "alloc_retries", "ooms", "stage", "batches"})


def file_column(name: str) -> str:
    """A history column's name in ``history.csv``, with its unit: ``allocated`` -> ``allocated_bytes``
    (counts and the ``_s`` times keep theirs)."""
    return name if name in _NOT_BYTES or name.endswith(("_s", "_bytes")) else f"{name}_bytes"


def frame_column(name: str) -> str:
    """A ``history.csv`` column's name in ``Monitor.history`` (``allocated_bytes`` -> ``allocated``);
    files from before the units were named keep their names."""
    return name[: -len("_bytes")] if name.endswith("_bytes") else name
