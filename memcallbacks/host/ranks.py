"""Per rank: which rank's host or device memory stands apart from the others' (imbalance).

Each rank contributes a flat dict of figures (``HostGrowth.figures()``, ``WorkerWatch.figures``,
device figures such as ``peak_allocated_bytes``), gathered to rank zero in the collective the run
end already makes (:func:`gather_figures` is that collective for callers that have none).
:func:`find_imbalance` compares each rank with the median of the *other* ranks, so a single rank
that stands apart is named, on 2 ranks as on 64.
"""

from __future__ import annotations

import statistics
from typing import Mapping, Sequence


from memcallbacks._base.distributed import gather_objects
from memcallbacks._base.findings import Finding
from memcallbacks._base.units import MiB, format_bytes

__all__ = ["find_imbalance", "gather_figures"]

_LABELS = {
    "host_private_bytes": "private resident memory",
    "host_private_growth_bytes": "growth of private resident memory",
    "host_rss_bytes": "resident memory",
    "host_python_bytes": "Python-object memory",
    "host_python_growth_bytes": "growth of Python-object memory",
    "host_worker_uss_bytes": "DataLoader workers' private memory",
}

# Gathered for the report's per-rank table but not compared: the Python-object total is tens of MiB,
# so what rank zero alone imports and keeps once (a logger, TensorBoard, W&B) is already more than
# ``min_fraction`` of it on every healthy run. Its growth after warm-up is compared instead.
REPORT_ONLY = frozenset({"host_python_bytes"})


def gather_figures(figures: Mapping[str, float]) -> list[dict[str, float]] | None:
    """Every rank's figures on every rank (a collective: every rank calls it). ``[figures]`` when not
    distributed. Through :func:`memcallbacks._base.distributed.gather_objects`, not torch's
    ``all_gather_object``: it gathers on the monitored device's collective device and keeps its
    tensors alive past the collective (gloo's teardown deadlock, see ``_LAST_COLLECTIVE`` there)."""
    return gather_objects(dict(figures))


def find_imbalance(
    figures: Sequence[Mapping[str, float] | None],
    *,
    step: int = 0,
    min_bytes: int = 32 * MiB,
    min_fraction: float = 0.25,
    stand_apart: float = 2.0,
) -> list[Finding]:
    """``rank_imbalance`` findings, one per channel (``host``, ``device``) at most.

    ``figures[r]`` is rank r's dict (None for a rank that sent none). For each figure, each rank's
    value is compared with the median of the other ranks; the rank furthest above fires when it is
    above by ``min_bytes`` and by ``min_fraction`` of that median, and (3 ranks or more) by at
    least ``stand_apart`` times as much as the next rank — one rank, not a spread. The figures in
    :data:`REPORT_ONLY` (the Python-object total) are not compared."""
    if min_bytes < 0:
        raise ValueError(f"find_imbalance(min_bytes={min_bytes}) must be 0 or more bytes, e.g. 32 * 2**20.")
    if not 0 <= min_fraction:
        raise ValueError(f"find_imbalance(min_fraction={min_fraction}) must be 0 or more, e.g. 0.25.")
    if stand_apart < 1:
        raise ValueError(f"find_imbalance(stand_apart={stand_apart}) must be at least 1, e.g. 2.0.")
    keys = sorted({k for f in figures if f for k in f} - REPORT_ONLY)
    best: dict[str, tuple[float, str, int, float, float, list[float | None]]] = {}
    for key in keys:
        values = [(r, float(f[key])) for r, f in enumerate(figures) if f and f.get(key) is not None]
        if len(values) < 2:
            continue
        above = []
        for r, v in values:
            others = statistics.median([w for q, w in values if q != r])
            above.append((v - others, r, v, others))
        above.sort(reverse=True)
        gap, rank, value, others = above[0]
        if gap < min_bytes or gap < min_fraction * abs(others):
            continue
        if len(values) >= 3 and above[1][0] > 0 and gap < stand_apart * above[1][0]:
            continue
        channel = "host" if key.startswith("host_") else "device"
        score = gap / max(abs(others), 1.0)
        if channel not in best or score > best[channel][0]:
            row = [float(f[key]) if f and f.get(key) is not None else None for f in figures]
            best[channel] = (score, key, rank, value, others, row)
    out = []
    for channel, (_score, key, rank, value, others, row) in sorted(best.items()):
        label = _LABELS.get(key, key.removesuffix("_bytes").replace("_", " "))
        out.append(Finding(
            kind="rank_imbalance",
            step=step,
            key=f"rank_imbalance:{channel}",
            bytes=int(value - others),
            message=(
                f"Rank {rank} stands apart in {channel} memory: its {label} is {format_bytes(value)}, against "
                f"{format_bytes(others)} on the other ranks (median), {format_bytes(value - others)} more. Usual causes: "
                "work only that rank does (rank-0-only logging, evaluation, checkpoint saving or metric gathering that "
                "keeps objects), uneven batches (a sampler or bucketing that gives one rank longer sequences or more "
                "samples), or a leak on that rank only (its own findings name the holder). Fix: move rank-only work out "
                "of the step or free what it keeps, balance the batches (`DistributedSampler`, equal bucket sizes), and "
                "read that rank's report."
            ),
            details={"rank": rank, "figure": key, "value": value, "others_median": others, "per_rank": row},
        ))
    return out
