"""Fault containment: a real internal component made to raise at every kind of framework entry point of
every adapter (Lightning, plain loop, Accelerate, Transformers). Training completes, or the user's own
exception propagates unchanged; the process state is restored; the files are one consistent set."""

from __future__ import annotations

import gc
import json
import logging
import sys
from pathlib import Path
from typing import Any, Callable

import lightning.pytorch as L
import pytest
import torch
from torch.optim import optimizer as optim_module

from helpers import BoringModel, RandomDataModule, TemporaryNet, trainer_kwargs
from memcallbacks import MemoryMonitor, Monitor
from memcallbacks._files import outputs
from memcallbacks._runtime import checks as checks_module, end_write, run_end, sampling, session as session_module
from memcallbacks._base.devices import CpuBackend
from memcallbacks._files.fileset import fingerprint
from memcallbacks._runtime.guard import safe_str
from memcallbacks._runtime.model_hooks import ModelHooks
from memcallbacks._runtime.plain_support import PlainControls
from memcallbacks._files.report import load_output_dir
from memcallbacks._runtime.sampling import MemoryEngine
from memcallbacks._runtime.checks import StateCheck

pytestmark = pytest.mark.usefixtures("fresh_accelerate_state", "one_thread")

CONFIG = dict(log_every_n_steps=1, sample_every_n_steps=1, leaks={"gc_every_n_steps": 2, "gc_disable_automatic": True})


def _boom(*args: Any, **kwargs: Any) -> Any:
    raise RuntimeError("injected fault")


def _no_figure(*args: Any, **kwargs: Any) -> Any:
    raise RuntimeError("injected plot fault")


# where: the entry point that meets the fault first; (object, attribute) made to raise
FAULTS: dict[str, tuple[Any, str, Callable[..., Any]]] = {
    "start: backend selection": (sampling, "select_backend", _boom),
    "start: host RSS reader": (sampling, "host_rss_reader", _boom),
    "start: leak watch construction": (checks_module, "LeakWatch", _boom),
    "start: model-state objects": (StateCheck, "set_objects", _boom),
    "step start": (MemoryEngine, "begin_step", _boom),
    "phase boundary (forward/backward/optimizer hooks)": (CpuBackend, "interval", _boom),
    "step end": (MemoryEngine, "end_step", _boom),
    "evaluation start": (MemoryEngine, "begin_eval", _boom),
    "evaluation batch": (MemoryEngine, "eval_batch", _boom),
    "evaluation end": (MemoryEngine, "end_eval", _boom),
    "plot": (outputs, "history_figure", _no_figure),
    "stop": (MemoryEngine, "stop", _boom),
}


def process_state() -> tuple[bool, int, int, object]:
    return (gc.isenabled(), len(optim_module._global_optimizer_pre_hooks), len(optim_module._global_optimizer_post_hooks),
            sys.excepthook)  # the monitor's chained excepthook is put back when it stops


def assert_consistent(folder: Path) -> None:
    """Either no files, or report.json beside the very history.csv it was written with."""
    if not (folder / "report.json").exists():
        assert not (folder / "history.csv").exists(), "history.csv without its report.json"
        return
    report = json.loads((folder / "report.json").read_text())
    assert report["integrity"]["history"] == fingerprint(folder / "history.csv")
    assert all(Path(p).exists() for p in report["files"].values())
    load_output_dir(folder)  # what `memcallbacks report` reads
    assert not list(folder.glob(".*.tmp")), "temporary files left behind"


# ---------------------------------------------------------------------- the four adapters, one short run each
class Failing(Exception):
    """A user exception whose __str__ raises (is_oom(str(exc)) once turned it into another error)."""

    def __str__(self) -> str:
        raise UnicodeDecodeError("utf-8", b"\xff", 0, 1, "injected")


def run_lightning(folder: Path, fail_at: int | None) -> None:
    monitor = MemoryMonitor(output_dir=str(folder), **CONFIG)
    model = BoringModel()
    if fail_at is not None:
        step = model.training_step

        def training_step(batch: Any, batch_idx: int) -> Any:
            if batch_idx == fail_at:
                raise Failing()
            return step(batch, batch_idx)

        model.training_step = training_step  # type: ignore[method-assign]
    trainer = L.Trainer(**trainer_kwargs(folder.parent, max_steps=3, limit_val_batches=1, val_check_interval=2, callbacks=[monitor]))
    trainer.fit(model, RandomDataModule())


def plain_loop(monitor: Monitor, model: torch.nn.Module, optimizer: Any, fail_at: int | None) -> None:
    for i, batch in enumerate(monitor.track(torch.randn(3, 4, 32).unbind(0))):
        if i == fail_at:
            raise Failing()
        model(batch).pow(2).mean().backward()
        optimizer.step()
        optimizer.zero_grad()
    with monitor.evaluate(), torch.no_grad():
        model(torch.randn(4, 32))


def run_plain(folder: Path, fail_at: int | None) -> None:
    model = TemporaryNet()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    with Monitor(model, optimizer, output_dir=str(folder), **CONFIG) as monitor:
        plain_loop(monitor, model, optimizer, fail_at)


def run_accelerate(folder: Path, fail_at: int | None) -> None:
    from accelerate import Accelerator

    from memcallbacks.accelerate import AccelerateMemoryMonitor

    accelerator = Accelerator(cpu=True)
    model = TemporaryNet()
    model, optimizer = accelerator.prepare(model, torch.optim.SGD(model.parameters(), lr=0.01))
    with AccelerateMemoryMonitor(accelerator, output_dir=str(folder), **CONFIG) as monitor:
        plain_loop(monitor, model, optimizer, fail_at)
    assert "backward" not in accelerator.__dict__


