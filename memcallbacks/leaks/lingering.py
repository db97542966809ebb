"""Lingering detection: the marks a step leaves, and step N-1's batch or graph still alive at step N.

At a watched step's end the detector leaves marks for the next step's check: weak references to
the batch's tensors and to the storages of the model's outputs, and a :class:`Sentinel` in
``grad_fn.metadata`` of the loss's graph (it dies exactly with the graph; :class:`GraphChains`
watches several of them). Storages, not tensors, are watched for outputs: frameworks hand the
monitor ``.detach()``ed copies while the user keeps the original; both share one storage, whose
Python object lives exactly as long as any tensor on it.
"""

from __future__ import annotations

import collections
import logging
import weakref
from typing import Any

import torch

from memcallbacks._base.findings import Finding
from memcallbacks._base.storage import storage_keys
from memcallbacks._base.units import MiB
from memcallbacks.leaks.roots import METADATA_KEY, find_graph_root
from memcallbacks.leaks.lingering_text import lingering_finding
from memcallbacks.leaks.tensors import describe_tensor, graph_freed, graph_tensors, is_parameter, iter_tensors

log = logging.getLogger(__name__)

__all__ = [
    "LingeringDetector", "GraphChains", "MIN_STEPS_ALIVE", "Sentinel", "mark_graphs", "OutputRef",
    "output_refs", "alive_outputs", "batch_weakrefs", "plain_tensors", "storage_tensor",
]

_Tensor = torch.Tensor


