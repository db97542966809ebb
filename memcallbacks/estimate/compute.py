"""Model-state memory per rank (params, grads, optimizer state, sharding buffers) from a model or from counts.

This module is arithmetic over shapes and dtypes: it never reads tensor data, never calls
``torch.cuda`` and works on models built on the meta device. Every formula, its source and its
assumptions are in ``docs/theory.md``; activations, allocator fragmentation, the CUDA context and
NCCL's own buffers are not modelled.

Seed 000's worked example (4 layers x 1B params, Adam, FSDP2 full shard on 8 ranks, bf16 mixed)::

    >>> e = estimate(num_params=4e9, largest_layer_params=1e9, optimizer="adam",
    ...              precision="bf16-mixed", strategy="fsdp2", world_size=8)
    >>> e.device_steady / GB, e.device_forward_peak / GB, e.device_backward_peak / GB
    (6.0, 10.0, 12.0)

Live helpers for the monitor: :func:`measure_model_states` counts the bytes held right now by
parameters, ``.grad`` and optimizer state; :func:`estimate_for` builds the estimate from the same
live objects, and :meth:`MemoryEstimate.expected_measurement` says what the measurement should read
right after ``optimizer.step()``.
"""

from __future__ import annotations

import dataclasses
import logging
import math
from collections.abc import Iterable, Mapping, Sequence
from typing import TYPE_CHECKING, Any, Union

import torch
from torch import nn

if TYPE_CHECKING:  # pragma: no cover
    import pandas as pd

log = logging.getLogger(__name__)

__all__ = [
    "GB",
    "GiB",
    "OPTIMIZERS",
    "PRECISIONS",
    "SHARDINGS",
    "STRATEGIES",
    "MemoryEstimate",
    "compare",
    "estimate",
    "estimate_for",
    "estimate_grid",
    "find_layers",
    "measure_model_states",
]

GB = 10**9
"""One gigabyte, 1e9 bytes (the unit of seed 000's arithmetic: 1B params x 2 bytes = 2 GB)."""
GiB = 2**30
"""One gibibyte, 2**30 bytes (the unit torch and DeepSpeed print as "GB")."""

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
class _Precision:
    name: str
    param_bytes: int  # the parameters the optimizer updates (fp32 master under mixed precision)
    compute_bytes: int  # the weights forward/backward run with
    mixed: bool


