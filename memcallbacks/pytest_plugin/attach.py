"""Attaching monitors to the trainers a test builds: constructor wrappers for one test.

Only frameworks already imported (or importable without side effects the test did not ask for)
are patched, and only while a ``train_memory`` test runs: Lightning's ``Trainer`` (both
``lightning.pytorch`` and ``pytorch_lightning``), Accelerate's ``Accelerator`` and Transformers'
``Trainer``.
"""

from __future__ import annotations

import functools
import importlib
import logging
import sys
from typing import Any, Callable

from memcallbacks._runtime.guard import session_of

log = logging.getLogger(__name__)

__all__ = ["Patches", "lightning_bookkeeping"]


def _imported(name: str) -> bool:
    # never import a framework for the test: importing transformers' Trainer alone takes seconds
    return name in sys.modules


def lightning_bookkeeping(trainer: Any) -> list[Any]:
    """Tensors Lightning keeps for ``self.log``: the metric dicts and the loops' result collections.

    Their number follows the number of logged keys, not of steps (a ``val_loss`` appears after the
    first validation), so they are carry-over, like optimizer state.
    """
    if trainer is None:
        return []
    out: list[Any] = []
    for name in ("callback_metrics", "logged_metrics", "progress_bar_metrics"):
        try:
            out.append(dict(getattr(trainer, name)))
        except Exception:
            pass
    loops = []
    epoch_loop = getattr(getattr(trainer, "fit_loop", None), "epoch_loop", None)
    loops += [epoch_loop, getattr(epoch_loop, "val_loop", None)]
    loops += [getattr(trainer, name, None) for name in ("validate_loop", "test_loop", "predict_loop")]
    for loop in loops:
        results = getattr(loop, "_results", None)
        if results is None:
            continue
        try:
            for metric in list(results.values()):
                out.append({k: v for k, v in vars(metric).items() if not k.startswith("_modules")})
        except Exception:
            pass
    return out


class Patches:
    """Constructor wrappers for one test; :meth:`remove` puts every original back (safe to call twice)."""

    def __init__(self, train_memory: Any) -> None:
        self.session = train_memory  # the test's TrainMemory (pytest_plugin/session.py, which imports this module)
        self._undo: list[Callable[[], None]] = []
        self._busy: list[str] = []  # frameworks whose constructor is running (a Trainer builds an Accelerator)
        self._trainer_cell: list[Any] = []  # a weak reference to the Trainer being built

    def install(self) -> None:
        for package in ("lightning.pytorch", "pytorch_lightning"):
            if _imported(package):
                self._wrap(package, "Trainer", self._lightning_kwargs, after=self._trainer_built)
        if _imported("accelerate"):
            self._wrap("accelerate", "Accelerator", None, after=self._accelerator_built)
        if _imported("transformers.trainer"):
            self._wrap("transformers", "Trainer", self._transformers_kwargs, busy="transformers", after=self._trainer_built)

    def remove(self) -> None:
        while self._undo:
            self._undo.pop()()

    def _wrap(self, module_name: str, class_name: str, edit_kwargs: Callable[[dict[str, Any]], None] | None, after: Callable[[Any], None] | None = None, busy: str = "") -> None:
        try:
            cls = getattr(importlib.import_module(module_name), class_name)
        except Exception:
            log.debug("train_memory: %s.%s not available", module_name, class_name, exc_info=True)
            return
        original = cls.__dict__.get("__init__")
        if original is None or getattr(original, "_train_memory_wrapper", False):
            return

        @functools.wraps(original)
        def __init__(obj: Any, *args: Any, **kwargs: Any) -> None:
            # a subclass calling super().__init__ reaches here once per class in its MRO that we wrapped
            outermost = not getattr(obj, "_train_memory_building", False)
            if outermost and edit_kwargs is not None:
                edit_kwargs(kwargs)
            if outermost:
                object.__setattr__(obj, "_train_memory_building", True)
                self._busy.append(busy)
            try:
                original(obj, *args, **kwargs)
            finally:
                if outermost:
                    obj.__dict__.pop("_train_memory_building", None)
                    self._busy.pop()
            if outermost and after is not None:
                after(obj)

        __init__._train_memory_wrapper = True  # type: ignore[attr-defined]
        cls.__init__ = __init__
        self._undo.append(lambda: setattr(cls, "__init__", original))

    # ------------------------------------------------------------------ per framework
    def _lightning_kwargs(self, kwargs: dict[str, Any]) -> None:
        from memcallbacks.lightning import MemoryMonitor

        callbacks = kwargs.get("callbacks")
        callbacks = [] if callbacks is None else list(callbacks) if isinstance(callbacks, (list, tuple)) else [callbacks]
        mine = next((cb for cb in callbacks if isinstance(cb, MemoryMonitor)), None)
        if mine is None:  # the user's own MemoryMonitor is probed as it is; otherwise one joins
            mine = MemoryMonitor(**self.session.monitor_config())
            callbacks.append(mine)
        kwargs["callbacks"] = callbacks
        cell = self._trainer_cell  # the Trainer being built, once its constructor has returned
        self.session.probe(session_of(mine), name="Lightning Trainer",
                           bookkeeping=lambda: lightning_bookkeeping(cell[0]() if cell else None))

    def _trainer_built(self, trainer: Any) -> None:
        from memcallbacks.pytest_plugin.trainer_locals import remember_trainer

        remember_trainer(self._trainer_cell, trainer)
        self._trainer_cell = []  # the next Trainer gets a fresh cell

    def _accelerator_built(self, accelerator: Any) -> None:
        from memcallbacks.accelerate import AccelerateMemoryMonitor

        if "transformers" in self._busy:
            return  # the Trainer's own Accelerator: the Trainer's callback already watches this loop
        monitor = AccelerateMemoryMonitor(accelerator, **self.session.monitor_config())
        self.session.probe(session_of(monitor), name="Accelerator", census_every_step=True)
        self.session.closers.append(monitor.close)
        prepare = accelerator.prepare

        def prepare_and_hook(*args: Any, **kwargs: Any) -> Any:
            # the monitor was built before the test's prepare(): hook the models it prepares now,
            # since a loop without monitor.track() never asks the monitor to look for them
            result = prepare(*args, **kwargs)
            monitor.watch_prepared_models()
            return result

        accelerator.prepare = prepare_and_hook  # an instance attribute, gone with the accelerator

    def _transformers_kwargs(self, kwargs: dict[str, Any]) -> None:
        from memcallbacks.pytest_plugin.trainer_locals import attach_transformers
        from memcallbacks.transformers import MemoryMonitorCallback

        callbacks = list(kwargs.get("callbacks") or [])
        mine = next((cb for cb in callbacks if isinstance(cb, MemoryMonitorCallback)), None)
        if mine is None:
            mine = MemoryMonitorCallback(**self.session.monitor_config())
            callbacks.insert(0, mine)
        kwargs["callbacks"] = callbacks
        attach_transformers(self.session, mine, self._trainer_cell)
