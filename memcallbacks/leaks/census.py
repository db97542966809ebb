"""Tensor census: which tensors are alive, what they are for (category), and who holds them."""

from __future__ import annotations

import dataclasses
import time
import warnings
from dataclasses import dataclass, field
from typing import Any, Iterable

import torch

from memcallbacks._base.storage import StorageKey
from memcallbacks._base.units import format_bytes
from memcallbacks.leaks.classify import StorageClassifier, as_list, scan_heap, unique
from memcallbacks.leaks.frozen import visible_heap
from memcallbacks.leaks.holders import HolderPath, search_paths
from memcallbacks.leaks.paths import GRAPH_HOP

__all__ = [
    "CATEGORIES",
    "NO_ROOT",
    "NOT_SEARCHED",
    "SUSPICIOUS",
    "Census",
    "HolderDelta",
    "TensorRecord",
    "UNNAMED",
    "container_of",
    "format_top_holders",
    "scan_heap",
    "take_census",
]

CATEGORIES = (
    "parameters",
    "gradients",
    "optimizer state",
    "buffers",
    "current batch",
    "previous batches",
    "graph-held",
    "other",
)
"""Census categories, in precedence order: a storage gets the first one that applies."""

MODEL_STATES = ("parameters", "gradients", "optimizer state", "buffers")
"""The model's own states: a storage that is one of them now and existed before is never growth."""

BATCHES = ("current batch", "previous batches")
"""The batches a census is told of: they get no holder path, so a census does not know which list held them."""

SUSPICIOUS = ("previous batches", "graph-held", "other")
"""Categories whose tensors get a holder path in a census."""

NO_ROOT = "(no root: a reference cycle awaiting gc, or held outside Python)"
NOT_SEARCHED = "(not searched: census time budget ran out)"

UNNAMED = frozenset((NO_ROOT, NOT_SEARCHED, *CATEGORIES))
"""The groups of :meth:`Census.by_holder` that name no holder: storages with no root, not searched, or not
searched for (a category: ``optimizer state`` of an optimizer in cyclic garbage)."""


def container_of(holder: str) -> str:
    """What holds a storage and everything it reaches through autograd graphs: ``FSDPBlocks.kept -> autograd graph``
    is ``FSDPBlocks.kept``, as ``FSDPBlocks.kept`` (the holder of a path, :func:`~memcallbacks.leaks.paths.holder_of`)."""
    return holder[: -len(GRAPH_HOP)] if holder.endswith(GRAPH_HOP) else holder


@dataclass
class TensorRecord:
    """One storage in a census (views of the same storage are one record)."""

    device: str
    data_ptr: int
    """Address of the storage (matches allocator snapshots and ``untyped_storage().data_ptr()``)."""
    nbytes: int
    shape: str
    """``"256x512 float32"`` for the first tensor seen on this storage."""
    category: str
    path: str | None = None
    """Reference path from a root, for suspicious categories; ``None`` when not searched."""
    holder: str | None = None
    """``path`` with item subscripts dropped: what to group by (``"LitModel.cache"``)."""
    via_graph: bool = False
    """True when the only path found runs through an autograd graph."""

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


@dataclass
class HolderDelta:
    """Change of one holder between two censuses: what it keeps itself and what it keeps through the autograd
    graphs of its tensors (their leaves, grads and saved tensors), together."""

    holder: str
    tensors: int
    bytes: int
    graph_bytes: int = 0
    """Of :attr:`bytes`, what it keeps through autograd graphs (``FSDPBlocks.kept -> autograd graph``)."""
    held_tensors: int | None = None
    """What the holder keeps alive in all at the later census (``None``: not known)."""
    held_bytes: int | None = None

    def __str__(self) -> str:
        verb = "grew" if self.bytes >= 0 else "shrank"
        n = abs(self.tensors)
        text = f"{self.holder} {verb} by {n} tensor{'s' if n != 1 else ''} / {format_bytes(abs(self.bytes))}"
        if self.graph_bytes and self.bytes > 0:
            text += f" ({format_bytes(self.graph_bytes)} of it through their autograd graphs)"
        if self.held_bytes is not None and self.bytes > 0 and self.held_bytes > 1.1 * self.bytes:
            text += f"; it keeps {self.held_tensors} tensors / {format_bytes(self.held_bytes)} alive in all"
        return text


