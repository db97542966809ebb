"""torch.distributed helpers: rank/world discovery and one-collective max-over-ranks reduction."""

from __future__ import annotations

import math
from typing import Any, Sequence

import torch

__all__ = ["is_distributed", "rank_and_world", "max_over_ranks", "gather_objects"]


def is_distributed() -> bool:
    return torch.distributed.is_available() and torch.distributed.is_initialized()


def rank_and_world() -> tuple[int, int]:
    if is_distributed():
        return torch.distributed.get_rank(), torch.distributed.get_world_size()
    return 0, 1


def _collective_device(device: torch.device | None = None) -> torch.device:
    """Where the collective's tensor goes: the monitored device for NCCL/XCCL, which need one.

    Not ``torch.cuda.current_device()``: a plain loop that did ``model.to(f"cuda:{local_rank}")``
    without ``set_device`` would put every rank's tensor on ``cuda:0``.
    """
    backend = torch.distributed.get_backend()
    if backend == "nccl":
        if device is not None and device.type == "cuda":
            return torch.device("cuda", device.index if device.index is not None else torch.cuda.current_device())
        return torch.device("cuda", torch.cuda.current_device())
    if backend in ("xccl",):
        if device is not None and device.type == "xpu":
            return device
        return torch.device("xpu", torch.xpu.current_device())
    return torch.device("cpu")


def max_over_ranks(values: Sequence[float], device: torch.device | None = None) -> tuple[list[float], list[int]]:
    """Return ``(max over ranks, rank holding it)`` for every value, in a single ``all_gather``.

    NaN stands for "this rank has no value" (a rank whose monitor disabled itself still joins
    the collective with NaNs so the others never hang). ``device``: the monitored device.
    """
    if not is_distributed():
        return list(values), [0] * len(values)
    world = torch.distributed.get_world_size()
    local = torch.tensor(list(values), dtype=torch.float64, device=_collective_device(device))
    gathered = [torch.empty_like(local) for _ in range(world)]
    torch.distributed.all_gather(gathered, local)
    table = torch.stack(gathered).cpu()
    table = torch.nan_to_num(table, nan=-math.inf)
    best, ranks = table.max(dim=0)
    return best.tolist(), ranks.tolist()


def gather_objects(obj: Any) -> list[Any]:
    """``all_gather_object`` when distributed, ``[obj]`` otherwise."""
    if not is_distributed():
        return [obj]
    out: list[Any] = [None] * torch.distributed.get_world_size()
    torch.distributed.all_gather_object(out, obj)
    return out
