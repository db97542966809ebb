"""Per-rank accounting behind ``estimate()``: shard sizes, placement by strategy, phase peaks.

Pure arithmetic over element counts, shapes and dtypes; the formulas and their sources are in
``docs/theory.md``. ``compute.py`` checks the arguments and turns a model or counts into
:class:`Tensor` rows; :func:`compute_states` turns those into a :class:`MemoryEstimate`.
"""

from __future__ import annotations

import dataclasses
import math

import torch

from memcallbacks.estimate.result import MemoryEstimate
from memcallbacks.estimate.tables import OptSpec, Precision

__all__: list[str] = []


@dataclasses.dataclass
class Tensor:
    numel: int
    shape: tuple[int, ...] | None  # None: a count, divided evenly by the shard size
    floating: bool
    elem_bytes: int  # used only when not floating
    grad: bool
    spec: OptSpec | None


@dataclasses.dataclass(frozen=True)
class Setup:
    """:func:`~memcallbacks.estimate.estimate`'s arguments, checked: canonical names, validated numbers."""

    strategy: str
    prec: Precision
    world_size: int
    shards: int  # ranks a sharded tensor is split over (1: unsharded)
    rank: int
    ranks_per_node: int
    sharding: str | None  # FSDP only
    offload_optimizer: bool
    offload_param: bool
    accumulation: int
    no_sync: bool
    set_to_none: bool
    bucket_view: bool
    reduce_bucket: int
    prefetch: int
    zero_init: bool
    conservative: bool

    @property
    def fsdp(self) -> bool:
        return self.strategy in ("fsdp", "fsdp2")

    @property
    def zero(self) -> bool:
        return self.strategy.startswith("zero")


# ----------------------------------------------------------------------------------------------
# sharding arithmetic


def _local(t: Tensor, mode: str, shards: int, rank: int) -> tuple[float, float]:
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


def _state_elements(t: Tensor, spec: OptSpec, owned: float, mode: str, shards: int, rank: int) -> float:
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
# per-tensor bytes


@dataclasses.dataclass(frozen=True)
class _StateBytes:
    """Bytes of each kind of model state this rank holds, summed over the tensors, before placement."""

    params: int
    grads: int
    grads_lp: int  # DeepSpeed's low-precision gradient partition
    states: int
    master: int  # DeepSpeed's fp32 master partition
    fp32_grad: int  # DeepSpeed's fp32 gradient partition
    temps: int  # foreach temporaries of the optimizer step
    scalars_dev: int  # per-tensor ``step`` scalars on the device (fused / capturable)
    scalars_host: int  # per-tensor ``step`` scalars on the CPU
    all_elems: int
    grad_elems: int
    float_elems: int


def _sum_states(tensors: list[Tensor], setup: Setup) -> _StateBytes:
    strategy, zero = setup.strategy, setup.zero
    mode = "dim0" if strategy == "fsdp2" else ("flat" if (setup.fsdp or zero) else "replicate")
    shards, shard_rank = setup.shards, setup.rank % setup.shards
    pb, cb = setup.prec.param_bytes, setup.prec.compute_bytes
    scalar_bytes = 8 if torch.get_default_dtype() == torch.float64 else 4

    def elem(t: Tensor, floating_bytes: int) -> int:
        return floating_bytes if t.floating else t.elem_bytes

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
    return _StateBytes(
        params=r(params), grads=r(grads), grads_lp=r(grads_lp), states=r(states), master=r(master),
        fp32_grad=r(fp32_grad), temps=r(temps), scalars_dev=r(scalars_dev), scalars_host=r(scalars_host),
        all_elems=sum(t.numel for t in tensors),
        grad_elems=sum(t.numel for t in tensors if t.grad),
        float_elems=sum(t.numel for t in tensors if t.floating),
    )


# ----------------------------------------------------------------------------------------------
# placement: where each kind of state lives under a strategy, and the transient working sets


@dataclasses.dataclass
class _Placement:
    dev_params: int = 0
    dev_grads: int = 0
    dev_opt: int = 0
    buffers: int = 0
    host_params: int = 0
    host_grads: int = 0
    host_opt: int = 0
    fwd_work: int = 0
    bwd_work: int = 0
    step_dev: int = 0
    step_host: int = 0
    grads_persist_dev: bool = False  # grads stay allocated after zero_grad
    grads_persist_host: bool = False
    accumulated: int = 0  # grad bytes kept alive between micro-batches


