"""``preflight=True`` in the monitor: real runs (Lightning, plain loops, Accelerate, Transformers) on CPU.

The first batch's step is predicted on fake tensors before it runs; every sampled steady step's
measured peaks are then compared with the prediction. CPU peaks are RSS high-water marks, so the
comparison is of peaks above the RSS at step start (``cpu_mmap_threshold`` makes freed tensors go
back to the OS, so the RSS follows tensor lifetimes).
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

import lightning.pytorch as L
import pandas as pd
import pytest
import torch
from lightning.pytorch.loggers import CSVLogger
from torch import nn
from torch.nn import functional as F
from torch.utils.data import DataLoader, TensorDataset

from helpers import MIB, csv_metrics, trainer_kwargs
from memcallbacks import Monitor
from memcallbacks.oom.remedies import MARGIN_MIN_BYTES

pytestmark = [pytest.mark.usefixtures("collected_heap"), pytest.mark.rss_sensitive]
CPU = dict(advanced={"cpu_mmap_threshold": 1 << 20}, sample_every_n_steps=1, log_every_n_steps=1)
PHASES = ("forward", "backward", "optimizer")
PREDICTED = [f"predicted_peak_{ph}" for ph in PHASES]
DIM, BATCH = 256, 2048  # activations (a few MiB per layer) outweigh the parameters


class Net(nn.Module):
    """An MLP whose activations outweigh its parameters. ``extra_mib``: from forward call
    ``extra_from_call`` on, a buffer held through the forward that the fake step never sees (it
    runs the model's first calls only)."""

    def __init__(self, extra_mib: int = 0, extra_from_call: int = 3, item: bool = False) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(DIM, 4 * DIM), nn.GELU(), nn.Linear(4 * DIM, 4 * DIM), nn.GELU(), nn.Linear(4 * DIM, 10))
        self.extra_mib, self.extra_from_call, self.item = extra_mib, extra_from_call, item
        self.calls = 0
        self.events: list[str] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        self.events.append("forward")
        if self.item and x.abs().max().item() < 0:  # data-dependent: cannot run on fake tensors
            x = -x
        held = None
        if self.extra_mib and self.calls >= self.extra_from_call:
            held = torch.ones(self.extra_mib * MIB, dtype=torch.uint8)  # every page written: resident
        out = self.net(x)
        del held
        return out


class LitNet(L.LightningModule):
    def __init__(self, **kwargs: Any) -> None:
        super().__init__()
        self.model = Net(**kwargs)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = F.cross_entropy(self.model(x), y)
        self.log("train_loss", loss)
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=1e-3)


def data(steps: int, batch: int = BATCH) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(0)
    return [(torch.randn(batch, DIM, generator=g), torch.randint(0, 10, (batch,), generator=g)) for _ in range(steps)]


class Recorder(logging.Handler):
    """Puts "warning: ..." into the model's own event list, so the order against its forward calls shows."""

    def __init__(self, events: list[str]) -> None:
        super().__init__(logging.WARNING)
        self.events = events

    def emit(self, record: logging.LogRecord) -> None:
        self.events.append("warning: " + record.getMessage())


def fit_lightning(tmp_path: Path, steps: int = 5, **monitor_kwargs: Any) -> tuple[Any, LitNet, Path]:
    from memcallbacks import MemoryMonitor

    model = LitNet(**monitor_kwargs.pop("model", {}))
    monitor = MemoryMonitor(preflight=True, **CPU, **monitor_kwargs)
    x, y = (torch.cat(t) for t in zip(*data(steps)))
    logger = CSVLogger(str(tmp_path), name="csv")
    trainer = L.Trainer(**trainer_kwargs(tmp_path, max_steps=steps, logger=logger, log_every_n_steps=1, callbacks=[monitor]))
    handler = Recorder(model.model.events)
    logging.getLogger("memcallbacks").addHandler(handler)
    try:
        trainer.fit(model, DataLoader(TensorDataset(x, y), batch_size=BATCH))
    finally:
        logging.getLogger("memcallbacks").removeHandler(handler)
    return monitor, model, Path(logger.log_dir) / "metrics.csv"


