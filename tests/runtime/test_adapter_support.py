"""What every adapter decides the same way (issue 22): strategy and precision names, rank zero's
trackers, and the global optimizer-step hooks with the pre-flight guard and weak references.

Real Lightning strategy objects (constructed, never launched), real torch optimizers stepping real
parameters, and the real pre-flight (``PreflightCheck``'s fake step, which is what sets
``fake_step_running()``: a module counter raised around the prediction, not a context manager).
"""

from __future__ import annotations

import gc
import logging
import weakref
from typing import Any

import pytest
import torch
from lightning.pytorch.strategies import DDPStrategy, FSDPStrategy, ModelParallelStrategy, SingleDeviceStrategy
from torch import nn
from torch.optim.optimizer import register_optimizer_step_pre_hook

from helpers import flat_settings
from memcallbacks._runtime import preflight_check
from memcallbacks._runtime.adapter_support import OptimizerHooks, lightning_strategy, precision_name, rank_zero_trackers
from memcallbacks._runtime.session import Session
from memcallbacks.estimate.tables import PRECISIONS, canonical_precision
from memcallbacks.trackers import Trackers

pytestmark = pytest.mark.usefixtures("one_thread")


# ---------------------------------------------------------------------- strategies
@pytest.mark.parametrize(("make", "name"), [
    (lambda: SingleDeviceStrategy(device=torch.device("cpu")), "single"),
    (lambda: DDPStrategy(), "ddp"),
    (lambda: DDPStrategy(start_method="spawn"), "ddp"),
    (lambda: FSDPStrategy(), "fsdp"),
    (lambda: ModelParallelStrategy(), "fsdp2"),
])
def test_lightning_strategy_names_real_strategy_objects(make, name):
    assert lightning_strategy(make()) == name


def test_lightning_strategy_of_a_real_trainer():
    import lightning.pytorch as L

    trainer = L.Trainer(accelerator="cpu", devices=1, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False)
    assert type(trainer.strategy).__name__ == "SingleDeviceStrategy"
    assert lightning_strategy(trainer.strategy) == "single"


def test_lightning_strategy_unknown_is_left_to_detection():
    class CustomStrategy(SingleDeviceStrategy):  # a user's own strategy: its name is not in the table
        pass

    assert lightning_strategy(CustomStrategy(device=torch.device("cpu"))) is None
    assert lightning_strategy(object()) is None


@pytest.mark.parametrize(("config", "name"), [
    ({"zero_optimization": {"stage": 1}}, "zero1"),
    ({"zero_optimization": {"stage": 2}}, "zero2"),
    ({"zero_optimization": {"stage": 3}}, "zero3"),
    ({"zero_optimization": {"stage": 0}}, "ddp"),
    ({}, "ddp"),
    (None, "ddp"),
])
def test_lightning_deepspeed_strategy_names_its_zero_stage(config, name):
    # DeepSpeed is not installed here, so Lightning's DeepSpeedStrategy cannot be built: a plain class
    # of that name with the ``config`` attribute Lightning's has stands in for it (third-party, not ours)
    DeepSpeedStrategy = type("DeepSpeedStrategy", (), {"config": config})
    assert lightning_strategy(DeepSpeedStrategy()) == name


# ---------------------------------------------------------------------- precision names
@pytest.mark.parametrize(("setting", "name"), [
    # full precision / not set: the estimate reads it from the model
    (None, None), (False, None), ("", None), ("no", None), ("None", None),
    # fp16 mixed, in every framework's spelling
    ("fp16", "16-mixed"), ("16", "16-mixed"), (16, "16-mixed"), ("16-mixed", "16-mixed"),
    # bf16 mixed
    ("bf16", "bf16-mixed"), ("bf16-mixed", "bf16-mixed"),
    # Lightning's true-precision settings pass through (the estimate knows them)
    ("32-true", "32-true"), ("bf16-true", "bf16-true"), ("16-true", "16-true"), ("64-true", "64-true"),
    ("32", "32"), (32, "32"), ("64", "64"),
    # case and bools: Accelerate's "FP16", a True flag (the estimate reads the model: None)
    ("FP16", "16-mixed"), ("BF16", "bf16-mixed"), (True, None),
    # settings the estimate does not know: None (read from the model), never an error at run time
    ("fp8", None), ("transformer-engine", None),
])
def test_precision_name_for_every_spelling(setting, name):
    assert precision_name(setting) == name


@pytest.mark.parametrize("setting", ["fp16", "bf16", "16", 16, "16-mixed", "bf16-mixed", "32-true", "bf16-true", "16-true",
                                     "64-true", "32", 32, "64"])
def test_every_precision_name_is_one_the_estimate_accepts(setting):
    assert canonical_precision(precision_name(setting), "test").name in PRECISIONS