class LingeringDetector:
    """Notices step N-1's batch or autograd graph still alive when step N starts.

    ``end_step(step, batch, loss)`` takes weak references to the batch's tensors and marks the
    loss's autograd graph: a sentinel goes into ``grad_fn.metadata`` of the loss node and of its
    immediate next nodes, so a loss the user keeps is noticed even when the framework handed
    over a derived tensor (``loss / accumulate_grad_batches``). ``check(step)`` at the start of
    the next step looks at those weak references; when nothing is alive it costs a few
    microseconds.

    When something is alive, the bytes it holds are measured: the batch's storages, plus the
    leaves (not parameters), their grads and the saved tensors of the graph. Batch tensors the
    graph does not hold count only if the batch of two steps ago is gone: an in-memory dataset
    or a cache keeps every batch (that is retention, for the growth detector), not one step's.
    A finding needs at least ``min_bytes`` and is reported once per cause. A cause below
    ``min_bytes`` (e.g. a loop variable ``loss`` whose graph, after ``backward()``, holds only
    parameters) is re-measured with exponential back-off (2, 4, ... steps) until the back-off passes
    ``max_backoff_steps``; then that situation is not measured again in the run. A check that cannot
    tell yet (outputs alive, none of two steps ago to compare) asks for marks at the next step
    (:attr:`wants_mark`) and is not backed off: the next check tells. Finding a graph's root looks at
    the variables of every frame and ``__main__`` first (a loop's ``loss = loss / k``); only when
    they do not reach the mark is the heap scanned (~0.1-0.5 s on a big heap, counted in
    :attr:`heap_scans`; the session's budget widens the interval between checks when they cost).
    """

    def __init__(self, *, min_bytes: int = 1 * MiB, max_tensors: int = 256, max_backoff_steps: int = 64) -> None:
        if min_bytes < 0:
            raise ValueError(f"LingeringDetector(min_bytes={min_bytes}) must be 0 or more; try 1048576.")
        if max_tensors < 1:
            raise ValueError(f"LingeringDetector(max_tensors={max_tensors}) must be at least 1; try 256.")
        if max_backoff_steps < 1:
            raise ValueError(f"LingeringDetector(max_backoff_steps={max_backoff_steps}) must be at least 1.")
        self.min_bytes = min_bytes
        self.max_tensors = max_tensors
        self.max_backoff_steps = max_backoff_steps
        self.reset()

    def reset(self) -> None:
        """Forget everything (e.g. when a new fit starts)."""
        self._batch_refs: list[weakref.ref[torch.Tensor]] = []
        self._older_refs: list[weakref.ref[torch.Tensor]] | None = None  # None: no batch two steps ago
        self._loss_ref: weakref.ref[torch.Tensor] | None = None
        self._output_refs: list[OutputRef] = []
        self._older_output_refs: list[OutputRef] | None = None
        self._output_targets: list[Any] = []  # weak references to the storages behind the last finding
        self.chains = GraphChains()
        self._sentinel_ref: weakref.ref[Sentinel] | None = None
        self._from_step: int | None = None
        self._targets: list[weakref.ref[torch.Tensor]] = []
        self._root_ref: weakref.ref[torch.Tensor] | None = None
        self._reported: set[str] = set()
        self._next_measure: dict[str, int] = {}
        self._backoff: dict[str, int] = {}
        self.heap_scans = 0  # checks whose graph root was only found by scanning the heap
        self.heap_scans_skipped = 0  # checks that needed a heap scan the budget had not paid for yet
        self.heap_allowed = True  # set by the caller before each check (LeakWatch: the budget)
        self._root_unknown = False
        self.wants_mark = False
        """A check could not tell yet (outputs alive, no outputs of two steps before to compare): the
        step that follows should leave marks too, so that the next check can tell."""
        self.pending = False
        """``end_step`` left references for the next ``check`` to look at (a field: the session asks
        after every step that is not quiet)."""
        self.occurrences: dict[str, int] = {}
        """How many step starts saw something alive, by situation (``"seen:batch+graph"``,
        ``"seen:graph"``, ...); ``"retained:batch"`` counts measured steps whose previous batch
        was kept together with older ones (not lingering)."""

    def end_step(self, step: int, batch: Any = None, loss: Any = None, outputs: Any = None) -> None:
        """Remember step ``step``'s batch, loss graph and model outputs, weakly. Never keeps them alive.

        ``outputs``: the step's model outputs (tensors or containers of them); their storages are
        watched (a kept ``logits``) and their graphs marked like the loss's (a running sum of them)."""
        self.wants_mark = False
        self._batch_refs = batch_weakrefs(batch, self.max_tensors)
        self._from_step = step
        self._loss_ref = None
        self._sentinel_ref = None
        exclude: set[int] = set()
        for r in self._batch_refs:
            t = r()
            if t is not None:
                try:
                    exclude.add(t.untyped_storage().data_ptr())
                except Exception:
                    pass
        plain = plain_tensors(outputs)  # Lightning's {"loss": loss}: no walk, no parameter check
        self._output_refs = output_refs(outputs, exclude, plain) if outputs is not None else []
        self.pending = bool(self._batch_refs) or bool(self._output_refs)
        graphs = []  # the loss's and the outputs' graphs (a loop: no comprehension frame at every marked step)
        if outputs is None:
            candidates = [loss]
        else:
            candidates = [loss, *(plain if plain is not None else iter_tensors(outputs, max_items=64))]
        for t in candidates:
            if isinstance(t, _Tensor) and t.grad_fn is not None:
                graphs.append(t)
        if not graphs:
            return
        sentinel = mark_graphs(step, graphs)
        self._sentinel_ref = weakref.ref(sentinel)
        self.pending = True
        self._loss_ref = weakref.ref(graphs[0])
        self.chains.mark(step, sentinel)

    def check(self, step: int, current_batch: Any = None) -> Finding | None:
        """At the start of ``step``: a Finding if the previous step's batch, graph or outputs are alive.

        ``current_batch``: this step's batch, when known; a batch reused as is (the same tensor
        objects every step) is not lingering.
        """
        batch_refs = self._batch_refs
        older = self._older_refs
        sref = self._sentinel_ref
        output_refs_ = self._output_refs
        older_outputs = self._older_output_refs
        self._older_refs = batch_refs
        self._older_output_refs = output_refs_
        self._batch_refs = []
        self._output_refs = []
        self._sentinel_ref = None
        self.pending = False
        sentinel = sref() if sref is not None else None
        any_alive = sentinel is not None
        if not any_alive:
            for r in batch_refs:
                if r() is not None:
                    any_alive = True
                    break
        if not any_alive:
            for o in output_refs_:
                if o.storage() is not None:
                    any_alive = True
                    break
        if not any_alive:
            return None
        return self._examine(step, batch_refs, older, sentinel, current_batch, output_refs_, older_outputs)

    def _examine(
        self,
        step: int,
        batch_refs: list[Any],
        older: list[Any] | None,
        sentinel: Sentinel | None,
        current_batch: Any,
        output_refs_: list[OutputRef] = (),  # type: ignore[assignment]
        older_outputs: list[OutputRef] | None = None,
    ) -> Finding | None:
        current_tensors = list(iter_tensors(current_batch)) if current_batch is not None else []
        current = {id(t) for t in current_tensors}
        batch = [t for t in (r() for r in batch_refs) if t is not None and id(t) not in current]
        outputs = alive_outputs(list(output_refs_), _storage_ptrs(current_tensors))
        graph = sentinel is not None
        if not batch and not graph and not outputs:
            return None
        # The situation seen (before measuring) decides whether to measure: once reported, or
        # while backing off after a measurement below min_bytes, it is only counted.
        seen_key = "seen:" + "+".join(k for k, v in (("batch", batch), ("graph", graph), ("outputs", outputs)) if v)
        self._count(seen_key)
        if seen_key in self._reported or step < self._next_measure.get(seen_key, -1):
            return None
        older_alive = not older or any(t is not None and id(t) not in current for t in (r() for r in older))
        watched = {(st.device, st.data_ptr()) for st, _ in outputs}
        too_early = bool(outputs) and not older_outputs
        if outputs:
            outputs = self._kept_outputs(outputs, output_refs_, older_outputs, too_early)
        held: dict[Any, int] = {}
        targets: list[torch.Tensor] = []
        output_keys: set[Any] = set()
        for st, _ref in outputs:
            output_keys.add((st.device, st.data_ptr()))
            held[(st.device, st.data_ptr())] = int(st.nbytes())
        self._root_ref = None
        self._root_unknown = False
        if too_early and graph and not self._graph_root_cheap(sentinel):  # type: ignore[arg-type]
            # what the graph holds is measured at the next check, which can tell: a heap scan for its
            # root now would be spent on a check that cannot conclude
            self.wants_mark = True
            self._count("too_early")
            return None
        graph_seen = graph
        if graph:
            # After backward a kept loss's graph holds only parameters: alive, but not a cause.
            graph_held, root_held = self._measure_graph(sentinel, held, targets, watched)
        batch = self._lingering_batch(batch, held, older_alive)
        if graph:
            # the root's own storage alone (a kept scalar loss) names the graph only when nothing else lingers
            graph = graph_held or (root_held and not batch and not outputs)
            if not graph:
                self._root_ref = None  # the holders then name what lingers, not the graph
                del targets[:]  # nor the graph's tensors (the loop's current `loss`): noise under the right holder
        key = "lingering:" + "+".join(k for k, v in (("batch", batch), ("graph", graph), ("outputs", outputs)) if v)
        if key in self._reported or not (batch or graph_seen or outputs):
            return None
        return self._conclude(step, key, seen_key, batch, graph, outputs, held, targets, output_keys, too_early)

    def _count(self, situation: str) -> None:
        self.occurrences[situation] = self.occurrences.get(situation, 0) + 1

    def _kept_outputs(self, outputs: list[Any], output_refs_: list[OutputRef], older_outputs: list[OutputRef] | None,
                      too_early: bool) -> list[Any]:
        """The alive outputs that count: an output whose counterpart of two steps ago is alive too is
        kept by a list, a cache or a chain (retention, the growth detector's), or it is too early to tell."""
        retained = set() if too_early else _retained(output_refs_, older_outputs)  # type: ignore[arg-type]
        kept = [(st, ref) for st, ref in outputs if not too_early and id(ref) not in retained]
        if len(kept) < len(outputs):
            self._count("retained:outputs")
        return kept

    def _conclude(
        self, step: int, key: str, seen_key: str, batch: list[torch.Tensor], graph: bool, outputs: list[Any],
        held: dict[Any, int], targets: list[torch.Tensor], output_keys: set[Any], too_early: bool,
    ) -> Finding | None:
        """Measure what lingers (the batch's storages added to ``held``) and report it, or back off."""
        batch_keys: set[Any] = set()
        for t in batch:
            _add_storages(t, held, targets)
            batch_keys.update(k for k, _ in storage_keys(t))
        batch_bytes = sum(n for k, n in held.items() if k in batch_keys)
        output_bytes = sum(n for k, n in held.items() if k in output_keys and k not in batch_keys)
        total = sum(held.values())
        if total < self.min_bytes or total == 0:
            if self._root_unknown:
                return None  # the graph was not measured (no heap scan yet): neither harmless nor a finding
            if too_early:
                # measure again at the next check, once the outputs of two steps ago are known: the
                # step that follows leaves marks too (after the first steps, marks are sparse and the
                # check before this one saw none, so without them every check would be too early)
                self.wants_mark = True
                self._count("too_early")
            else:
                self._back_off(seen_key, step)
            return None
        self._reported.add(key)
        self._reported.add(seen_key)
        self._targets = [weakref.ref(t) for t in targets]
        self._output_targets = [weakref.ref(st) for st, _ in outputs]
        described = [ref.described for _, ref in outputs]
        return self._finding(step, key, batch, graph, batch_bytes, total, described, output_bytes)

    def _measure_graph(
        self, sentinel: Any, held: dict[Any, int], targets: list[torch.Tensor], outputs: set[Any] = frozenset()  # type: ignore[assignment]
    ) -> tuple[bool, bool]:
        """Add the storages the marked graph holds (not parameters) to ``held``, the root tensor's own
        storage included (a kept ``logits`` holds its own bytes even when its graph holds none), the
        watched ``outputs``' storages left out; ``(the graph holds bytes, the root holds bytes)``."""
        root = self._graph_root(sentinel)
        added: dict[Any, int] = {}
        root_keys: set[Any] = set()
        if root is not None:
            if not is_parameter(root):
                _add_storages(root, added, targets)
                root_keys = {k for k in added if k not in outputs}
            # after backward() every saved tensor is released (each read would raise): leaves only
            for t, _how in graph_tensors([root], saved=not graph_freed(root)):
                if is_parameter(t) or is_parameter(t._base):  # a parameter, or a view of one a node saved (weight.t())
                    continue
                _add_storages(t, added, targets)
                try:
                    if t.is_leaf and t.grad is not None:
                        _add_storages(t.grad, added, targets)
                except Exception:
                    pass
        for k, n in added.items():
            if k not in outputs:  # a watched output counts as an output (or, kept with older ones, not here)
                held.setdefault(k, n)
        graph_held = any(k not in outputs and k not in root_keys for k in added)
        if not graph_held and not root_keys:
            return False, False
        self._root_ref = weakref.ref(root)
        return graph_held, bool(root_keys)

    def _lingering_batch(self, batch: list[torch.Tensor], held: dict[Any, int], older_alive: bool) -> list[torch.Tensor]:
        """The batch tensors that count: those the graph holds, plus the others unless older batches live too."""
        in_graph = [t for t in batch if all(k in held for k, _ in storage_keys(t))]
        in_graph_ids = {id(t) for t in in_graph}
        loose = [t for t in batch if id(t) not in in_graph_ids]
        if loose and older_alive:
            # Kept with older batches (dataset in memory, a cache) or too early to tell.
            self._count("retained:batch")
            loose = []
        return in_graph + loose

    def _back_off(self, seen_key: str, step: int) -> None:
        """Measured below ``min_bytes``: measure this situation again later, or never."""
        backoff = self._backoff.get(seen_key, 1) * 2
        self._backoff[seen_key] = backoff
        # a situation measured harmless this many times (a loop variable `loss` whose graph holds
        # only parameters) is not measured again: measuring may scan the heap for the graph's root
        self._next_measure[seen_key] = step + backoff if backoff <= self.max_backoff_steps else 2**62

    def _finding(
        self, step: int, key: str, batch: list[torch.Tensor], graph: bool, batch_bytes: int, total: int,
        outputs: list[str] = (), output_bytes: int = 0,  # type: ignore[assignment]
    ) -> Finding:
        from_step = self._from_step if self._from_step is not None else step - 1
        return lingering_finding(step, from_step, key, len(batch), graph, batch_bytes, total, list(outputs), output_bytes)

    def _graph_root(self, sentinel: Sentinel) -> Any:
        """A live tensor of the marked graph (only called when the graph is alive)."""
        loss = self._loss_ref() if self._loss_ref is not None else None
        if loss is not None:
            return loss
        # The user kept another tensor of the graph: the loss before the framework divided it,
        # or (plain loops, where the monitor marks the model's output) the loss computed from it
        # (`loss = loss / k`): the variables first, the heap only when they do not reach the mark.
        root = find_graph_root(sentinel, heap=False)
        if root is None:
            if not self.heap_allowed:
                self.heap_scans_skipped += 1
                self._root_unknown = True
                return None
            self.heap_scans += 1
            root = find_graph_root(sentinel)
        return root

    def _graph_root_cheap(self, sentinel: Sentinel) -> bool:
        """Whether the marked graph's root is at hand without a heap scan."""
        loss = self._loss_ref() if self._loss_ref is not None else None
        return loss is not None or find_graph_root(sentinel, heap=False) is not None

    def graph_root(self) -> torch.Tensor | None:
        """The live tensor through which the last finding's graph is held (e.g. the user's loss), if any."""
        return self._root_ref() if self._root_ref is not None else None

    def alive_tensors(self) -> list[torch.Tensor]:
        """The lingering tensors behind the last finding (for :func:`find_holders`), if still alive."""
        tensors = [t for t in (r() for r in self._targets) if t is not None]
        return tensors + [storage_tensor(st) for st in (r() for r in self._output_targets) if st is not None]


