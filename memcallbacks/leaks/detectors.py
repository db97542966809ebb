"""Leak detectors: steady growth, tensors lingering into the next step, and tensors in reference cycles."""

from __future__ import annotations

import collections
import gc
import logging
import math
import time
import warnings
import weakref
from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from memcallbacks.leaks.census import _edge, describe_tensor, graph_tensors, is_parameter, iter_tensors, storage_keys
from memcallbacks._findings import Finding
from memcallbacks._units import KiB, MiB, format_bytes

log = logging.getLogger(__name__)

__all__ = [
    "GarbageCollector",
    "GcResult",
    "GrowthDetector",
    "LingeringDetector",
    "heap_in_use_bytes",
]



# ----------------------------------------------------------------------------------------------
# CPU "allocated": glibc in-use heap bytes
# ----------------------------------------------------------------------------------------------


# one implementation, in the device seam; re-exported here for the detectors' users
from memcallbacks._runtime.devices import heap_in_use_bytes  # noqa: E402


# ----------------------------------------------------------------------------------------------
# Growth
# ----------------------------------------------------------------------------------------------


class _Level:
    """Step-start baselines summarised as blocks of ``size`` steps: (first step, min, max)."""

    __slots__ = ("size", "blocks", "n", "step0", "lo", "hi")

    def __init__(self, size: int, keep: int) -> None:
        self.size = size
        self.blocks: collections.deque[tuple[int, int, int]] = collections.deque(maxlen=keep)
        self.n = 0
        self.step0 = 0
        self.lo = 0
        self.hi = 0

    def add(self, step: int, lo: int, hi: int) -> bool:
        """Fold one sample (or a finer block) in; True when a block closed."""
        if self.n == 0:
            self.step0, self.lo, self.hi = step, lo, hi
        else:
            if lo < self.lo:
                self.lo = lo
            if hi > self.hi:
                self.hi = hi
        self.n += 1
        if self.n < self.size:
            return False
        self.blocks.append((self.step0, self.lo, self.hi))
        self.n = 0
        return True


@dataclass
class _Trend:
    rate: float
    span_steps: int
    since_step: int
    z: float
    noise: float