def train_plain(steps: int, net: Net, **monitor_kwargs: Any) -> Monitor:
    optimizer = torch.optim.AdamW(net.parameters(), lr=1e-3)
    monitor = Monitor(net, optimizer, preflight=True, write_files=False, **CPU, **monitor_kwargs)
    handler = Recorder(net.events)
    logging.getLogger("memcallbacks").addHandler(handler)
    try:
        for x, y in monitor.track(data(steps)):
            F.cross_entropy(net(x), y).backward()
            optimizer.step()
            optimizer.zero_grad()
        monitor.close()
    finally:
        logging.getLogger("memcallbacks").removeHandler(handler)
    return monitor


def assert_close_to_prediction(monitor: Any) -> dict[str, Any]:
    """Every phase's measured peak above step start within 15% (+2 MiB of RSS noise) of the
    prediction, on every steady step but at most one.

    CPU peaks are the process's RSS high-water marks: in a long test session another thread's
    allocation (a logger's writer, a worker an earlier test left) now and then lands inside one
    step's phase, and the report's ``measured_max_bytes`` (the worst step) carries it; one such step
    in the full suite read +25 MiB in backward. A wrong prediction is off on every step."""
    pre = monitor.report()["preflight"]
    assert pre["status"] == "predicted", pre
    comparison = pre["comparison"]
    assert comparison["steps_compared"] >= 3
    for phase, c in comparison["phases"].items():
        assert c["predicted_bytes"] > 2 * MIB, (phase, c)
    history = monitor.history
    assert set(PREDICTED + ["predicted_peak_error"]) <= set(history.columns)
    steady = history.iloc[1:]  # after the first optimizer step: the step the prediction is for
    columns = [(f"peak_{ph}", f"predicted_peak_{ph}") for ph in PHASES] + [("peak_allocated", None)]
    for measured, predicted in columns:
        expected = steady[predicted] if predicted else steady[PREDICTED].max(axis=1)
        close = (steady[measured] - expected).abs() <= 0.15 * (expected - steady["reserved"]) + 2 * MIB
        assert close.sum() >= len(close) - 1, (measured, comparison["phases"], steady[[measured, "reserved"]].assign(expected=expected))
    return pre


# ------------------------------------------------------------------ Lightning
def test_lightning_logs_predictions_that_match_measured_peaks(tmp_path: Path) -> None:
    monitor, model, metrics_csv = fit_lightning(tmp_path)
    pre = assert_close_to_prediction(monitor)
    assert pre["precision"] == "32-true" and pre["optimizer"] == "AdamW" and pre["batch_size"] == BATCH
    assert pre["fits"] is True and not monitor.findings
    # the previous step's gradients live through Lightning's forward (zero_grad runs after training_step)
    assert pre["grads_alive_at_step_start_bytes"] == sum(p.numel() * 4 for p in model.parameters())
    logged = csv_metrics(metrics_csv)
    history = monitor.history
    for phase in PHASES:
        values = logged[f"memory/predicted_peak_{phase}_GiB"]
        assert values[0][0] == 0  # on the first logged step already
        assert values[-1][1] * 2**30 == pytest.approx(history[f"predicted_peak_{phase}"].iloc[-1], rel=1e-6)
    assert "memory/preflight_error_GiB" in logged
    written = json.loads(Path(monitor.files["report"]).read_text())["preflight"]
    assert written["comparison"] == pre["comparison"]
    on_disk = pd.read_csv(monitor.files["history"])
    assert {f"{c}_bytes" for c in PREDICTED} <= set(on_disk.columns)  # the file's names carry their unit
    text = monitor.format_report()
    assert "pre-flight" in text and "measured vs predicted" in text