def test_precision_name_of_real_lightning_trainers():
    import lightning.pytorch as L

    for precision, expected in [("32-true", "32-true"), ("bf16-mixed", "bf16-mixed"), ("bf16-true", "bf16-true")]:
        trainer = L.Trainer(accelerator="cpu", devices=1, precision=precision, logger=False, enable_checkpointing=False,
                            enable_progress_bar=False, enable_model_summary=False)
        assert precision_name(trainer.precision) == expected


# ---------------------------------------------------------------------- rank zero's trackers
def test_rank_zero_trackers_only_on_the_main_process():
    log = logging.getLogger("t")
    assert rank_zero_trackers(False, lambda: [], "Owner", log) is None
    trackers = rank_zero_trackers(True, lambda: [], "Owner", log)
    assert isinstance(trackers, Trackers) and trackers.owner == "Owner"


# ---------------------------------------------------------------------- optimizer hooks
class Target:
    """What an adapter is to the hooks: an object whose bound methods they call."""

    def __init__(self, calls: list[tuple[str, Any]]) -> None:
        self.calls = calls

    def pre(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        self.calls.append(("pre", optimizer))

    def post(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        self.calls.append(("post", optimizer))


def real_step(optimizer: torch.optim.Optimizer, model: nn.Module) -> None:
    model(torch.randn(4, 8)).sum().backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


@pytest.fixture
def model_and_optimizer():
    torch.manual_seed(0)
    model = nn.Linear(8, 2)
    return model, torch.optim.SGD(model.parameters(), lr=0.1)


def test_installed_hooks_fire_on_a_real_optimizer_step(model_and_optimizer):
    model, optimizer = model_and_optimizer
    calls: list[tuple[str, Any]] = []
    target = Target(calls)
    hooks = OptimizerHooks(target.pre, target.post)
    assert hooks.handles == []
    try:
        handles = hooks.install()
        assert len(handles) == 2 and hooks.install() is handles  # a second install adds nothing
        before = model.weight.detach().clone()
        real_step(optimizer, model)
        assert not torch.equal(before, model.weight)  # the step really ran
        assert calls == [("pre", optimizer), ("post", optimizer)]  # once each, in order, with the optimizer
        real_step(optimizer, model)
        assert [c[0] for c in calls] == ["pre", "post", "pre", "post"]
    finally:
        hooks.remove()


def test_hooks_are_skipped_during_the_preflight_fake_step(tmp_path, model_and_optimizer):
    model, optimizer = model_and_optimizer
    calls: list[tuple[str, Any]] = []
    target = Target(calls)
    hooks = OptimizerHooks(target.pre, target.post)
    hooks.install()
    # a raw global hook, not guarded: it shows that the fake step does fire torch's global hooks
    raw: list[bool] = []
    raw_handle = register_optimizer_step_pre_hook(lambda opt, args, kwargs: raw.append(preflight_check.fake_step_running()))
    session = Session(flat_settings(preflight=True, write_files=False), "plain", "Monitor")
    try:
        session.start(torch.device("cpu"))
        session.attach(model=model, optimizer=optimizer)
        session.watch_first_forward(model)  # the plain loop's pre-flight: at the first training forward
        assert not preflight_check.fake_step_running()
        model(torch.randn(4, 8))  # runs the pre-flight's fake steps, then this forward
        assert session.checks.preflight.status == "predicted", session.checks.preflight.info
        assert raw and all(raw)  # the fake optimizer steps fired the global hooks, with the guard up
        assert calls == []  # ... and OptimizerHooks left them out
        assert not preflight_check.fake_step_running()  # lowered after the prediction
        raw.clear()
        real_step(optimizer, model)  # the loop's own step: seen
        assert raw == [False]
        assert calls == [("pre", optimizer), ("post", optimizer)]
    finally:
        raw_handle.remove()
        hooks.remove()
        session.stop()


def test_hooks_hold_their_target_weakly(model_and_optimizer):
    model, optimizer = model_and_optimizer
    calls: list[tuple[str, Any]] = []
    target = Target(calls)
    hooks = OptimizerHooks(target.pre, target.post)
    hooks.install()
    try:
        real_step(optimizer, model)
        assert len(calls) == 2
        alive = weakref.ref(target)
        del target
        gc.collect()
        assert alive() is None  # the hooks (and torch's global table) did not keep it
        real_step(optimizer, model)  # no call, no error
        assert len(calls) == 2
    finally:
        hooks.remove()


def test_remove_is_safe_twice_and_stops_the_calls(model_and_optimizer):
    model, optimizer = model_and_optimizer
    calls: list[tuple[str, Any]] = []
    target = Target(calls)
    hooks = OptimizerHooks(target.pre, target.post)
    hooks.remove()  # before install: nothing to remove
    hooks.install()
    real_step(optimizer, model)
    assert len(calls) == 2
    hooks.remove()
    assert hooks.handles == []
    hooks.remove()  # twice: no error
    real_step(optimizer, model)
    assert len(calls) == 2  # removed: no more calls
    hooks.install()  # and it can be installed again
    try:
        real_step(optimizer, model)
        assert len(calls) == 4
    finally:
        hooks.remove()
