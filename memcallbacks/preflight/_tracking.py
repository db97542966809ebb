"""Storage lifetimes of a fake training step: one record per storage, one event per alloc and free."""

from __future__ import annotations

import dataclasses
import weakref
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

__all__ = ["Allocation", "StorageTracker"]

# categories of storages alive before the step starts
PARAMS, GRADS, OPTIMIZER, INPUTS = "params", "grads", "optimizer_state", "inputs"
# categories given to storages made during the step once their fate is known
ACTIVATIONS, TEMPORARIES = "activations", "temporaries"
CATEGORIES = (PARAMS, GRADS, OPTIMIZER, INPUTS, ACTIVATIONS, TEMPORARIES)


@dataclasses.dataclass
class Allocation:
    """One storage: its size, when it appeared and died (event indices), who made it and what it became."""

    nbytes: int
    phase: str  # "before" (alive at step start), or the phase that allocated it
    module: str | None  # innermost module running forward when it was allocated
    op: str
    born: int  # index of its alloc event
    died: int | None = None  # index of its free event; None: alive at the end
    category: str | None = None  # set for pre-existing storages, grads and optimizer state


class StorageTracker(TorchDispatchMode):
    """Sees every op's outputs (inside a ``FakeTensorMode``) and records each new storage until it dies.

    Storages are found by identity; a ``weakref.finalize`` on the storage object records its free
    event. Views and in-place outputs share a known storage and are not counted again.
    """

    def __init__(self) -> None:
        super().__init__()
        self.records: list[Allocation] = []
        self.events: list[tuple[int, int]] = []  # (record index, +1 alloc / -1 free)
        self.phase = "before"
        self.module_stack: list[str] = []
        self.last_op = ""
        self._live: dict[int, int] = {}  # id(storage) -> record index
        self._finalizers: list[weakref.finalize] = []

    # -- recording -------------------------------------------------------------------------
    def add(self, tensor: torch.Tensor, category: str | None = None, *, op: str = "") -> Allocation | None:
        """Record ``tensor``'s storage if it is new; tag it with ``category`` when given."""
        storage = tensor.untyped_storage()
        key = id(storage)
        index = self._live.get(key)
        if index is not None:
            record = self.records[index]
            if category is not None and record.category is None:
                record.category = category
            return record
        nbytes = int(storage.nbytes())
        module = self.module_stack[-1] if self.module_stack else None
        record = Allocation(nbytes, self.phase, module, op, born=len(self.events), category=category)
        index = len(self.records)
        self.records.append(record)
        self.events.append((index, 1))
        self._live[key] = index
        self._finalizers.append(weakref.finalize(storage, self._free, key, index))
        return record

    def tag(self, tensor: torch.Tensor, category: str) -> None:
        """Mark the storage behind ``tensor`` as ``category`` (a gradient, optimizer state)."""
        record = self.add(tensor)
        if record is not None:
            record.category = category

    def _free(self, key: int, index: int) -> None:
        if self._live.get(key) == index:
            del self._live[key]
        record = self.records[index]
        if record.died is None:
            record.died = len(self.events)
            self.events.append((index, -1))

    def detach(self) -> None:
        """Stop listening for frees (records stay); safe to call twice."""
        for fin in self._finalizers:
            fin.detach()
        self._finalizers.clear()
        self._live.clear()

    # -- dispatch --------------------------------------------------------------------------
    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        self.last_op = str(func)
        out = func(*args, **(kwargs or {}))
        for leaf in tree_leaves(out):
            if isinstance(leaf, torch.Tensor):
                self.add(leaf, op=self.last_op)
        return out

    # -- module attribution ----------------------------------------------------------------
    def install_module_hooks(self, model: torch.nn.Module) -> list[Any]:
        """Forward hooks that keep :attr:`module_stack` (qualified names); returns the handles."""
        handles = []
        for name, module in model.named_modules():
            label = name or type(model).__name__

            def push(_m: Any, _inputs: Any, label: str = label) -> None:
                self.module_stack.append(label)

            def pop(_m: Any, _inputs: Any, _output: Any, label: str = label) -> None:
                if self.module_stack and self.module_stack[-1] == label:
                    self.module_stack.pop()

            handles.append(module.register_forward_pre_hook(push))
            handles.append(module.register_forward_hook(pop, always_call=True))
        return handles
