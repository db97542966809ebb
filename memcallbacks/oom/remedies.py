"""The changes that make a failed step fit, each with the saving the pre-flight predicts for it."""

from __future__ import annotations

import dataclasses
import logging
from typing import Any, Callable

import torch
from torch import nn

from memcallbacks._base.units import format_bytes
from memcallbacks.oom.accounting import Accounting

log = logging.getLogger(__name__)

__all__ = ["Remedy", "StepModel", "checkpoint_blocks", "rank_remedies"]

# sharding is tried over these rank counts, the smallest that fits is advised
_RANKS = (2, 4, 8, 16)
# lighter optimizer state: what to switch to from each (torch.optim names), bytes of state per fp32 parameter
_LIGHTER = {"adam": ("sgd+momentum", "SGD with momentum", 8, 4), "adamw": ("sgd+momentum", "SGD with momentum", 8, 4),
            "rmsprop": ("sgd", "SGD without momentum", 4, 0), "adagrad": ("sgd", "SGD without momentum", 4, 0),
            "sgd+momentum": ("sgd", "SGD without momentum", 4, 0)}


@dataclasses.dataclass
class Remedy:
    """One change, its predicted saving at the step's peak, and whether the step then fits."""

    kind: str
    """``leak``, ``batch_size``, ``checkpointing``, ``optimizer``, ``precision``, ``sharding``, ``expandable_segments``."""
    advice: str
    saving_bytes: int | None
    """Predicted bytes saved at the peak; None when it cannot be predicted (``advice`` says why)."""
    fits: bool | None = None
    details: dict[str, Any] = dataclasses.field(default_factory=dict)

    def __str__(self) -> str:
        saving = f"saves {format_bytes(self.saving_bytes)}" if self.saving_bytes is not None else "saving not predicted"
        verdict = {True: ", fits", False: ", still does not fit", None: ""}[self.fits]
        return f"[{self.kind}] {self.advice} ({saving}{verdict})"


@dataclasses.dataclass
class StepModel:
    """What the pre-flight needs to replay the failed step: the module called, its call, the optimizer, the settings."""

    module: nn.Module
    call: Any
    """``(args, kwargs)`` of the module call, or the loader's batch for ``training_step``."""
    optimizer: Any
    precision: str = "fp32"
    device: torch.device | str | None = None
    step_fn: str | Callable[[nn.Module, Any], Any] = "call"
    """``"call"``, ``"training_step"`` (Lightning), ``"default"``: :func:`~memcallbacks.preflight.predict`'s own
    (``model(**batch).loss``, or ``loss_fn(model(x), y)`` with ``extra["loss_fn"]``), or the forward function itself."""
    extra: dict[str, Any] = dataclasses.field(default_factory=dict)
    """More :func:`~memcallbacks.preflight.predict` arguments (``loss_fn``, ``strategy``, ``world_size``, ``hopper``)."""
    known: dict[int, Any] = dataclasses.field(default_factory=dict)
    """Predictions of this step at other batch sizes already made (batch size -> prediction): not made again."""

    @property
    def forward_fn(self) -> Callable[[nn.Module, Any], Any]:
        from memcallbacks.preflight._step import call_step, training_step
        from memcallbacks.preflight._step import default_forward_fn

        if callable(self.step_fn):
            return self.step_fn
        if self.step_fn == "default":
            return default_forward_fn(self.extra.get("loss_fn"))
        return call_step if self.step_fn == "call" else training_step(0)

    def predict(self, batch: Any = None, forward_fn: Callable[..., Any] | None = None, **changes: Any) -> Any:
        from memcallbacks.preflight import predict

        kwargs = dict(self.extra, forward_fn=forward_fn or self.forward_fn, precision=self.precision, device=self.device)
        kwargs.pop("loss_fn", None)
        optimizer = changes.pop("optimizer", self.optimizer)
        kwargs.update(changes)
        return predict(self.module, self.call if batch is None else batch, optimizer, **kwargs)