@dataclass
class Census:
    """Live tensors by category and holder, and what the census cost."""

    step: int | None
    bytes_by_category: dict[str, int]
    tensors_by_category: dict[str, int]
    records: list[TensorRecord] = field(repr=False)
    seconds: float
    objects_scanned: int
    """Python objects looked at: ``gc.get_objects()`` plus the objects the path search visited."""
    truncated: bool
    """True when the path search stopped at the time budget (some holders are unknown)."""
    paths: list[HolderPath] = field(default_factory=list, repr=False)
    """Paths to the explicit ``targets`` given to :func:`take_census`."""

    @property
    def total_bytes(self) -> int:
        return sum(self.bytes_by_category.values())

    def by_holder(self, skip: frozenset[tuple[str, int, int]] = frozenset()) -> dict[str, tuple[int, int]]:
        """``{holder: (tensors, bytes)}``; unattributed storages group under their category.
        ``skip``: storages (``(device, data_ptr, nbytes)``) left out."""
        return {k: (v[0], v[1]) for k, v in self._by_container(skip).items()}

    def _by_container(self, skip: frozenset[tuple[str, int, int]] = frozenset()) -> dict[str, list[int]]:
        """``{container: [tensors, bytes, bytes through autograd graphs]}``: a holder and what it keeps through the
        graphs of its tensors are one container (:func:`container_of`)."""
        out: dict[str, list[int]] = {}
        for r in self.records:
            if skip and (r.device, r.data_ptr, r.nbytes) in skip:
                continue
            key = container_of(r.holder) if r.holder is not None else r.category
            acc = out.setdefault(key, [0, 0, 0])
            acc[0] += 1
            acc[1] += r.nbytes
            if r.holder is not None and key != r.holder:
                acc[2] += r.nbytes
        return out

    def grown_keys(self, before: Census, holders: Iterable[str]) -> set[tuple[str, int]]:
        """``(device, data_ptr)`` of the storages of ``holders`` (containers of :meth:`by_holder`) that ``before`` did not have."""
        names = set(holders)
        then = {(r.device, r.data_ptr, r.nbytes) for r in before.records}
        return {(r.device, r.data_ptr) for r in self.records if (r.device, r.data_ptr, r.nbytes) not in then
                and (container_of(r.holder) if r.holder is not None else r.category) in names}

    def diff(self, before: Census, *, min_bytes: int = 1) -> list[HolderDelta]:
        """What changed since ``before``, by holder: growth first, largest first, with the
        :data:`NOT_SEARCHED` group (storages whose holder a truncated census did not search) after
        every named holder that grew; then what shrank.

        A storage that an object (not a frame's local) held at both censuses is neither: the path
        search may reach it through another holder the second time (a dataset found through
        ``Trainer.fit_loop._data_source``, then ``Trainer.fit_loop._combined_loader``), and "grew by
        1 tensor" would then name a holder that holds nothing new. Nor is a storage that was there
        before and is now bound to a frame's variable itself (``local x``, no subscript or
        attribute), or that is a model state now (a model the first census missed). A storage that
        a frame held the first time (the step's batch) and a container keeps now counts as that
        container's growth; one that was a batch of the step the first time (not searched for a holder)
        does not, when it is all a container gained: a fixed list of batches (``for x in
        monitor.track(loader)``) is reached through ``loader[i]`` at one census and is the current
        batch at the other, a list that never grew."""
        held = {(r.device, r.data_ptr, r.nbytes) for r in before.records if r.holder and " local " not in r.holder and r.holder not in (NOT_SEARCHED, NO_ROOT)}
        existed = {(r.device, r.data_ptr, r.nbytes) for r in before.records}
        now_keys = {(r.device, r.data_ptr, r.nbytes) for r in self.records}
        settled = {(r.device, r.data_ptr, r.nbytes) for r in self.records if _bare_local(r) or r.category in MODEL_STATES}
        both = frozenset((held & now_keys) | (settled & existed))
        now, then, whole = self._by_container(both), before._by_container(both), self._by_container()
        moved = self._batches_only(before, both)
        deltas = []
        for key in set(now) | set(then):
            n1, b1, g1 = now.get(key, (0, 0, 0))
            n0, b0, g0 = then.get(key, (0, 0, 0))
            if abs(b1 - b0) >= min_bytes and not (key in moved and b1 > b0):
                held = whole.get(key) if key not in UNNAMED else None  # what a named holder keeps now, in all
                deltas.append(HolderDelta(key, n1 - n0, b1 - b0, max(0, g1 - g0), *((held[0], held[1]) if held else (None, None))))
        deltas.sort(key=lambda d: (d.bytes <= 0, d.holder == NOT_SEARCHED, -d.bytes))
        return deltas

    def _batches_only(self, before: Census, skip: frozenset[tuple[str, int, int]]) -> set[str]:
        """The named containers whose every storage new to them since ``before`` was a batch of ``before``'s step
        (:data:`BATCHES`): a batch the list held all along, seen as the step's batch the first time."""
        then: dict[str, set[tuple[str, int, int]]] = {}
        for r in before.records:
            then.setdefault(container_of(r.holder) if r.holder is not None else r.category, set()).add(key_of(r))
        batches = {key_of(r) for r in before.records if r.category in BATCHES}
        gained: dict[str, set[tuple[str, int, int]]] = {}
        for r in self.records:
            if r.holder is not None and r.holder not in UNNAMED and key_of(r) not in skip:
                container = container_of(r.holder)
                if key_of(r) not in then.get(container, ()):
                    gained.setdefault(container, set()).add(key_of(r))
        return {c for c, keys in gained.items() if keys <= batches}

    def top_holders(self, n: int = 5, categories: Iterable[str] = SUSPICIOUS) -> list[tuple[str, int, int]]:
        """``(holder, tensors, bytes)`` of the ``n`` largest holders among the given categories.

        Named holders come first, largest first. When the path search ran out of time, the
        storages it did not reach follow as one last entry, whatever their size, labelled
        :data:`NOT_SEARCHED` (so up to ``n + 1`` entries): a group nobody searched names no
        culprit, and must not push the holders that were found out of the first line.
        """
        cats = set(categories)
        acc: dict[str, list[int]] = {}
        for r in self.records:
            if r.category in cats:
                a = acc.setdefault(r.holder or r.category, [0, 0])
                a[0] += 1
                a[1] += r.nbytes
        unsearched = acc.pop(NOT_SEARCHED, None)
        top = sorted(((k, v[0], v[1]) for k, v in acc.items()), key=lambda x: -x[2])[:n]
        if unsearched is not None:
            top.append((NOT_SEARCHED, unsearched[0], unsearched[1]))
        return top

    def to_dict(self) -> dict[str, Any]:
        return {
            "step": self.step,
            "bytes_by_category": dict(self.bytes_by_category),
            "tensors_by_category": dict(self.tensors_by_category),
            "records": [r.to_dict() for r in self.records],
            "paths": [dataclasses.asdict(p) for p in self.paths],
            "seconds": self.seconds,
            "objects_scanned": self.objects_scanned,
            "truncated": self.truncated,
        }

    def to_frame(self) -> Any:
        """Records as a pandas DataFrame (pandas imported on call)."""
        import pandas as pd

        return pd.DataFrame([r.to_dict() for r in self.records])

    def summary(self) -> str:
        parts = [f"{c} {format_bytes(b)}" for c, b in self.bytes_by_category.items() if b]
        cost = f"{self.seconds:.2f} s, {self.objects_scanned} objects{', truncated' if self.truncated else ''}"
        return f"census: {', '.join(parts) or 'no tensors'} ({cost})"