def test_lightning_capacity_warning_before_step_zero(tmp_path: Path) -> None:
    from memcallbacks.preflight import predict

    probe = LitNet()
    x, y = data(1)[0]

    def step(m: LitNet, b: Any) -> torch.Tensor:
        return F.cross_entropy(m.model(b[0]), b[1])

    one = predict(probe, (x[:1], y[:1]), probe.configure_optimizers(), forward_fn=step)
    full = predict(probe, (x, y), probe.configure_optimizers(), forward_fn=step)
    # batch 1 fits with the margin a proposed batch keeps free beside its peak, the full batch does not
    capacity = (one.peak_bytes + MARGIN_MIN_BYTES + full.peak_bytes) // 2
    assert one.peak_bytes + MARGIN_MIN_BYTES < capacity < full.peak_bytes

    monitor, model, _ = fit_lightning(tmp_path, steps=2, capacity_bytes=capacity)
    events = model.model.events
    warnings = [e for e in events if e.startswith("warning") and "[preflight]" in e]
    assert len(warnings) == 1 and events.index(warnings[0]) == 0  # before the first real forward
    message = warnings[0]
    fit = monitor.report()["preflight"]["max_batch_size"]["batch_size"]
    assert 1 <= fit < BATCH
    assert f"largest batch size that fits is {fit}" in message and f"this batch has {BATCH}" in message
    assert "in optimizer" in message or "in backward" in message or "in forward" in message
    assert "optimizer_state" in message or "temporaries" in message or "activations" in message
    finding = monitor.findings[0]
    assert finding.kind == "preflight" and finding.bytes > 0 and finding.details["max_batch_size"] == fit
    # the explanation an OOM at this step would get, before the step runs: ranked changes, each with its number
    explained = monitor.report()["preflight"]["explanation"]
    assert explained["source"] == "pre-flight" and explained["text"].startswith("the step would run out of memory")
    kinds = [r["kind"] for r in explained["remedies"]]
    assert "batch_size" in kinds and finding.details["remedies"] == explained["remedies"], kinds
    batch = explained["remedies"][kinds.index("batch_size")]
    assert batch["fits"] and 1 <= batch["details"]["batch_size"] < BATCH, batch
    assert batch["details"]["predicted_peak_bytes"] <= capacity and batch["saving_bytes"] > 0, batch
    assert "What makes it fit, largest predicted saving first: 1. " in message
    assert len(monitor.history) == 2  # training went on


def test_lightning_unfakeable_forward_warns_and_trains_on(tmp_path: Path) -> None:
    monitor, model, metrics_csv = fit_lightning(tmp_path, steps=3, model={"item": True})
    warnings = [e for e in model.model.events if e.startswith("warning")]
    assert len(warnings) == 1 and "aten._local_scalar_dense" in warnings[0] and "Training goes on" in warnings[0]
    assert len(monitor.history) == 3 and not set(PREDICTED) & set(monitor.history.columns)
    assert monitor.report()["preflight"]["status"] == "failed"
    assert not any("predicted" in key for key in csv_metrics(metrics_csv))


# ------------------------------------------------------------------ plain loop
def test_plain_monitor_predictions_match_measured_peaks() -> None:
    monitor = train_plain(5, Net())
    pre = assert_close_to_prediction(monitor)
    assert pre["grads_alive_at_step_start_bytes"] == 0 and not monitor.findings
    assert monitor.history["optimizer_steps"].tolist() == [1] * 5  # the fake optimizer's steps are not counted


def test_plain_monitor_capacity_warning_before_the_first_forward() -> None:
    net = Net()
    monitor = train_plain(2, net, capacity_bytes=1 << 20)
    assert net.events[0].startswith("warning") and "[preflight]" in net.events[0]
    assert "above the 1.0 MiB of capacity_bytes" in net.events[0] and "No batch size fits" in net.events[0]
    assert monitor.report()["preflight"]["max_batch_size"]["batch_size"] == 0
    assert len(monitor.history) == 2


def test_plain_monitor_memory_above_prediction_is_a_finding() -> None:
    monitor = train_plain(5, Net(extra_mib=64, extra_from_call=3))
    findings = [f for f in monitor.findings if f.kind == "preflight"]
    assert len(findings) == 1
    finding = findings[0]
    assert finding.details["phase"] == "forward" and finding.first_step == 2  # the third step, the first with the extra
    assert finding.step == 4  # updated by each later step
    assert 56 * MIB <= finding.bytes <= 72 * MIB  # the 64 MiB the fake step could not see
    assert finding.count == 3  # steps 2, 3, 4
    assert "pre-flight predicted" in finding.message
    report = monitor.report()
    assert report["findings"][0]["kind"] == "preflight"
    assert report["preflight"]["comparison"]["phases"]["forward"]["max_gap_bytes"] >= 56 * MIB


