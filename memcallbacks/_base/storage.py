"""Storage de-duplication: the one way census, theory check and batch measurement count tensor bytes.

Views, DDP bucket views and FSDP2's padded shards share storages; counting ``nbytes`` of each
tensor would count them several times. Every byte count in memcallbacks goes through
:func:`storage_keys`, keyed by ``(device, data_ptr)``, so a storage is counted once.
"""

from __future__ import annotations

from typing import Any, Iterable

import torch

__all__ = ["StorageKey", "storage_keys", "local_tensor", "distinct_bytes"]

StorageKey = tuple  # (device, data_ptr)


def local_tensor(tensor: torch.Tensor) -> torch.Tensor:
    """A DTensor's local shard (the memory this rank holds); any other tensor unchanged."""
    to_local = getattr(tensor, "to_local", None)
    if to_local is not None and type(tensor).__name__ == "DTensor":
        with torch.no_grad():
            return to_local()
    return tensor


def storage_keys(t: torch.Tensor) -> list[tuple[StorageKey, int]]:
    """``[(key, nbytes)]`` of the storages behind ``t``; ``[]`` for meta/empty/odd tensors.

    Sparse tensors report their index and value storages; DTensors their local shard; anything
    that cannot expose a storage (fake, functional or wrapper subclasses without data) reports
    nothing.
    """
    try:
        t = local_tensor(t)
        layout = t.layout
        if layout is not torch.strided:
            if layout is torch.sparse_coo:
                parts = [t._indices(), t._values()]
            elif layout in (torch.sparse_csr, torch.sparse_bsr):
                parts = [t.crow_indices(), t.col_indices(), t.values()]
            elif layout in (torch.sparse_csc, torch.sparse_bsc):
                parts = [t.ccol_indices(), t.row_indices(), t.values()]
            else:
                return []
            out: list[tuple[StorageKey, int]] = []
            for p in parts:
                out += storage_keys(p)
            return out
        st = t.untyped_storage()
        ptr = st.data_ptr()
        nbytes = st.nbytes()
        if not ptr or not nbytes:
            return []
        return [((t.device, ptr), int(nbytes))]
    except Exception:
        return []


def distinct_bytes(tensors: Iterable[Any], seen: dict[StorageKey, int] | None = None) -> int:
    """Bytes of the distinct storages behind ``tensors``, skipping those already in ``seen`` (updated)."""
    seen = {} if seen is None else seen
    total = 0
    for tensor in tensors:
        for key, nbytes in storage_keys(tensor):
            if key not in seen:
                seen[key] = nbytes
                total += nbytes
    return total