def run_transformers(folder: Path, fail_at: int | None) -> None:
    from transformers import Trainer, TrainerCallback

    from memcallbacks.transformers import MemoryMonitorCallback
    from test_transformers import TokenData, tiny_gpt2, training_args

    class FailAt(TrainerCallback):
        def on_step_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            if state.global_step == fail_at:
                raise Failing()

    monitor = MemoryMonitorCallback(output_dir=str(folder), **CONFIG)
    args = training_args(folder.parent, max_steps=3, gradient_accumulation_steps=1, report_to=[])
    trainer = Trainer(model=tiny_gpt2(), args=args, train_dataset=TokenData(16), callbacks=[monitor, FailAt()])
    try:
        trainer.train()
    except BaseException as exc:
        monitor.record_exception(exc)  # what the docs ask of a Transformers user
        raise


ADAPTERS = {"lightning": run_lightning, "plain": run_plain, "accelerate": run_accelerate, "transformers": run_transformers}


# entry points an adapter does not have: plain loops and Accelerate see no evaluation batches, the
# Transformers callback records no evaluation loops
ABSENT = {("plain", "evaluation batch"), ("accelerate", "evaluation batch")} | {("transformers", f) for f in FAULTS if f.startswith("evaluation")}


@pytest.mark.parametrize("adapter,fault", [(a, f) for a in ADAPTERS for f in FAULTS if (a, f) not in ABSENT])
def test_internal_fault_never_stops_training(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: Any, adapter: str, fault: str) -> None:
    caplog.set_level(logging.INFO, logger="memcallbacks")
    before = process_state()
    target, name, replacement = FAULTS[fault]
    monkeypatch.setattr(target, name, replacement)
    if fault == "plot":  # drawn in this process (a plot failing in the writer process: test_distributed_end_write.py)
        monkeypatch.setattr(end_write, "WRITER", False)
    folder = tmp_path / "mem"
    ADAPTERS[adapter](folder, None)  # completes: no exception reaches the loop
    gc.collect()
    assert process_state() == before
    assert_consistent(folder)
    if fault == "plot":  # an optional file failing takes none of the others down
        assert (folder / "report.json").exists() and not (folder / "memory.png").exists()
    injected = [r for r in caplog.records if "injected" in (safe_str(r.exc_info[1]) if r.exc_info else r.getMessage())]
    assert injected, f"the {fault} fault was never met"


FAILURE_PATH_FAULTS = {
    "none": None,
    "recording the exception": (run_end.RunEnd, "_record_exception"),
    "writing the files": (session_module.Session, "finish"),
    "closing the backend": (MemoryEngine, "stop"),
}


@pytest.mark.parametrize("fault", list(FAILURE_PATH_FAULTS))
@pytest.mark.parametrize("adapter", list(ADAPTERS))
def test_user_exception_propagates_unchanged(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, adapter: str, fault: str) -> None:
    before = process_state()
    if FAILURE_PATH_FAULTS[fault] is not None:  # the failure path itself broken too
        monkeypatch.setattr(*FAILURE_PATH_FAULTS[fault], _boom)
    folder = tmp_path / "mem"
    with pytest.raises(Failing) as caught:
        ADAPTERS[adapter](folder, 1)
    assert type(caught.value) is Failing and caught.value.__context__ is None  # the very exception, not a wrapper
    del caught
    gc.collect()
    assert process_state() == before
    assert_consistent(folder)
    if fault == "none":
        report = json.loads((folder / "report.json").read_text())
        assert [e["kind"] for e in report["events"]] == ["exception"]
        assert "Failing" in report["events"][0]["error"]


def test_every_framework_hook_is_guarded() -> None:
    """The one guard (``entry_point``) wraps every hook a framework calls, in every adapter."""
    from transformers import TrainerCallback

    from memcallbacks.accelerate import AccelerateMemoryMonitor
    from memcallbacks.transformers import MemoryMonitorCallback

    def hooks(cls: type, base: type | None, extra: tuple[str, ...]) -> list[str]:
        names = [n for n in vars(cls) if callable(vars(cls)[n]) and (n in extra or (base is not None and hasattr(base, n) and not n.startswith("_")))]
        return [n for n in names if not n.startswith("__")]

    cases = [
        (MemoryMonitor, L.Callback, ("setup", "teardown", "on_exception")),
        (MemoryMonitorCallback, TrainerCallback, ("record_exception", "close")),
        (Monitor, None, ("_forward_pre", "_optimizer_pre", "_optimizer_post",
                         "open_step", "end_phase", "close_step", "_track_item", "_track_end", "_step_enter", "_phase_enter")),
        (PlainControls, None, ("close", "record_exception", "_exit_failing")),  # Monitor's base: its end of run
        (AccelerateMemoryMonitor, None, ("close", "_backward_starts", "_backward_ends", "_step_complete", "watch_prepared_models")),
        (ModelHooks, None, ("_forward_post", "_backward_start", "_backward_end")),  # the plain loop's model hooks
    ]
    unguarded = []
    for cls, base, extra in cases:
        names = hooks(cls, base, extra)
        assert len(names) >= len(extra)
        unguarded += [f"{cls.__name__}.{n}" for n in names if n not in ("state_dict", "load_state_dict", "state_key", "on_load_checkpoint")
                      and not hasattr(vars(cls)[n], "__memcallbacks_entry_point__")]
    assert unguarded == []
