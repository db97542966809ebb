"""The Lightning adapter besides its hooks: its folder, its session's start, the evaluation hooks.

Functions of a Trainer and a LightningModule read by duck typing: nothing here imports Lightning
(``lightning.py`` does, and calls these).
"""

from __future__ import annotations

import functools
import logging
import os
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable

from memcallbacks._base.config import MonitorConfig
from memcallbacks._base.columns import OPTIMIZER, OTHER
from memcallbacks._runtime.adapter_support import (
    OptimizerHooks, lightning_strategy, precision_name, rank_zero_trackers, refuse_shared_folder, saved_state_of,
)
from memcallbacks._runtime.guard import Guarded, entry_point
from memcallbacks._runtime.lifecycle import output_folder

if TYPE_CHECKING:  # pragma: no cover
    from memcallbacks._runtime.session import Session

__all__ = ["default_dir", "files_folder", "check_siblings", "start_session", "predict_step", "attach_fit", "ManualOptimizerHooks", "checkpoint_state",
           "add_eval_hooks"]


def default_dir(trainer: Any, config: MonitorConfig) -> Path | None:
    """The folder for the files when ``output_dir`` is None: ``memcallbacks`` in the trainer's log dir."""
    if not config.write_files or config.output_dir is not None:
        return None
    try:
        base = trainer.log_dir
    except Exception:
        base = None
    return Path(base or trainer.default_root_dir or os.getcwd()) / "memcallbacks"


def files_folder(trainer: Any, config: MonitorConfig) -> str | None:
    """The folder the files will go to (as ``Session.start`` picks it); None without files."""
    if not config.write_files:
        return None
    return output_folder(config.output_dir, default_dir(trainer, config))


def check_siblings(monitor: Any, trainer: Any, cls: type) -> None:
    """Refuse, before training, a second monitor of class ``cls`` that would overwrite ``monitor``'s files.

    Two monitors with the same ``prefix`` never get here: their ``state_key`` is the same, and
    the Trainer refuses them when it is built.
    """
    others = [cb for cb in trainer.callbacks if cb is not monitor and isinstance(cb, cls)]
    refuse_shared_folder(files_folder(trainer, monitor.config), monitor.config,
                         [(o.config, files_folder(trainer, o.config)) for o in others])


def start_session(session: Session, trainer: Any, emit: Callable[[dict[str, float], int], None], owner: str, log: logging.Logger) -> None:
    """Start ``session`` for ``trainer``: its loggers (``emit``), rank zero's trackers, device, rank, folder and intervals."""
    if not trainer.loggers:
        session.warn_once(
            "no-logger",
            f"{owner}: the Trainer has no logger (logger=False); memory metrics are not logged, but "
            "`monitor.history` and the files in output_dir are still kept.",
        )
    # the loggers as of each logged step (a partial of a builtin: no frame of ours at every look)
    loggers = functools.partial(getattr, trainer, "loggers")
    session.attach(log_fn=emit, trackers=rank_zero_trackers(trainer.is_global_zero, loggers, owner, log))
    session.start(
        trainer.strategy.root_device,
        rank=trainer.global_rank,
        world_size=trainer.world_size,
        default_output_dir=default_dir(trainer, session.config),
        framework_log_every=trainer.log_every_n_steps,
        logs=bool(trainer.loggers) and int(trainer.log_every_n_steps or 0) > 0,
    )


def predict_step(session: Session, batch: Any, pl_module: Any, batch_idx: int, automatic: bool) -> None:
    """``preflight=True``: this batch's step predicted on fake tensors, before it starts (``training_step`` as
    the forward; a manual-optimization module is skipped: it runs its own backward and optimizer steps)."""
    manual = None if automatic else "manual optimization (training_step runs its own backward and optimizer steps)"
    from memcallbacks.preflight._step import training_step

    session.run_preflight(batch, model=pl_module, forward_fn=training_step(batch_idx), skip=manual, grads_through_forward=True)


def attach_fit(session: Session, trainer: Any, pl_module: Any) -> None:
    """The fit's title, model, optimizer (one, or none), precision, strategy and world size, told to ``session``."""
    optimizers = list(trainer.optimizers)
    session.attach(
        title=type(pl_module).__name__,
        model=trainer.strategy.model or pl_module,
        optimizer=optimizers[0] if len(optimizers) == 1 else None,
        precision=precision_name(getattr(trainer, "precision", None)),
        strategy=lightning_strategy(trainer.strategy),
        world_size=trainer.world_size,
    )


class ManualOptimizerHooks(Guarded):
    """Manual optimization: the optimizer's own hooks bound the optimizer phase exactly (its
    pre-hook closes ``OTHER``, its hook ``OPTIMIZER``). Held by the adapter; torch's global hook
    table holds these methods weakly (:class:`OptimizerHooks`)."""

    def __init__(self, session: Session) -> None:
        self._session = session  # the guard (entry_point) hands a fault to it
        self.hooks: OptimizerHooks | None = None  # made at the first install (a train start), after any pickling

    def install(self) -> None:
        if self.hooks is None:
            self.hooks = OptimizerHooks(self._optimizer_pre_hook, self._optimizer_post_hook)
        self.hooks.install()

    def remove(self) -> None:
        if self.hooks is not None:
            self.hooks.remove()

    @entry_point("optimizer pre-hook")
    def _optimizer_pre_hook(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        if self._session.step_open:
            self._session.boundary(OTHER)

    @entry_point("optimizer hook")
    def _optimizer_post_hook(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        if self._session.step_open:
            self._session.boundary(OPTIMIZER)


def checkpoint_state(monitor: Any, trainer: Any, checkpoint: dict[str, Any], cls: type, log: logging.Logger) -> Any:
    """The monitor state in ``checkpoint`` that is ``monitor``'s (``MemoryMonitor.on_load_checkpoint``), or None."""
    monitors = sum(isinstance(cb, cls) for cb in trainer.callbacks)
    return saved_state_of(checkpoint.get("callbacks") or {}, monitor.state_key, type(monitor).__qualname__, monitors,
                          monitor.config.advanced.prefix, log)


def add_eval_hooks(cls: type, start: Callable[..., None], batch_end: Callable[..., None], end: Callable[..., None]) -> None:
    """``on_{hook}_start``/``_batch_end``/``_end`` on ``cls`` for the validate, test and predict loops
    (Lightning dispatches by hook name), each guarded and forwarding to ``start(self, trainer, stage)``,
    ``batch_end(self)`` or ``end(self, trainer)``."""
    for stage, hook in (("validate", "validation"), ("test", "test"), ("predict", "predict")):
        _add_loop_hooks(cls, stage, hook, start, batch_end, end)


def _add_loop_hooks(cls: type, stage: str, hook: str, start: Callable[..., None], batch_end: Callable[..., None],
                    end: Callable[..., None]) -> None:
    def on_start(self: Any, trainer: Any, pl_module: Any) -> None:
        start(self, trainer, stage)

    def on_batch_end(self: Any, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int, dataloader_idx: int = 0) -> None:
        batch_end(self)

    def on_end(self: Any, trainer: Any, pl_module: Any) -> None:
        end(self, trainer)

    for name, fn in ((f"on_{hook}_start", on_start), (f"on_{hook}_batch_end", on_batch_end), (f"on_{hook}_end", on_end)):
        fn.__name__ = fn.__qualname__ = name
        setattr(cls, name, entry_point(name)(fn))
