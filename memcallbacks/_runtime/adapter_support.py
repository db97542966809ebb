"""The decisions every adapter makes the same way, made once: strategy and precision names, rank
zero's trackers, and the optimizer-step hooks that bound the optimizer phase.

Adapters translate their framework's objects into these calls and nothing else: a strategy or a
precision setting becomes one of :func:`memcallbacks.estimate.estimate`'s names here, so the
theory check reads the same run the same way under Lightning, Accelerate and the Transformers Trainer.
"""

from __future__ import annotations

import logging
from typing import Any, Callable

from memcallbacks._runtime.lifecycle import weak_method
from memcallbacks._runtime.preflight_check import fake_step_running
from memcallbacks.trackers import Trackers

__all__ = ["lightning_strategy", "accelerate_strategy", "precision_name", "rank_zero_trackers", "OptimizerHooks"]

# Lightning's strategies by class name, in memcallbacks.estimate's names (others: detected from the model).
_LIGHTNING_STRATEGIES = {
    "SingleDeviceStrategy": "single",
    "SingleDeviceXLAStrategy": "single",
    "DDPStrategy": "ddp",
    "FSDPStrategy": "fsdp",
    "ModelParallelStrategy": "fsdp2",
}

# every framework's spelling of a mixed-precision setting, in memcallbacks.estimate's names
_PRECISIONS = {"fp16": "16-mixed", "bf16": "bf16-mixed", "16": "16-mixed", "bf16-mixed": "bf16-mixed", "16-mixed": "16-mixed"}


def _zero(stage: Any) -> str:
    return f"zero{stage}" if stage in (1, 2, 3) else "ddp"


def lightning_strategy(strategy: Any) -> str | None:
    """A Lightning strategy object's name for the estimate (None: detect it from the model)."""
    name = type(strategy).__name__
    if name in _LIGHTNING_STRATEGIES:
        return _LIGHTNING_STRATEGIES[name]
    if name == "DeepSpeedStrategy":
        return _zero((getattr(strategy, "config", None) or {}).get("zero_optimization", {}).get("stage", 0))
    return None


def accelerate_strategy(accelerator: Any) -> str | None:
    """An Accelerator's distributed type as the estimate's name (``accelerator._models`` keeps the
    bare module under DDP, so the model cannot tell)."""
    kind = str(getattr(accelerator.distributed_type, "value", accelerator.distributed_type))
    if kind == "DEEPSPEED":
        return _zero(getattr(getattr(accelerator.state, "deepspeed_plugin", None), "zero_stage", 0))
    if kind == "FSDP":
        version = getattr(getattr(accelerator.state, "fsdp_plugin", None), "fsdp_version", 1)
        return "fsdp2" if version == 2 else "fsdp"
    if kind.startswith("MULTI_") and int(accelerator.num_processes) > 1:
        return "ddp"
    return None


def precision_name(setting: Any) -> str | None:
    """``"fp16"``/``"16-mixed"``/``"bf16"``/... as the estimate's precision name; None for full
    precision or a setting the estimate reads from the model instead (Lightning's ``"32-true"``
    and ``"bf16-true"`` pass through: the estimate knows them)."""
    if setting is None or setting is False:
        return None
    text = str(setting)
    if text in ("", "no", "None"):
        return None
    return _PRECISIONS.get(text, text)


def rank_zero_trackers(main: bool, source: Callable[[], Any], owner: str, logger: logging.Logger) -> Trackers | None:
    """The run's trackers (TensorBoard, W&B, MLflow), looked up through ``source`` at each use, on
    the main process only: rank zero's get the dashboard, report and snapshots."""
    return Trackers(source, owner=owner, logger=logger) if main else None


class OptimizerHooks:
    """torch's global optimizer-step hooks, bounding the optimizer phase of every optimizer's step.

    The hook table is global and holds ``pre``/``post`` weakly (:func:`weak_method`): an adapter
    dropped without its cleanup can still be collected. The pre-flight's fake optimizer step is
    not the loop's and is left out."""

    def __init__(self, pre: Callable[..., Any], post: Callable[..., Any]) -> None:
        self._pre, self._post = weak_method(pre), weak_method(post)
        self.handles: list[Any] = []

    def install(self) -> list[Any]:
        from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook

        if not self.handles:
            self.handles = [register_optimizer_step_pre_hook(self._call_pre), register_optimizer_step_post_hook(self._call_post)]
        return self.handles

    def _call_pre(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        if not fake_step_running():
            self._pre(optimizer, args, kwargs)

    def _call_post(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        if not fake_step_running():
            self._post(optimizer, args, kwargs)

    def remove(self) -> None:
        handles, self.handles = self.handles, []
        for handle in handles:
            handle.remove()