def _place_replicated(s: _StateBytes, largest: int, setup: Setup, notes: list[str]) -> _Placement:
    """``single`` and ``ddp``: every rank holds everything."""
    pb, cb = setup.prec.param_bytes, setup.prec.compute_bytes
    out = _Placement(dev_params=s.params, dev_grads=s.grads, dev_opt=s.states + s.scalars_dev, host_opt=s.scalars_host)
    out.step_dev = s.temps
    out.grads_persist_dev = not setup.set_to_none
    if setup.strategy == "ddp":
        if setup.bucket_view:
            out.grads_persist_dev = True  # the grads are views of buckets the reducer never frees
            notes.append("DDP gradient_as_bucket_view=True: grads are the reducer's buckets, always allocated")
        else:
            out.buffers = round(s.grad_elems * pb)
            notes.append("DDP gradient_as_bucket_view=False: buckets are a second copy of every gradient")
    if setup.prec.mixed:
        # autocast keeps a low-precision cast of each weight for the forward (its cache, then
        # autograd's saved tensors); nothing low-precision survives the step
        out.fwd_work = round(s.float_elems * cb)
        out.bwd_work = largest * cb
        notes.append("mixed precision: autocast's weight casts are transient, counted in forward")
    out.accumulated = out.dev_grads
    return out


def _place_fsdp(s: _StateBytes, largest: int, root: int, setup: Setup) -> _Placement:
    """FSDP1 / FSDP2: sharded states, units gathered one (plus prefetch) at a time."""
    cb, prefetch = setup.prec.compute_bytes, setup.prefetch
    rb = cb  # reduce_dtype defaults to param_dtype
    out = _Placement(grads_persist_dev=not setup.set_to_none)
    if setup.offload_param:
        out.host_params, out.host_grads, out.host_opt = s.params, s.grads, s.states + s.scalars_dev + s.scalars_host
        out.step_host = s.temps
    else:
        out.dev_params, out.dev_grads, out.dev_opt, out.host_opt = s.params, s.grads, s.states + s.scalars_dev, s.scalars_host
        out.step_dev = s.temps
    if setup.sharding == "grad_op":
        out.fwd_work = round(s.float_elems * cb)  # nothing resharded after forward: every unit ends forward unsharded
        out.bwd_work = round(s.float_elems * cb) + root * rb + 2 * largest * rb
    else:
        out.fwd_work = root * cb + (1 + prefetch) * largest * cb
        out.bwd_work = root * (cb + rb) + largest * cb + 2 * largest * rb
        if setup.conservative:
            out.bwd_work += prefetch * largest * cb
    out.accumulated = round(s.grad_elems * rb) if setup.no_sync else out.dev_grads
    return out


def _place_zero(s: _StateBytes, largest: int, root: int, setup: Setup) -> _Placement:
    """DeepSpeed ZeRO 1/2/3: fp32 master and optimizer partitions, low-precision module weights."""
    strategy, cb, prefetch = setup.strategy, setup.prec.compute_bytes, setup.prefetch
    out = _Placement(buffers=setup.reduce_bucket * cb, dev_params=s.params, grads_persist_dev=not setup.set_to_none)
    if strategy == "zero3" and setup.offload_param:
        out.dev_params, out.host_params = 0, s.params
    if setup.offload_optimizer:
        out.host_opt = s.states + s.master
        out.grads_persist_host = True
        if strategy == "zero1":
            out.dev_grads, out.host_grads = s.grads_lp, s.fp32_grad
        elif strategy == "zero2":
            out.host_grads = s.fp32_grad
        else:  # stage3.py keeps its low-precision grad partition buffer where the optimizer runs
            out.host_grads = s.grads_lp + s.fp32_grad
    else:
        out.dev_opt = s.states + s.master
        out.dev_grads = s.grads_lp
        out.step_dev = s.fp32_grad  # the fp32 copy of the grad partition exists only inside step()
        if strategy == "zero3":
            out.grads_persist_dev = True  # grad_partitions_flat_buffer is allocated once, at init
    if strategy == "zero3":
        out.fwd_work = root * cb + (1 + prefetch) * largest * cb
        out.bwd_work = root * 2 * cb + largest * cb + largest * cb
        if setup.conservative:
            out.bwd_work += prefetch * largest * cb
    out.accumulated = out.dev_grads
    return out


