"""What ``estimate()`` accepts: strategies, precisions, optimizers, and the argument checks.

Every check raises a ``ValueError`` naming the function, the argument, its value and the fix.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from typing import Any, Union

import torch

from memcallbacks._base.units import UNITS as _UNITS

__all__ = ["OPTIMIZERS", "PRECISIONS", "SHARDINGS", "STRATEGIES", "OptimizerArg", "canonical_strategy"]


STRATEGIES = ("single", "ddp", "fsdp", "fsdp2", "zero1", "zero2", "zero3")
"""Canonical strategy names accepted by :func:`estimate`."""
SHARDINGS = ("full", "grad_op", "hybrid")
"""FSDP sharding: FULL_SHARD / SHARD_GRAD_OP (FSDP2 ``reshard_after_forward=False``) / HYBRID_SHARD."""
PRECISIONS = ("fp32", "bf16-mixed", "16-mixed", "bf16-true", "16-true", "64-true")
"""Canonical precision names; Lightning's spellings are accepted as aliases."""
OPTIMIZERS = ("sgd", "adam", "adamw", "adagrad", "rmsprop", "adafactor")
"""Optimizer names; flags are appended with ``+``: ``"sgd+momentum"``, ``"adamw+amsgrad"``,
``"rmsprop+momentum+centered"``, ``"adam+fused"``."""

_STRATEGY_ALIASES = {
    "single_device": "single",
    "none": "single",
    "fsdp1": "fsdp",
    "deepspeed_stage_1": "zero1",
    "deepspeed_stage_2": "zero2",
    "deepspeed_stage_3": "zero3",
    "zero-1": "zero1",
    "zero-2": "zero2",
    "zero-3": "zero3",
    # torch's wrapper classes, as strategy detection finds them on a model
    "distributeddataparallel": "ddp",
    "fullyshardeddataparallel": "fsdp",
    "fsdpmodule": "fsdp2",
}
_SHARDING_ALIASES = {
    "full_shard": "full",
    "shard_grad_op": "grad_op",
    "hybrid_shard": "hybrid",
}
_OPTIMIZER_FLAGS = {
    "sgd": ("momentum", "nesterov"),
    "adam": ("amsgrad", "fused", "capturable"),
    "adamw": ("amsgrad", "fused", "capturable"),
    "adagrad": ("fused",),
    "rmsprop": ("momentum", "centered", "capturable"),
    "adafactor": (),
}


@dataclasses.dataclass(frozen=True)
class Precision:
    name: str
    param_bytes: int  # the parameters the optimizer updates (fp32 master under mixed precision)
    compute_bytes: int  # the weights forward/backward run with
    mixed: bool


_PRECISIONS = {
    "fp32": Precision("fp32", 4, 4, False),
    "bf16-mixed": Precision("bf16-mixed", 4, 2, True),
    "16-mixed": Precision("16-mixed", 4, 2, True),
    "bf16-true": Precision("bf16-true", 2, 2, False),
    "16-true": Precision("16-true", 2, 2, False),
    "64-true": Precision("64-true", 8, 8, False),
}
# Lightning's precision strings and its legacy short forms ("16" -> "16-mixed", "bf16" -> "bf16-mixed")
_PRECISION_ALIASES = {
    "32": "fp32",
    "32-true": "fp32",
    "float32": "fp32",
    "16": "16-mixed",
    "fp16-mixed": "16-mixed",
    "bf16": "bf16-mixed",
    "fp16-true": "16-true",
    "64": "64-true",
    "fp64": "64-true",
}


@dataclasses.dataclass(frozen=True)
class OptSpec:
    label: str
    full_states: int = 0  # state tensors shaped like the parameter
    factored: bool = False  # Adafactor: row + column second moment for >=2-D params
    step_scalar: bool = False  # a 0-dim ``step`` tensor per parameter
    step_on_device: bool = False  # fused / capturable keep ``step`` on the param's device
    temporaries: int = 0  # param-sized temporaries of the foreach step
    bytes_per_param: float | None = None  # a plain number given by the caller