def key_of(record: TensorRecord) -> tuple[str, int, int]:
    """A storage as two censuses both name it: ``(device, data_ptr, nbytes)``."""
    return record.device, record.data_ptr, record.nbytes


def _bare_local(record: TensorRecord) -> bool:
    """The record's path is a frame's variable itself (``"train() local x"``), not an item or an
    attribute reached through one."""
    path, holder = record.path, record.holder
    if not path or not holder or " local " not in holder or not (path == holder or path.startswith(holder + " (")):
        return False  # (a frame's path ends with its place: "train() local x (train.py:40)")
    return holder.split(" local ", 1)[1].isidentifier()


def format_top_holders(census: Census, n: int = 5) -> list[str]:
    """``"LitModel.cache (40 tensors, 10.0 MiB)"`` for each of :meth:`Census.top_holders`."""
    return [f"{holder} ({n_tensors} tensors, {format_bytes(nbytes)})" for holder, n_tensors, nbytes in census.top_holders(n)]


# ----------------------------------------------------------------------------------------------
# Taking a census
# ----------------------------------------------------------------------------------------------


def take_census(
    *,
    model: torch.nn.Module | Iterable[torch.nn.Module] | None = None,
    optimizer: torch.optim.Optimizer | Iterable[torch.optim.Optimizer] | None = None,
    current_batch: Any = None,
    previous_batches: Iterable[Any] = (),
    targets: Iterable[torch.Tensor] = (),
    find_paths: bool = True,
    time_budget_s: float = 2.0,
    step: int | None = None,
    ignore: Iterable[Any] = (),
) -> Census:
    """Count live tensors by storage and category; find holders of the suspicious ones.

    Sees every tensor Python can reach (``gc.get_objects``), their ``.grad``s, optimizer state,
    and tensors only autograd graphs hold (``AccumulateGrad.variable``, saved tensors). Models
    and optimizers found in the heap are used even when not passed. ``previous_batches``: the
    batches of earlier steps the engine still has. ``targets`` get paths in ``Census.paths``
    whatever their category. A frozen heap (``gc.freeze()``) is thawed for the census. Runs only on
    demand; its cost is in the result.
    """
    start, deadline = time.perf_counter(), time.thread_time() + time_budget_s  # the budget in CPU time (leaks/search.py)
    if time_budget_s <= 0:
        raise ValueError(f"take_census(time_budget_s={time_budget_s}) must be positive; try 2.0.")
    with warnings.catch_warnings(), visible_heap():  # two censuses that saw different parts of a frozen heap would disagree
        warnings.simplefilter("ignore")
        n_objects, tensors, modules, optimizers = scan_heap()
        modules = unique(as_list(model) + modules, torch.nn.Module)
        optimizers = unique(as_list(optimizer) + optimizers, torch.optim.Optimizer)
        sorter = StorageClassifier()
        sorter.mark_model_states(modules, optimizers, tensors)
        sorter.mark_batches(current_batch, previous_batches)
        sorter.mark_graph_held(tensors)
        sorter.mark_other(tensors)
        target_keys = sorter.mark_targets(targets)
        del tensors
        records = _records(sorter)
        del sorter
        scanned, truncated, paths = n_objects, False, []
        if find_paths:
            wanted = {k for k, r in records.items() if r.category in SUSPICIOUS} | target_keys
            if wanted:
                searched, truncated, paths = _attribute(records, wanted, target_keys, ignore, deadline)
                scanned += searched
    paths.sort(key=lambda p: -p.nbytes)
    bytes_by, count_by = _totals(records.values())
    return Census(
        step=step,
        bytes_by_category=bytes_by,
        tensors_by_category=count_by,
        records=sorted(records.values(), key=lambda r: -r.nbytes),
        seconds=time.perf_counter() - start,
        objects_scanned=scanned,
        truncated=truncated,
        paths=paths,
    )