def checkpoint_blocks(model: nn.Module) -> list[str]:
    """The repeated blocks to checkpoint: the children of the model's longest ``ModuleList``/``Sequential`` (else its children)."""
    best: list[str] = []
    for name, module in model.named_modules():
        if isinstance(module, (nn.ModuleList, nn.Sequential)) and len(module) > len(best):
            children = [f"{name}.{n}" if name else n for n, c in module.named_children() if any(True for _ in c.parameters())]
            if len(children) >= 2:
                best = children
    return best or [n for n, c in model.named_children() if any(True for _ in c.parameters())]


def _checkpointed(names: list[str], step: Callable[[nn.Module, Any], Any]) -> Callable[[nn.Module, Any], Any]:
    """A ``forward_fn`` that runs the fake copy with ``names`` under ``torch.utils.checkpoint`` (the real model is untouched)."""

    def forward(model: nn.Module, batch: Any) -> Any:
        from torch.utils.checkpoint import checkpoint

        for name in names:
            sub = model.get_submodule(name)
            inner = sub.forward
            object.__setattr__(sub, "forward", lambda *a, _f=inner, **k: checkpoint(_f, *a, use_reentrant=False, **k))
        return step(model, batch)

    return forward


def available_bytes(acc: Accounting) -> int | None:
    """What a step may take: the capacity less what is not the step's (the process or other processes, earlier steps' memory)."""
    if acc.capacity_bytes is None:
        return None
    outside = sum(v for k, v in acc.categories.items() if k.startswith(("the process", "outside PyTorch")))
    return acc.capacity_bytes - outside - acc.categories.get("held from earlier steps", 0)


