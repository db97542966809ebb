"""Kept outputs: weak references to a step's model outputs' storages and its batch's tensors.

A loop variable that holds the previous step's forward output through the next step costs its
storage (often several MiB of logits). The lingering detector watches the outputs the adapters
see: the model's outputs from the forward hooks (plain loops, Accelerate, Transformers) and what
``training_step`` returned (Lightning). Storages, not tensors, are watched because frameworks
hand the monitor ``.detach()``ed copies while the user keeps the original: both share one
storage, and a storage's Python object lives exactly as long as any tensor on it.
"""

from __future__ import annotations

import weakref
from typing import Any

import torch

from memcallbacks.leaks.tensors import describe_tensor, is_parameter, iter_tensors

__all__ = ["OutputRef", "output_refs", "alive_outputs", "batch_weakrefs", "storage_tensor"]

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
