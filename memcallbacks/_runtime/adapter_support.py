"""The decisions every adapter makes the same way, made once: strategy and precision names, rank
zero's trackers, and the optimizer-step hooks that bound the optimizer phase.

Adapters translate their framework's objects into these calls and nothing else: a strategy or a
precision setting becomes one of :func:`memcallbacks.estimate.estimate`'s names here, so the
theory check reads the same run the same way under Lightning, Accelerate and the Transformers Trainer.
"""


from __future__ import annotations

import logging
from typing import Any, Callable, Iterable

import torch
from torch import nn
from memcallbacks._base.columns import PHASES
from memcallbacks._base.errors import SetupError
from memcallbacks.estimate.tables import canonical_precision
from memcallbacks._runtime.lifecycle import weak_method
from memcallbacks._runtime.preflight_check import fake_step_running
from memcallbacks.trackers import Trackers

__all__ = ["check_plain_arguments", "saved_step", "phase_index", "refuse_shared_folder", "saved_state_of", "lightning_strategy", "accelerate_strategy", "precision_name", "rank_zero_trackers", "OptimizerHooks", "unusable_device", "device_for"]

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
    if setting is None or isinstance(setting, bool):
        return None
    text = str(setting).strip().lower()
    if text in ("", "no", "none"):
        return None
    name = _PRECISIONS.get(text, text)
    try:  # a setting the estimate does not know (fp8, transformer-engine): read from the model instead
        canonical_precision(name, "precision_name")
    except ValueError:
        return None
    return name


def rank_zero_trackers(main: bool, source: Callable[[], Any], owner: str, logger: logging.Logger) -> Trackers | None:
    """The run's trackers (TensorBoard, W&B, MLflow), looked up through ``source`` at each use, on
    the main process only: rank zero's get the dashboard, report and snapshots."""
    return Trackers(source, owner=owner, logger=logger) if main else None