def _records(sorter: StorageClassifier) -> dict[StorageKey, TensorRecord]:
    out: dict[StorageKey, TensorRecord] = {}
    for key, cat in sorter.category.items():
        nbytes, shape = sorter.info[key]
        out[key] = TensorRecord(device=str(key[0]), data_ptr=key[1], nbytes=nbytes, shape=shape, category=cat)
    return out


def _attribute(
    records: dict[StorageKey, TensorRecord],
    wanted: set[StorageKey],
    target_keys: set[StorageKey],
    ignore: Iterable[Any],
    deadline: float,
) -> tuple[int, bool, list[HolderPath]]:
    """Give the ``wanted`` records their paths and holders; return (objects scanned, truncated, target paths).

    The path decides between "other" and "graph-held": a tensor only an autograd graph reaches is graph-held.
    """
    rendered, search = search_paths(wanted, ignore, deadline)
    paths: list[HolderPath] = []
    for key in wanted:
        rec = records[key]
        got = rendered.get(key)
        if got is None:
            rec.holder = NOT_SEARCHED if search.truncated else NO_ROOT
            continue
        rec.path, rec.holder, rec.via_graph = got
        if rec.category == "other" and rec.via_graph:
            rec.category = "graph-held"
        elif rec.category == "graph-held" and not rec.via_graph:
            rec.category = "other"
        if key in target_keys:
            paths.append(HolderPath(rec.path, rec.holder, rec.shape, rec.nbytes, rec.via_graph))
    return search.scanned, search.truncated, paths


def _totals(records: Iterable[TensorRecord]) -> tuple[dict[str, int], dict[str, int]]:
    """Bytes and storage counts by category, every category present."""
    bytes_by: dict[str, int] = {c: 0 for c in CATEGORIES}
    count_by: dict[str, int] = {c: 0 for c in CATEGORIES}
    for r in records:
        bytes_by[r.category] += r.nbytes
        count_by[r.category] += 1
    return bytes_by, count_by
