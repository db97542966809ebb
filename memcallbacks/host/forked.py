"""Processes forked during a monitored run start their garbage collector afresh, as a new interpreter.

A forked DataLoader worker shares its parent's pages until one of them writes to a page, and it inherits
the collector's state with them: the generation counts and the objects promoted to the oldest generation
since the last full collection. CPython collects the whole heap once the oldest generation's count has
passed 10 and those promoted objects pass a quarter of the objects its last full collection kept. A worker
forked from a parent close to both runs that collection at its first allocations: it writes the collector
header of every object it inherited, and each worker ends up with its own copy of the parent's Python heap
(timm's ``train.py``: 15 -> 120 MiB a worker). The monitor's own objects (its modules, its tables) move a
parent towards it, so while a run is monitored a child's counts start at zero (``gc.freeze()`` then
``gc.unfreeze()`` in the child: two list splices, the inherited objects join the oldest generation and nothing
stays frozen). docs/host.md ("What a monitored run costs a worker") has the measurements.
"""

from __future__ import annotations

import gc
import os
import weakref
from typing import Any

__all__ = ["guard_forked_children", "unguard_forked_children"]

_runs: weakref.WeakSet[Any] = weakref.WeakSet()  # the monitored runs of this process (each start's owner)
_hooked: list[bool] = []


def _fresh_collector() -> None:
    """``os.register_at_fork(after_in_child=...)``: in a child of a monitored process, the collector's counts start
    at zero (not where the collector is off, nor in a process that froze objects itself: unfreeze would thaw them)."""
    if not _runs:
        return
    _runs.clear()  # no monitor runs in the child
    try:
        if gc.isenabled() and gc.get_freeze_count() == 0:
            gc.freeze()
            gc.unfreeze()
    except Exception:
        pass


def guard_forked_children(run: Any) -> None:
    """From now on (``run``'s start) a process forked from this one starts its collector afresh; safe to call twice."""
    if not _hooked and hasattr(os, "register_at_fork"):
        os.register_at_fork(after_in_child=_fresh_collector)  # once a process: a fork handler cannot be removed
        _hooked.append(True)
    _runs.add(run)


def unguard_forked_children(run: Any) -> None:
    """Undo :func:`guard_forked_children` for ``run`` (its end); safe to call twice."""
    _runs.discard(run)
