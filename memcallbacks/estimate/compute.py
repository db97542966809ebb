"""Model-state memory per rank (params, grads, optimizer state, sharding buffers).

This module is arithmetic over shapes and dtypes: it never reads tensor data, never calls
``torch.cuda`` and works on models built on the meta device. Every formula, its source and its
assumptions are in ``docs/theory.md``; activations, allocator fragmentation, the CUDA context and
NCCL's own buffers are not modelled.

Seed 000's worked example (4 layers x 1B params, Adam, FSDP2 full shard on 8 ranks, bf16 mixed)::

    >>> from memcallbacks.estimate import GB
    >>> e = estimate(num_params=4e9, largest_layer_params=1e9, optimizer="adam",
    ...              precision="bf16-mixed", strategy="fsdp2", world_size=8)
    >>> e.device_steady / GB, e.device_forward_peak / GB, e.device_backward_peak / GB
    (6.0, 10.0, 12.0)

:func:`estimate` checks its arguments and turns the model (or the counts) into per-tensor rows;
``accounting.py`` does the per-rank arithmetic.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import NamedTuple

from torch import nn

from memcallbacks.estimate.accounting import compute_states, Setup, Tensor
from memcallbacks.estimate.layers import wrap_units, unwrap, find_layers
from memcallbacks.estimate.result import MemoryEstimate
from memcallbacks.estimate.tables import (
    OptimizerArg,
    canonical_precision,
    canonical_sharding,
    count_of,
    fail,
    OptSpec,
    param_specs,
    positive_int,
    canonical_strategy,
)

log = logging.getLogger(__name__)

__all__ = ["estimate"]


def estimate(
    model: nn.Module | None = None,
    *,
    num_params: float | None = None,
    largest_layer_params: float | None = None,
    trainable_params: float | None = None,
    root_params: float | None = None,
    layer_cls: type | str | Sequence[type | str] | None = None,
    layer_names: Sequence[str] | None = None,
    optimizer: OptimizerArg = "adamw",
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
    setup = _resolve(
        func, strategy=strategy, precision=precision, world_size=world_size, rank=rank, ranks_per_node=ranks_per_node,
        sharding=sharding, shard_group_size=shard_group_size, offload_optimizer=offload_optimizer, offload_param=offload_param,
        gradient_accumulation_steps=gradient_accumulation_steps, no_sync=no_sync, set_to_none=set_to_none,
        gradient_as_bucket_view=gradient_as_bucket_view, reduce_bucket_size=reduce_bucket_size,
        prefetch_layers=prefetch_layers, zero_init=zero_init, conservative=conservative,
    )
    notes: list[str] = []
    default_spec, per_param = param_specs(optimizer, func)
    sizes = _Sizes(num_params, trainable_params, largest_layer_params, root_params)
    if model is None:
        rows = _from_counts(setup, sizes, default_spec, notes)
    else:
        rows = _from_model(model, setup, sizes, layer_cls, layer_names, default_spec, per_param, notes)
    return compute_states(*rows, setup, default_spec, notes)


# ----------------------------------------------------------------------------------------------
# arguments


def _resolve(
    func: str,
    *,
    strategy: str,
    precision: str,
    world_size: int,
    rank: int,
    ranks_per_node: int | None,
    sharding: str,
    shard_group_size: int | None,
    offload_optimizer: bool,
    offload_param: bool,
    gradient_accumulation_steps: int,
    no_sync: bool,
    set_to_none: bool,
    gradient_as_bucket_view: bool,
    reduce_bucket_size: int,
    prefetch_layers: int | None,
    zero_init: bool,
    conservative: bool,
) -> Setup:
    """Check :func:`estimate`'s arguments, in the order the errors are reported, into a :class:`Setup`."""
    strategy = canonical_strategy(strategy, func)
    prec = canonical_precision(precision, func)
    world_size = positive_int(world_size, "world_size", func)
    accumulation = positive_int(gradient_accumulation_steps, "gradient_accumulation_steps", func)
    if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < world_size:
        raise fail(func, "rank", rank, f"is outside 0..{world_size - 1}; pass a rank below world_size={world_size}.")
    if ranks_per_node is None:
        ranks_per_node = min(world_size, 8)
    ranks_per_node = positive_int(ranks_per_node, "ranks_per_node", func)
    if strategy == "single" and world_size != 1:
        raise fail(func, "world_size", world_size, "does not apply to strategy='single'; pass world_size=1 or strategy='ddp'.")
    fsdp = strategy in ("fsdp", "fsdp2")
    sharding_name, shards = _resolve_sharding(func, strategy, world_size, sharding, shard_group_size)
    _check_offload(func, strategy, offload_optimizer, offload_param)
    if strategy.startswith("zero") and prec.param_bytes > 4:
        raise fail(func, "precision", precision, "is not supported by DeepSpeed ZeRO; pass 'fp32', 'bf16-mixed' or '16-mixed'.")
    if prefetch_layers is None:
        prefetch_layers = 1 if fsdp else 0
    if isinstance(prefetch_layers, bool) or not isinstance(prefetch_layers, int) or prefetch_layers < 0:
        raise fail(func, "prefetch_layers", prefetch_layers, "must be an int >= 0; pass 0, 1, ...")
    return Setup(
        strategy=strategy,
        prec=prec,
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
        reduce_bucket=count_of(reduce_bucket_size, "reduce_bucket_size", func),
        prefetch=prefetch_layers,
        zero_init=bool(zero_init),
        conservative=bool(conservative),
    )