def _leak(acc: Accounting, holders: list[str]) -> Remedy | None:
    held = acc.categories.get("held from earlier steps", 0)
    # the floor rose by more than this step's own memory, or by a tenth of the figure: not the batch's fault
    if held <= 0 or held < max(acc.step_bytes, acc.figure_bytes // 10):
        return None
    since = f" since step {acc.floor_steps[0]}" if acc.floor_steps else ""
    who = f"; held by {holders[0]}" if holders else "; no holder named yet (memcallbacks' growth finding names it once its census runs)"
    return Remedy("leak", f"this is the leak, not the batch: the memory held from earlier steps rose by {format_bytes(held)}{since}{who}. "
                  "Free it (return loss.item(), do not keep outputs or graphs across steps); a smaller batch only delays the failure",
                  held, None, {"holders": holders[:3]})


def _window(step: StepModel, base: Any, size: int, available: int) -> tuple[int, int, int | None, dict[int, Any]]:
    """Where to search: the peak grows about linearly with the batch, so one more prediction (batch 1)
    places the answer (the guess) within a few sizes; the search still proves it on both sides.
    Also returns the predictions made (batch size -> prediction), for the search to reuse."""
    from memcallbacks.preflight.batch_size import resize_batch

    one = step.known[1] if 1 in step.known else step.predict(resize_batch(step.call, size, 1))
    known = {1: one}
    if base.peak_bytes <= one.peak_bytes:
        return 1, size - 1, None, known
    guess = 1 + int((available - one.peak_bytes) * (size - 1) / (base.peak_bytes - one.peak_bytes))
    guess = min(max(guess, 1), size - 1)
    return max(1, guess - 2), min(size - 1, guess + 2), guess, known


def _batch(step: StepModel, base: Any, available: int) -> Remedy | None:
    from memcallbacks.preflight import max_batch_size

    from memcallbacks.preflight.batch_size import batch_size_of, resize_batch

    size = batch_size_of(step.call)
    if size is None or size <= 1:
        return None
    kwargs = dict(step.extra, forward_fn=step.forward_fn, precision=step.precision, device=step.device)
    kwargs.pop("loss_fn", None)
    low, high, guess, known = _window(step, base, size, available)
    known = {**step.known, **known}

    def search(low: int, high: int) -> Any:
        fit = max_batch_size(step.module, lambda n: resize_batch(step.call, size, n), available, step.optimizer, low=low, high=high,
                             known=known, **kwargs)
        known.update(fit.predictions)  # a later search predicts none of these again
        return fit

    fit = None
    if guess is not None:  # the line's answer and the size above it: two predictions when the line is right
        fit = search(guess, min(size - 1, guess + 1))
        proven = fit.batch_size == guess < size - 1 or fit.batch_size == size - 1
    if fit is None or not proven:  # the line missed: the window around it, then (still outside) every size
        fit = search(low, high)
        if (fit.batch_size == 0 and low > 1) or (fit.batch_size == high < size - 1):
            fit = search(1, size - 1)
    if fit.batch_size == 0:
        return Remedy("batch_size", f"no batch size fits: batch size 1 is predicted to peak at {format_bytes(fit.peak_bytes)}, "
                      f"above the {format_bytes(available)} the step may take", base.peak_bytes - fit.peak_bytes, False,
                      {"batch_size": 0, "failed_batch_size": size})
    return Remedy("batch_size", f"batch size {fit.batch_size} is the largest that fits (this batch has {size}, dimension 0 of its first "
                  f"tensor): predicted peak {format_bytes(fit.peak_bytes)} of the {format_bytes(available)} the step may take",
                  base.peak_bytes - fit.peak_bytes, True, {"batch_size": fit.batch_size, "failed_batch_size": size,
                                                           "predicted_peak_bytes": fit.peak_bytes, "tried": dict(fit.tried)})


def _variant(kind: str, advice: str, step: StepModel, base: Any, available: int | None, details: dict[str, Any], **changes: Any) -> Remedy:
    p = step.predict(**changes)
    fits = p.peak_bytes <= available if available is not None else None
    return Remedy(kind, f"{advice}: predicted peak {format_bytes(p.peak_bytes)} in {p.peak_phase}", base.peak_bytes - p.peak_bytes,
                  fits, dict(details, predicted_peak_bytes=p.peak_bytes))


def _checkpointing(step: StepModel, base: Any, available: int | None) -> Remedy | None:
    names = checkpoint_blocks(step.module)
    if not names:
        return None
    shown = ", ".join(names[:3]) + (f" and {len(names) - 3} more" if len(names) > 3 else "")
    return _variant("checkpointing", f"activation checkpointing of {shown} (torch.utils.checkpoint; the largest saved activations "
                    f"are in {', '.join(n or '(model)' for n, _ in base.top_modules[:3])})", step, base, available,
                    {"modules": names}, forward_fn=_checkpointed(names, step.forward_fn))


def _optimizer(step: StepModel, base: Any, available: int | None, acc: Accounting) -> Remedy | None:
    opt = step.optimizer
    if opt is None or acc.categories.get("optimizer state", 0) == 0:
        return None
    current = opt.lower() if isinstance(opt, str) else type(opt).__name__.lower()
    if current == "sgd" and not isinstance(opt, str) and any(g.get("momentum") for g in opt.param_groups):
        current = "sgd+momentum"
    lighter = _LIGHTER.get(current)
    if lighter is None:
        return None
    name, words, before, after = lighter
    return _variant("optimizer", f"a lighter optimizer: {words} keeps {after} bytes of state per fp32 parameter where "
                    f"{current} keeps {before}", step, base, available, {"optimizer": name}, optimizer=name)


def _attempt(what: str, make: Callable[[], Remedy | None], out: list[Remedy]) -> None:
    """A remedy whose prediction fails is said so, with the reason, not guessed."""
    try:
        remedy = make()
    except Exception as exc:
        log.debug("oom remedy %s could not be predicted", what, exc_info=True)
        out.append(Remedy(what, f"{what}: the saving cannot be predicted ({type(exc).__name__}: {exc})", None))
        return
    if remedy is not None:
        out.append(remedy)


def _sharding(step: StepModel, base: Any, available: int | None, acc: Accounting) -> Remedy | None:
    states = sum(acc.categories.get(k, 0) for k in ("parameters", "gradients", "optimizer state"))
    if available is None or states < base.peak_bytes // 4:
        return None  # the model states are not what fills the memory: sharding them saves little
    for n in _RANKS:
        p = _sharded(step, base, n)
        if p.peak_bytes <= available:
            return Remedy("sharding", f"sharding the model states over {n} ranks (FSDP2 / ZeRO-3), this batch per rank: predicted "
                          f"peak {format_bytes(p.peak_bytes)} per rank", base.peak_bytes - p.peak_bytes, True,
                          {"world_size": n, "predicted_peak_bytes": p.peak_bytes})
    return None


def _sharded(step: StepModel, base: Any, world_size: int) -> Any:
    """The step under FSDP2 over ``world_size`` ranks. Only the model states per rank change, not the fake step:
    a single-device ``base`` is resharded as :func:`~memcallbacks.preflight.predict` does, without running the step again."""
    if base.strategy != "single" or base.world_size != 1:
        return step.predict(strategy="fsdp2", world_size=world_size)
    from memcallbacks.preflight.predict import shard_prediction

    return shard_prediction(base, step.module, step.optimizer, base.precision, "fsdp2", world_size)


def _fragmentation(acc: Accounting) -> Remedy | None:
    free, largest, want = acc.reserved_unallocated_bytes, acc.largest_free_block_bytes, acc.requested_bytes
    if acc.device != "cuda" or acc.expandable_segments or not free or want is None or largest is None:
        return None
    if free < want or largest >= want:
        return None  # not fragmentation: there is not enough cached memory, or a block big enough
    return Remedy("expandable_segments", f"fragmentation: {format_bytes(free)} is cached but the largest free block is "
                  f"{format_bytes(largest)}, below the {format_bytes(want)} asked for. Set "
                  "PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True before the process starts", free, None)


def rank_remedies(step: StepModel | None, acc: Accounting, holders: list[str], base: Any = None) -> tuple[list[Remedy], Any]:
    """The remedies, largest predicted saving first (the leak, when the floor rose, before everything);
    and the pre-flight's prediction of the failed step (``base`` when given; None when the step cannot be replayed)."""
    out: list[Remedy] = []
    leak = _leak(acc, holders)
    fragmentation = _fragmentation(acc)
    available = available_bytes(acc)
    if step is None:
        out.append(Remedy("preflight", "the failed step's model call was not found (an OOM in the optimizer step or in "
                          "evaluation, or a model called outside its modules): no saving is predicted", None))
    elif base is None:
        try:
            base = step.predict()
        except Exception as exc:  # said so, with the reason
            out.append(Remedy("preflight", f"the failed step cannot be replayed on fake tensors ({type(exc).__name__}: {exc}); "
                              "no saving is predicted", None))
    if base is not None and step is not None:
        if available is not None:
            _attempt("batch_size", lambda: _batch(step, base, available), out)
        _attempt("checkpointing", lambda: _checkpointing(step, base, available), out)
        _attempt("optimizer", lambda: _optimizer(step, base, available, acc), out)
        if step.precision in ("fp32", "32-true", "32"):
            _attempt("precision", lambda: _variant("precision", "bf16 mixed precision (autocast)", step, base, available, {},
                                                   precision="bf16-mixed"), out)
        _attempt("sharding", lambda: _sharding(step, base, available, acc), out)
    out = [r for r in out if r.saving_bytes is None or r.saving_bytes > 0]  # a change predicted to save nothing is no remedy
    out.sort(key=lambda r: -(r.saving_bytes if r.saving_bytes is not None else -1))
    first = [r for r in (leak, fragmentation) if r is not None]
    return first + out, base