_PRECISIONS = {
    "fp32": _Precision("fp32", 4, 4, False),
    "bf16-mixed": _Precision("bf16-mixed", 4, 2, True),
    "16-mixed": _Precision("16-mixed", 4, 2, True),
    "bf16-true": _Precision("bf16-true", 2, 2, False),
    "16-true": _Precision("16-true", 2, 2, False),
    "64-true": _Precision("64-true", 8, 8, False),
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
class _OptSpec:
    label: str
    full_states: int = 0  # state tensors shaped like the parameter
    factored: bool = False  # Adafactor: row + column second moment for >=2-D params
    step_scalar: bool = False  # a 0-dim ``step`` tensor per parameter
    step_on_device: bool = False  # fused / capturable keep ``step`` on the param's device
    temporaries: int = 0  # param-sized temporaries of the foreach step
    bytes_per_param: float | None = None  # a plain number given by the caller


@dataclasses.dataclass
class _Tensor:
    numel: int
    shape: tuple[int, ...] | None  # None: a count, divided evenly by the shard size
    floating: bool
    elem_bytes: int  # used only when not floating
    grad: bool
    spec: _OptSpec | None


@dataclasses.dataclass(frozen=True, kw_only=True)
class MemoryEstimate:
    """Model-state bytes on one rank: persistent parts, transient working sets and per-phase peaks.

    "device" is the accelerator the model runs on, "host" is CPU memory. All byte fields are
    ``int``; phases are measured as ``torch.cuda.memory_allocated()`` would see them (model states
    only: activations, the CUDA context and allocator caching are not included).
    """

    strategy: str
    """Canonical strategy: one of :data:`STRATEGIES`."""
    sharding: str | None
    """FSDP sharding (``"full"``, ``"grad_op"``, ``"hybrid"``); ``None`` for other strategies."""
    world_size: int
    """Number of data-parallel ranks."""
    shard_size: int
    """Ranks a sharded tensor is split over (world size, or the hybrid shard group size; 1 if unsharded)."""
    rank: int
    """The rank this estimate describes (FSDP2 shards unevenly: rank 0 holds the largest chunk)."""
    ranks_per_node: int
    """Ranks sharing one host, used for :attr:`host_peak_per_node`."""
    precision: str
    """Canonical precision: one of :data:`PRECISIONS`."""
    optimizer: str
    """Optimizer label, e.g. ``"adamw+amsgrad"`` or ``"8.0 B/param"``."""
    num_params: int
    """Parameter elements in the model (tied parameters counted once)."""
    trainable_params: int
    """Parameter elements that receive a gradient."""
    layer_params: int
    """Elements of the largest unit FSDP wraps / ZeRO-3 gathers."""
    root_params: int
    """Elements left outside every unit (FSDP's root unit: gathered for the whole forward and backward)."""
    offload_optimizer: bool
    """Optimizer state (and DeepSpeed's fp32 master and gradient partitions) in host memory."""
    offload_param: bool
    """Sharded parameters in host memory (FSDP: params, grads and optimizer state)."""
    gradient_accumulation_steps: int
    """Micro-batches per optimizer step."""
    device_params: int
    """Parameters held on the device between steps (sharded where the strategy shards)."""
    device_grads: int
    """Gradients held on the device after backward, before ``zero_grad`` (sharded where sharded)."""
    device_optimizer: int
    """Optimizer state on the device, including DeepSpeed's fp32 master partition."""
    device_buffers: int
    """Persistent communication buffers: DDP's gradient buckets, DeepSpeed's reduce bucket."""
    device_forward_working: int
    """Transient bytes at the forward peak: gathered layers (FSDP/ZeRO-3), autocast weight casts."""
    device_backward_working: int
    """Transient bytes at the backward peak: gathered layer params and unsharded layer grads."""
    device_step_working: int
    """Transient bytes during ``optimizer.step()``: foreach temporaries, DeepSpeed's fp32 grad partition."""
    device_steady: int
    """At the start of a step (after ``zero_grad``): what never goes away."""
    device_forward_peak: int
    """Model-state peak during forward."""
    device_backward_peak: int
    """Model-state peak during backward."""
    device_step_peak: int
    """Model-state peak during ``optimizer.step()``."""
    host_params: int
    """Parameters offloaded to host memory."""
    host_grads: int
    """Gradients in host memory (offloaded optimizer: DeepSpeed's fp32/low-precision partitions)."""
    host_optimizer: int
    """Optimizer state in host memory (offload; torch's Adam keeps its ``step`` scalars on the CPU)."""
    host_init: int
    """Host bytes while the model is being built (a full CPU copy unless built partitioned/on meta)."""
    host_steady: int
    """Host bytes that persist between steps."""
    host_peak: int
    """Largest host footprint: init, steady or during the (offloaded) optimizer step."""
    notes: tuple[str, ...] = ()
    """Assumptions that applied to this estimate, in words."""

    @property
    def device_peak(self) -> int:
        """The largest of the four device phases."""
        return max(self.device_steady, self.device_forward_peak, self.device_backward_peak, self.device_step_peak)

    @property
    def host_peak_per_node(self) -> int:
        """:attr:`host_peak` times :attr:`ranks_per_node` (DeepSpeed's estimators report per node)."""
        return self.host_peak * self.ranks_per_node

    @property
    def label(self) -> str:
        """A short column name: ``"fsdp2 x8"``, ``"zero3+offload_param x16"``, ``"fsdp/hybrid(8) x64"``."""
        name = self.strategy
        if self.sharding is not None and self.sharding != "full":
            name += f"/{self.sharding}" + (f"({self.shard_size})" if self.sharding == "hybrid" else "")
        if self.offload_optimizer:
            name += "+offload_opt"
        if self.offload_param:
            name += "+offload_param"
        return f"{name} x{self.world_size}"

    def expected_measurement(self) -> dict[str, int]:
        """What :func:`measure_model_states` should read right after ``optimizer.step()``.

        Same keys as :func:`measure_model_states`. Communication buffers are not included (DDP's
        buckets are not reachable from Python unless ``gradient_as_bucket_view``, where they *are*
        the gradients). Meaningful for torch strategies; DeepSpeed keeps its partitions outside
        ``param.grad`` and ``optimizer.state``.
        """
        out = {
            "device_params": self.device_params,
            "device_grads": self.device_grads,
            "device_optimizer": self.device_optimizer,
            "host_params": self.host_params,
            "host_grads": self.host_grads,
            "host_optimizer": self.host_optimizer,
        }
        for kind in ("params", "grads", "optimizer"):
            out[kind] = out[f"device_{kind}"] + out[f"host_{kind}"]
        out["total"] = out["params"] + out["grads"] + out["optimizer"]
        return out

    def to_frame(self, unit: str = "bytes") -> pd.DataFrame:
        """One row per component or phase, columns ``device`` and ``host`` in ``unit`` (bytes, GB, GiB, MB, MiB)."""
        import pandas as pd

        scale = _unit_scale(unit, "MemoryEstimate.to_frame")
        rows = {
            "params": (self.device_params, self.host_params),
            "grads": (self.device_grads, self.host_grads),
            "optimizer": (self.device_optimizer, self.host_optimizer),
            "buffers": (self.device_buffers, 0),
            "forward_working": (self.device_forward_working, 0),
            "backward_working": (self.device_backward_working, 0),
            "step_working": (self.device_step_working, 0),
            "init": (0, self.host_init),
            "steady": (self.device_steady, self.host_steady),
            "forward_peak": (self.device_forward_peak, self.host_steady),
            "backward_peak": (self.device_backward_peak, self.host_steady),
            "step_peak": (self.device_step_peak, self.host_peak),
            "peak": (self.device_peak, self.host_peak),
        }
        frame = pd.DataFrame.from_dict(rows, orient="index", columns=["device", "host"])
        frame.index.name = f"{self.label} ({unit})"
        return frame if scale == 1 else frame / scale


# ----------------------------------------------------------------------------------------------
# input parsing


def _fail(func: str, name: str, value: Any, fix: str) -> ValueError:
    return ValueError(f"{func}(): {name}={value!r} {fix}")


def _canonical_strategy(strategy: str, func: str) -> str:
    key = str(strategy).strip().lower()
    key = _STRATEGY_ALIASES.get(key, key)
    if key not in STRATEGIES:
        options = ", ".join(repr(s) for s in STRATEGIES)
        raise _fail(func, "strategy", strategy, f"is not one of {options}; pass one of those.")
    return key


def _canonical_precision(precision: str, func: str) -> _Precision:
    key = str(precision).strip().lower()
    key = _PRECISION_ALIASES.get(key, key)
    if key not in _PRECISIONS:
        options = ", ".join(repr(p) for p in PRECISIONS)
        raise _fail(
            func,
            "precision",
            precision,
            f"is not one of {options} (or Lightning's '32-true', '16', 'bf16'); pass one of those.",
        )
    return _PRECISIONS[key]


def _precision_from_dtype(dtype: torch.dtype) -> str:
    return {torch.bfloat16: "bf16-true", torch.float16: "16-true", torch.float64: "64-true"}.get(dtype, "fp32")


def _spec_from_name(name: str, func: str) -> _OptSpec:
    tokens = [t.strip() for t in str(name).strip().lower().split("+")]
    base, flags = tokens[0], set(tokens[1:])
    if base not in _OPTIMIZER_FLAGS:
        raise _fail(
            func,
            "optimizer",
            name,
            f"is not one of {', '.join(repr(o) for o in OPTIMIZERS)}; pass one of those (flags with '+', "
            "e.g. 'sgd+momentum', 'adamw+amsgrad'), a torch.optim.Optimizer, or the bytes of state per parameter.",
        )
    unknown = flags - set(_OPTIMIZER_FLAGS[base])
    if unknown:
        allowed = ", ".join(repr(f) for f in _OPTIMIZER_FLAGS[base]) or "none"
        raise _fail(func, "optimizer", name, f"has unknown flag(s) {sorted(unknown)} for {base!r}; allowed: {allowed}.")
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
) -> _OptSpec:
    flags = [f for f, on in (("momentum", momentum), ("amsgrad", amsgrad), ("centered", centered), ("fused", fused), ("capturable", capturable)) if on]
    label = "+".join([base, *flags])
    # foreach steps materialise one param-sized temporary (e.g. Adam's sqrt(exp_avg_sq)); fused kernels none
    temporaries = 0 if fused else 1
    if base == "sgd":
        return _OptSpec(label, full_states=int(momentum))
    if base in ("adam", "adamw"):
        return _OptSpec(label, full_states=2 + int(amsgrad), step_scalar=True, step_on_device=fused or capturable, temporaries=temporaries)
    if base == "adagrad":
        return _OptSpec(label, full_states=1, step_scalar=True, step_on_device=fused, temporaries=temporaries)
    if base == "rmsprop":
        return _OptSpec(
            label, full_states=1 + int(momentum) + int(centered), step_scalar=True, step_on_device=capturable, temporaries=temporaries
        )
    if base == "adafactor":
        return _OptSpec(label, factored=True, step_scalar=True, temporaries=1)
    raise AssertionError(base)  # pragma: no cover


