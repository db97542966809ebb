"""torch.distributed helpers: rank and world, one-collective max over ranks, object gather.

Every collective's tensors go to :func:`_collective_device` (the monitored device under NCCL), never
to ``torch.cuda.current_device()``.
"""

from __future__ import annotations

import math
import pickle
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


_LAST_COLLECTIVE: list[torch.Tensor] = []
"""The tensors of the last collective this module ran, kept alive from Python until the next one.

torch's gloo process group releases a finished ``all_gather`` work in its run-loop thread. When
Python has already dropped the tensors, that release hands each tensor's Python object back
through ``decref_pyobject``, and that needs the GIL. A rank that ends right after our last gather
(``wait_for_every_rank``) deallocates its DDP ``Reducer`` and with it the process group. That
happens with the GIL held and joins the run-loop thread: a deadlock. It was seen as a rank that
never exited in a 2-rank Accelerate test. While the Python objects are alive, the loop thread's
release is a plain reference decrement. The tensors are a few bytes (``max_over_ranks``) or one
gather's pickled payload (``gather_objects``)."""


def _keep(*tensors: Any) -> None:
    _LAST_COLLECTIVE[:] = [t for group in tensors for t in (group if isinstance(group, list) else [group])]


def max_over_ranks(values: Sequence[float], device: torch.device | None = None) -> tuple[list[float], list[int]]:
    """Return ``(max over ranks, rank holding it)`` for every value, in a single ``all_gather``.

    NaN stands for "this rank has no value" (a rank whose monitor disabled itself still joins
    the collective with NaNs so the others never hang). ``device``: the monitored device.

    Under NCCL the gathered table comes back to the host with one device-to-host copy, which waits
    for the work queued on the device so far: a synchronization on every logged step
    (docs/metrics.md; ``reduce_across_ranks=False`` avoids it). The values have to reach the host
    to be logged, and NCCL has no host-memory path.
    """
    if not is_distributed():
        return list(values), [0] * len(values)
    world = torch.distributed.get_world_size()
    local = torch.tensor(list(values), dtype=torch.float64, device=_collective_device(device))
    gathered = [torch.empty_like(local) for _ in range(world)]
    torch.distributed.all_gather(gathered, local)
    _keep(local, gathered)
    table = torch.stack(gathered).cpu()  # the one device-to-host copy (a sync under NCCL)
    table = torch.nan_to_num(table, nan=-math.inf)
    best, ranks = table.max(dim=0)
    return best.tolist(), ranks.tolist()


def gather_objects(obj: Any, device: torch.device | None = None) -> list[Any]:
    """Every rank's ``obj`` (picklable), in rank order, on every rank; ``[obj]`` when not distributed.

    torch's ``all_gather_object`` puts its byte tensors on ``torch.cuda.current_device()`` under
    NCCL (``_get_object_coll_device`` gives only the device type, and ``_object_to_tensor`` calls
    ``.to("cuda")``), so a plain loop that never called ``set_device`` would gather every rank's
    object through ``cuda:0``. This does the same two ``all_gather`` calls (sizes, then the padded
    bytes) with the tensors on :func:`_collective_device` (``device``: the monitored device).
    """
    if not is_distributed():
        return [obj]
    world = torch.distributed.get_world_size()
    where = _collective_device(device)
    data = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
    size = torch.tensor([len(data)], dtype=torch.int64, device=where)
    sizes = [torch.empty_like(size) for _ in range(world)]
    torch.distributed.all_gather(sizes, size)
    lengths = [int(n) for n in torch.cat(sizes).tolist()]
    longest = max(lengths)
    local = torch.zeros(longest, dtype=torch.uint8)
    local[: len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
    local = local.to(where)
    out = [torch.empty(longest, dtype=torch.uint8, device=where) for _ in range(world)]
    torch.distributed.all_gather(out, local)
    _keep(size, sizes, local, out)
    return [pickle.loads(t[:n].cpu().numpy().tobytes()) for t, n in zip(out, lengths)]
