"""Live helpers for the monitor: the bytes model states hold right now, and their estimate.

:func:`measure_model_states` counts the bytes held right now by parameters, ``.grad`` and optimizer
state; :func:`estimate_for` builds the estimate from the same live objects, and
:meth:`~memcallbacks.estimate.MemoryEstimate.expected_measurement` says what the measurement should
read right after ``optimizer.step()``.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from memcallbacks._base.storage import distinct_bytes, local_tensor
from memcallbacks.estimate.compute import estimate
from memcallbacks.estimate.layers import detect_strategy, is_fsdp2, unwrap
from memcallbacks.estimate.result import MemoryEstimate
from memcallbacks.estimate.tables import precision_from_dtype

__all__ = ["estimate_for", "measure_model_states", "hidden_state_bytes"]


def estimate_for(
    model: nn.Module,
    optimizer: torch.optim.Optimizer | str | float | None = None,
    *,
    precision: str | None = None,
    strategy: str | None = None,
    world_size: int | None = None,
    rank: int | None = None,
    **kwargs: Any,
) -> MemoryEstimate:
    """:func:`estimate` for the live (or meta) model and optimizer a training loop holds.

    Unset arguments are read from the objects: ``precision`` from the parameters' dtype (fp32 ->
    ``"fp32"``, bf16 -> ``"bf16-true"``; fp32 under a ``fully_shard`` ``MixedPrecisionPolicy`` with
    a bf16/fp16 ``param_dtype`` -> ``"bf16-mixed"``/``"16-mixed"``), ``strategy`` from the wrapper (``DistributedDataParallel``
    -> ``"ddp"``, ``fully_shard`` -> ``"fsdp2"``, FSDP1 -> ``"fsdp"``, else ``"single"``),
    ``world_size``/``rank`` from ``torch.distributed`` when initialised. ``optimizer=None`` counts
    no optimizer state. Other keyword arguments go to :func:`estimate`.
    """
    inner = unwrap(model)
    if precision is None:
        dtypes = [p.dtype for p in inner.parameters() if p.is_floating_point()]
        precision = precision_from_dtype(max(set(dtypes), key=dtypes.count)) if dtypes else "fp32"
        if precision == "fp32":
            precision = _fsdp2_mixed_precision(model) or precision
    if strategy is None:
        strategy = detect_strategy(model)
    dist = torch.distributed
    initialised = dist.is_available() and dist.is_initialized()
    if world_size is None:
        world_size = dist.get_world_size() if initialised and strategy != "single" else 1
    if rank is None:
        rank = dist.get_rank() if initialised and strategy != "single" else 0
    return estimate(
        model,
        optimizer=0.0 if optimizer is None else optimizer,
        precision=precision,
        strategy=strategy,
        world_size=world_size,
        rank=rank,
        **kwargs,
    )



_MEASURE_KINDS = ("params", "grads", "optimizer")


def measure_model_states(model: nn.Module, optimizer: torch.optim.Optimizer | None = None) -> dict[str, int]:
    """Bytes held right now by parameters, their ``.grad`` and the optimizer's state tensors.

    Each storage is counted once (key: device, ``untyped_storage().data_ptr()``, ``nbytes()``),
    first as a parameter, then as a gradient, then as optimizer state, so views (DDP's bucket views,
    FSDP2's padded shards) count their whole storage exactly once. DTensors count their local
    shard; meta tensors count nothing. Keys: ``device_{params,grads,optimizer}``,
    ``host_{params,grads,optimizer}`` (tensors in CPU memory), ``params``, ``grads``,
    ``optimizer`` (both) and ``total``. Cost: one pass over parameters and state, no allocation.
    """
    seen: dict[Any, int] = {}
    out = dict.fromkeys([f"{where}_{kind}" for where in ("device", "host") for kind in _MEASURE_KINDS], 0)

    def add(tensor: Any, kind: str) -> None:
        if isinstance(tensor, torch.Tensor):
            where = "host" if local_tensor(tensor).device.type == "cpu" else "device"
            out[f"{where}_{kind}"] += distinct_bytes([tensor], seen)
        elif isinstance(tensor, Mapping):
            for value in tensor.values():
                add(value, kind)
        elif isinstance(tensor, (list, tuple)):
            for value in tensor:
                add(value, kind)

    parameters = list(unwrap(model).parameters())
    for p in parameters:
        add(p, "params")
    for p in parameters:
        if p.grad is not None:
            add(p.grad, "grads")
    if optimizer is not None:
        for group in optimizer.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    add(p.grad, "grads")
        for state in optimizer.state.values():
            add(state, "optimizer")
    for kind in _MEASURE_KINDS:
        out[kind] = out[f"device_{kind}"] + out[f"host_{kind}"]
    out["total"] = sum(out[kind] for kind in _MEASURE_KINDS)
    return out


def hidden_state_bytes(model: Any) -> int:
    """Bytes of model state that exist once the model is wrapped but that no parameter, ``.grad`` or
    optimizer state shows: DDP's gradient buckets (one per trainable gradient, allocated by the
    reducer when ``DistributedDataParallel`` is built; with ``gradient_as_bucket_view`` the grads
    become views of them later)."""
    if type(model).__name__ != "DistributedDataParallel":
        return 0
    return sum(p.numel() * p.element_size() for p in model.parameters() if p.requires_grad)


def _fsdp2_mixed_precision(model: nn.Module) -> str | None:
    """``"bf16-mixed"``/``"16-mixed"`` when ``fully_shard``'s ``MixedPrecisionPolicy`` computes in a
    lower dtype than the (fp32) sharded parameters: those, their grads and the optimizer state stay
    fp32; the unsharded copies gathered for compute are in ``param_dtype``."""
    from memcallbacks._base.torch_private import fsdp2_param_dtype

    for module in model.modules():
        if is_fsdp2(module):
            return {torch.bfloat16: "bf16-mixed", torch.float16: "16-mixed"}.get(fsdp2_param_dtype(module))  # type: ignore[arg-type]
    return None