# ----------------------------------------------------------------------------------------------
# names


def fail(func: str, name: str, value: Any, fix: str) -> ValueError:
    return ValueError(f"{func}(): {name}={value!r} {fix}")


def canonical_strategy(strategy: str, func: str = "estimate") -> str:
    """The name in :data:`STRATEGIES` for ``strategy``: one of those, an alias (``"deepspeed_stage_3"``,
    ``"fsdp1"``) or the class name of torch's wrapper (``"DistributedDataParallel"``), any case.

    The one strategy-name mapping of the estimator: arguments and strategy detection both go through it.
    Raises ``ValueError`` naming ``func`` for anything else.
    """
    return _canonical(strategy, _STRATEGY_ALIASES, STRATEGIES, func, "strategy")


def canonical_sharding(sharding: str, func: str) -> str:
    return _canonical(sharding, _SHARDING_ALIASES, SHARDINGS, func, "sharding")


def canonical_precision(precision: str, func: str) -> Precision:
    also = " (or Lightning's '32-true', '16', 'bf16')"
    return _PRECISIONS[_canonical(precision, _PRECISION_ALIASES, PRECISIONS, func, "precision", also)]


def _canonical(value: str, aliases: Mapping[str, str], names: tuple[str, ...], func: str, arg: str, also: str = "") -> str:
    """``value`` lower-cased, through ``aliases``, checked against ``names``."""
    key = str(value).strip().lower()
    key = aliases.get(key, key)
    if key not in names:
        options = ", ".join(repr(n) for n in names)
        raise fail(func, arg, value, f"is not one of {options}{also}; pass one of those.")
    return key


def precision_from_dtype(dtype: torch.dtype) -> str:
    return {torch.bfloat16: "bf16-true", torch.float16: "16-true", torch.float64: "64-true"}.get(dtype, "fp32")


# ----------------------------------------------------------------------------------------------
# optimizer specs


def _spec_from_name(name: str, func: str) -> OptSpec:
    tokens = [t.strip() for t in str(name).strip().lower().split("+")]
    base, flags = tokens[0], set(tokens[1:])
    if base not in _OPTIMIZER_FLAGS:
        raise fail(
            func,
            "optimizer",
            name,
            f"is not one of {', '.join(repr(o) for o in OPTIMIZERS)}; pass one of those (flags with '+', "
            "e.g. 'sgd+momentum', 'adamw+amsgrad'), a torch.optim.Optimizer, or the bytes of state per parameter.",
        )
    unknown = flags - set(_OPTIMIZER_FLAGS[base])
    if unknown:
        allowed = ", ".join(repr(f) for f in _OPTIMIZER_FLAGS[base]) or "none"
        raise fail(func, "optimizer", name, f"has unknown flag(s) {sorted(unknown)} for {base!r}; allowed: {allowed}.")
    return _make_spec(
        base,
        momentum="momentum" in flags or "nesterov" in flags,
        amsgrad="amsgrad" in flags,
        centered="centered" in flags,
        fused="fused" in flags,
        capturable="capturable" in flags,
    )


def _make_spec(
    base: str, *, momentum: bool = False, amsgrad: bool = False, centered: bool = False, fused: bool = False, capturable: bool = False
) -> OptSpec:
    flags = [f for f, on in (("momentum", momentum), ("amsgrad", amsgrad), ("centered", centered), ("fused", fused), ("capturable", capturable)) if on]
    label = "+".join([base, *flags])
    # foreach steps materialise one param-sized temporary (e.g. Adam's sqrt(exp_avg_sq)); fused kernels none
    temporaries = 0 if fused else 1
    if base == "sgd":
        return OptSpec(label, full_states=int(momentum))
    if base in ("adam", "adamw"):
        return OptSpec(label, full_states=2 + int(amsgrad), step_scalar=True, step_on_device=fused or capturable, temporaries=temporaries)
    if base == "adagrad":
        return OptSpec(label, full_states=1, step_scalar=True, step_on_device=fused, temporaries=temporaries)
    if base == "rmsprop":
        return OptSpec(
            label, full_states=1 + int(momentum) + int(centered), step_scalar=True, step_on_device=capturable, temporaries=temporaries
        )
    if base == "adafactor":
        return OptSpec(label, factored=True, step_scalar=True, temporaries=1)
    raise AssertionError(base)  # pragma: no cover


