"""The changes that make a failed step fit, each with the saving the pre-flight predicts for it."""

from __future__ import annotations

import dataclasses
import logging
from typing import Any, Callable

import torch
from torch import nn

from memcallbacks._base.units import format_bytes
from memcallbacks.oom.accounting import RESERVE_BYTES, Accounting

log = logging.getLogger(__name__)

__all__ = ["Remedy", "StepModel", "checkpoint_blocks", "fix_of", "leak_threshold", "rank_remedies"]

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
    margin: Callable[[Any], int] | None = None
    """Bytes a change keeps free beside its predicted peak for it to fit (:class:`Margin`); None: none."""

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


def leak_threshold(acc: Accounting) -> int:
    """What the memory held from earlier steps must exceed to be the cause, whatever phase failed: this step's own
    memory as counted at the failure (its batch, activations and temporaries), and a tenth of what the run's tensors
    take (the figure less the process's own share, other processes' and the allocator's cache; at least
    :data:`MARGIN_MIN_BYTES`, the prediction's noise). Not a tenth of the whole figure: under an address-space
    limit the process's own share (700+ MiB on CPU) hid a 94 MiB leak beside a 28 MiB step."""
    tensors = sum(v for k, v in acc.categories.items() if not k.startswith(_NOT_TENSORS))
    return max(acc.step_bytes, MARGIN_MIN_BYTES, tensors // 10)


_NOT_TENSORS = ("the process", "outside PyTorch", "reserved by PyTorch")


def _leak(acc: Accounting, holders: list[str]) -> Remedy | None:
    held = acc.categories.get("held from earlier steps", 0)
    if held <= leak_threshold(acc):  # not the batch's fault once earlier steps hold more than the step itself
        return None
    since = f" since step {acc.floor_steps[0]}" if acc.floor_steps else ""
    who = f"; held by {holders[0]}" if holders else "; no holder named yet (memcallbacks' growth finding names it once its census runs)"
    return Remedy("leak", f"this is the leak, not the batch: the memory held from earlier steps rose by {format_bytes(held)}{since}{who}. "
                  "Free it (return loss.item(), do not keep outputs or graphs across steps); a smaller batch only delays the failure",
                  held, None, {"holders": holders[:3]})


#: The margin's floor and shares (see :class:`Margin`).
MARGIN_MIN_BYTES = 16 << 20
MARGIN_SHARE = 0.10
MARGIN_SHARE_ADAPTIVE_HEAP = 0.25
_OWN = ("inputs", "activations", "temporaries", "workspace")


class Margin:
    """What a proposed change keeps free beside its predicted peak: what the prediction of a step cannot see (a
    C library's buffers, the allocator's own placement). ``share`` of the step's own predicted memory (its batch,
    activations and temporaries), at least :data:`MARGIN_MIN_BYTES`. Measured on CPU (docs/oom.md, by
    scripts/oom_prediction_error.py): a real step's rise was -10%..+7% of the prediction (at most +3.3 MiB) with glibc's
    mmap threshold fixed, and up to +102% with its adaptive threshold (glibc's default), whose heap keeps freed
    blocks under 32 MiB: the note :data:`ADAPTIVE_HEAP_NOTE` says so where it applies."""

    def __init__(self, acc: Accounting) -> None:
        self.adaptive_heap = acc.heap.endswith("adaptive mmap threshold")
        self.share = MARGIN_SHARE_ADAPTIVE_HEAP if self.adaptive_heap else MARGIN_SHARE

    def __call__(self, prediction: Any) -> int:
        return max(MARGIN_MIN_BYTES, int(self.share * own_bytes(prediction)))

    def words(self) -> str:
        return f"{self.share:.0%} of the step's own memory, at least {format_bytes(MARGIN_MIN_BYTES)}"


def own_bytes(prediction: Any) -> int:
    """The step's own memory at its predicted peak: the batch, activations, temporaries (and cuBLAS' workspace)."""
    return sum(v for k, v in prediction.breakdown[prediction.peak_phase].items() if k in _OWN)


def room_for_a_rerun(acc: Accounting, available: int) -> int:
    """What a re-run under the same limit, monitor on, may take: less the monitor's reserve where it was not mapped
    at the failure (a monitor started under an address-space limit keeps one; where it was, it is in the process's share)."""
    if acc.device == "cpu" and acc.capacity_source == "RLIMIT_AS" and not acc.reserve_held:
        return available - RESERVE_BYTES
    return available


def _window(step: StepModel, base: Any, size: int, room: int, margin: Margin) -> tuple[int, int, int | None, dict[int, Any]]:
    """Where to search: the peak (and its margin) grows about linearly with the batch, so one more prediction
    (batch 1) places the answer (the guess) within a few sizes; the search still proves it on both sides.
    Also returns the predictions made (batch size -> prediction), for the search to reuse."""
    from memcallbacks.preflight.batch_size import resize_batch

    one = step.known[1] if 1 in step.known else step.predict(resize_batch(step.call, size, 1))
    known = {1: one}
    need_one, need_base = one.peak_bytes + margin(one), base.peak_bytes + margin(base)
    if need_base <= need_one:
        return 1, size - 1, None, known
    guess = 1 + int((room - need_one) * (size - 1) / (need_base - need_one))
    guess = min(max(guess, 1), size - 1)
    return max(1, guess - 2), min(size - 1, guess + 2), guess, known


def _batch(step: StepModel, base: Any, room: int, acc: Accounting) -> Remedy | None:
    """The largest batch whose predicted peak and margin fit in ``room`` (what a re-run may take: :func:`room_for_a_rerun`)."""
    from memcallbacks.preflight import max_batch_size

    from memcallbacks.preflight.batch_size import batch_size_of, resize_batch

    size = batch_size_of(step.call)
    if size is None or size <= 1:
        return None
    kwargs = dict(step.extra, forward_fn=step.forward_fn, precision=step.precision, device=step.device)
    kwargs.pop("loss_fn", None)
    margin = Margin(acc)
    low, high, guess, known = _window(step, base, size, room, margin)
    known = {**step.known, **known}

    def search(low: int, high: int) -> Any:
        fit = max_batch_size(step.module, lambda n: resize_batch(step.call, size, n), room, step.optimizer, low=low, high=high,
                             known=known, margin=margin, **kwargs)
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
    kept = margin(fit.prediction)
    details = {"batch_size": fit.batch_size, "failed_batch_size": size, "predicted_peak_bytes": fit.peak_bytes, "margin_bytes": kept,
               "margin_share": margin.share, "room_bytes": room, "tried": dict(fit.tried)}
    if fit.batch_size == 0:
        return Remedy("batch_size", f"no batch size fits: batch size 1 is predicted to peak at {format_bytes(fit.peak_bytes)}, and "
                      f"{format_bytes(kept)} kept free beside it, above the {format_bytes(room)} the step may take",
                      base.peak_bytes - fit.peak_bytes, False, dict(details, batch_size=0))
    if margin.adaptive_heap and acc.device == "cpu":
        acc.notes.append(ADAPTIVE_HEAP_NOTE)
    return Remedy("batch_size", f"batch size {fit.batch_size} is the largest that fits (this batch has {size}, dimension 0 of its first "
                  f"tensor): predicted peak {format_bytes(fit.peak_bytes)}, and {format_bytes(kept)} kept free for what the prediction "
                  f"cannot see ({margin.words()}), of the {format_bytes(room)} the step may take"
                  + ("" if acc.figure.startswith("predicted") else " with the monitor on"),  # a re-run of a failed step
                  base.peak_bytes - fit.peak_bytes, True, details)


ADAPTIVE_HEAP_NOTE = ("glibc's adaptive mmap threshold (its default) keeps freed blocks under 32 MiB in its heap, which the prediction "
                      "does not count (a step's rise measured up to twice the prediction's): the batch that fits keeps 25% free and may "
                      "still fail. Set MALLOC_MMAP_THRESHOLD_=1048576 in the environment (or "
                      "advanced=AdvancedOptions(cpu_mmap_threshold='1 MiB')) for a prediction within about 10%")


def _variant(kind: str, advice: str, step: StepModel, base: Any, available: int | None, details: dict[str, Any], **changes: Any) -> Remedy:
    p = step.predict(**changes)
    fits = p.peak_bytes + (step.margin(p) if step.margin else 0) <= available if available is not None else None
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
    if str(acc.device).startswith("cpu"):
        return None  # ranks on one host share its memory: sharding the states over them saves it nothing
    if available is None or states < base.peak_bytes // 4:
        return None  # the model states are not what fills the memory: sharding them saves little
    for n in _RANKS:
        p = _sharded(step, base, n)
        if p.peak_bytes + (step.margin(p) if step.margin else 0) <= available:
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


def fix_of(remedies: list[Remedy]) -> str:
    """The fix in a few words (the verdict's ``fix:``, docs/findings.md): the first remedy listed when it is the leak or
    fragmentation, otherwise the first that fits (the largest predicted saving that does); "" when none does."""
    for r in remedies:
        d = r.details
        if r.kind == "leak":
            return "Free what earlier steps hold (return loss.item(), do not keep outputs or graphs across steps)"
        if r.kind == "expandable_segments":
            return "Set PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True before the process starts"
        if r.fits is not True:
            continue
        if r.kind == "batch_size":
            return f"Use batch size {d.get('batch_size')} (the largest that fits)"
        if r.kind == "checkpointing":
            return f"Checkpoint {', '.join(d.get('modules', [])[:3])} (torch.utils.checkpoint)"
        if r.kind == "precision":
            return "Use bf16 mixed precision (autocast)"
        if r.kind == "optimizer":
            return f"Use a lighter optimizer ({d.get('optimizer')})"
        if r.kind == "sharding":
            return f"Shard the model states over {d.get('world_size')} ranks (FSDP2 / ZeRO-3)"
    return ""


def rank_remedies(step: StepModel | None, acc: Accounting, holders: list[str], base: Any = None,
                  no_call: str = "") -> tuple[list[Remedy], Any]:
    """The remedies, largest predicted saving first (the leak, when earlier steps hold more than :func:`leak_threshold`,
    before everything); and the pre-flight's prediction of the failed step (``base`` when given; None when the step
    cannot be replayed). ``no_call``: why no step can be replayed, where ``step`` is None."""
    out: list[Remedy] = []
    fragmentation = _fragmentation(acc)
    available = available_bytes(acc)
    if step is None:
        out.append(Remedy("preflight", no_call or "the failed step's model call was not found (an OOM in the optimizer step or in "
                          "evaluation, or a model called outside its modules): no saving is predicted", None))
    elif base is None:
        try:
            base = step.predict()
        except Exception as exc:  # said so, with the reason
            out.append(Remedy("preflight", f"the failed step cannot be replayed on fake tensors ({type(exc).__name__}: {exc}); "
                              "no saving is predicted", None))
    if base is not None and step is not None:
        step.margin = Margin(acc)
        available = room_for_a_rerun(acc, available) if available is not None else None
        if available is not None:
            _attempt("batch_size", lambda: _batch(step, base, available, acc), out)
        _attempt("checkpointing", lambda: _checkpointing(step, base, available), out)
        _attempt("optimizer", lambda: _optimizer(step, base, available, acc), out)
        if step.precision in ("fp32", "32-true", "32"):
            _attempt("precision", lambda: _variant("precision", "bf16 mixed precision (autocast)", step, base, available, {},
                                                   precision="bf16-mixed"), out)
        _attempt("sharding", lambda: _sharding(step, base, available, acc), out)
    out = [r for r in out if r.saving_bytes is None or r.saving_bytes > 0]  # a change predicted to save nothing is no remedy
    out.sort(key=lambda r: -(r.saving_bytes if r.saving_bytes is not None else -1))
    first = [r for r in (_leak(acc, holders), fragmentation) if r is not None]
    return first + out, base