class GrowthDetector:
    """Finds a steady climb of the step-start baseline (allocated bytes when a step begins).

    Feed ``update(step, baseline_bytes)`` once per optimizer step. After ``warmup_steps`` the
    baselines are summarised as per-block minima (blocks of ``block_steps`` steps, and of
    ``8 * block_steps`` for slow leaks). The minimum of a block is the memory floor: a variable
    batch, a long sequence, an eval pass or a checkpoint save only add on top of it, while a leak
    raises it. A window of block minima fires when all of these hold:

    * Mann–Kendall monotonic trend, z >= ``z_min`` (6 blocks: at most one pair out of order);
    * Theil–Sen slope >= ``min_rate_bytes`` per step;
    * growth over the window (slope x span) >= ``min_growth_bytes`` and >= ``noise_factor`` x
      the median within-block range (the step-to-step noise);
    * no single block-to-block jump carries more than ``max_jump_fraction`` of the growth
      (one-off steps such as a lazily built cache are not leaks).

    A 256 KiB/step leak is found 24 steps after warm-up with the defaults. ``update`` costs
    about 1 µs on an idle core: the trend test runs only when a block closes and the floor has
    risen by ``min_growth_bytes`` inside the window.
    """

    def __init__(
        self,
        *,
        warmup_steps: int = 10,
        min_rate_bytes: int = 64 * KiB,
        min_growth_bytes: int = 4 * MiB,
        block_steps: int = 4,
        min_blocks: int = 6,
        max_blocks: int = 16,
        z_min: float = 2.3,
        noise_factor: float = 2.0,
        max_jump_fraction: float = 0.5,
    ) -> None:
        checks = (
            ("warmup_steps", warmup_steps, warmup_steps >= 0, "use 0 or more"),
            ("min_rate_bytes", min_rate_bytes, min_rate_bytes > 0, "use a positive byte count, e.g. 65536"),
            ("min_growth_bytes", min_growth_bytes, min_growth_bytes >= 0, "use 0 or more bytes"),
            ("block_steps", block_steps, block_steps >= 1, "use 1 or more"),
            ("min_blocks", min_blocks, min_blocks >= 4, "use 4 or more (fewer blocks cannot show a trend)"),
            ("max_blocks", max_blocks, max_blocks >= min_blocks, "use at least min_blocks"),
            ("z_min", z_min, z_min > 0, "use e.g. 2.3"),
            ("noise_factor", noise_factor, noise_factor >= 0, "use 0 or more"),
            ("max_jump_fraction", max_jump_fraction, 0 < max_jump_fraction <= 1, "use a value in (0, 1]"),
        )
        for name, value, ok, fix in checks:
            if not ok:
                raise ValueError(f"GrowthDetector({name}={value!r}) is invalid; {fix}.")
        self.warmup_steps = warmup_steps
        self.min_rate_bytes = min_rate_bytes
        self.min_growth_bytes = min_growth_bytes
        self.block_steps = block_steps
        self.min_blocks = min_blocks
        self.max_blocks = max_blocks
        self.z_min = z_min
        self.noise_factor = noise_factor
        self.max_jump_fraction = max_jump_fraction
        self.reset()

    def reset(self) -> None:
        """Forget all history (e.g. when a new fit starts)."""
        self._seen = 0
        self._fine = _Level(self.block_steps, self.max_blocks)
        self._coarse = _Level(8, self.max_blocks)  # 8 fine blocks per coarse block
        self._floor0: tuple[int, int] | None = None  # (step, bytes) of the first floor after warm-up
        self.last: Finding | None = None
        """The latest growth finding, if the leak has been confirmed."""

    def update(self, step: int, baseline_bytes: int) -> Finding | None:
        """Record the baseline at the start of ``step``; a Finding while a leak is confirmed.

        The finding (key ``"growth"``) is returned again, with new numbers, each time a later
        block confirms the trend; a :class:`FindingLog` keeps one entry and updates it.
        """
        self._seen += 1
        if self._seen <= self.warmup_steps:
            return None
        fine = self._fine  # _Level.add inlined: this is the per-step path
        if fine.n == 0:
            fine.step0 = step
            fine.lo = fine.hi = baseline_bytes
        elif baseline_bytes < fine.lo:
            fine.lo = baseline_bytes
        elif baseline_bytes > fine.hi:
            fine.hi = baseline_bytes
        fine.n += 1
        if fine.n < fine.size:
            return None
        fine.blocks.append((fine.step0, fine.lo, fine.hi))
        fine.n = 0
        return self._block_closed(step)

    def _block_closed(self, step: int) -> Finding | None:
        fine, coarse = self._fine, self._coarse
        step0, lo, hi = fine.blocks[-1]
        if self._floor0 is None:
            self._floor0 = (step0, lo)
        trend = self._test(fine.blocks)
        if coarse.add(step0, lo, hi) and trend is None:
            trend = self._test(coarse.blocks)
        if trend is None:
            return None
        floor_step, floor_bytes = self._floor0
        growth = lo - floor_bytes
        finding = Finding(
            kind="growth",
            step=step,
            key="growth",
            bytes=int(growth),
            message=(
                f"Memory at step start grew steadily by {format_bytes(trend.rate)}/step since step "
                f"{trend.since_step} (+{format_bytes(growth)} since step {floor_step}). Something keeps "
                "tensors from every step: a list or dict on a module or a global that gets a tensor per "
                "step (`self.cache.append(out)`), a running total without `.detach()` "
                "(`total += loss` — use `total += loss.item()`), or outputs stored on `self`. Store "
                "`.item()` or `.detach().cpu()` values, bound or clear the cache, and check the "
                "holders: they name what grew."
            ),
            details={
                "rate_bytes_per_step": int(trend.rate),
                "growth_bytes": int(growth),
                "since_step": trend.since_step,
                "window_steps": trend.span_steps,
                "z": round(trend.z, 2),
                "noise_bytes": int(trend.noise),
                "floor_bytes": int(lo),
            },
        )
        if self.last is not None:
            finding.first_step = self.last.first_step
        self.last = finding
        return finding

    def _test(self, blocks: collections.deque[tuple[int, int, int]]) -> _Trend | None:
        n_all = len(blocks)
        if n_all < self.min_blocks:
            return None
        for n in (self.min_blocks, n_all) if n_all > self.min_blocks else (n_all,):
            trend = self._test_window(list(blocks)[-n:])
            if trend is not None:
                return trend
        return None

    def _test_window(self, window: list[tuple[int, int, int]]) -> _Trend | None:
        ys = [b[1] for b in window]
        # Cheap gate first: the floor must have risen by the minimum growth inside the window.
        if ys[-1] - min(ys) < self.min_growth_bytes or ys[-1] <= ys[0]:
            return None
        xs = [b[0] for b in window]
        n = len(ys)
        s = 0
        slopes = []
        for i in range(n - 1):
            yi, xi = ys[i], xs[i]
            for j in range(i + 1, n):
                d = ys[j] - yi
                s += (d > 0) - (d < 0)
                slopes.append(d / ((xs[j] - xi) or 1))
        z = (s - 1) / math.sqrt(n * (n - 1) * (2 * n + 5) / 18)
        if z < self.z_min:
            return None
        slopes.sort()
        m = len(slopes)
        rate = slopes[m // 2] if m % 2 else (slopes[m // 2 - 1] + slopes[m // 2]) / 2
        if rate < self.min_rate_bytes:
            return None
        span = xs[-1] - xs[0]
        growth = rate * span
        ranges = sorted(b[2] - b[1] for b in window)
        noise = float(ranges[len(ranges) // 2])
        if growth < self.min_growth_bytes or growth < self.noise_factor * noise:
            return None
        total = ys[-1] - ys[0]
        jump = max(ys[i + 1] - ys[i] for i in range(n - 1))
        if jump > self.max_jump_fraction * total:
            return None
        # A leak that started inside the window is steeper than the whole-window slope says.
        recent = sorted((ys[j] - ys[i]) / ((xs[j] - xs[i]) or 1) for i in range(n - 4, n) for j in range(i + 1, n))
        rate = max(rate, recent[len(recent) // 2])
        return _Trend(rate=rate, span_steps=span, since_step=xs[0], z=z, noise=noise)


# ----------------------------------------------------------------------------------------------
# Lingering
# ----------------------------------------------------------------------------------------------

METADATA_KEY = "memcallbacks"
"""Key of the sentinel memcallbacks puts into ``grad_fn.metadata``."""


class _Sentinel:
    """Lives in ``grad_fn.metadata``: dies exactly when the autograd node dies."""

    __slots__ = ("step", "__weakref__")
    step: int


_Tensor = torch.Tensor
_MARKABLE: dict[type, bool] = {}


def _markable(node_type: type) -> bool:
    """Whether a node may carry the sentinel: not AccumulateGrad, which can outlive the graph
    (DDP keeps references to them)."""
    ok = _MARKABLE.get(node_type)
    if ok is None:
        ok = _MARKABLE[node_type] = node_type.__name__ != "AccumulateGrad"
    return ok


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
    ``max_backoff_steps``; then that situation is not measured again in the run, which bounds the
    cost of the heap scan that finding a graph's root may need (~0.1-0.5 s on a big heap).
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
        self._sentinel_ref: weakref.ref[_Sentinel] | None = None
        self._from_step: int | None = None
        self._targets: list[weakref.ref[torch.Tensor]] = []
        self._root_ref: weakref.ref[torch.Tensor] | None = None
        self._reported: set[str] = set()
        self._next_measure: dict[str, int] = {}
        self._backoff: dict[str, int] = {}
        self.occurrences: dict[str, int] = {}
        """How many step starts saw something alive, by situation (``"seen:batch+graph"``,
        ``"seen:graph"``, ...); ``"retained:batch"`` counts measured steps whose previous batch
        was kept together with older ones (not lingering)."""

    def end_step(self, step: int, batch: Any = None, loss: Any = None) -> None:
        """Remember step ``step``'s batch and loss graph, weakly. Never keeps them alive."""
        ref = weakref.ref
        refs: list[weakref.ref[torch.Tensor]] = []
        tp = type(batch)
        plain = tp is dict or tp is list or tp is tuple
        if plain:  # fast path: a flat dict/list/tuple of plain tensors
            for v in batch.values() if tp is dict else batch:
                if type(v) is _Tensor:
                    refs.append(ref(v))
                else:
                    plain = False
                    break
        if not plain and batch is not None:
            refs = []
            limit = self.max_tensors
            for t in iter_tensors(batch):
                if not is_parameter(t):
                    refs.append(ref(t))
                    if len(refs) >= limit:
                        break
        self._batch_refs = refs if len(refs) <= self.max_tensors else refs[: self.max_tensors]
        self._from_step = step
        self._loss_ref = None
        self._sentinel_ref = None
        if isinstance(loss, _Tensor):
            fn = loss.grad_fn
            if fn is not None:
                sentinel = _Sentinel()
                sentinel.step = step
                try:
                    fn.metadata[METADATA_KEY] = sentinel
                    for nxt, _ in fn.next_functions:
                        if nxt is not None and _markable(type(nxt)):
                            nxt.metadata[METADATA_KEY] = sentinel
                except Exception:  # exotic node types without metadata
                    log.debug("could not mark the loss graph of step %s", step, exc_info=True)
                self._sentinel_ref = ref(sentinel)
                self._loss_ref = ref(loss)

    @property
    def pending(self) -> bool:
        """``end_step`` left references for the next ``check`` to look at."""
        return bool(self._batch_refs) or self._sentinel_ref is not None

    def check(self, step: int, current_batch: Any = None) -> Finding | None:
        """At the start of ``step``: a Finding if the previous step's batch or graph is alive.

        ``current_batch``: this step's batch, when known; a batch reused as is (the same tensor
        objects every step) is not lingering.
        """
        batch_refs = self._batch_refs
        older = self._older_refs
        sref = self._sentinel_ref
        self._older_refs = batch_refs
        self._batch_refs = []
        self._sentinel_ref = None
        sentinel = sref() if sref is not None else None
        any_batch = False
        for r in batch_refs:
            if r() is not None:
                any_batch = True
                break
        if not any_batch and sentinel is None:
            return None
        return self._examine(step, batch_refs, older, sentinel, current_batch)

    def _examine(
        self, step: int, batch_refs: list[Any], older: list[Any] | None, sentinel: _Sentinel | None, current_batch: Any
    ) -> Finding | None:
        current = {id(t) for t in iter_tensors(current_batch)} if current_batch is not None else set()
        batch = [t for t in (r() for r in batch_refs) if t is not None and id(t) not in current]
        graph = sentinel is not None
        if not batch and not graph:
            return None
        # The situation seen (before measuring) decides whether to measure: once reported, or
        # while backing off after a measurement below min_bytes, it is only counted.
        seen_key = "seen:" + "+".join(k for k, v in (("batch", batch), ("graph", graph)) if v)
        self.occurrences[seen_key] = self.occurrences.get(seen_key, 0) + 1
        if seen_key in self._reported or step < self._next_measure.get(seen_key, -1):
            return None
        older_alive = not older or any(t is not None and id(t) not in current for t in (r() for r in older))

        held: dict[Any, int] = {}
        targets: list[torch.Tensor] = []
        self._root_ref = None
        graph_seen = graph
        if graph:
            root = self._graph_root(sentinel)
            if root is not None:
                for t, _how in graph_tensors([root]):
                    if is_parameter(t):
                        continue
                    _add_storages(t, held, targets)
                    try:
                        if t.is_leaf and t.grad is not None:
                            _add_storages(t.grad, held, targets)
                    except Exception:
                        pass
            if held:
                self._root_ref = weakref.ref(root)
            else:
                # After backward a kept loss's graph holds only parameters: alive, but not a cause.
                graph = False
            del root
        in_graph = [t for t in batch if all(k in held for k, _ in storage_keys(t))]
        in_graph_ids = {id(t) for t in in_graph}
        loose = [t for t in batch if id(t) not in in_graph_ids]
        if loose and older_alive:
            # Kept with older batches (dataset in memory, a cache) or too early to tell.
            self.occurrences["retained:batch"] = self.occurrences.get("retained:batch", 0) + 1
            loose = []
        batch = in_graph + loose
        key = "lingering:" + "+".join(k for k, v in (("batch", batch), ("graph", graph)) if v)
        if key in self._reported or not (batch or graph_seen):
            return None
        batch_keys: set[Any] = set()
        for t in batch:
            _add_storages(t, held, targets)
            batch_keys.update(k for k, _ in storage_keys(t))
        batch_bytes = sum(n for k, n in held.items() if k in batch_keys)
        total = sum(held.values())
        graph_bytes = total - batch_bytes
        if total < self.min_bytes or total == 0:
            backoff = self._backoff.get(seen_key, 1) * 2
            self._backoff[seen_key] = backoff
            # a situation measured harmless this many times (a loop variable `loss` whose graph holds
            # only parameters) is not measured again: measuring may scan the heap for the graph's root
            self._next_measure[seen_key] = step + backoff if backoff <= self.max_backoff_steps else 2**62
            return None
        self._reported.add(key)
        self._reported.add(seen_key)
        self._targets = [weakref.ref(t) for t in targets]
        from_step = self._from_step if self._from_step is not None else step - 1
        what = []
        n = len(batch)
        if batch:
            what.append(f"{n} tensor{'s' if n != 1 else ''} of its batch ({format_bytes(batch_bytes)})")
        if graph:
            what.append(f"its autograd graph (holding {format_bytes(graph_bytes)} more)" if batch else f"autograd graph (holding {format_bytes(graph_bytes)})")
        verb = "were" if graph and batch or n > 1 else "was"
        message = (
            f"Step {from_step}'s {' and '.join(what)} {verb} still alive when step {step} started, "
            f"{format_bytes(total)} in all. Something keeps them from one step to the next, usually "
            "a loss returned with its graph and kept by the loop until the next step rebinds the "
            "variable (`return {\"loss\": loss}`, `outputs = train_one_step(batch)`): the graph holds "
            "the inputs that require grad and their gradients. Return `loss.item()` (or "
            "`loss.detach()`), or `del outputs, batch` at the end of the loop body. The holders "
            "show where the reference lives."
        )
        return Finding(
            kind="lingering",
            step=step,
            key=key,
            bytes=int(total),
            message=message,
            details={
                "from_step": from_step,
                "batch_tensors_alive": len(batch),
                "graph_alive": graph,
                "batch_bytes": int(batch_bytes),
                "graph_bytes": int(graph_bytes),
            },
        )

    def _graph_root(self, sentinel: _Sentinel) -> Any:
        """A live tensor of the marked graph (only called when the graph is alive)."""
        loss = self._loss_ref() if self._loss_ref is not None else None
        if loss is not None:
            return loss
        # The user kept another tensor of the graph: the loss before the framework divided it,
        # or (plain loops, where the monitor marks the model's output) the loss computed from it.
        # Find a live tensor whose graph reaches a node carrying this step's sentinel. Only runs
        # when the graph is alive, i.e. when something is already suspicious.
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # proxies of deprecated names warn when isinstance() looks at them
            objects = [obj for obj in gc.get_objects() if isinstance(obj, _Tensor)]
        with_graph = []
        for obj in objects:
            try:
                fn = obj.grad_fn
            except Exception:
                continue
            if fn is None:
                continue
            try:
                if fn.metadata.get(METADATA_KEY) is sentinel:
                    return obj
            except Exception:
                continue
            with_graph.append((obj, fn))
        del objects
        budget = 20_000  # nodes visited over all candidates
        seen: set[int] = set()
        for obj, fn in with_graph:
            stack = [fn]
            while stack and budget > 0:
                node = stack.pop()
                if id(node) in seen:
                    continue
                seen.add(id(node))
                budget -= 1
                try:
                    if node.metadata.get(METADATA_KEY) is sentinel:
                        return obj
                    stack.extend(n for n, _ in node.next_functions if n is not None)
                except Exception:
                    continue
        return None

    def graph_root(self) -> torch.Tensor | None:
        """The live tensor through which the last finding's graph is held (e.g. the user's loss), if any."""
        return self._root_ref() if self._root_ref is not None else None

    def alive_tensors(self) -> list[torch.Tensor]:
        """The lingering tensors behind the last finding (for :func:`find_holders`), if still alive."""
        return [t for t in (r() for r in self._targets) if t is not None]


def _add_storages(t: Any, held: dict[Any, int], targets: list[torch.Tensor]) -> None:
    new = False
    for key, nbytes in storage_keys(t):
        if key not in held:
            held[key] = nbytes
            new = True
    if new:
        targets.append(t)


# ----------------------------------------------------------------------------------------------
# Garbage collection at step boundaries
# ----------------------------------------------------------------------------------------------


@dataclass
class GcResult:
    """What one collection did."""

    step: int
    seconds: float
    collected: int
    """Unreachable objects found (``gc.collect()``'s return value)."""
    bytes_freed: int | None
    """Drop of ``allocated_bytes()`` across the collection; ``None`` without that callable."""
    inspected: bool = False
    """True when the garbage was looked at before being freed (types and cycles are known)."""
    tensors: int = 0
    """Tensors found in the garbage (inspected collections only)."""
    tensor_bytes: int = 0
    """Bytes of the storages of those tensors (including what their autograd graphs held)."""
    types: dict[str, int] = field(default_factory=dict)
    """Most common object types in the garbage."""
    cycles: list[str] = field(default_factory=list)
    """Cycles that held tensors, e.g. ``"Node -> Node -> Node holds Node.buf (Tensor 256x512 float32)"``."""

    def to_finding(self, *, min_bytes: int = 1 * MiB) -> Finding | None:
        """A "cycle" finding when an inspected collection freed tensors of ``min_bytes`` or more."""
        held = self.bytes_freed if self.bytes_freed is not None and self.bytes_freed > 0 else self.tensor_bytes
        if not self.inspected or not self.tensors or max(held, self.tensor_bytes) < min_bytes:
            return None
        names = "; ".join(self.cycles[:3]) or ", ".join(self.types)
        key = "cycle:" + (self.cycles[0].split(" holds ")[0] if self.cycles else ",".join(sorted(self.types)[:3]))
        return Finding(
            kind="cycle",
            step=self.step,
            key=key,
            bytes=int(max(held, self.tensor_bytes)),
            message=(
                f"Reference cycles kept {self.tensors} tensor{'s' if self.tensors != 1 else ''} "
                f"({format_bytes(self.tensor_bytes)}) alive until the garbage collector ran at step "
                f"{self.step}: {names}. Reference counting cannot free a cycle, so these tensors live "
                "until the next full collection (never, if gc is disabled). Break the cycle: keep "
                "back-references as `weakref.ref(obj)`, clear the attribute when done "
                "(`node.buf = None`), or do not store tensors on objects that reference each other."
            ),
            holders=list(self.cycles),
            details={
                "collected": self.collected,
                "tensors": self.tensors,
                "tensor_bytes": self.tensor_bytes,
                "bytes_freed": self.bytes_freed,
                "types": dict(self.types),
                "gc_seconds": round(self.seconds, 6),
            },
        )


class GarbageCollector:
    """Periodic ``gc.collect()`` at step boundaries, timed, with what each collection freed.

    ``disable_automatic=True`` turns automatic collection off between ``start()`` and ``stop()``
    (as torchtitan does) so collections happen only at step boundaries; ``stop()`` restores the
    previous state exactly and is safe to call twice.

    ``inspect``: ``"auto"`` looks at the garbage (types, cycles holding tensors) in the collection
    after one that freed ``min_cycle_bytes`` or more; without ``allocated_bytes`` every collection
    is inspected. ``"always"`` inspects every collection, ``"never"`` none. An inspected
    collection runs gc twice (once keeping the garbage in ``gc.garbage`` to look at it, once to
    free it).
    """

    def __init__(
        self,
        *,
        every_n_steps: int = 0,
        disable_automatic: bool = False,
        generation: int = 2,
        allocated_bytes: Callable[[], int | None] | None = None,
        inspect: str = "auto",
        min_cycle_bytes: int = 1 * MiB,
    ) -> None:
        if every_n_steps < 0:
            raise ValueError(f"GarbageCollector(every_n_steps={every_n_steps}) must be 0 (off) or more; try 100.")
        if generation not in (0, 1, 2):
            raise ValueError(f"GarbageCollector(generation={generation}) must be 0, 1 or 2.")
        if inspect not in ("auto", "always", "never"):
            raise ValueError(f"GarbageCollector(inspect={inspect!r}) must be 'auto', 'always' or 'never'.")
        if min_cycle_bytes < 0:
            raise ValueError(f"GarbageCollector(min_cycle_bytes={min_cycle_bytes}) must be 0 or more.")
        self.every_n_steps = every_n_steps
        self.disable_automatic = disable_automatic
        self.generation = generation
        self.allocated_bytes = allocated_bytes
        self.inspect = inspect
        self.min_cycle_bytes = min_cycle_bytes
        self._started = False
        self._was_enabled: bool | None = None
        self._inspect_next = False
        self.results: collections.deque[GcResult] = collections.deque(maxlen=100)

    def start(self) -> None:
        """Begin managing gc (idempotent)."""
        if self._started:
            return
        self._started = True
        if self.disable_automatic:
            self._was_enabled = gc.isenabled()
            gc.disable()

    def stop(self) -> None:
        """Restore the gc state found at ``start()``; safe to call twice."""
        if not self._started:
            return
        self._started = False
        if self._was_enabled:
            gc.enable()
        self._was_enabled = None

    def __enter__(self) -> GarbageCollector:
        self.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.stop()

    def maybe_collect(self, step: int) -> GcResult | None:
        """Collect when ``every_n_steps`` divides ``step`` (and it is positive)."""
        if self.every_n_steps and step > 0 and step % self.every_n_steps == 0:
            return self.collect(step)
        return None

    def collect(self, step: int) -> GcResult:
        """Collect now; return timing, objects found, bytes freed and, if inspected, what was freed."""
        inspect = self.inspect == "always" or (
            self.inspect == "auto" and (self._inspect_next or self.allocated_bytes is None)
        )
        result = self._collect_inspecting(step) if inspect else self._collect_plain(step)
        if self.inspect == "auto":
            freed = result.bytes_freed or 0
            self._inspect_next = not result.inspected and freed >= self.min_cycle_bytes
        self.results.append(result)
        return result

    def _allocated(self) -> int | None:
        if self.allocated_bytes is None:
            return None
        return self.allocated_bytes()

    def _collect_plain(self, step: int) -> GcResult:
        before = self._allocated()
        t0 = time.perf_counter()
        collected = gc.collect(self.generation)
        seconds = time.perf_counter() - t0
        after = self._allocated()
        freed = before - after if before is not None and after is not None else None
        return GcResult(step=step, seconds=seconds, collected=collected, bytes_freed=freed)

    def _collect_inspecting(self, step: int) -> GcResult:
        t0 = time.perf_counter()
        flags = gc.get_debug()
        n0 = len(gc.garbage)
        gc.set_debug(flags | gc.DEBUG_SAVEALL)
        try:
            collected = gc.collect(self.generation)
        finally:
            gc.set_debug(flags)
        garbage = gc.garbage[n0:]
        del gc.garbage[n0:]
        try:
            summary = _describe_garbage(garbage)
        except Exception:
            log.debug("could not describe the garbage", exc_info=True)
            summary = (0, 0, {}, [])
        finally:
            garbage.clear()
        del garbage
        before = self._allocated()
        gc.collect(self.generation)  # now really free it
        after = self._allocated()
        seconds = time.perf_counter() - t0
        freed = before - after if before is not None and after is not None else None
        tensors, tensor_bytes, types, cycles = summary
        return GcResult(
            step=step,
            seconds=seconds,
            collected=collected,
            bytes_freed=freed,
            inspected=True,
            tensors=tensors,
            tensor_bytes=tensor_bytes,
            types=types,
            cycles=cycles,
        )


_MAX_DESCRIBED = 200_000


def _describe_garbage(garbage: list[Any]) -> tuple[int, int, dict[str, int], list[str]]:
    """(tensors, tensor bytes, top types, cycle descriptions) of a gc.garbage slice."""
    types = collections.Counter(type(o).__name__ for o in garbage)
    top = dict(types.most_common(8))
    tensors = [o for o in garbage if isinstance(o, _Tensor)]
    if not tensors:
        return 0, 0, top, []
    held: dict[Any, int] = {}
    for t in tensors:
        for key, nbytes in storage_keys(t):
            held.setdefault(key, nbytes)
    for t, _how in graph_tensors([t for t in tensors if t.grad_fn is not None]):
        if not is_parameter(t):
            for key, nbytes in storage_keys(t):
                held.setdefault(key, nbytes)
    tensor_bytes = sum(held.values())
    if len(garbage) > _MAX_DESCRIBED:
        return len(tensors), tensor_bytes, top, []

    ids = {id(o): o for o in garbage}
    children: dict[int, list[Any]] = {}
    parents: dict[int, list[Any]] = collections.defaultdict(list)
    for o in garbage:
        kids = [c for c in gc.get_referents(o) if id(c) in ids]
        children[id(o)] = kids
        for c in kids:
            parents[id(c)].append(o)

    cycles: list[str] = []
    seen_sigs: set[str] = set()
    for t in sorted(tensors, key=lambda x: -sum(n for _, n in storage_keys(x)))[:20]:
        desc = _cycle_for(t, children, parents)
        if desc is None:
            continue
        sig = desc.split(" holds ")[0]
        if sig in seen_sigs:
            continue
        seen_sigs.add(sig)
        cycles.append(desc)
        if len(cycles) >= 3:
            break
    return len(tensors), tensor_bytes, top, cycles


def _cycle_for(t: Any, children: dict[int, list[Any]], parents: dict[int, list[Any]]) -> str | None:
    """``"A -> B -> A holds A.x.buf (Tensor 4x4 float32)"`` for the nearest cycle above ``t``."""
    # Walk up from the tensor (BFS over referrers inside the garbage) to the nearest object on a cycle.
    prev: dict[int, Any] = {id(t): None}
    queue = collections.deque([t])
    while queue:
        obj = queue.popleft()
        loop = _shortest_cycle(obj, children) if obj is not t else None
        if loop is not None:
            hold = [obj]
            cur = obj
            while cur is not t:
                cur = prev[id(cur)]
                hold.append(cur)
            cycle_str = " -> ".join(type(o).__name__ for o in loop + [loop[0]])
            path = type(obj).__name__
            attr = False
            for a, b in zip(hold, hold[1:]):
                frag, attr = _edge(a, b, attr)
                path += frag
            return f"{cycle_str} holds {path} (Tensor {describe_tensor(t)})"
        for p in parents.get(id(obj), ()):
            if id(p) not in prev:
                prev[id(p)] = obj
                queue.append(p)
    return None


def _shortest_cycle(start: Any, children: dict[int, list[Any]], limit: int = 10_000) -> list[Any] | None:
    """Objects on the shortest cycle through ``start`` (start first), or None."""
    prev: dict[int, Any] = {id(start): None}
    queue = collections.deque([start])
    steps = 0
    while queue and steps < limit:
        obj = queue.popleft()
        steps += 1
        for c in children.get(id(obj), ()):
            if c is start:
                path = [obj]
                while path[-1] is not start:
                    path.append(prev[id(path[-1])])
                path.reverse()
                return path
            if id(c) not in prev:
                prev[id(c)] = obj
                queue.append(c)
    return None