def _storage_ptrs(tensors: list[torch.Tensor]) -> set[int]:
    """The data pointers of the tensors' storages (those that have one)."""
    ptrs = set()
    for t in tensors:
        try:
            ptrs.add(t.untyped_storage().data_ptr())
        except Exception:
            pass
    return ptrs


def _retained(refs: list[OutputRef], older: list[OutputRef]) -> set[int]:
    """Ids of the refs in ``refs`` whose counterpart in ``older`` (same position) is still alive."""
    return {id(r) for r, o in zip(refs, older) if o.storage() is not None}


def _add_storages(t: Any, held: dict[Any, int], targets: list[torch.Tensor]) -> None:
    new = False
    for key, nbytes in storage_keys(t):
        if key not in held:
            held[key] = nbytes
            new = True
    if new:
        targets.append(t)


# ------------------------------------------------------------------ marks
# What end_step leaves for the next step's check. Most marks die unread (the step's batch and graph are
# freed), so a mark costs as little as it can: the commonest batches and outputs (a tensor, a flat
# dict/list/tuple of plain tensors, Lightning's {"loss": loss}) are taken without a walk, and an output is
# described only when a check finds it alive.
class Sentinel:
    """Lives in ``grad_fn.metadata``: dies exactly when the autograd node dies."""

    __slots__ = ("step", "loss_ref", "__weakref__")
    step: int
    loss_ref: Any  # a weak reference to the marked loss: the chain's root without a heap scan


