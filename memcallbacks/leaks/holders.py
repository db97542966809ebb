"""Who holds a tensor: reference paths from the roots (frame locals, globals) to target storages."""

from __future__ import annotations

import re
import time
import warnings
from dataclasses import dataclass
from typing import Any, Iterable

import torch

from memcallbacks._base.storage import StorageKey, storage_keys
from memcallbacks._base.units import format_bytes
from memcallbacks.leaks.paths import render_chain
from memcallbacks.leaks.roots import Roots
from memcallbacks.leaks.search import ReferenceSearch
from memcallbacks.leaks.tensors import describe_tensor

__all__ = ["HolderPath", "HolderSearch", "find_holders", "group_paths", "search_paths"]

# a path that ends in sequence indices (``outputs['past_key_values'][1][0]``), before an optional
# "(file:line)" of a frame local
_INDEXED = re.compile(r"^(?P<head>.*?)(?P<index>(?:\[\d+\])+)(?P<where> \([^()]*\))?$")


@dataclass
class HolderPath:
    """A reference path from a root to a tensor."""

    path: str
    """e.g. ``"train() local outputs['loss'] (train.py:42) -> autograd graph -> leaf tensor 256x512 float32"``."""
    holder: str
    """The container, for grouping: ``"LitModel.cache"``, ``"module m: global SEEN"``."""
    tensor: str
    """``"256x512 float32"``."""
    nbytes: int
    via_graph: bool

    def __str__(self) -> str:
        return f"{self.path} ({format_bytes(self.nbytes)})"


def group_paths(paths: list[HolderPath]) -> list[str]:
    """One line per holder: paths into one container that differ only in their trailing sequence
    indices (a kept output's KV cache, ``outputs['past_key_values'][i][j]``; ``self.cache[17]``) make
    one line, ``outputs['past_key_values'][...] (4 tensors, 4.0 MiB)``, where the first of them was.
    Paths through an autograd graph stay as they are."""
    groups: dict[str, list[HolderPath]] = {}
    order: list[tuple[str, HolderPath | None]] = []
    for p in paths:
        m = None if p.via_graph or " -> " in p.path else _INDEXED.match(p.path)
        if m is None:
            order.append(("", p))
            continue
        key = m.group("head") + "[...]" + (m.group("where") or "")
        if key not in groups:
            groups[key] = []
            order.append((key, None))
        groups[key].append(p)
    lines = []
    for key, p in order:
        if p is not None:
            lines.append(str(p))
        elif len(groups[key]) == 1:
            lines.append(str(groups[key][0]))
        else:
            members = groups[key]
            lines.append(f"{key} ({len(members)} tensors, {format_bytes(sum(m.nbytes for m in members))})")
    return lines


@dataclass
class HolderSearch:
    """Result of :func:`find_holders`."""

    paths: list[HolderPath]
    missing: int
    """Targets for which no path was found (unreachable from roots, or budget ran out)."""
    seconds: float
    objects_scanned: int
    truncated: bool
    """True when the time budget ran out before every target was found."""


def search_paths(
    wanted: Iterable[StorageKey], ignore: Iterable[Any], deadline: float
) -> tuple[dict[StorageKey, tuple[str, str, bool]], ReferenceSearch]:
    """``{key: (path, holder, via_graph)}`` for the storages a search from the roots reached.

    The search comes back released (it holds no object), for its counters.
    """
    roots = Roots()
    search = ReferenceSearch(roots, ignore, deadline)
    search.run(set(wanted))
    found = list(search.found.items())
    chains = search.chains([(t, depth) for _, (t, depth) in found])
    out = {}
    for key, (t, _depth) in found:
        chain = chains.get(id(t))
        if chain is not None:
            out[key] = render_chain(chain, roots)
    search.release()
    return out, search


def _wanted(targets: Iterable[torch.Tensor]) -> dict[StorageKey, tuple[int, str]]:
    wanted: dict[StorageKey, tuple[int, str]] = {}
    for t in targets:
        for key, nbytes in storage_keys(t):
            wanted.setdefault(key, (nbytes, describe_tensor(t)))
    return wanted


def find_holders(
    targets: Iterable[torch.Tensor],
    *,
    time_budget_s: float = 2.0,
    ignore: Iterable[Any] = (),
) -> HolderSearch:
    """Reference paths from roots (locals of every frame, module globals) to ``targets``.

    Targets match by storage, so a path to any view counts. Paths may pass through autograd
    graphs (``... -> autograd graph -> leaf tensor 256x512 float32``); a path through an
    nn.Module is named from the outermost module (``LitModel.cache[17]``). ``ignore``: objects
    not to search through (e.g. the monitor that holds the targets itself).
    """
    start, deadline = time.perf_counter(), time.thread_time() + time_budget_s  # the budget in CPU time (leaks/search.py)
    if time_budget_s <= 0:
        raise ValueError(f"find_holders(time_budget_s={time_budget_s}) must be positive; try 2.0.")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # module attributes that warn when touched
        wanted = _wanted(targets)
        rendered, search = search_paths(wanted, ignore, deadline)
    paths = [
        HolderPath(path, holder, wanted[key][1], wanted[key][0], via_graph)
        for key, (path, holder, via_graph) in rendered.items()
    ]
    paths.sort(key=lambda p: -p.nbytes)
    return HolderSearch(
        paths=paths,
        missing=len(wanted) - len(paths),
        seconds=time.perf_counter() - start,
        objects_scanned=search.scanned,
        truncated=search.truncated,
    )