def _spec_from_group(optimizer: torch.optim.Optimizer, group: Mapping[str, Any], func: str) -> OptSpec:
    optim = torch.optim
    adafactor = getattr(optim, "Adafactor", None)
    fused, capturable = bool(group.get("fused") or False), bool(group.get("capturable") or False)
    if isinstance(optimizer, optim.AdamW):
        return _make_spec("adamw", amsgrad=bool(group.get("amsgrad")), fused=fused, capturable=capturable)
    if isinstance(optimizer, optim.Adam):
        return _make_spec("adam", amsgrad=bool(group.get("amsgrad")), fused=fused, capturable=capturable)
    if isinstance(optimizer, optim.SGD):
        return _make_spec("sgd", momentum=bool(group.get("momentum", 0)))
    if isinstance(optimizer, optim.Adagrad):
        return _make_spec("adagrad", fused=fused)
    if isinstance(optimizer, optim.RMSprop):
        return _make_spec("rmsprop", momentum=bool(group.get("momentum", 0)), centered=bool(group.get("centered")), capturable=capturable)
    if adafactor is not None and isinstance(optimizer, adafactor):
        return _make_spec("adafactor")
    raise fail(
        func,
        "optimizer",
        type(optimizer).__name__,
        f"is not modelled (known: {', '.join(OPTIMIZERS)}); pass optimizer=<bytes of state per parameter>, "
        "e.g. 8.0 for two fp32 moments.",
    )


def _number_spec(value: float, func: str) -> OptSpec:
    if isinstance(value, bool) or not math.isfinite(float(value)) or float(value) < 0:
        raise fail(func, "optimizer", value, "is not a valid number of bytes per parameter; pass a finite number >= 0.")
    return OptSpec(f"{float(value):g} B/param", bytes_per_param=float(value))


OptimizerArg = Union[str, float, int, torch.optim.Optimizer]


def param_specs(optimizer: OptimizerArg, func: str) -> tuple[OptSpec, dict[int, OptSpec] | None]:
    """The default spec and, for an optimizer instance, the spec of every parameter it holds (by id)."""
    if isinstance(optimizer, torch.optim.Optimizer):
        per_param: dict[int, OptSpec] = {}
        for group in optimizer.param_groups:
            spec = _spec_from_group(optimizer, group, func)
            for p in group["params"]:
                per_param.setdefault(id(p), spec)
        return _spec_from_group(optimizer, optimizer.defaults, func), per_param
    if isinstance(optimizer, str):
        return _spec_from_name(optimizer, func), None
    if isinstance(optimizer, (int, float)):
        return _number_spec(optimizer, func), None
    raise fail(func, "optimizer", optimizer, "is not a name, a torch.optim.Optimizer or a number; pass one of those.")


# ----------------------------------------------------------------------------------------------
# numbers


def count_of(value: float | int | None, name: str, func: str, *, allow_zero: bool = True) -> int:
    if value is None:
        return 0
    try:
        number = float(value)
    except (TypeError, ValueError):
        number = float("nan")
    if isinstance(value, bool) or not math.isfinite(number) or number < 0 or (number == 0 and not allow_zero):
        need = "> 0" if not allow_zero else ">= 0"
        raise fail(func, name, value, f"is not a valid parameter count; pass a number {need} (e.g. 7e9).")
    return int(round(number))


def positive_int(value: Any, name: str, func: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise fail(func, name, value, "must be an integer >= 1; pass a positive int.")
    return value

def unit_scale(unit: str, func: str) -> int:
    if unit not in _UNITS:
        raise fail(func, "unit", unit, f"is not one of {', '.join(repr(u) for u in _UNITS)}; pass one of those.")
    return _UNITS[unit]