_MARKABLE: dict[type, bool] = {}
"""Node types that may carry the sentinel: not AccumulateGrad, which can outlive the graph (DDP keeps them)."""


def mark_graphs(step: int, graphs: list[torch.Tensor]) -> Sentinel:
    """Put one :class:`Sentinel` for ``step`` into ``grad_fn.metadata`` of the first 8 ``graphs``'
    nodes, and of the loss's (``graphs[0]``) next nodes: a framework may hand over ``loss / n``."""
    sentinel = Sentinel()
    sentinel.step = step
    sentinel.loss_ref = weakref.ref(graphs[0])
    try:
        for i, t in enumerate(graphs[:8]):
            fn = t.grad_fn
            fn.metadata[METADATA_KEY] = sentinel
            if i == 0:
                for nxt, _ in fn.next_functions:
                    if nxt is None:
                        continue
                    tp = type(nxt)
                    ok = _MARKABLE.get(tp)
                    if ok is None:
                        ok = _MARKABLE[tp] = tp.__name__ != "AccumulateGrad"
                    if ok:
                        nxt.metadata[METADATA_KEY] = sentinel
    except Exception:  # exotic node types without metadata
        log.debug("could not mark the loss graph of step %s", step, exc_info=True)
    return sentinel


MAX_OUTPUT_TENSORS = 16


