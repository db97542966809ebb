"""What a step leaves for the next one's lingering check: weak references and graph marks.

At a watched step's end the lingering detector keeps weak references to the batch's tensors and to
the storages of the model's outputs, and puts a :class:`Sentinel` into ``grad_fn.metadata`` of the
loss's graph (it dies exactly with the graph; ``lingering.GraphChains`` watches several of them).

Storages, not tensors, are watched for outputs: frameworks hand the monitor ``.detach()``ed copies
while the user keeps the original; both share one storage, whose Python object lives exactly as
long as any tensor on it.
"""

from __future__ import annotations

import logging
import weakref
from typing import Any

import torch

from memcallbacks.leaks.tensors import describe_tensor, is_parameter, iter_tensors

log = logging.getLogger(__name__)

__all__ = [
    "METADATA_KEY", "Sentinel", "mark_graphs", "OutputRef", "output_refs", "alive_outputs", "batch_weakrefs",
    "storage_tensor",
]

METADATA_KEY = "memcallbacks"
"""Key of the sentinel memcallbacks puts into ``grad_fn.metadata``."""

_MARKABLE: dict[type, bool] = {}


class Sentinel:
    """Lives in ``grad_fn.metadata``: dies exactly when the autograd node dies."""

    __slots__ = ("step", "loss_ref", "__weakref__")
    step: int
    loss_ref: Any  # a weak reference to the marked loss: the chain's root without a heap scan


def _markable(node_type: type) -> bool:
    """Whether a node may carry the sentinel: not AccumulateGrad, which can outlive the graph
    (DDP keeps references to them)."""
    ok = _MARKABLE.get(node_type)
    if ok is None:
        ok = _MARKABLE[node_type] = node_type.__name__ != "AccumulateGrad"
    return ok


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
                    if nxt is not None and _markable(type(nxt)):
                        nxt.metadata[METADATA_KEY] = sentinel
    except Exception:  # exotic node types without metadata
        log.debug("could not mark the loss graph of step %s", step, exc_info=True)
    return sentinel


MAX_OUTPUT_TENSORS = 16


class OutputRef:
    """A weak reference to one output's storage, with what the tensor looked like."""

    __slots__ = ("storage", "nbytes", "described")

    def __init__(self, storage: Any, nbytes: int, described: str) -> None:
        self.storage = weakref.ref(storage)
        self.nbytes = nbytes
        self.described = described


def output_refs(outputs: Any, exclude: set[int] | None = None) -> list[OutputRef]:
    """Weak references to the storages of the tensors in ``outputs`` (parameters and the storages
    whose ``data_ptr`` is in ``exclude``, e.g. the batch's, left out); at most 16."""
    if outputs is None:
        return []
    refs: list[OutputRef] = []
    seen: set[int] = set()
    for t in iter_tensors(outputs, max_items=256):
        if is_parameter(t) or t.device.type == "meta":
            continue
        try:
            st = t.untyped_storage()
            ptr = st.data_ptr()
            if not ptr or ptr in seen or (exclude and ptr in exclude):
                continue
            seen.add(ptr)
            refs.append(OutputRef(st, int(st.nbytes()), describe_tensor(t)))
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
    ref = weakref.ref
    refs: list[weakref.ref[torch.Tensor]] = []
    tp = type(batch)
    plain = tp is dict or tp is list or tp is tuple
    if plain:  # fast path: a flat dict/list/tuple of plain tensors
        for v in batch.values() if tp is dict else batch:
            if type(v) is torch.Tensor:
                refs.append(ref(v))
            else:
                plain = False
                break
    if not plain and batch is not None:
        refs = []
        for t in iter_tensors(batch):
            if not is_parameter(t):
                refs.append(ref(t))
                if len(refs) >= max_tensors:
                    break
    return refs if len(refs) <= max_tensors else refs[:max_tensors]