# ----------------------------------------------------------------------------------------------
# phase peaks and the result


@dataclasses.dataclass(frozen=True)
class _DevicePhases:
    steady: int
    forward: int
    backward: int
    step: int


def _device_phases(p: _Placement, setup: Setup, notes: list[str]) -> _DevicePhases:
    steady = p.dev_params + p.dev_opt + p.buffers + (p.dev_grads if p.grads_persist_dev else 0)
    grads_extra = 0 if p.grads_persist_dev else p.dev_grads
    if setup.accumulation > 1 and (not p.grads_persist_dev or (setup.fsdp and setup.no_sync)):
        accum_extra = p.accumulated
        notes.append(f"gradient accumulation x{setup.accumulation}: grads stay allocated between micro-batches")
    else:
        accum_extra = 0
    forward = steady + p.fwd_work + accum_extra
    if setup.fsdp:
        # seed 000: sharded grads "come and go" and are not part of the backward peak
        reduced = grads_extra if setup.conservative and accum_extra != grads_extra else 0
        backward = steady + p.bwd_work + accum_extra + reduced
    else:
        backward = steady + p.bwd_work + max(grads_extra, accum_extra)
    return _DevicePhases(steady=steady, forward=forward, backward=backward, step=steady + grads_extra + p.step_dev)


def _host_init(s: _StateBytes, largest: int, setup: Setup) -> int:
    ib = setup.prec.param_bytes  # the model is built in its parameter dtype (fp32 for mixed precision)
    if (setup.strategy == "zero3" or setup.fsdp) and setup.zero_init:
        return largest * ib if setup.strategy == "zero3" else 0
    return round(s.all_elems * ib)


def compute_states(
    tensors: list[Tensor], largest: int, root: int, setup: Setup, default_spec: OptSpec, notes: list[str]
) -> MemoryEstimate:
    """The estimate for ``tensors`` under ``setup``; appends the assumptions that applied to ``notes``."""
    s = _sum_states(tensors, setup)
    if setup.strategy in ("single", "ddp"):
        p = _place_replicated(s, largest, setup, notes)
    elif setup.fsdp:
        p = _place_fsdp(s, largest, root, setup)
    else:
        p = _place_zero(s, largest, root, setup)
    dev = _device_phases(p, setup, notes)
    host_init = _host_init(s, largest, setup)
    host_steady = p.host_params + p.host_opt + (p.host_grads if p.grads_persist_host else 0)
    host_step = p.host_params + p.host_opt + p.host_grads + p.step_host
    return MemoryEstimate(
        strategy=setup.strategy,
        sharding=setup.sharding,
        world_size=setup.world_size,
        shard_size=setup.shards,
        rank=setup.rank,
        ranks_per_node=setup.ranks_per_node,
        precision=setup.prec.name,
        optimizer=default_spec.label,
        num_params=s.all_elems,
        trainable_params=s.grad_elems,
        layer_params=largest,
        root_params=root,
        offload_optimizer=setup.offload_optimizer,
        offload_param=setup.offload_param,
        gradient_accumulation_steps=setup.accumulation,
        device_params=p.dev_params,
        device_grads=p.dev_grads,
        device_optimizer=p.dev_opt,
        device_comm_buffers=p.buffers,
        device_forward_working=p.fwd_work,
        device_backward_working=p.bwd_work,
        device_optimizer_working=p.step_dev,
        device_steady=dev.steady,
        device_forward_peak=dev.forward,
        device_backward_peak=dev.backward,
        device_optimizer_peak=dev.step,
        host_params=p.host_params,
        host_grads=p.host_grads,
        host_optimizer=p.host_opt,
        host_init=host_init,
        host_steady=host_steady,
        host_peak=max(host_init, host_steady, host_step),
        notes=tuple(notes),
    )