class OutputRef:
    """A weak reference to one output's storage, with what the tensor looked like (:attr:`described`)."""

    __slots__ = ("storage", "nbytes", "shape", "dtype", "device", "kind")

    def __init__(self, storage: Any, nbytes: int, t: torch.Tensor) -> None:
        self.storage = weakref.ref(storage)
        self.nbytes = nbytes
        try:
            self.shape = t.shape
        except Exception:  # a nested tensor has no sizes: described by its type, as describe_tensor does
            self.shape = None
        self.dtype, self.device, self.kind = t.dtype, t.device, type(t)

    @property
    def described(self) -> str:
        """``describe_tensor``'s text for the tensor as it was marked: made only for a finding."""
        return describe_tensor(self, self.kind)


def plain_tensors(obj: Any) -> list[torch.Tensor] | None:
    """``obj``'s tensors when it is a plain tensor or a flat dict/list/tuple of them (``type(t) is
    torch.Tensor``: no parameter, no subclass, nothing to walk); None for anything else."""
    tp = type(obj)
    if tp is _Tensor:
        return [obj]
    if tp is not dict and tp is not list and tp is not tuple:
        return None
    values = list(obj.values()) if tp is dict else list(obj)
    for v in values:  # a loop, not all(<generator>): this runs at every step that leaves marks
        if type(v) is not _Tensor:
            return None
    return values