def _resolve_sharding(func: str, strategy: str, world_size: int, sharding: str, shard_group_size: int | None) -> tuple[str, int]:
    """The canonical FSDP sharding and the ranks a sharded tensor is split over."""
    fsdp = strategy in ("fsdp", "fsdp2")
    sharding_name = canonical_sharding(sharding, func)
    if not fsdp and sharding_name != "full":
        raise fail(func, "sharding", sharding, f"applies to strategy='fsdp'/'fsdp2' only, not {strategy!r}; leave it at 'full'.")
    shards = 1
    if fsdp or strategy.startswith("zero"):
        shards = world_size
    if sharding_name == "hybrid":
        if shard_group_size is None:
            raise fail(func, "shard_group_size", None, "is required with sharding='hybrid'; pass the ranks one replica is sharded over (e.g. 8).")
        shard_group_size = positive_int(shard_group_size, "shard_group_size", func)
        if world_size % shard_group_size:
            raise fail(func, "shard_group_size", shard_group_size, f"does not divide world_size={world_size}; pass a divisor of it.")
        shards = shard_group_size
    elif shard_group_size is not None and shard_group_size != world_size:
        raise fail(func, "shard_group_size", shard_group_size, "needs sharding='hybrid'; pass sharding='hybrid' or drop it.")
    return sharding_name, shards


def _check_offload(func: str, strategy: str, offload_optimizer: bool, offload_param: bool) -> None:
    fsdp = strategy in ("fsdp", "fsdp2")
    if offload_optimizer and not strategy.startswith("zero"):
        fix = "for FSDP pass offload_param=True (CPUOffload moves params, grads and optimizer state)" if fsdp else "use a zero* strategy"
        raise fail(func, "offload_optimizer", offload_optimizer, f"applies to DeepSpeed ZeRO only, not strategy={strategy!r}; {fix}.")
    if offload_param and not (fsdp or strategy == "zero3"):
        raise fail(func, "offload_param", offload_param, f"applies to 'zero3', 'fsdp' and 'fsdp2' only, not {strategy!r}; use one of those.")


# ----------------------------------------------------------------------------------------------
# what to count: the parameters of a model, or counts


class _Sizes(NamedTuple):
    """:func:`estimate`'s parameter counts, as given (``None``: not given)."""

    num_params: float | None
    trainable_params: float | None
    largest_layer_params: float | None
    root_params: float | None


