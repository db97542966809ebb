"""Lingering tensors held only by cyclic garbage: unreachable objects the collector has not freed yet."""

from __future__ import annotations

import collections
import gc
import logging
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Iterator

import torch

from memcallbacks._base.cpu import counted_collection
from memcallbacks._base.findings import Finding, cycle_types, evidence_of
from memcallbacks._base.storage import distinct_bytes, storage_keys
from memcallbacks._base.units import format_bytes
from memcallbacks.leaks.cycles import cycle_fix, cycle_for
from memcallbacks.leaks.tensors import graph_tensors, is_parameter

log = logging.getLogger(__name__)

__all__ = ["GarbageNote", "cyclic_garbage_note", "garbage_holding", "gc_paused"]


@contextmanager
def gc_paused() -> Iterator[None]:
    """Python's automatic collections held off: a holder search allocates enough to start one, which
    would free the cyclic garbage the search is about to look for (it would then find no holder, and
    the garbage no cycle)."""
    was = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was:
            gc.enable()


@dataclass
class GarbageNote:
    holders: list[str]
    """``"cyclic garbage: Ctx -> dict -> Ctx holds Ctx.batch (Tensor 128x1024 float32)"``."""
    tensor_bytes: int = 0
    """What the garbage kept alive: its tensors' distinct storages and what their autograd graphs hold (leaves, their
    grads, saved tensors), parameters left out."""

    @property
    def cycles(self) -> list[list[str]]:
        """The types that tell each cycle apart (:func:`~memcallbacks._base.findings.cycle_types`): what ties this
        garbage to a ``cycle`` finding of the same cycle."""
        return [cycle_types(h) for h in self.holders]

    @property
    def key(self) -> str:
        """``cycle:Record -> Record``: the key a ``cycle`` finding of this cycle has."""
        return "cycle:" + self.holders[0].removeprefix("cyclic garbage: ").split(" holds ")[0]

    def cycle_finding(self, seen: Finding, step: int, what: str, nbytes: int) -> Finding:
        """The ``cycle`` finding that ``seen`` (a lingering step, a chain of graphs) turns out to be: ``what`` (``"Step
        0's batch (1.0 MiB)"``) was alive at ``step`` only because a reference cycle held it."""
        return Finding(
            kind="cycle", step=step, key=self.key, bytes=int(max(nbytes, self.tensor_bytes)), holders=list(self.holders),
            message=(
                f"{what} still alive when step {step} started, held only by reference cycles that nothing reaches any "
                "more (cyclic garbage): they live until the garbage collector next runs, so every step until then adds "
                f"to memory ({format_bytes(max(nbytes, self.tensor_bytes))} of tensors in that garbage). "
                f"{cycle_fix(self.holders)} The holders name the cycle."
            ),
            details={**seen.details, "in_cyclic_garbage": True, "cycles": self.cycles},
            evidence=[evidence_of(seen)],
        )


@contextmanager
def _saved_garbage() -> Iterator[list[Any]]:
    """A collection that keeps the cyclic garbage it finds (``gc.DEBUG_SAVEALL``), for the block to look at; the
    garbage is freed when the block ends. Both collections are the monitor's own work: their time is own time."""
    flags = gc.get_debug()
    n0 = len(gc.garbage)
    gc.set_debug(flags | gc.DEBUG_SAVEALL)
    try:
        with counted_collection():
            gc.collect()
    finally:
        gc.set_debug(flags)
    garbage = gc.garbage[n0:]
    del gc.garbage[n0:]
    try:
        yield garbage
    finally:
        garbage.clear()
        del garbage
        with counted_collection():
            gc.collect()  # really free it now


def cyclic_garbage_note(targets: list[torch.Tensor]) -> GarbageNote | None:
    """Whether objects in cyclic garbage hold ``targets``; collects (that garbage is freed)."""
    wanted = {id(t): t for t in targets}
    with _saved_garbage() as garbage:
        try:
            return _note(garbage, wanted)
        except Exception:
            log.debug("could not describe the cyclic garbage", exc_info=True)
            return None


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
    return GarbageNote(holders, _kept_bytes(garbage)) if holders else None


def _kept_bytes(garbage: list[Any]) -> int:
    tensors = [o for o in garbage if isinstance(o, torch.Tensor)]
    kept = [t for t in tensors if not is_parameter(t)]
    for t, _how in graph_tensors([t for t in tensors if t.grad_fn is not None][:200]):
        if not is_parameter(t):
            kept.append(t)
            if t.is_leaf and t.grad is not None:
                kept.append(t.grad)
    return distinct_bytes(kept)


def garbage_holding(keys: set[tuple[str, int]], limit: int = 20) -> GarbageNote | None:
    """Whether cyclic garbage holds the storages ``keys`` (``(device, data_ptr)``, as a census names them), directly
    or through the autograd graph of a tensor in the garbage; collects (that garbage is freed)."""
    with _saved_garbage() as garbage:
        try:
            targets: dict[int, torch.Tensor] = {}
            graphs = 0
            for o in garbage:
                if not isinstance(o, torch.Tensor):
                    continue
                if _holds(o, keys):
                    targets[id(o)] = o
                elif o.grad_fn is not None and graphs < 200:
                    graphs += 1
                    if any(_holds(t, keys) for t, _how in graph_tensors([o])):
                        targets[id(o)] = o
                if len(targets) >= limit:
                    break
            return _note(garbage, targets) if targets else None
        except Exception:
            log.debug("could not look for the grown tensors in the cyclic garbage", exc_info=True)
            return None


def _holds(t: torch.Tensor, keys: set[tuple[str, int]]) -> bool:
    return any((str(key[0]), key[1]) in keys for key, _n in storage_keys(t))