def output_refs(outputs: Any, exclude: set[int] | None = None, plain: list[torch.Tensor] | None = None) -> list[OutputRef]:
    """Weak references to the storages of the tensors in ``outputs`` (parameters and the storages
    whose ``data_ptr`` is in ``exclude``, e.g. the batch's, left out); at most 16. ``plain``:
    :func:`plain_tensors` of ``outputs`` when it found them (no walk, no parameter among them)."""
    if outputs is None:
        return []
    refs: list[OutputRef] = []
    seen: set[int] = set()
    for t in plain if plain is not None else iter_tensors(outputs, max_items=256):
        if (plain is None and is_parameter(t)) or t.device.type == "meta":
            continue
        try:
            st = t.untyped_storage()
            ptr = st.data_ptr()
            if not ptr or ptr in seen or (exclude and ptr in exclude):
                continue
            seen.add(ptr)
            refs.append(OutputRef(st, int(st.nbytes()), t))
        except Exception:
            continue
        if len(refs) >= MAX_OUTPUT_TENSORS:
            break
    return refs


def alive_outputs(refs: list[OutputRef], current: set[int]) -> list[tuple[Any, OutputRef]]:
    """``[(storage, ref)]`` of the referenced storages still alive, except those of ``current``
    (data pointers of this step's batch: a batch the model returns as is is not a kept output)."""
    out = []
    for r in refs:
        st = r.storage()
        if st is not None:
            try:
                if st.data_ptr() in current:
                    continue
            except Exception:
                continue
            out.append((st, r))
    return out


