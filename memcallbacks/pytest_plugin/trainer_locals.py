"""The pytest plugin on a Transformers Trainer: both censuses at a step end, its per-step tensors.

The Trainer hands callbacks no batch and ends training with ``on_train_end`` after its loop has
dropped the last batch, its prefetched next batch and its loss tensors; a census there sees less
than the warm-up census (taken at a step end) and hides a small leak. So the end census is taken
at the last step's ``on_step_end`` too (``state.global_step == state.max_steps``), where the
same things are alive as at warm-up, and what the Trainer itself keeps for the step is left out
of both: the batches of the step (``batch_samples``, ``inputs``), the loss tensors
(``tr_loss_step``, ``Trainer._tr_loss``, ``tr_loss`` in older releases), ``grad_norm``,
``num_items_in_batch``, and the batches the data iterator holds (Accelerate's
``DataLoaderShard`` prefetches the next one). A run stopped early (``EarlyStoppingCallback``)
never reaches ``max_steps``; its end census falls back to ``on_train_end``.
"""

from __future__ import annotations

import logging
import sys
import weakref
from typing import Any

from memcallbacks._runtime.guard import session_of
from memcallbacks.leaks.roots import frame_locals

log = logging.getLogger(__name__)

__all__ = ["TRAINER_LOOP_FRAMES", "TRAINER_LOOP_LOCALS", "attach_transformers", "remember_trainer", "transformers_bookkeeping"]

TRAINER_LOOP_FRAMES = ("_run_epoch", "_inner_training_loop")
"""The Trainer's methods whose frames hold a step's tensors while ``on_step_end`` runs (private to transformers)."""
TRAINER_LOOP_LOCALS = ("batch_samples", "inputs", "tr_loss", "tr_loss_step", "grad_norm", "num_items_in_batch")
"""Their locals that hold the step's batch, loss and gradient norm (tensors or containers of tensors)."""
_ITERATOR_LOCALS = ("epoch_iterator",)
_MAX_FRAMES = 40
_MAX_GENERATORS = 8


def _generator_tensor_holders(gen: Any) -> list[Any]:
    """The locals of a suspended data-iterator generator and of those it delegates to (``yield from``)."""
    out: list[Any] = []
    for _ in range(_MAX_GENERATORS):
        frame = getattr(gen, "gi_frame", None)
        if frame is None:
            break
        out.extend(value for _, value in frame_locals(frame))
        gen = getattr(gen, "gi_yieldfrom", None)
    return out


def transformers_bookkeeping(trainer: Any) -> list[Any]:
    """Tensors the Trainer keeps for the current step, read while a callback event runs inside its loop.

    Call from within ``on_step_end``: the loop frames are found on the call stack by their
    ``self`` (this trainer) and their name. Outside the loop only ``Trainer._tr_loss`` is found.
    Locals are read with :func:`~memcallbacks.leaks.roots.frame_locals`, which leaves no cached
    snapshot behind (a snapshot would keep this step's batch alive into the next census).
    """
    if trainer is None:
        return []
    out: list[Any] = [getattr(trainer, "_tr_loss", None)]
    frame = sys._getframe(1)
    for _ in range(_MAX_FRAMES):
        if frame is None:
            break
        if frame.f_code.co_name in TRAINER_LOOP_FRAMES:
            local = dict(frame_locals(frame))
            if local.get("self") is trainer:
                out.extend(local.get(name) for name in TRAINER_LOOP_LOCALS)
                for name in _ITERATOR_LOCALS:
                    out.extend(_generator_tensor_holders(local.get(name)))
            del local
        frame = frame.f_back
    return [obj for obj in out if obj is not None]


def attach_transformers(train_memory: Any, callback: Any, trainer_cell: list[Any]) -> None:
    """Probe every ``train()`` of the callback's Trainer: the end census at the last step's ``on_step_end``.

    ``trainer_cell`` holds a weak reference to the Trainer once its constructor has returned.
    """
    on_train_begin, on_step_end = callback.on_train_begin, callback.on_step_end
    last = {"step": False}

    def trainer() -> Any:
        return trainer_cell[0]() if trainer_cell else None

    def probed_train_begin(*args: Any, **kw: Any) -> Any:
        result = on_train_begin(*args, **kw)
        session = session_of(callback)
        if session is not None:  # a new Monitor per train(): probe each
            train_memory.probe(
                session, name="Transformers Trainer",
                bookkeeping=lambda: transformers_bookkeeping(trainer()),
                last_step=lambda: last["step"],
            )
        return result

    def probed_step_end(args: Any, state: Any, control: Any, **kw: Any) -> Any:
        # read before the step's row closes: the probe's end_step wrapper asks while it runs
        last["step"] = bool(state.max_steps) and state.global_step >= state.max_steps
        try:
            return on_step_end(args, state, control, **kw)
        finally:
            last["step"] = False

    callback.on_train_begin = probed_train_begin
    callback.on_step_end = probed_step_end


def remember_trainer(trainer_cell: list[Any], trainer: Any) -> None:
    """After the Trainer's constructor returned: keep a weak reference to it in the cell its callback's probe reads."""
    try:
        trainer_cell[:] = [weakref.ref(trainer)]
    except TypeError:
        log.debug("train_memory: the Trainer takes no weak reference; its bookkeeping is not read")
