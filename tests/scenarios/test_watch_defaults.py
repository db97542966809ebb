"""Issue 11: at DEFAULT settings every adapter watches every step, whether or not anything is logged,
and finds a leak within a number of steps that shrinks with its rate.

Each run is a real fit on CPU (Lightning with and without a logger, the plain ``Monitor`` with and
without ``log_fn``, Accelerate) of a small MLP whose step takes a few ms, with one planted leak that
starts at step 0. The monitor is built with no arguments beyond where to write its files.
"""

from __future__ import annotations

import collections
import json
import logging
from pathlib import Path
from typing import Any

import lightning.pytorch as L
import pytest
import torch
from lightning.pytorch.loggers import CSVLogger
from torch import nn
from torch.utils.data import DataLoader

from helpers import MIB, csv_metrics, trainer_kwargs
from memcallbacks import MemoryMonitor, Monitor

pytestmark = pytest.mark.usefixtures("one_thread", "collected_heap")

DIM, BATCH = 256, 128
KEPT: list[torch.Tensor] = []  # the module-level list of the "global list" leak


def mlp() -> nn.Module:
    return nn.Sequential(nn.Linear(DIM, 512), nn.ReLU(), nn.Linear(512, 1))


def leak_tensor(nbytes: int) -> torch.Tensor:
    return torch.ones(nbytes // 4)  # written, so its pages are really in use


def growth_step(findings: list[Any]) -> int | None:
    growth = [f for f in findings if f.kind == "growth"]
    if not growth:
        return None
    return growth[0].first_step if growth[0].first_step is not None else growth[0].step


class LeakyCallback(L.Callback):
    """A callback that keeps a tensor per step (an image logger that never flushes)."""

    def __init__(self, nbytes: int) -> None:
        self.nbytes = nbytes
        self.pending: list[torch.Tensor] = []

    def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        self.pending.append(leak_tensor(self.nbytes))


class Net(L.LightningModule):
    def __init__(self, nbytes: int = 0, queue: int = 0) -> None:
        super().__init__()
        self.net = mlp()
        self.nbytes = nbytes
        self.history = collections.deque(maxlen=queue or None)  # bounded: a warm-up queue when queue > 0
        self.state = type("State", (), {})()
        self.state.buffers = collections.deque()  # two levels deep when it leaks

    def training_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
        if self.nbytes and not self.history.maxlen:
            self.state.buffers.append(leak_tensor(self.nbytes))  # BUG: a module attribute two levels deep
        if self.history.maxlen:
            self.history.append(leak_tensor(256 << 10))  # bounded: fills for `queue` steps, then flat
        return self.net(batch).pow(2).mean()

    def configure_optimizers(self) -> Any:
        opt = torch.optim.AdamW(self.parameters(), lr=1e-3)
        return [opt], [torch.optim.lr_scheduler.StepLR(opt, step_size=10, gamma=0.5)]


def loader(steps: int, variable: bool = False) -> DataLoader:
    if not variable:
        return DataLoader(torch.randn(steps * BATCH, DIM), batch_size=BATCH)
    sizes = [BATCH // 2 + (i * 37) % BATCH for i in range(steps)]  # 64..191 rows, no order
    return DataLoader([torch.randn(n, DIM) for n in sizes], batch_size=None)


def fit(tmp_path: Path, model: L.LightningModule, steps: int, logger: bool, callbacks: list[Any] = (), variable: bool = False, **monitor: Any) -> MemoryMonitor:
    mon = MemoryMonitor(output_dir=str(tmp_path / "mem"), plot=False, **monitor)
    log = CSVLogger(str(tmp_path), name="csv", version=0) if logger else False
    trainer = L.Trainer(**trainer_kwargs(tmp_path, max_steps=steps, logger=log, callbacks=[mon, *callbacks]))
    trainer.fit(model, loader(steps, variable))
    assert trainer.global_step == steps
    return mon


@pytest.mark.parametrize(("rate", "within"), [(4 * MIB, 12), (256 << 10, 35)])
def test_lightning_without_logger_finds_a_callback_leak(tmp_path, rate, within):
    callback = LeakyCallback(rate)
    mon = fit(tmp_path, Net(), within + 25, logger=False, callbacks=[callback])
    step = growth_step(mon.findings)
    assert step is not None and step <= within, [str(f) for f in mon.findings]
    report = json.loads((tmp_path / "mem" / "report.json").read_text())
    cadence = report["summary"]["cadence"]
    assert cadence["log_every_n_steps"] is None and cadence["sample_interval_source"] == "overhead_budget"
    assert cadence["overhead"] > 0 and 1 <= cadence["read_every_n_steps"] <= 32 and cadence["dense_read_steps"] >= 24  # every step read up to 24 (48 or a burst's end on a rising floor)
    assert "rows in history.csv" in mon.format_report()


def test_lightning_with_logger_finds_a_nested_module_attribute(tmp_path):
    mon = fit(tmp_path, Net(nbytes=MIB), 60, logger=True, log_keys=["default", "overhead"])
    step = growth_step(mon.findings)
    assert step is not None and step <= 20, [str(f) for f in mon.findings]
    growth = next(f for f in mon.findings if f.kind == "growth")
    assert any("buffers" in h for h in growth.holders), growth.holders  # named after the census gap
    logged = csv_metrics(tmp_path / "csv" / "version_0" / "metrics.csv")
    assert logged["memory/findings"][-1][1] >= 1
    assert all(v > 0 for _, v in logged["memory/overhead"])


def test_lightning_clean_run_after_a_leaky_fit_finds_nothing(tmp_path):
    # A clean run (variable batches, a bounded warm-up queue, AdamW + StepLR) after a leaky fit in the
    # same process, as in a notebook: the earlier fit's freed 1 MiB tensors raise glibc's mmap threshold,
    # so native one-off buffers (~4.7 MiB, allocated at a new batch shape and barely touched) land in the
    # heap on top of a floor that creeps by a few KiB/step. Two such one-offs are not a steady climb.
    fit(tmp_path / "leaky", Net(nbytes=MIB), 30, logger=False)
    mon = fit(tmp_path, Net(queue=8), 80, logger=False, variable=True)
    assert [str(f) for f in mon.findings] == []


def plain_loop(monitor: Monitor, model: nn.Module, optimizer: Any, steps: int, keep: list[Any] | None, nbytes: int) -> None:
    for x in monitor.track(list(torch.randn(steps, BATCH, DIM))):
        outputs = model(x)
        outputs.pow(2).mean().backward()
        optimizer.step()
        optimizer.zero_grad()
        if keep is not None:
            keep.append(leak_tensor(nbytes))  # BUG: every step's outputs kept
    monitor.close()


@pytest.mark.parametrize("with_log_fn", [False, True])
def test_plain_monitor_finds_a_list_with_and_without_log_fn(tmp_path, with_log_fn):
    model = mlp()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    logged: list[tuple[dict[str, float], int]] = []
    log_fn = (lambda metrics, step: logged.append((metrics, step))) if with_log_fn else None
    monitor = Monitor(model, optimizer, log_fn, output_dir=str(tmp_path / "mem"), plot=False)
    KEPT.clear()
    plain_loop(monitor, model, optimizer, 60, KEPT, MIB)
    KEPT.clear()
    step = growth_step(monitor.findings)
    assert step is not None and step <= 20, [str(f) for f in monitor.findings]
    assert bool(logged) == with_log_fn
    report = json.loads((tmp_path / "mem" / "report.json").read_text())
    assert report["findings"][0]["kind"] == "growth"


def test_accelerate_finds_a_list(tmp_path):
    accelerate = pytest.importorskip("accelerate")
    from memcallbacks.accelerate import AccelerateMemoryMonitor

    accelerator = accelerate.Accelerator(cpu=True, project_dir=str(tmp_path))
    model = mlp()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    model, optimizer = accelerator.prepare(model, optimizer)
    monitor = AccelerateMemoryMonitor(accelerator, plot=False)
    kept = []
    for x in monitor.track(list(torch.randn(40, BATCH, DIM))):
        loss = model(x).pow(2).mean()
        accelerator.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        kept.append(leak_tensor(MIB))
    monitor.close()
    accelerator.end_training()
    step = growth_step(monitor.findings)
    assert step is not None and step <= 20, [str(f) for f in monitor.findings]


def test_auto_snapshot_at_defaults_fires_on_growth_without_a_logger(tmp_path, caplog):
    caplog.set_level(logging.WARNING, logger="memcallbacks")
    mon = fit(tmp_path, Net(), 30, logger=False, callbacks=[LeakyCallback(MIB)], auto_snapshot=True)
    assert growth_step(mon.findings) is not None
    report = json.loads((tmp_path / "mem" / "report.json").read_text())
    triggers = [str(s.get("trigger", "")) for s in report["snapshots"]]
    assert any("growth" in t for t in triggers), report["snapshots"]
    assert list((tmp_path / "mem" / "snapshots").glob("*.pickle"))