def storage_tensor(storage: Any) -> torch.Tensor:
    """A byte tensor on ``storage``: what :func:`~memcallbacks.leaks.find_holders` matches by storage."""
    return torch.empty(0, dtype=torch.uint8, device=storage.device).set_(storage)


def batch_weakrefs(batch: Any, max_tensors: int) -> list[weakref.ref[torch.Tensor]]:
    """Weak references to the batch's tensors (parameters excepted), at most ``max_tensors``."""
    plain = plain_tensors(batch)
    if plain is not None:  # a tensor, or a flat dict/list/tuple of them: map, not a comprehension's frame
        return list(map(weakref.ref, plain[:max_tensors]))
    refs: list[weakref.ref[torch.Tensor]] = []
    if batch is not None:
        for t in iter_tensors(batch):
            if not is_parameter(t):
                refs.append(weakref.ref(t))
                if len(refs) >= max_tensors:
                    break
    return refs


# ------------------------------------------------------------------ graph chains
# ``self.total = self.total + loss`` links every step's graph to the next one. After ``backward()`` each
# graph holds few bytes, so neither the lingering threshold nor the growth detector sees it early, but
# the number of graphs grows without bound. A chain is reported as kind ``"growth"`` with the growth
# detector's key: unbounded retention seen within a few steps; the detector's confirmation updates it.
MIN_STEPS_ALIVE = 3
"""Graphs of this many earlier steps alive at once, at two checks in a row with the oldest of the
first still alive at the second, are a chain (one kept step is lingering, two a ``prev``/``cur``
pair). Without the second check, a loop whose iteration is two steps (a GAN: the discriminator's
optimizer step, then the generator's) showed three graphs alive once, at step 3, and two ever after."""

_WINDOW = 8


class GraphChains:
    """Weak references to the sentinels of the last marked steps; :meth:`check` costs a few
    dereferences per step and stops once a chain has been reported."""

    def __init__(self, min_steps: int = MIN_STEPS_ALIVE, window: int = _WINDOW) -> None:
        if min_steps < 2 or window < min_steps:
            raise ValueError(f"GraphChains(min_steps={min_steps}, window={window}): need 2 <= min_steps <= window.")
        self.min_steps = min_steps
        self._marks: collections.deque[tuple[int, weakref.ref[Any]]] = collections.deque(maxlen=window)
        self._oldest: weakref.ref[Any] | None = None  # the oldest graph of the last check that saw min_steps alive
        self.reported = False

    def mark(self, step: int, sentinel: Any) -> None:
        """Step ``step``'s graph carries ``sentinel`` (it dies with the graph)."""
        if not self.reported:
            self._marks.append((step, weakref.ref(sentinel)))

    def check(self, step: int) -> list[tuple[int, Any]] | None:
        """At the start of ``step``: ``[(step, sentinel)]`` of the earlier graphs alive, oldest first,
        the first time at least ``min_steps`` of them are at two checks in a row and the oldest graph
        of the first is still among them (a chain keeps it; a loop's bounded retention lets it go); else None."""
        if self.reported or len(self._marks) < self.min_steps:
            return None
        alive = []
        for s, ref in self._marks:
            if s < step:
                sentinel = ref()
                if sentinel is not None:
                    alive.append((s, sentinel))
        if len(alive) < self.min_steps:
            self._oldest = None
            return None
        oldest = self._oldest() if self._oldest is not None else None
        if oldest is None or all(sentinel is not oldest for _, sentinel in alive):
            self._oldest = weakref.ref(alive[0][1])  # seen once: confirmed if it is still alive at the next check
            return None
        self.reported = True
        self._oldest = None
        self._marks.clear()
        return alive