class OptimizerHooks:
    """torch's global optimizer-step hooks, bounding the optimizer phase of every optimizer's step.

    The hook table is global and holds ``pre``/``post`` weakly (:func:`weak_method`): an adapter
    dropped without its cleanup can still be collected. The pre-flight's fake optimizer step is
    not the loop's and is left out. ``pre_open = False`` skips the pre-hook's call (the plain loop's
    quiet steps, where it has nothing to do: a call costs 8-20 µs of cold caches after the step's
    compute, 0.6% of a 1.4 ms step). ``post_open = False`` makes the post-hook's call only note that
    an optimizer stepped (:attr:`stepped`, which the owner reads and clears) and open the forward
    pre-hooks' gates in :attr:`gates` (the plain loop's auto mode: the next forward ends the step): a full
    call costs 20-55 µs of cold caches after the optimizer's work, this one 1-3 µs, which the dispatch
    estimate prices as a gate call."""

    def __init__(self, pre: Callable[..., Any], post: Callable[..., Any], meter: Any = None) -> None:
        self._pre, self._post = weak_method(pre), weak_method(post)
        self.meter = meter  # a HookMeter: each call's whole time is the monitor's own
        self.pre_open = True
        self.post_open = True
        self.stepped = False  # an optimizer stepped while post_open was False
        self.gates: list[Any] = []  # (pre, post) gate pairs whose pre gate a quiet step's post-hook opens
        self.handles: list[Any] = []

    def install(self) -> list[Any]:
        from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook

        if not self.handles:
            self.handles = [register_optimizer_step_pre_hook(self._call_pre), register_optimizer_step_post_hook(self._call_post)]
        return self.handles

    def _call_pre(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        if self.pre_open and not fake_step_running():
            self._pre(optimizer, args, kwargs) if self.meter is None else self.meter.call(self._pre, (optimizer, args, kwargs), {})

    def _call_post(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        if not self.post_open:
            if not fake_step_running():
                self.stepped = True
                for gate, _ in self.gates:
                    gate.open = True
                if self.meter is not None:
                    self.meter.calls += 1  # untimed: priced by the dispatch estimate
        elif not fake_step_running():
            self._post(optimizer, args, kwargs) if self.meter is None else self.meter.call(self._post, (optimizer, args, kwargs), {})

    def remove(self) -> None:
        handles, self.handles = self.handles, []
        for handle in handles:
            handle.remove()


def refuse_shared_folder(mine: str | None, config: Any, others: list[tuple[Any, str | None]]) -> None:
    """Refuse, before training, a second monitor in one trainer that would overwrite this one's
    files (``others``: each sibling's config and folder; None: writes no files)."""
    if mine is None:
        return
    for other, folder in others:
        if folder == mine:
            raise SetupError(
                f"MemoryMonitor(output_dir={config.output_dir!r}, prefix={config.advanced.prefix!r}): the "
                f"MemoryMonitor with prefix={other.advanced.prefix!r} in the same Trainer writes its files to the "
                f"same folder, {mine}, so one would overwrite the other's history.csv, report.json and "
                "memory.png. Give each monitor its own output_dir=..., or write_files=False to all but one."
            )


def saved_state_of(states: dict[str, Any], key: str, name: str, monitors: int, prefix: str, log: logging.Logger) -> Any:
    """A monitor's state saved under another key, when which one is this monitor's is unambiguous.

    A checkpoint saved when every monitor was keyed by its class name ``name``, or before
    ``prefix`` was changed, has the state under another key than ``key``: with one monitor in the
    trainer (``monitors``) and one monitor state in the checkpoint, that state is this monitor's.
    None: the state is under ``key`` already (the framework loads it), or none can be adopted."""
    if key in states:
        return None
    saved = [k for k in states if isinstance(k, str) and (k == name or k.startswith(name + "{"))]
    if len(saved) == 1 and monitors == 1 and states[saved[0]]:
        log.info("%s(prefix=%r): restoring the history saved under the checkpoint key %r.", name, prefix, saved[0])
        return states[saved[0]]
    if saved:
        log.info("%s(prefix=%r): the checkpoint has no state under %r (it has %s); the history starts afresh.", name, prefix, key, saved)
    return None


def check_plain_arguments(owner: str, model: Any, optimizer: Any, log_fn: Any) -> None:
    """A plain-loop monitor's arguments, checked before anything is set up (``TypeError`` naming ``owner``)."""
    if model is not None and not isinstance(model, nn.Module):
        raise TypeError(f"{owner}(model={type(model).__name__}) must be a torch.nn.Module or None.")
    if optimizer is not None and not hasattr(optimizer, "step"):
        raise TypeError(f"{owner}(optimizer={type(optimizer).__name__}) must be a torch optimizer or None.")
    if log_fn is not None and not callable(log_fn):
        raise TypeError(f"{owner}(log_fn={log_fn!r}) must be callable as log_fn(metrics, step) or None.")


def saved_step(state: dict[str, Any], default: int, key: str) -> int:
    """The step counter in a plain-loop monitor's saved state (``default`` when absent); not an integer: ``ValueError``."""
    step = state.get("step", default)
    if isinstance(step, bool) or not isinstance(step, int):
        raise ValueError(f"memcallbacks: the monitor state passed to {key} has step={step!r}, not an integer.")
    return step


_PHASE_INDEX = {name: i for i, name in enumerate(PHASES)}


def phase_index(name: str) -> int:
    """The phase ``Monitor.phase(name)`` names (``"forward"``, ...); any other name: ``ValueError``."""
    index = _PHASE_INDEX.get(name)
    if index is None:
        raise ValueError(f"Monitor.phase(name={name!r}) is not one of {', '.join(PHASES)}; pass one of those.")
    return index


# ---------------------------------------------------------------------- the device a monitor measures, checked when it is built
def device_for(owner: str, device: Any, model: Any, optimizer: Any) -> torch.device:
    """The device a monitor measures: ``device`` (checked here, a ``ValueError`` naming ``owner``
    when it is not a usable torch device), else the model's, else the optimizer's parameters', else CPU."""
    if device is not None:
        try:
            chosen = torch.device(device)
        except (RuntimeError, TypeError, ValueError) as exc:
            raise ValueError(
                f"{owner}(device={device!r}) is not a torch device ({exc}); pass e.g. 'cpu', 'cuda' or "
                "'cuda:0', or leave it out to use the model's device."
            ) from None
        reason = unusable_device(chosen)
        if reason is not None:
            raise ValueError(f"{owner}(device={device!r}) cannot be measured: {reason}. Pass the device your model "
                             "is on (e.g. device='cpu'), or leave device out to use the model's device.")
        return chosen
    tensors: Iterable[torch.Tensor] = ()
    if model is not None:
        tensors = model.parameters()
    elif optimizer is not None:
        tensors = (p for group in getattr(optimizer, "param_groups", []) for p in group["params"])
    for t in tensors:
        if t.device.type != "meta":
            return t.device
    return torch.device("cpu")


def unusable_device(device: torch.device) -> str | None:
    """Why ``device`` cannot be measured here (a sentence), or None when it can. CPU and ``meta`` always can."""
    if device.type in ("cpu", "meta"):
        return None
    module = getattr(torch, device.type, None)
    is_available = getattr(module, "is_available", None)
    if is_available is None:
        return None  # an accelerator without the usual module: its backend reports what it can
    try:
        available = bool(is_available())
    except Exception as exc:  # a broken driver: say so rather than fail later
        return f"torch.{device.type}.is_available() failed ({type(exc).__name__}: {exc})"
    if not available:
        built = "" if device.type != "cuda" or torch.version.cuda else " (this torch build has no CUDA support)"
        return f"no {device.type} device is available in this process{built}"
    count_fn = getattr(module, "device_count", None)
    if device.index is not None and count_fn is not None:
        count = int(count_fn())
        if device.index >= count:
            return f"this process sees {count} {device.type} device(s), numbered 0 to {count - 1}"
    return None