def test_plain_monitor_unfakeable_forward_warns_and_trains_on() -> None:
    net = Net(item=True)
    monitor = train_plain(3, net)
    warnings = [e for e in net.events if e.startswith("warning")]
    assert len(warnings) == 1 and "aten._local_scalar_dense" in warnings[0]
    assert len(monitor.history) == 3 and not set(PREDICTED) & set(monitor.history.columns)
    assert monitor.report()["preflight"]["status"] == "failed" and not monitor.findings


def test_plain_monitor_under_autocast_predicts_bf16_mixed() -> None:
    net = Net()
    optimizer = torch.optim.SGD(net.parameters(), lr=0.1)
    monitor = Monitor(net, optimizer, preflight=True, write_files=False, **CPU)
    for x, y in monitor.track(data(2, batch=64)):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = F.cross_entropy(net(x), y)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    monitor.close()
    pre = monitor.report()["preflight"]
    assert pre["status"] == "predicted" and pre["precision"] == "bf16-mixed" and pre["prediction"]["precision"] == "bf16-mixed"


def test_preflight_off_adds_nothing() -> None:
    net = Net()
    optimizer = torch.optim.SGD(net.parameters(), lr=0.1)
    monitor = Monitor(net, optimizer, write_files=False, **CPU)
    for x, y in monitor.track(data(2, batch=64)):
        F.cross_entropy(net(x), y).backward()
        optimizer.step()
    monitor.close()
    assert monitor.report()["preflight"] is None and not set(PREDICTED) & set(monitor.history.columns)
    assert net.events == ["forward", "forward"]  # no fake steps ran


# ------------------------------------------------------------------ Accelerate and Transformers
@pytest.mark.usefixtures("fresh_accelerate_state")
def test_accelerate_predictions_match_measured_peaks(tmp_path: Path) -> None:
    pytest.importorskip("accelerate")
    from accelerate import Accelerator

    from memcallbacks.accelerate import AccelerateMemoryMonitor

    accelerator = Accelerator(cpu=True)
    net = Net()
    x, y = (torch.cat(t) for t in zip(*data(5)))
    model, optimizer, loader = accelerator.prepare(
        net, torch.optim.AdamW(net.parameters(), lr=1e-3), DataLoader(TensorDataset(x, y), batch_size=BATCH)
    )
    monitor = AccelerateMemoryMonitor(accelerator, preflight=True, write_files=False, **CPU)
    for xb, yb in monitor.track(loader):
        accelerator.backward(F.cross_entropy(model(xb), yb))
        optimizer.step()
        optimizer.zero_grad()
    monitor.close()
    pre = assert_close_to_prediction(monitor)
    assert pre["optimizer"] == "AdamW" and pre["batch_size"] == BATCH and not monitor.findings


@pytest.mark.usefixtures("fresh_accelerate_state")
def test_transformers_trainer_logs_predictions(tmp_path: Path) -> None:
    transformers = pytest.importorskip("transformers")
    from memcallbacks.transformers import MemoryMonitorCallback

    torch.manual_seed(0)
    config = transformers.GPT2Config(n_layer=2, n_embd=64, n_head=2, vocab_size=128, n_positions=32, bos_token_id=0, eos_token_id=0)
    ids = torch.randint(0, 128, (32, 16), generator=torch.Generator().manual_seed(0))
    dataset = [{"input_ids": row, "labels": row} for row in ids]
    monitor = MemoryMonitorCallback(preflight=True, write_files=False, **CPU)
    args = transformers.TrainingArguments(
        output_dir=str(tmp_path / "out"), use_cpu=True, report_to=[], logging_steps=1, max_steps=3,
        per_device_train_batch_size=4, save_strategy="no", disable_tqdm=True, dataloader_num_workers=0,
    )
    trainer = transformers.Trainer(model=transformers.GPT2LMHeadModel(config), args=args, train_dataset=dataset, callbacks=[monitor])
    trainer.train()
    pre = monitor.report()["preflight"]
    assert pre["status"] == "predicted" and pre["batch_size"] == 4 and pre["optimizer"] == "AdamW"
    assert pre["prediction"]["top_modules"]  # model(**inputs).loss ran on the fake copy
    logged = [h for h in trainer.state.log_history if "memory/predicted_peak_forward_GiB" in h]
    assert [h["step"] for h in logged] == [1, 2, 3]
    assert set(PREDICTED) <= set(monitor.history.columns)
    assert not [f for f in monitor.findings if f.kind == "preflight"]