def _spec_from_group(optimizer: torch.optim.Optimizer, group: Mapping[str, Any], func: str) -> _OptSpec:
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
    raise _fail(
        func,
        "optimizer",
        type(optimizer).__name__,
        f"is not modelled (known: {', '.join(OPTIMIZERS)}); pass optimizer=<bytes of state per parameter>, "
        "e.g. 8.0 for two fp32 moments.",
    )


def _number_spec(value: float, func: str) -> _OptSpec:
    if isinstance(value, bool) or not math.isfinite(float(value)) or float(value) < 0:
        raise _fail(func, "optimizer", value, "is not a valid number of bytes per parameter; pass a finite number >= 0.")
    return _OptSpec(f"{float(value):g} B/param", bytes_per_param=float(value))


OptimizerArg = Union[str, float, int, torch.optim.Optimizer]


def _param_specs(optimizer: OptimizerArg, func: str) -> tuple[_OptSpec, dict[int, _OptSpec] | None]:
    """The default spec and, for an optimizer instance, the spec of every parameter it holds (by id)."""
    if isinstance(optimizer, torch.optim.Optimizer):
        per_param: dict[int, _OptSpec] = {}
        for group in optimizer.param_groups:
            spec = _spec_from_group(optimizer, group, func)
            for p in group["params"]:
                per_param.setdefault(id(p), spec)
        return _spec_from_group(optimizer, optimizer.defaults, func), per_param
    if isinstance(optimizer, str):
        return _spec_from_name(optimizer, func), None
    if isinstance(optimizer, (int, float)):
        return _number_spec(optimizer, func), None
    raise _fail(func, "optimizer", optimizer, "is not a name, a torch.optim.Optimizer or a number; pass one of those.")


def _count(value: float | int | None, name: str, func: str, *, allow_zero: bool = True) -> int:
    if value is None:
        return 0
    try:
        number = float(value)
    except (TypeError, ValueError):
        number = float("nan")
    if isinstance(value, bool) or not math.isfinite(number) or number < 0 or (number == 0 and not allow_zero):
        need = "> 0" if not allow_zero else ">= 0"
        raise _fail(func, name, value, f"is not a valid parameter count; pass a number {need} (e.g. 7e9).")
    return int(round(number))


