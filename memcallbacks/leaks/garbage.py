"""Lingering tensors held only by cyclic garbage: unreachable objects the collector has not freed yet."""

from __future__ import annotations

import collections
import gc
import logging
from dataclasses import dataclass
from typing import Any

import torch

from memcallbacks._base.cpu import counted_collection
from memcallbacks.leaks.cycles import cycle_for

log = logging.getLogger(__name__)

__all__ = ["GarbageNote", "cyclic_garbage_note"]


@dataclass
class GarbageNote:
    holders: list[str]
    """``"cyclic garbage: Ctx -> dict -> Ctx holds Ctx.batch (Tensor 128x1024 float32)"``."""

    def message(self, lingering: str) -> str:
        """The lingering finding's message, its usual-cause sentence replaced by this one's."""
        head = lingering.split(" Something keeps")[0]
        return (
            f"{head} No live object holds them: they sit in reference cycles that nothing reaches any more "
            "(cyclic garbage), which only the garbage collector frees, whenever it next runs. Break the "
            "cycle (`weakref.ref(obj)` for back-references, clear the attribute when done, or do not keep "
            "the batch on an object that points back at itself). The holders name the cycle."
        )


def cyclic_garbage_note(targets: list[torch.Tensor]) -> GarbageNote | None:
    """Whether objects in cyclic garbage hold ``targets``; collects (that garbage is freed)."""
    wanted = {id(t): t for t in targets}
    flags = gc.get_debug()
    n0 = len(gc.garbage)
    gc.set_debug(flags | gc.DEBUG_SAVEALL)
    try:
        with counted_collection():  # the monitor's own work: its time is own time
            gc.collect()
    finally:
        gc.set_debug(flags)
    garbage = gc.garbage[n0:]
    del gc.garbage[n0:]
    try:
        return _note(garbage, wanted)
    except Exception:
        log.debug("could not describe the cyclic garbage", exc_info=True)
        return None
    finally:
        garbage.clear()
        del garbage
        with counted_collection():
            gc.collect()  # really free it now


def _note(garbage: list[Any], wanted: dict[int, torch.Tensor]) -> GarbageNote | None:
    if not garbage:
        return None
    ids = {id(o) for o in garbage}
    children: dict[int, list[Any]] = {}
    parents: dict[int, list[Any]] = collections.defaultdict(list)
    held: dict[int, torch.Tensor] = {}
    for o in garbage:
        kids = [c for c in gc.get_referents(o) if id(c) in ids or id(c) in wanted]
        children[id(o)] = kids
        for c in kids:
            parents[id(c)].append(o)
            if id(c) in wanted:
                held[id(c)] = c
    holders = []
    for t in list(held.values())[:3]:
        desc = cycle_for(t, children, parents)
        if desc is not None and f"cyclic garbage: {desc}" not in holders:
            holders.append(f"cyclic garbage: {desc}")
    return GarbageNote(holders) if holders else None
