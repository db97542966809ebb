"""``predict()``: run two training steps on fake tensors and report the second one's memory per phase."""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from memcallbacks.estimate.tables import canonical_precision
from memcallbacks.estimate.tables import canonical_strategy as _canonical_strategy
from memcallbacks.preflight import allocator, workspaces
from memcallbacks.preflight._analysis import StepResult, analyse
from memcallbacks.preflight._fake import fake_batch, fake_model, fake_optimizer
from memcallbacks.preflight._step import ForwardFn, default_forward_fn, run_step
from memcallbacks.preflight._tracking import GRADS, OPTIMIZER, PARAMS
from memcallbacks.preflight.prediction import Prediction

log = logging.getLogger(__name__)

__all__ = ["predict"]

_TRUE_DTYPES = {"bf16-true": torch.bfloat16, "16-true": torch.float16, "64-true": torch.float64}
_AUTOCAST_DTYPES = {"bf16-mixed": torch.bfloat16, "16-mixed": torch.float16}
_MODEL_STATES = (PARAMS, GRADS, OPTIMIZER)


def _target_device(model: nn.Module, device: str | torch.device | None) -> torch.device:
    if device is None:
        first = next(iter(model.parameters()), None)
        device = first.device if first is not None and first.device.type != "meta" else "cpu"
    try:
        return torch.device(device)
    except (RuntimeError, TypeError):
        raise ValueError(f"predict(): device={device!r} is not a torch device; pass 'cuda', 'cpu' or a torch.device.") from None


def _compute_device(target: torch.device, notes: list[str]) -> torch.device:
    """Fake tensors on CUDA need CUDA in this torch build (autograd asks the device guard); else CPU shapes."""
    if target.type == "cpu":
        return target
    if target.type == "cuda" and torch.cuda.is_available():
        return target
    notes.append(f"ran on CPU fake tensors for the {target.type} target (this torch has no {target.type}): CPU kernels' "
                 "shapes, foreach optimizer, CUDA allocator rounding applied")
    return torch.device("cpu")


def predict(
    model: nn.Module,
    batch: Any,
    optimizer: torch.optim.Optimizer | str | None = None,
    *,
    loss_fn: Callable[..., torch.Tensor] | None = None,
    forward_fn: ForwardFn | None = None,
    precision: str = "fp32",
    device: str | torch.device | None = None,
    strategy: str = "single",
    world_size: int = 1,
    hopper: bool = False,
) -> Prediction:
    """Predict one training step's device memory per phase without running it for real.

    Args:
        model: a real or meta-device model; it is copied structurally with fake tensors (no data
            copied, no hooks carried over) and never modified.
        batch: one rank's batch: a tensor, a tuple/list, or a dict; real or meta tensors.
        optimizer: a ``torch.optim.Optimizer`` (its class and param-group settings are reused, its
            state is not touched), a name (``"adamw"``, ``"adam"``, ``"sgd"``, ``"sgd+momentum"``),
            or ``None`` for no optimizer step.
        loss_fn: with an ``(x, y)`` batch: ``loss_fn(model(x), y)``.
        forward_fn: ``forward_fn(model, batch) -> loss`` for any other step (several losses,
            activation checkpointing, a Lightning ``training_step``). Default: ``model(**batch).loss``
            for a dict batch.
        precision: ``"fp32"``/``"32-true"``, ``"bf16-mixed"``, ``"16-mixed"`` (autocast around
            forward_fn), ``"bf16-true"``, ``"16-true"``, ``"64-true"`` (params and float inputs cast).
        device: the target device; default: the model's (CPU for a meta model).
        strategy, world_size: model states per rank as :func:`memcallbacks.estimate.estimate` shards them.
        hopper: CUDA target is Hopper (a 32 MiB cuBLAS workspace instead of 8.1 MiB). One workspace per
            thread that runs matmuls: the forward thread's from its first matmul, the autograd
            device thread's from the first backward matmul (two in the steady step).

    Raises:
        PreflightError: the step cannot run on fake tensors (``.item()``, data-dependent shapes, an
            op with no fake kernel); the message names the op.
        ValueError: a bad argument, named.
    """
    precision_name = canonical_precision(precision, "predict").name
    strategy = _canonical_strategy(strategy, "predict")
    if not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"predict(): world_size={world_size!r} must be a positive int; pass the number of ranks.")
    notes: list[str] = []
    target = _target_device(model, device)
    compute = _compute_device(target, notes)
    forward_fn = forward_fn or default_forward_fn(loss_fn)
    runs = _run_two_steps(model, batch, optimizer, forward_fn, precision_name, compute, target.type == "cuda")
    if target.type == "cuda":
        first, steady = _build_cuda(runs, allocator.cublas_workspace_bytes(hopper), target, precision_name, notes)
    else:  # exact bytes: what the CPU allocator is asked for
        first, steady = (_build(analyse(t, b, int), target, precision_name, notes) for t, b in runs)
    steady = dataclass_replace(steady, first_step=first)
    if strategy != "single":
        steady = shard_prediction(steady, model, optimizer, precision_name, strategy, world_size)
    return steady


def dataclass_replace(p: Prediction, **changes: Any) -> Prediction:
    import dataclasses

    return dataclasses.replace(p, **changes)