def _positive_int(value: Any, name: str, func: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise _fail(func, name, value, "must be an integer >= 1; pass a positive int.")
    return value


# ----------------------------------------------------------------------------------------------
# layers ("units"): what FSDP wraps / ZeRO-3 gathers


def _unwrap(model: nn.Module) -> nn.Module:
    inner = getattr(model, "module", None)
    if isinstance(inner, nn.Module) and type(model).__name__ in ("DistributedDataParallel", "DataParallel"):
        return inner
    return model


def _class_matches(module: nn.Module, wanted: Sequence[type | str]) -> bool:
    names = {c.__name__ for c in type(module).__mro__}
    return any((isinstance(w, str) and w in names) or (isinstance(w, type) and isinstance(module, w)) for w in wanted)


def find_layers(
    model: nn.Module,
    *,
    layer_cls: type | str | Sequence[type | str] | None = None,
    layer_names: Sequence[str] | None = None,
) -> list[str]:
    """Names of the modules treated as FSDP units ("layers"), as :func:`estimate` would choose them.

    With ``layer_cls`` (classes or class names) or ``layer_names`` those are used. Otherwise, in
    order: modules that are already ``fully_shard``-ed (FSDP2, the root excluded); classes named by
    the model's ``_no_split_modules`` (what Transformers/Accelerate wrap by default, e.g.
    ``LlamaDecoderLayer``); the children of the ``nn.ModuleList`` holding the most parameters (the
    repeated blocks torchtitan shards one by one); else the direct children that hold parameters.
    Parameters outside every unit form the root unit.
    """
    func = "find_layers"
    model = _unwrap(model)
    named = dict(model.named_modules())
    if layer_names is not None:
        missing = [n for n in layer_names if n not in named]
        if missing:
            sample = ", ".join(repr(n) for n in list(named)[1:6])
            raise _fail(func, "layer_names", missing, f"are not modules of the model; pass names from model.named_modules() (e.g. {sample}).")
        return list(layer_names)
    if layer_cls is not None:
        wanted = [layer_cls] if isinstance(layer_cls, (type, str)) else list(layer_cls)
        found = [n for n, m in named.items() if n and _class_matches(m, wanted)]
        if not found:
            raise _fail(func, "layer_cls", layer_cls, "matches no submodule of the model; pass a class (or class name) the model contains.")
        return found
    # by class name: importing torch.distributed.fsdp costs seconds and this must stay cheap
    sharded = [n for n, m in named.items() if n and _is_fsdp2(m)]
    if sharded:
        return sharded
    no_split = getattr(model, "_no_split_modules", None)
    if no_split:
        found = [n for n, m in named.items() if n and type(m).__name__ in set(no_split)]
        if found:
            return found
    lists = [(n, m) for n, m in named.items() if isinstance(m, nn.ModuleList)]
    best: tuple[int, str, nn.ModuleList] | None = None
    for name, mlist in lists:
        size = sum(p.numel() for p in mlist.parameters())
        if size and (best is None or size > best[0]):
            best = (size, name, mlist)
    if best is not None:
        _, name, mlist = best
        return [f"{name}.{child}" for child, m in mlist.named_children() if any(True for _ in m.parameters())]
    return [n for n, m in model.named_children() if any(True for _ in m.parameters())]


def _units(model: nn.Module, names: Sequence[str] | None) -> tuple[list[int], int, dict[int, int]]:
    """Unit sizes, root size and param-id -> unit index. ``names=None``: ZeRO-3's per-module units."""
    unit_of: dict[int, int] = {}
    sizes: list[int] = []
    if names is None:  # DeepSpeed gathers each module's own (recurse=False) parameters
        for module in model.modules():
            own = [p for p in module.parameters(recurse=False) if id(p) not in unit_of]
            if own:
                for p in own:
                    unit_of[id(p)] = len(sizes)
                sizes.append(sum(p.numel() for p in own))
        return sizes, 0, unit_of
    named = dict(model.named_modules())
    # innermost first, so a unit nested inside another keeps its own parameters (as FSDP does)
    for name in sorted(names, key=lambda n: -n.count(".") if n else 0):
        index = len(sizes)
        size = 0
        for p in named[name].parameters():
            if id(p) not in unit_of:
                unit_of[id(p)] = index
                size += p.numel()
        sizes.append(size)
    root = sum(p.numel() for p in model.parameters() if id(p) not in unit_of)
    return sizes, root, unit_of


# ----------------------------------------------------------------------------------------------
# sharding arithmetic


def _local(t: _Tensor, mode: str, shards: int, rank: int) -> tuple[float, float]:
    """(elements held, elements owned) by ``rank`` of ``shards`` for one tensor.

    ``dim0``: FSDP2 chunks dim 0 like ``torch.chunk``; the parameter and gradient storage of every
    rank is padded to the first chunk, the optimizer state is the rank's own (unpadded) chunk.
    ``flat``: DeepSpeed / FSDP1 equal partitions of ``ceil(numel / shards)`` elements.
    """
    if shards == 1 or mode == "replicate":
        return float(t.numel), float(t.numel)
    if t.shape is None:
        even = t.numel / shards
        return even, even
    if mode == "dim0":
        dim0 = t.shape[0] if t.shape else 1
        rest = t.numel // dim0 if dim0 else 0
        chunk = -(-dim0 // shards)
        owned = max(0, min(chunk, dim0 - rank * chunk))
        return float(chunk * rest), float(owned * rest)
    part = -(-t.numel // shards)
    return float(part), float(part)


def _state_elements(t: _Tensor, spec: _OptSpec, owned: float, mode: str, shards: int, rank: int) -> float:
    elements = spec.full_states * owned
    if spec.factored:
        if t.shape is None:
            return elements  # counts only: factored moments are sub-linear, see notes
        shape = list(t.shape) if t.shape else [1]
        if mode == "dim0" and shards > 1:
            chunk = -(-shape[0] // shards)
            shape[0] = max(0, min(chunk, shape[0] - rank * chunk))
        if len(shape) >= 2:
            elements += math.prod(shape[:-1]) + math.prod(shape[:-2]) * shape[-1]
        else:
            elements += math.prod(shape)
    return elements


# ----------------------------------------------------------------------------------------------
# the estimator


def estimate(
    model: nn.Module | None = None,
    *,
    num_params: float | None = None,
    largest_layer_params: float | None = None,
    trainable_params: float | None = None,
    root_params: float | None = None,
    layer_cls: type | str | Sequence[type | str] | None = None,
    layer_names: Sequence[str] | None = None,
    optimizer: OptimizerArg = "adam",
    precision: str = "fp32",
    strategy: str = "single",
    world_size: int = 1,
    rank: int = 0,
    ranks_per_node: int | None = None,
    sharding: str = "full",
    shard_group_size: int | None = None,
    offload_optimizer: bool = False,
    offload_param: bool = False,
    gradient_accumulation_steps: int = 1,
    no_sync: bool = False,
    set_to_none: bool = True,
    gradient_as_bucket_view: bool = False,
    reduce_bucket_size: int = 500_000_000,
    prefetch_layers: int | None = None,
    zero_init: bool = True,
    conservative: bool = False,
) -> MemoryEstimate:
    """Estimate model-state memory per rank.

    Args:
        model: a real or meta-device ``nn.Module`` (only shapes, dtypes and ``requires_grad`` are
            read), or ``None`` to estimate from ``num_params`` and ``largest_layer_params``.
        num_params: total parameter elements (e.g. ``7e9``) when no model is given.
        largest_layer_params: elements of the largest FSDP unit / ZeRO-3 gathered module; needed
            for ``fsdp``/``fsdp2``/``zero3`` when estimating from counts.
        trainable_params: elements that get gradients and optimizer state (default: all).
        root_params: elements outside every unit (FSDP root, gathered for the whole step); default 0.
        layer_cls, layer_names: which modules are the units (see :func:`find_layers`). ZeRO-3's
            default, like DeepSpeed's estimator, is every module's own (``recurse=False``) params.
        optimizer: a name from :data:`OPTIMIZERS` with ``+flags``, a ``torch.optim.Optimizer``
            (its class and every param group's settings are read), or bytes of state per parameter.
        precision: ``"fp32"``, ``"bf16-mixed"``, ``"16-mixed"``, ``"bf16-true"``, ``"16-true"``
            (Lightning's strings accepted).
        strategy: one of :data:`STRATEGIES`.
        world_size: data-parallel ranks; ``rank``: which one (FSDP2 chunks are uneven).
        ranks_per_node: ranks sharing one host (default ``min(world_size, 8)``).
        sharding: FSDP only: ``"full"``, ``"grad_op"`` (SHARD_GRAD_OP / FSDP2
            ``reshard_after_forward=False``) or ``"hybrid"`` with ``shard_group_size``.
        offload_optimizer: ZeRO: optimizer state, fp32 master and gradient partitions on the host.
        offload_param: ZeRO-3: parameter partitions on the host; FSDP: ``CPUOffload``/
            ``CPUOffloadPolicy`` (sharded params, grads and optimizer state on the host).
        gradient_accumulation_steps: >1 keeps gradients alive into the next micro-batch's forward.
        no_sync: FSDP with accumulation: gradients accumulate unsharded (``no_sync()`` /
            ``set_requires_gradient_sync(False)``) instead of reduce-scattering every micro-batch.
        set_to_none: ``optimizer.zero_grad(set_to_none=...)``; ``False`` keeps grads allocated.
        gradient_as_bucket_view: DDP's flag; ``False`` (DDP's default) means the reducer's buckets
            are a second copy of every gradient.
        reduce_bucket_size: DeepSpeed's ``reduce_bucket_size`` in elements (a persistent
            low-precision buffer); 0 leaves it out, as DeepSpeed's own estimators do.
        prefetch_layers: layers gathered ahead in forward (default 1 for FSDP, 0 for ZeRO-3).
        zero_init: ZeRO-3 built under ``deepspeed.zero.Init`` / FSDP built on the meta device,
            so no full host copy of the model exists at init.
        conservative: also count, at the FSDP/ZeRO-3 backward peak, the backward-prefetched layer
            and the sharded gradients already reduced (seed 000's accounting leaves both out).

    Raises:
        ValueError: naming the argument, its value and the fix.
    """
    func = "estimate"
    strategy = _canonical_strategy(strategy, func)
    prec = _canonical_precision(precision, func)
    world_size = _positive_int(world_size, "world_size", func)
    accumulation = _positive_int(gradient_accumulation_steps, "gradient_accumulation_steps", func)
    if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < world_size:
        raise _fail(func, "rank", rank, f"is outside 0..{world_size - 1}; pass a rank below world_size={world_size}.")
    if ranks_per_node is None:
        ranks_per_node = min(world_size, 8)
    ranks_per_node = _positive_int(ranks_per_node, "ranks_per_node", func)
    if strategy == "single" and world_size != 1:
        raise _fail(func, "world_size", world_size, "does not apply to strategy='single'; pass world_size=1 or strategy='ddp'.")
    fsdp = strategy in ("fsdp", "fsdp2")
    zero = strategy.startswith("zero")
    key = str(sharding).strip().lower()
    sharding_name = _SHARDING_ALIASES.get(key, key)
    if sharding_name not in SHARDINGS:
        raise _fail(func, "sharding", sharding, f"is not one of {', '.join(repr(s) for s in SHARDINGS)}; pass one of those.")
    if not fsdp and sharding_name != "full":
        raise _fail(func, "sharding", sharding, f"applies to strategy='fsdp'/'fsdp2' only, not {strategy!r}; leave it at 'full'.")
    shards = 1
    if fsdp or zero:
        shards = world_size
    if sharding_name == "hybrid":
        if shard_group_size is None:
            raise _fail(func, "shard_group_size", None, "is required with sharding='hybrid'; pass the ranks one replica is sharded over (e.g. 8).")
        shard_group_size = _positive_int(shard_group_size, "shard_group_size", func)
        if world_size % shard_group_size:
            raise _fail(func, "shard_group_size", shard_group_size, f"does not divide world_size={world_size}; pass a divisor of it.")
        shards = shard_group_size
    elif shard_group_size is not None and shard_group_size != world_size:
        raise _fail(func, "shard_group_size", shard_group_size, "needs sharding='hybrid'; pass sharding='hybrid' or drop it.")
    if offload_optimizer and not zero:
        fix = "for FSDP pass offload_param=True (CPUOffload moves params, grads and optimizer state)" if fsdp else "use a zero* strategy"
        raise _fail(func, "offload_optimizer", offload_optimizer, f"applies to DeepSpeed ZeRO only, not strategy={strategy!r}; {fix}.")
    if offload_param and not (fsdp or strategy == "zero3"):
        raise _fail(func, "offload_param", offload_param, f"applies to 'zero3', 'fsdp' and 'fsdp2' only, not {strategy!r}; use one of those.")
    if zero and prec.param_bytes > 4:
        raise _fail(func, "precision", precision, "is not supported by DeepSpeed ZeRO; pass 'fp32', 'bf16-mixed' or '16-mixed'.")
    if prefetch_layers is None:
        prefetch_layers = 1 if fsdp else 0
    if isinstance(prefetch_layers, bool) or not isinstance(prefetch_layers, int) or prefetch_layers < 0:
        raise _fail(func, "prefetch_layers", prefetch_layers, "must be an int >= 0; pass 0, 1, ...")
    reduce_bucket = _count(reduce_bucket_size, "reduce_bucket_size", func)
    notes: list[str] = []

    default_spec, per_param = _param_specs(optimizer, func)
    tensors: list[_Tensor] = []
    if model is not None:
        for name, value in (("num_params", num_params), ("trainable_params", trainable_params)):
            if value is not None:
                raise _fail(func, name, value, "cannot be combined with a model (it is counted from the model); drop it.")
        inner = _unwrap(model)
        if strategy == "zero3" and layer_cls is None and layer_names is None:
            unit_sizes, root, _ = _units(inner, None)
            notes.append("ZeRO-3 units: each module's own parameters (DeepSpeed's estimator's largest layer)")
        else:
            names = find_layers(inner, layer_cls=layer_cls, layer_names=layer_names)
            unit_sizes, root, _ = _units(inner, names)
            log.debug("estimate(): %d units, largest %d, root %d", len(unit_sizes), max(unit_sizes, default=0), root)
        largest = max(unit_sizes, default=0)
        if largest_layer_params is not None:
            largest = _count(largest_layer_params, "largest_layer_params", func)
        if root_params is not None:
            root = _count(root_params, "root_params", func)
        for p in inner.parameters():
            floating = p.is_floating_point() or p.is_complex()
            spec = None
            if p.requires_grad:
                spec = per_param.get(id(p)) if per_param is not None else default_spec
            tensors.append(
                _Tensor(
                    numel=p.numel(),
                    shape=tuple(p.shape),
                    floating=floating,
                    elem_bytes=p.element_size(),
                    grad=bool(p.requires_grad),
                    spec=spec,
                )
            )
    else:
        if num_params is None:
            raise _fail(func, "num_params", None, "is required without a model; pass the parameter count (e.g. 7e9) or a model.")
        total = _count(num_params, "num_params", func, allow_zero=False)
        trainable = total if trainable_params is None else _count(trainable_params, "trainable_params", func)
        if trainable > total:
            raise _fail(func, "trainable_params", trainable_params, f"exceeds num_params={total}; pass at most num_params.")
        if largest_layer_params is None:
            if fsdp or strategy == "zero3":
                raise _fail(
                    func,
                    "largest_layer_params",
                    None,
                    f"is required for strategy={strategy!r} without a model; pass the parameter count of the unit "
                    "FSDP wraps / ZeRO-3 gathers (e.g. one transformer block).",
                )
            largest = 0
        else:
            largest = _count(largest_layer_params, "largest_layer_params", func)
        if largest > total:
            raise _fail(func, "largest_layer_params", largest_layer_params, f"exceeds num_params={total}; pass at most num_params.")
        root = _count(root_params, "root_params", func)
        if trainable:
            tensors.append(_Tensor(trainable, None, True, 4, True, default_spec))
        if total - trainable:
            tensors.append(_Tensor(total - trainable, None, True, 4, False, None))
        if default_spec.factored:
            notes.append("Adafactor from counts: factored row/column moments are sub-linear and not counted")
        if default_spec.step_scalar:
            notes.append("from counts: the 4-byte per-tensor 'step' scalars are not counted")

    return _compute(
        tensors=tensors,
        largest=largest,
        root=root,
        strategy=strategy,
        prec=prec,
        default_spec=default_spec,
        world_size=world_size,
        shards=shards,
        rank=rank,
        ranks_per_node=ranks_per_node,
        sharding=sharding_name if fsdp else None,
        offload_optimizer=bool(offload_optimizer),
        offload_param=bool(offload_param),
        accumulation=accumulation,
        no_sync=bool(no_sync),
        set_to_none=bool(set_to_none),
        bucket_view=bool(gradient_as_bucket_view),
        reduce_bucket=reduce_bucket,
        prefetch=prefetch_layers,
        zero_init=bool(zero_init),
        conservative=bool(conservative),
        notes=notes,
    )


def _compute(
    *,
    tensors: list[_Tensor],
    largest: int,
    root: int,
    strategy: str,
    prec: _Precision,
    default_spec: _OptSpec,
    world_size: int,
    shards: int,
    rank: int,
    ranks_per_node: int,
    sharding: str | None,
    offload_optimizer: bool,
    offload_param: bool,
    accumulation: int,
    no_sync: bool,
    set_to_none: bool,
    bucket_view: bool,
    reduce_bucket: int,
    prefetch: int,
    zero_init: bool,
    conservative: bool,
    notes: list[str],
) -> MemoryEstimate:
    fsdp = strategy in ("fsdp", "fsdp2")
    zero = strategy.startswith("zero")
    mode = "dim0" if strategy == "fsdp2" else ("flat" if (fsdp or zero) else "replicate")
    shard_rank = rank % shards
    pb, cb = prec.param_bytes, prec.compute_bytes
    scalar_bytes = 8 if torch.get_default_dtype() == torch.float64 else 4

    def elem(t: _Tensor, floating_bytes: int) -> int:
        return floating_bytes if t.floating else t.elem_bytes

    all_elems = sum(t.numel for t in tensors)
    grad_elems = sum(t.numel for t in tensors if t.grad)
    float_elems = sum(t.numel for t in tensors if t.floating)
    params = grads = grads_lp = states = master = scalars_dev = scalars_host = temps = fp32_grad = 0.0
    for t in tensors:
        held, owned = _local(t, mode, shards, shard_rank)
        if zero:
            # DeepSpeed: the module holds low-precision weights (partitioned by ZeRO-3 only)
            params += (held if strategy == "zero3" else t.numel) * elem(t, cb)
        else:
            params += held * elem(t, pb)
        if not t.grad:
            continue
        if zero:
            grads_lp += (t.numel if strategy == "zero1" else owned) * elem(t, cb)
            fp32_grad += owned * 4
        else:
            grads += held * elem(t, pb)
        spec = t.spec
        if spec is None:
            continue
        state_bytes = 4 if zero else elem(t, pb)
        if spec.bytes_per_param is not None:
            states += owned * spec.bytes_per_param
        else:
            states += _state_elements(t, spec, owned, mode, shards, shard_rank) * state_bytes
            # DeepSpeed's optimizers keep one step per group; counts have no tensors to give one to
            if spec.step_scalar and not zero and t.shape is not None:
                if spec.step_on_device:
                    scalars_dev += 4
                else:
                    scalars_host += scalar_bytes
            if not zero:
                temps += spec.temporaries * owned * state_bytes
        if zero:
            master += owned * 4

    r = round
    params_b, grads_b, grads_lp_b = r(params), r(grads), r(grads_lp)
    states_b, master_b, fp32_grad_b, temps_b = r(states), r(master), r(fp32_grad), r(temps)
    scalars_dev_b, scalars_host_b = r(scalars_dev), r(scalars_host)
    largest_b, root_b = largest, root

    dev_params = dev_grads = dev_opt = buffers = 0
    host_params = host_grads = host_opt = 0
    fwd_work = bwd_work = step_dev = step_host = 0
    grads_persist_dev = not set_to_none
    grads_persist_host = False
    accumulated = 0

    if strategy in ("single", "ddp"):
        dev_params, dev_grads = params_b, grads_b
        dev_opt, host_opt = states_b + scalars_dev_b, scalars_host_b
        step_dev = temps_b
        if strategy == "ddp":
            if bucket_view:
                grads_persist_dev = True  # the grads are views of buckets the reducer never frees
                notes.append("DDP gradient_as_bucket_view=True: grads are the reducer's buckets, always allocated")
            else:
                buffers = r(grad_elems * pb)
                notes.append("DDP gradient_as_bucket_view=False: buckets are a second copy of every gradient")
        if prec.mixed:
            # autocast keeps a low-precision cast of each weight for the forward (its cache, then
            # autograd's saved tensors); nothing low-precision survives the step
            fwd_work = r(float_elems * cb)
            bwd_work = largest_b * cb
            notes.append("mixed precision: autocast's weight casts are transient, counted in forward")
        accumulated = dev_grads
    elif fsdp:
        rb = cb  # reduce_dtype defaults to param_dtype
        if offload_param:
            host_params, host_grads, host_opt = params_b, grads_b, states_b + scalars_dev_b + scalars_host_b
            step_host = temps_b
        else:
            dev_params, dev_grads, dev_opt, host_opt = params_b, grads_b, states_b + scalars_dev_b, scalars_host_b
            step_dev = temps_b
        if sharding == "grad_op":
            fwd_work = r(float_elems * cb)  # nothing resharded after forward: every unit ends forward unsharded
            bwd_work = r(float_elems * cb) + root_b * rb + 2 * largest_b * rb
        else:
            fwd_work = root_b * cb + (1 + prefetch) * largest_b * cb
            bwd_work = root_b * (cb + rb) + largest_b * cb + 2 * largest_b * rb
            if conservative:
                bwd_work += prefetch * largest_b * cb
        accumulated = r(grad_elems * rb) if no_sync else dev_grads
    else:  # DeepSpeed ZeRO 1/2/3
        buffers = reduce_bucket * cb
        dev_params = params_b
        if strategy == "zero3" and offload_param:
            dev_params, host_params = 0, params_b
        if offload_optimizer:
            host_opt = states_b + master_b
            grads_persist_host = True
            if strategy == "zero1":
                dev_grads, host_grads = grads_lp_b, fp32_grad_b
            elif strategy == "zero2":
                host_grads = fp32_grad_b
            else:  # stage3.py keeps its low-precision grad partition buffer where the optimizer runs
                host_grads = grads_lp_b + fp32_grad_b
        else:
            dev_opt = states_b + master_b
            dev_grads = grads_lp_b
            step_dev = fp32_grad_b  # the fp32 copy of the grad partition exists only inside step()
            if strategy == "zero3":
                grads_persist_dev = True  # grad_partitions_flat_buffer is allocated once, at init
        if strategy == "zero3":
            fwd_work = root_b * cb + (1 + prefetch) * largest_b * cb
            bwd_work = root_b * 2 * cb + largest_b * cb + largest_b * cb
            if conservative:
                bwd_work += prefetch * largest_b * cb
        accumulated = dev_grads

    dev_steady = dev_params + dev_opt + buffers + (dev_grads if grads_persist_dev else 0)
    grads_extra = 0 if grads_persist_dev else dev_grads
    if accumulation > 1 and (not grads_persist_dev or (fsdp and no_sync)):
        accum_extra = accumulated
        notes.append(f"gradient accumulation x{accumulation}: grads stay allocated between micro-batches")
    else:
        accum_extra = 0
    dev_forward = dev_steady + fwd_work + accum_extra
    if fsdp:
        # seed 000: sharded grads "come and go" and are not part of the backward peak
        dev_backward = dev_steady + bwd_work + accum_extra + (grads_extra if conservative and accum_extra != grads_extra else 0)
    else:
        dev_backward = dev_steady + bwd_work + max(grads_extra, accum_extra)
    dev_step = dev_steady + grads_extra + step_dev

    ib = pb  # the model is built in its parameter dtype (fp32 for mixed precision)
    if (strategy == "zero3" or fsdp) and zero_init:
        host_init = largest_b * ib if strategy == "zero3" else 0
    else:
        host_init = r(all_elems * ib)
    host_steady = host_params + host_opt + (host_grads if grads_persist_host else 0)
    host_step = host_params + host_opt + host_grads + step_host
    host_peak = max(host_init, host_steady, host_step)

    return MemoryEstimate(
        strategy=strategy,
        sharding=sharding,
        world_size=world_size,
        shard_size=shards,
        rank=rank,
        ranks_per_node=ranks_per_node,
        precision=prec.name,
        optimizer=default_spec.label,
        num_params=all_elems,
        trainable_params=grad_elems,
        layer_params=largest_b,
        root_params=root_b,
        offload_optimizer=offload_optimizer,
        offload_param=offload_param,
        gradient_accumulation_steps=accumulation,
        device_params=dev_params,
        device_grads=dev_grads,
        device_optimizer=dev_opt,
        device_buffers=buffers,
        device_forward_working=fwd_work,
        device_backward_working=bwd_work,
        device_step_working=step_dev,
        device_steady=dev_steady,
        device_forward_peak=dev_forward,
        device_backward_peak=dev_backward,
        device_step_peak=dev_step,
        host_params=host_params,
        host_grads=host_grads,
        host_optimizer=host_opt,
        host_init=host_init,
        host_steady=host_steady,
        host_peak=host_peak,
        notes=tuple(notes),
    )


# ----------------------------------------------------------------------------------------------
# live objects


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
    inner = _unwrap(model)
    if precision is None:
        dtypes = [p.dtype for p in inner.parameters() if p.is_floating_point()]
        precision = _precision_from_dtype(max(set(dtypes), key=dtypes.count)) if dtypes else "fp32"
        if precision == "fp32":
            precision = _fsdp2_mixed_precision(model) or precision
    if strategy is None:
        strategy = _detect_strategy(model)
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


def _detect_strategy(model: nn.Module) -> str:
    if type(model).__name__ == "DistributedDataParallel":
        return "ddp"
    for module in model.modules():
        if type(module).__name__ == "FullyShardedDataParallel":
            return "fsdp"
        if _is_fsdp2(module):
            return "fsdp2"
    return "single"


def _is_fsdp2(module: nn.Module) -> bool:
    return any(c.__name__ == "FSDPModule" for c in type(module).__mro__)


def _fsdp2_mixed_precision(model: nn.Module) -> str | None:
    """``"bf16-mixed"``/``"16-mixed"`` when ``fully_shard``'s ``MixedPrecisionPolicy`` computes in a
    lower dtype than the (fp32) sharded parameters: those, their grads and the optimizer state stay
    fp32; the unsharded copies gathered for compute are in ``param_dtype``."""
    from memcallbacks._runtime.torch_private import fsdp2_param_dtype

    for module in model.modules():
        if _is_fsdp2(module):
            return {torch.bfloat16: "bf16-mixed", torch.float16: "16-mixed"}.get(fsdp2_param_dtype(module))  # type: ignore[arg-type]
    return None


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
    seen: set[tuple[str, int | None, int, int]] = set()
    out = dict.fromkeys([f"{where}_{kind}" for where in ("device", "host") for kind in _MEASURE_KINDS], 0)

    def add(tensor: Any, kind: str) -> None:
        if isinstance(tensor, torch.Tensor):
            local = _local_tensor(tensor)
            if local.device.type == "meta":
                return
            storage = local.untyped_storage()
            key = (local.device.type, local.device.index, storage.data_ptr(), storage.nbytes())
            if key in seen:
                return
            seen.add(key)
            where = "host" if local.device.type == "cpu" else "device"
            out[f"{where}_{kind}"] += storage.nbytes()
        elif isinstance(tensor, Mapping):
            for value in tensor.values():
                add(value, kind)
        elif isinstance(tensor, (list, tuple)):
            for value in tensor:
                add(value, kind)

    parameters = list(_unwrap(model).parameters())
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


def _local_tensor(tensor: torch.Tensor) -> torch.Tensor:
    to_local = getattr(tensor, "to_local", None)
    if to_local is not None and type(tensor).__name__ == "DTensor":
        with torch.no_grad():
            return to_local()
    return tensor


# ----------------------------------------------------------------------------------------------
# tables

_UNITS = {"bytes": 1, "B": 1, "KB": 10**3, "KiB": 2**10, "MB": 10**6, "MiB": 2**20, "GB": GB, "GiB": GiB}


def _unit_scale(unit: str, func: str) -> int:
    if unit not in _UNITS:
        raise _fail(func, "unit", unit, f"is not one of {', '.join(repr(u) for u in _UNITS)}; pass one of those.")
    return _UNITS[unit]


_COMPARE_ROWS = (
    ("device/params", lambda e: e.device_params),
    ("device/grads", lambda e: e.device_grads),
    ("device/optimizer", lambda e: e.device_optimizer),
    ("device/buffers", lambda e: e.device_buffers),
    ("device/steady", lambda e: e.device_steady),
    ("device/forward_peak", lambda e: e.device_forward_peak),
    ("device/backward_peak", lambda e: e.device_backward_peak),
    ("device/step_peak", lambda e: e.device_step_peak),
    ("device/peak", lambda e: e.device_peak),
    ("host/params", lambda e: e.host_params),
    ("host/grads", lambda e: e.host_grads),
    ("host/optimizer", lambda e: e.host_optimizer),
    ("host/init", lambda e: e.host_init),
    ("host/steady", lambda e: e.host_steady),
    ("host/peak", lambda e: e.host_peak),
    ("host/peak_per_node", lambda e: e.host_peak_per_node),
)


def compare(estimates: Iterable[MemoryEstimate] | Mapping[str, MemoryEstimate], *, unit: str = "GiB") -> pd.DataFrame:
    """Several estimates side by side: one column per configuration, one row per quantity.

    Row names carry the unit (``"device/steady (GiB)"``). Columns are the estimates' labels, or
    the mapping's keys.
    """
    import pandas as pd

    scale = _unit_scale(unit, "compare")
    items = list(estimates.items()) if isinstance(estimates, Mapping) else [(e.label, e) for e in estimates]
    columns: dict[str, list[float]] = {}
    for label, est in items:
        name, n = label, 2
        while name in columns:
            name, n = f"{label} #{n}", n + 1
        columns[name] = [getter(est) if scale == 1 else getter(est) / scale for _, getter in _COMPARE_ROWS]
    return pd.DataFrame(columns, index=[f"{row} ({unit})" for row, _ in _COMPARE_ROWS])


def estimate_grid(
    model: nn.Module | None = None,
    *,
    strategies: Sequence[str],
    world_sizes: Sequence[int],
    **kwargs: Any,
) -> list[MemoryEstimate]:
    """One :func:`estimate` per strategy and world size (``"single"`` once, at world size 1).

    ``offload_optimizer`` / ``offload_param`` in ``kwargs`` apply only to the strategies that
    support them, so a grid can mix ``"ddp"`` with ``"zero3"`` and offload.
    """
    out: list[MemoryEstimate] = []
    offload_optimizer = kwargs.pop("offload_optimizer", False)
    offload_param = kwargs.pop("offload_param", False)
    for strategy in strategies:
        canonical = _canonical_strategy(strategy, "estimate_grid")
        sizes = [1] if canonical == "single" else list(world_sizes)
        for size in sizes:
            extra = dict(kwargs)
            if canonical.startswith("zero"):
                extra["offload_optimizer"] = offload_optimizer
            if offload_param and canonical in ("zero3", "fsdp", "fsdp2"):
                extra["offload_param"] = True
            if canonical == "single":
                extra.pop("ranks_per_node", None)
            out.append(estimate(model, strategy=canonical, world_size=size, **extra))
    return out
