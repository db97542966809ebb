"""Fake copies of a model, its optimizer and a batch: right shapes and dtypes, no memory."""

from __future__ import annotations

import collections
import copy
import inspect
from collections import OrderedDict
from collections.abc import Mapping
from typing import Any

import torch
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode

__all__ = ["fake_batch", "fake_model", "fake_optimizer", "make_optimizer"]

# references a module may hold that belong to the trainer around it, never to the model
_SHARED_ATTRIBUTES = ("_trainer", "_fabric", "_fabric_optimizers", "_device_mesh", "_compiler_ctx", "_metric_attributes")

_OPTIMIZER_NAMES = {"sgd": "SGD", "adam": "Adam", "adamw": "AdamW", "adagrad": "Adagrad", "rmsprop": "RMSprop"}


def _fake_like(mode: FakeTensorMode, t: torch.Tensor, device: torch.device, dtype: torch.dtype | None) -> torch.Tensor:
    """A fake tensor shaped like ``t`` on ``device`` (``dtype`` replaces floating dtypes); never reads ``t``."""
    target = dtype if (dtype is not None and t.is_floating_point()) else t.dtype
    with mode:
        out = torch.empty_strided(tuple(t.shape), tuple(t.stride()), dtype=target, device=device)
    return out


def fake_model(
    model: nn.Module, mode: FakeTensorMode, device: torch.device, dtype: torch.dtype | None
) -> tuple[nn.Module, dict[int, nn.Parameter]]:
    """A structural copy of ``model`` whose parameters and buffers are fake; returns it and id(real) -> fake param.

    ``copy.deepcopy`` runs with a memo that already maps every tensor to its fake twin (so no data
    is copied, tied weights stay tied), every hook dict to an empty one (the copy runs no user or
    monitor hooks) and trainer references to themselves (never copied).
    """
    memo: dict[int, Any] = {}
    params: dict[int, nn.Parameter] = {}
    for module in model.modules():
        for name, p in module._parameters.items():
            if p is not None and id(p) not in memo:
                fake = nn.Parameter(_fake_like(mode, p, device, dtype), requires_grad=p.requires_grad)
                memo[id(p)] = params[id(p)] = fake
        for name, b in module._buffers.items():
            if b is not None and id(b) not in memo:
                memo[id(b)] = _fake_like(mode, b, device, dtype)
        for attr, value in vars(module).items():
            if "hooks" in attr and isinstance(value, dict):
                memo[id(value)] = type(value)() if isinstance(value, OrderedDict) else {}
            elif attr in _SHARED_ATTRIBUTES:
                memo[id(value)] = value
            else:
                _fake_tensors_in(value, memo, mode, device)
    return copy.deepcopy(model, memo), params


def _fake_tensors_in(value: Any, memo: dict[int, Any], mode: FakeTensorMode, device: torch.device, depth: int = 4) -> None:
    """Map every tensor in ``value`` and in the containers it holds to a fake twin, so that the copy copies no data:
    a module that keeps tensors in a list (a leak's list of outputs, a queue) would otherwise be copied for real,
    at the moment memory ran out."""
    if isinstance(value, torch.Tensor):
        if id(value) not in memo:
            memo[id(value)] = _fake_like(mode, value, device, None)
    elif depth and isinstance(value, (list, tuple, set, frozenset, collections.deque)):
        for item in value:
            _fake_tensors_in(item, memo, mode, device, depth - 1)
    elif depth and isinstance(value, Mapping):
        for item in value.values():
            _fake_tensors_in(item, memo, mode, device, depth - 1)


def make_optimizer(name: str, params: list[nn.Parameter]) -> torch.optim.Optimizer:
    """``"adamw"`` -> ``torch.optim.AdamW(params)`` (SGD with ``lr=0.01``, its required argument)."""
    key = name.strip().lower()
    cls_name = _OPTIMIZER_NAMES.get(key.split("+")[0])
    if cls_name is None:
        raise ValueError(
            f"predict(): optimizer={name!r} is not one of {', '.join(map(repr, _OPTIMIZER_NAMES))}; "
            "pass one of those names or a torch.optim.Optimizer."
        )
    cls = getattr(torch.optim, cls_name)
    extra: dict[str, Any] = {"lr": 0.01} if cls_name == "SGD" else {}
    if "momentum" in key:
        extra["momentum"] = 0.9
    return cls(params, **extra)


def fake_optimizer(
    optimizer: torch.optim.Optimizer | str | None,
    params: dict[int, nn.Parameter],
    fake_params: list[nn.Parameter],
    *,
    foreach: bool | None,
) -> torch.optim.Optimizer | None:
    """The same optimizer class and param-group settings over the fake parameters (no state copied)."""
    if optimizer is None:
        return None
    if isinstance(optimizer, str):
        return make_optimizer(optimizer, [p for p in fake_params if p.requires_grad])
    groups = []
    for group in optimizer.param_groups:
        settings = {k: v for k, v in group.items() if k != "params"}
        if foreach is not None and "foreach" in settings and settings["foreach"] is None and not settings.get("fused"):
            settings["foreach"] = foreach
        try:
            fakes = [params[id(p)] for p in group["params"]]
        except KeyError:
            raise ValueError(
                "predict(): the optimizer holds a parameter that is not one of model.parameters(); "
                "pass the optimizer built for this model."
            ) from None
        groups.append({"params": fakes, **settings})
    cls = type(optimizer)
    accepted = inspect.signature(cls.__init__).parameters
    return cls(groups, **{k: v for k, v in optimizer.defaults.items() if k in accepted})


def fake_batch(batch: Any, mode: FakeTensorMode, device: torch.device, dtype: torch.dtype | None) -> Any:
    """The batch with every tensor replaced by a fake one on ``device`` (floating ones cast to ``dtype``)."""
    if isinstance(batch, torch.Tensor):
        return _fake_like(mode, batch, device, dtype)
    if isinstance(batch, Mapping):  # BatchEncoding and other mappings become plain dicts
        return {k: fake_batch(v, mode, device, dtype) for k, v in batch.items()}
    if isinstance(batch, tuple) and hasattr(batch, "_fields"):
        return type(batch)(*(fake_batch(v, mode, device, dtype) for v in batch))
    if isinstance(batch, (list, tuple)):
        return type(batch)(fake_batch(v, mode, device, dtype) for v in batch)
    return batch


def batch_tensors(batch: Any) -> list[torch.Tensor]:
    """Every tensor in a (nested) batch."""
    if isinstance(batch, torch.Tensor):
        return [batch]
    if isinstance(batch, Mapping):
        return [t for v in batch.values() for t in batch_tensors(v)]
    if isinstance(batch, (list, tuple)):
        return [t for v in batch for t in batch_tensors(v)]
    return []
