"""Graph chains: autograd graphs of several earlier steps alive at once (a total without detach()).

``self.total = self.total + loss`` links every step's graph to the next one. After ``backward()``
each graph holds few bytes (its nodes, no saved tensors), so neither the lingering threshold nor
the growth detector sees it early, but the number of graphs grows without bound. The lingering
detector marks each watched step's graph with a sentinel that dies with the graph;
:class:`GraphChains` keeps weak references to the sentinels of the last few marked steps, and
:data:`MIN_STEPS_ALIVE` of them alive at once is a leak whatever their size.

The finding is of kind ``"growth"`` with the growth detector's key: a chain *is* unbounded
retention, reported within a few steps instead of after the growth warm-up, and the growth
detector's later confirmation (rate, census holders) updates the same finding.
"""

from __future__ import annotations

import collections
import weakref
from typing import Any

from memcallbacks._base.findings import Finding
from memcallbacks._base.units import format_bytes

__all__ = ["GraphChains", "MIN_STEPS_ALIVE", "chain_finding"]

MIN_STEPS_ALIVE = 3
"""Graphs of this many earlier steps alive at once are a chain (one kept step is lingering, two a
``prev``/``cur`` pair)."""

_WINDOW = 8


class GraphChains:
    """Weak references to the sentinels of the last marked steps; :meth:`check` costs a few
    dereferences per step and stops once a chain has been reported."""

    def __init__(self, min_steps: int = MIN_STEPS_ALIVE, window: int = _WINDOW) -> None:
        if min_steps < 2 or window < min_steps:
            raise ValueError(f"GraphChains(min_steps={min_steps}, window={window}): need 2 <= min_steps <= window.")
        self.min_steps = min_steps
        self._marks: collections.deque[tuple[int, weakref.ref[Any]]] = collections.deque(maxlen=window)
        self.reported = False

    def mark(self, step: int, sentinel: Any) -> None:
        """Step ``step``'s graph carries ``sentinel`` (it dies with the graph)."""
        if not self.reported:
            self._marks.append((step, weakref.ref(sentinel)))

    def check(self, step: int) -> list[tuple[int, Any]] | None:
        """At the start of ``step``: ``[(step, sentinel)]`` of the earlier graphs alive, oldest first,
        the first time at least ``min_steps`` of them are; else None."""
        if self.reported or len(self._marks) < self.min_steps:
            return None
        alive = []
        for s, ref in self._marks:
            if s < step:
                sentinel = ref()
                if sentinel is not None:
                    alive.append((s, sentinel))
        if len(alive) < self.min_steps:
            return None
        self.reported = True
        self._marks.clear()
        return alive


def chain_finding(step: int, steps_alive: list[int], nbytes: int, holders: list[str]) -> Finding:
    """The ``growth`` finding for a graph chain seen at the start of ``step``."""
    shown = ", ".join(str(s) for s in steps_alive)
    return Finding(
        kind="growth",
        key="growth",
        step=step,
        bytes=int(nbytes),
        message=(
            f"The autograd graphs of steps {shown} were all still alive when step {step} started "
            f"({format_bytes(nbytes)} of tensors in them besides parameters): something links every step's "
            "graph to the next and keeps them all, usually a running total without `.detach()` "
            "(`self.total = self.total + loss`), an evaluation without `torch.no_grad()` summed into a "
            "variable, or outputs kept with their graphs in a list. After `backward()` each graph is "
            "small, but their number (nodes, saved tensors of graphs never backpropagated) grows every "
            "step without bound. Accumulate `loss.detach()` or `loss.item()`, evaluate under "
            "`torch.no_grad()`, keep `.detach()`ed outputs. The holders show the variable."
        ),
        holders=holders,
        details={"evidence": "graph_chain", "graph_steps_alive": list(steps_alive), "graph_bytes": int(nbytes)},
    )
