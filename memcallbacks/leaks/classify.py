"""The census's classification: one pass over the heap for tensors, modules and optimizers, and the
first category (:data:`~memcallbacks.leaks.census.CATEGORIES`) that applies to each storage."""

from __future__ import annotations

import gc
from itertools import compress
from typing import Any, Iterable

import torch

from memcallbacks._base.storage import StorageKey, storage_keys
from memcallbacks.leaks.tensors import describe_tensor, graph_tensors, iter_tensors

__all__ = ["StorageClassifier", "as_list", "parameters_of", "scan_heap", "unique"]


def as_list(obj: Any) -> list[Any]:
    if obj is None:
        return []
    if isinstance(obj, (list, tuple, set)):
        return list(obj)
    return [obj]


def unique(objs: list[Any], kind: type) -> list[Any]:
    """The objects of type ``kind``, each once, in first-seen order."""
    return list({id(o): o for o in objs if isinstance(o, kind)}.values())


def scan_heap() -> tuple[int, list[torch.Tensor], list[torch.nn.Module], list[Any]]:
    """One pass over ``gc.get_objects()``: (object count, tensors, modules, optimizers)."""
    tensors: list[torch.Tensor] = []
    modules: list[torch.nn.Module] = []
    optimizers: list[Any] = []
    Tensor, Module, Optimizer = torch.Tensor, torch.nn.Module, torch.optim.Optimizer
    kind_of: dict[type, int] = {}
    objects = gc.get_objects()
    n_objects = len(objects)
    for tp in set(map(type, objects)):
        kind_of[tp] = (
            1 if issubclass(tp, Tensor) else 2 if issubclass(tp, Module) else 3 if issubclass(tp, Optimizer) else 0
        )
    for o in compress(objects, map(kind_of.__getitem__, map(type, objects))):
        k = kind_of[type(o)]
        (tensors if k == 1 else modules if k == 2 else optimizers).append(o)
    del objects
    return n_objects, tensors, modules, optimizers


class StorageClassifier:
    """Gives each storage the first category that applies; call the ``mark_*`` methods in :data:`~memcallbacks.leaks.census.CATEGORIES` order.

    ``category`` and ``info`` (bytes, shape of the first tensor seen) per storage are the result."""

    def __init__(self) -> None:
        self.category: dict[StorageKey, str] = {}
        self.info: dict[StorageKey, tuple[int, str]] = {}  # key -> (bytes, shape of the first tensor seen)

    def mark(self, t: Any, cat: str) -> None:
        if not isinstance(t, torch.Tensor):
            return
        category = self.category
        for key, nbytes in storage_keys(t):
            if key not in category:
                category[key] = cat
                self.info[key] = (nbytes, describe_tensor(t))

    def mark_model_states(self, modules: list[torch.nn.Module], optimizers: list[Any], tensors: list[torch.Tensor]) -> None:
        """Parameters, their gradients, optimizer state, buffers."""
        params = parameters_of(modules, optimizers, tensors)
        for p in params:
            self.mark(p, "parameters")
        for p in params:
            try:
                self.mark(p.grad, "gradients")
            except Exception:
                pass
        for opt in optimizers:
            try:
                for state in list(opt.state.values()):
                    for t in iter_tensors(state):
                        self.mark(t, "optimizer state")
            except Exception:
                pass
        for m in modules:
            try:
                for b in m._buffers.values():
                    self.mark(b, "buffers")
            except Exception:
                pass

    def mark_batches(self, current_batch: Any, previous_batches: Iterable[Any]) -> None:
        for t in iter_tensors(current_batch):
            self.mark(t, "current batch")
        for batch in previous_batches or ():
            for t in iter_tensors(batch):
                self.mark(t, "previous batches")

    def mark_graph_held(self, tensors: list[torch.Tensor]) -> None:
        """Leaves and saved tensors of the autograd graphs of live tensors (and the leaves' grads)."""
        with_graph = []
        for t in tensors:
            try:
                if t.grad_fn is not None:
                    with_graph.append(t)
            except Exception:
                pass
        for t, _how in graph_tensors(with_graph):
            self.mark(t, "graph-held")
            try:
                if t.is_leaf:
                    self.mark(t.grad, "graph-held")
            except Exception:
                pass

    def mark_other(self, tensors: list[torch.Tensor]) -> None:
        for t in tensors:
            self.mark(t, "other")
            try:
                if t.is_leaf and t.requires_grad:
                    self.mark(t.grad, "other")
            except Exception:
                pass

    def mark_targets(self, targets: Iterable[torch.Tensor]) -> set[StorageKey]:
        """Mark the explicit targets (as "other" unless already known); return their storage keys."""
        target_keys: set[StorageKey] = set()
        for t in targets:
            for key, _ in storage_keys(t):
                target_keys.add(key)
            self.mark(t, "other")
        return target_keys


def parameters_of(modules: list[torch.nn.Module], optimizers: list[Any], tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    """Parameters of the modules, every ``nn.Parameter`` in the heap, and the optimizers' params."""
    params: list[torch.Tensor] = []
    for m in modules:
        try:
            params.extend(p for p in m._parameters.values() if p is not None)
        except Exception:
            pass
    params.extend(t for t in tensors if isinstance(t, torch.nn.Parameter))
    for opt in optimizers:
        try:
            for group in opt.param_groups:
                params.extend(p for p in group.get("params", ()) if isinstance(p, torch.Tensor))
        except Exception:
            pass
    return params