def _run_two_steps(
    model: nn.Module, batch: Any, optimizer: Any, forward_fn: ForwardFn, precision: str, compute: torch.device, cuda: bool
) -> list[tuple[Any, list[int]]]:
    from torch._subclasses.fake_tensor import FakeTensorMode

    dtype = _TRUE_DTYPES.get(precision)
    autocast_dtype = _AUTOCAST_DTYPES.get(precision)

    def autocast() -> contextlib.AbstractContextManager[Any]:
        if autocast_dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(compute.type, dtype=autocast_dtype)

    mode = FakeTensorMode(allow_non_fake_inputs=True)
    with torch.random.fork_rng(devices=[]):
        fmodel, params = fake_model(model, mode, compute, dtype)
        fmodel.train(model.training)
        fopt = fake_optimizer(optimizer, params, list(fmodel.parameters()), foreach=True if cuda else None)
        fbatch = fake_batch(batch, mode, compute, dtype)
        runs = []
        with mode:
            for _ in range(2):
                runs.append(run_step(fmodel, fopt, fbatch, forward_fn, autocast))
    return runs


def _build_cuda(
    runs: list[tuple[Any, list[int]]], workspace: int, target: torch.device, precision: str, notes: list[str]
) -> list[Prediction]:
    """Both steps through the caching-allocator model, with one cuBLAS workspace per thread that runs
    matmuls (:mod:`memcallbacks.preflight.workspaces`), allocated at that thread's first matmul."""
    first_mm = workspaces.first_matmuls(runs[0][0].records)
    # the steady step starts with the first step's workspaces; a thread whose first matmul comes only now gets one then
    steady_mm = dict.fromkeys(first_mm, 0)
    for thread, born in workspaces.first_matmuls(runs[1][0].records).items():
        steady_mm.setdefault(thread, born + 1)
    first_mm = {thread: born + 1 for thread, born in first_mm.items()}  # cuBLAS runs after the output's allocation
    out = []
    for (tracker, bounds), starts in ((runs[0], first_mm), (runs[1], steady_mm)):
        extra: dict[int, list[int]] = {}
        for at in starts.values():
            extra.setdefault(at, []).append(workspace)
        rep = allocator.replay(tracker.events, [r.nbytes for r in tracker.records], extra)
        result = analyse(tracker, bounds, allocator.round_size, record_bytes=rep.record_bytes,
                         workspace_at={at: sum(blocks) for at, blocks in rep.extra_bytes.items()})
        threads = " and ".join(sorted(starts)) or "none (no matmul seen)"
        note = (f"cuBLAS workspace {workspace} bytes for each thread that runs matmuls: {threads}; blocks as the caching "
                f"allocator hands them out (rounded to {allocator.MIN_BLOCK} bytes, a large-pool block split only when more "
                f"than 1 MiB is left); reserved (estimated) {rep.peak_reserved} bytes")
        out.append(_build(result, target, precision, [*notes, note]))
    return out


def _build(result: StepResult, target: torch.device, precision: str, notes: list[str]) -> Prediction:
    breakdown = {phase: dict(r.breakdown) for phase, r in result.phases.items()}
    peaks = {phase: r.peak_bytes for phase, r in result.phases.items()}
    return Prediction(
        device=target.type,
        precision=precision,
        strategy="single",
        world_size=1,
        start_bytes=result.start_bytes,
        forward_peak_bytes=peaks["forward"],
        backward_peak_bytes=peaks["backward"],
        optimizer_peak_bytes=peaks["optimizer"],
        breakdown=breakdown,
        top_modules=tuple(result.top_modules),
        activation_bytes=result.activation_bytes,
        notes=tuple(notes),
    )


def shard_prediction(
    p: Prediction, model: nn.Module, optimizer: Any, precision: str, strategy: str, world_size: int
) -> Prediction:
    """Swap the single-device model states at each phase peak for :func:`estimate`'s per-rank ones."""
    from memcallbacks.estimate import estimate

    opt: Any = 0.0 if optimizer is None else optimizer
    est = estimate(model, optimizer=opt, precision=precision, strategy=strategy, world_size=world_size)
    per_phase = {
        "forward": est.device_forward_peak,
        "backward": est.device_backward_peak,
        "optimizer": est.device_optimizer_peak,
    }
    breakdown = {}
    peaks = {}
    for phase, cats in p.breakdown.items():
        single = sum(cats[c] for c in _MODEL_STATES)
        cats = {c: v for c, v in cats.items() if c not in _MODEL_STATES}
        cats["model_states"] = per_phase[phase]
        breakdown[phase] = cats
        peaks[phase] = p.phase_peaks()[phase] - single + per_phase[phase]
    start = p.start_bytes - sum(p.breakdown["forward"][c] for c in (PARAMS, OPTIMIZER)) + est.device_steady
    note = (f"model states per rank from estimate(strategy={strategy!r}, world_size={world_size}): "
            f"{est.device_steady} bytes steady; activations are one rank's batch")
    first = shard_prediction(p.first_step, model, optimizer, precision, strategy, world_size) if p.first_step else None
    return dataclass_replace(
        p, strategy=strategy, world_size=world_size, start_bytes=start, forward_peak_bytes=peaks["forward"],
        backward_peak_bytes=peaks["backward"], optimizer_peak_bytes=peaks["optimizer"], breakdown=breakdown,
        notes=(*p.notes, note), first_step=first,
    )