def _from_model(
    model: nn.Module,
    setup: Setup,
    sizes: _Sizes,
    layer_cls: type | str | Sequence[type | str] | None,
    layer_names: Sequence[str] | None,
    default_spec: OptSpec,
    per_param: dict[int, OptSpec] | None,
    notes: list[str],
) -> tuple[list[Tensor], int, int]:
    """One row per parameter (tied ones once), the largest unit and the root unit, in elements."""
    func = "estimate"
    for name in ("num_params", "trainable_params"):
        value = getattr(sizes, name)
        if value is not None:
            raise fail(func, name, value, "cannot be combined with a model (it is counted from the model); drop it.")
    largest_layer_params, root_params = sizes.largest_layer_params, sizes.root_params
    inner = unwrap(model)
    if setup.strategy == "zero3" and layer_cls is None and layer_names is None:
        unit_sizes, root, _ = wrap_units(inner, None)
        notes.append("ZeRO-3 units: each module's own parameters (DeepSpeed's estimator's largest layer)")
    else:
        names = find_layers(inner, layer_cls=layer_cls, layer_names=layer_names)
        unit_sizes, root, _ = wrap_units(inner, names)
        log.debug("estimate(): %d units, largest %d, root %d", len(unit_sizes), max(unit_sizes, default=0), root)
    largest = max(unit_sizes, default=0)
    if largest_layer_params is not None:
        largest = count_of(largest_layer_params, "largest_layer_params", func)
    if root_params is not None:
        root = count_of(root_params, "root_params", func)
    tensors: list[Tensor] = []
    for p in inner.parameters():
        floating = p.is_floating_point() or p.is_complex()
        spec = None
        if p.requires_grad:
            spec = per_param.get(id(p)) if per_param is not None else default_spec
        tensors.append(
            Tensor(
                numel=p.numel(),
                shape=tuple(p.shape),
                floating=floating,
                elem_bytes=p.element_size(),
                grad=bool(p.requires_grad),
                spec=spec,
            )
        )
    return tensors, largest, root


def _from_counts(setup: Setup, sizes: _Sizes, default_spec: OptSpec, notes: list[str]) -> tuple[list[Tensor], int, int]:
    """Rows for ``num_params`` elements (trainable and frozen), the largest unit and the root unit."""
    func = "estimate"
    num_params, trainable_params, largest_layer_params, root_params = sizes
    if num_params is None:
        raise fail(func, "num_params", None, "is required without a model; pass the parameter count (e.g. 7e9) or a model.")
    total = count_of(num_params, "num_params", func, allow_zero=False)
    trainable = total if trainable_params is None else count_of(trainable_params, "trainable_params", func)
    if trainable > total:
        raise fail(func, "trainable_params", trainable_params, f"exceeds num_params={total}; pass at most num_params.")
    if largest_layer_params is None:
        if setup.fsdp or setup.strategy == "zero3":
            raise fail(
                func,
                "largest_layer_params",
                None,
                f"is required for strategy={setup.strategy!r} without a model; pass the parameter count of the unit "
                "FSDP wraps / ZeRO-3 gathers (e.g. one transformer block).",
            )
        largest = 0
    else:
        largest = count_of(largest_layer_params, "largest_layer_params", func)
    if largest > total:
        raise fail(func, "largest_layer_params", largest_layer_params, f"exceeds num_params={total}; pass at most num_params.")
    root = count_of(root_params, "root_params", func)
    tensors: list[Tensor] = []
    if trainable:
        tensors.append(Tensor(trainable, None, True, 4, True, default_spec))
    if total - trainable:
        tensors.append(Tensor(total - trainable, None, True, 4, False, None))
    if default_spec.factored:
        notes.append("Adafactor from counts: factored row/column moments are sub-linear and not counted")
    if default_spec.step_scalar:
        notes.append("from counts: the 4-byte per-tensor 'step' scalars are not counted")
    return tensors, largest, root
