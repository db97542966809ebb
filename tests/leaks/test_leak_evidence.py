"""Issue 11 items 5-8 at DEFAULT settings: kept outputs, graph chains, cycles freed by Python's own
collections, and holders named from stable owners.

Every run is a real, short training run on CPU with the monitor built with no settings beyond where
its files go (or none at all): Lightning with and without a logger, the plain ``Monitor`` with and
without ``log_fn``, ``AccelerateMemoryMonitor`` and the Transformers ``MemoryMonitorCallback``.
"""

from __future__ import annotations

import gc
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

DIM, BATCH, VOCAB = 64, 128, 4096  # logits of one step: 128 x 4096 float32 = 2 MiB


def lm_head() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(DIM, 128), nn.ReLU(), nn.Linear(128, VOCAB))


def batches(steps: int) -> list[torch.Tensor]:
    return list(torch.randn(steps, BATCH, DIM))


def by_key(findings: list[Any], prefix: str) -> Any:
    hits = [f for f in findings if f.key.startswith(prefix)]
    assert hits, [str(f) for f in findings]
    return hits[0]


# ---------------------------------------------------------------------- Lightning
class LM(L.LightningModule):
    def __init__(self, bug: str = "") -> None:
        super().__init__()
        self.net = lm_head()
        self.bug = bug
        self.total: Any = 0.0

    def training_step(self, batch: torch.Tensor, batch_idx: int) -> Any:
        logits = self.net(batch)
        loss = logits.pow(2).mean()
        if self.bug == "kept logits":
            self._train_logits = logits  # BUG: the step's logits live until the next step overwrites them
        if self.bug == "running total":
            self.total = self.total + loss  # BUG: no .detach(): every step's graph stays linked
        if self.bug == "cycle":
            Trace(torch.ones(256 * 1024))  # BUG: 1 MiB per step in a reference cycle
        return {"loss": loss, "logits": logits.detach()}

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.parameters(), lr=0.01)


class Trace:
    """A per-step record that points back at itself, with a few Python objects (so gen-0 collections come)."""

    def __init__(self, t: torch.Tensor) -> None:
        self.t = t
        self.me = self
        self.parts = [[] for _ in range(60)]


class ImageLogger(L.Callback):
    """Keeps 1 MiB per step to log 'later': the holder is the callback, reached from the Trainer."""

    def __init__(self) -> None:
        self.pending: list[torch.Tensor] = []

    def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        self.pending.append(torch.ones(256 * 1024))


def lightning_fit(tmp_path: Path, model: L.LightningModule, steps: int, logger: bool, callbacks: list[Any] = ()) -> tuple[MemoryMonitor, L.Trainer]:
    mon = MemoryMonitor(output_dir=str(tmp_path / "mem"), plot=False)
    log = CSVLogger(str(tmp_path), name="csv", version=0) if logger else False
    trainer = L.Trainer(**trainer_kwargs(tmp_path, max_steps=steps, logger=log, log_every_n_steps=4, callbacks=[mon, *callbacks]))
    trainer.fit(model, DataLoader(torch.randn(steps * BATCH, DIM), batch_size=BATCH))
    return mon, trainer


def test_lightning_without_logger_names_kept_logits(tmp_path):
    mon, _ = lightning_fit(tmp_path, LM("kept logits"), 8, logger=False)
    finding = by_key(mon.findings, "lingering:")
    assert "outputs" in finding.key and finding.step <= 3, str(finding)
    assert finding.details["output_bytes"] >= 2 * MIB
    assert "model output 128x4096 float32" in finding.message and "del logits" in finding.message
    assert any(h.startswith("LM._train_logits") for h in finding.holders), finding.holders


def test_lightning_with_logger_reports_a_running_total_within_a_few_steps(tmp_path):
    mon, _ = lightning_fit(tmp_path, LM("running total"), 12, logger=True)
    finding = by_key(mon.findings, "growth")
    assert finding.first_step <= 4 and finding.details["evidence"] == "graph_chain", str(finding)
    assert finding.details["graph_steps_alive"][:3] == [0, 1, 2]
    assert any(h.startswith("LM.total -> autograd graphs of steps 0..") for h in finding.holders), finding.holders
    logged = csv_metrics(tmp_path / "csv" / "version_0" / "metrics.csv")
    assert logged["memory/findings"][-1][1] >= 1


def test_lightning_without_logger_reports_cycles_freed_by_automatic_collections(tmp_path):
    mon, _ = lightning_fit(tmp_path, LM("cycle"), 40, logger=False)
    # one cause, one finding (issue 44): the cycle, whether the collection watch saw it first (a large automatic
    # collection, then the garbage inspected) or the growth it causes (what grew sits in cyclic garbage)
    (finding,) = [f for f in mon.findings if f.is_problem]
    assert finding.kind == "cycle" and finding.key.startswith("cycle:Trace"), str(finding)
    assert any("Trace" in h and "holds Trace.t (Tensor 262144 float32)" in h for h in finding.holders), finding.holders
    assert finding.bytes >= MIB and finding.details["cycles"] == [["Trace"]]
    assert finding.details.get("evidence") == "automatic_gc" or "growth" in {e["kind"] for e in finding.evidence}, finding
    assert all(cb.__self__.__class__.__name__ != "CollectionWatch" for cb in gc.callbacks if hasattr(cb, "__self__"))


def test_lightning_callback_holder_is_named_from_the_trainer(tmp_path):
    mon = MemoryMonitor(output_dir=str(tmp_path / "mem"), plot=False)
    trainer = L.Trainer(**trainer_kwargs(tmp_path, max_steps=40, callbacks=[mon, ImageLogger()]))
    trainer.fit(LM(), DataLoader(torch.randn(40 * BATCH, DIM), batch_size=BATCH))
    growth = by_key(mon.findings, "growth")
    assert growth.holders and growth.holders[0].startswith("Trainer.callbacks[1] (ImageLogger).pending grew by"), growth.holders


# ---------------------------------------------------------------------- plain loops
@pytest.mark.parametrize("with_log_fn", [False, True])
def test_plain_monitor_names_a_kept_logits_variable(tmp_path, with_log_fn):
    model = lm_head()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    logged: list[Any] = []
    monitor = Monitor(model, optimizer, (lambda m, s: logged.append(s)) if with_log_fn else None, output_dir=str(tmp_path / "mem"), plot=False)
    for x in monitor.track(batches(6)):
        logits = model(x)  # BUG: bound until the next step's forward rebinds it
        loss = logits.pow(2).mean()
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    monitor.close()
    del logits
    finding = by_key(monitor.findings, "lingering:outputs")
    assert finding.step == 2 and finding.bytes >= 2 * MIB, str(finding)  # step 1 cannot yet tell a kept list from a variable
    assert any(" local logits (test_leak_evidence.py:" in h for h in finding.holders), finding.holders


def test_plain_monitor_is_quiet_when_the_logits_are_deleted(tmp_path):
    model = lm_head()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    monitor = Monitor(model, optimizer, write_files=False)
    total = 0.0
    for x in monitor.track(batches(8)):
        logits = model(x)
        loss = logits.pow(2).mean()
        del logits
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        total += loss.item()  # the fixed running total
    monitor.close()
    assert [str(f) for f in monitor.findings] == []


def test_plain_monitor_with_log_fn_reports_a_running_total(tmp_path):
    model = lm_head()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    monitor = Monitor(model, optimizer, lambda m, s: None, write_files=False)
    total: Any = 0.0
    for x in monitor.track(batches(8)):
        loss = model(x).pow(2).mean()
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        total = total + loss  # BUG: keeps every step's graph
    monitor.close()
    finding = by_key(monitor.findings, "growth")
    assert finding.first_step <= 4 and finding.details["evidence"] == "graph_chain", str(finding)
    assert any(" local total (test_leak_evidence.py:" in h for h in finding.holders), finding.holders


class Record:
    def __init__(self, loss: torch.Tensor) -> None:
        self.loss = loss
        self.me = self


def step_with_a_record(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    emb = torch.randn(256, 1024).requires_grad_()  # a leaf input: its graph keeps it and its grad (2 MiB)
    loss = model(x).pow(2).mean() + emb.pow(2).mean()
    Record(loss)  # BUG: the record keeps the loss in a reference cycle after this function returns
    return loss


def test_plain_monitor_says_when_a_lingering_graph_sits_in_cyclic_garbage(tmp_path):
    model = lm_head()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    monitor = Monitor(model, optimizer, write_files=False)
    gc.disable()  # the collector may not run between two steps; here it certainly does not
    try:
        for x in monitor.track(batches(4)):
            step_with_a_record(model, x).backward()
            optimizer.step()
            optimizer.zero_grad()
    finally:
        gc.enable()
        monitor.close()
    # a lingering step that only cyclic garbage holds is that cycle's (issue 44: its kind is the cause's)
    (finding,) = monitor.findings
    assert finding.kind == "cycle" and finding.key == "cycle:Record -> Record", str(finding)
    assert finding.details.get("in_cyclic_garbage") and finding.details["from_step"] == 0, str(finding)
    assert "cyclic garbage" in finding.message and "a loss returned with its graph" not in finding.message
    assert finding.holders and finding.holders[0].startswith("cyclic garbage: Record -> Record holds Record.loss"), finding.holders
    assert [e["kind"] for e in finding.evidence] == ["lingering"] and finding.first_step == 1  # what the lingering check saw


# ---------------------------------------------------------------------- Accelerate
@pytest.mark.usefixtures("fresh_accelerate_state")
def test_accelerate_marks_model_outputs_and_an_evaluation_summed_without_no_grad(tmp_path):
    accelerate = pytest.importorskip("accelerate")
    from memcallbacks.accelerate import AccelerateMemoryMonitor

    accelerator = accelerate.Accelerator(cpu=True, project_dir=str(tmp_path))
    model = lm_head()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    model, optimizer = accelerator.prepare(model, optimizer)
    monitor = AccelerateMemoryMonitor(accelerator, plot=False)
    held_out = torch.randn(8, DIM)
    val_total: Any = 0.0
    for x in monitor.track(batches(8)):
        outputs = model(x)  # BUG: bound until the next step's forward
        accelerator.backward(outputs.pow(2).mean())
        optimizer.step()
        optimizer.zero_grad()
        val_total = val_total + model(held_out).pow(2).mean()  # BUG: evaluated without torch.no_grad()
    monitor.close()
    accelerator.end_training()
    del outputs
    kept = by_key(monitor.findings, "lingering:outputs")
    assert any(" local outputs (test_leak_evidence.py:" in h for h in kept.holders), kept.holders
    chain = by_key(monitor.findings, "growth")
    assert chain.first_step <= 4 and chain.details["evidence"] == "graph_chain", str(chain)
    assert any(" local val_total (test_leak_evidence.py:" in h for h in chain.holders), chain.holders


# ---------------------------------------------------------------------- Transformers
@pytest.mark.usefixtures("fresh_accelerate_state")
def test_transformers_trainer_subclass_names_its_kept_logits_and_running_total(tmp_path):
    transformers = pytest.importorskip("transformers")
    from memcallbacks.transformers import MemoryMonitorCallback

    class MyTrainer(transformers.Trainer):
        total: Any = 0.0

        def compute_loss(self, model: Any, inputs: Any, return_outputs: bool = False, **kwargs: Any) -> Any:
            outputs = model(**inputs)
            self._train_logits = outputs.logits  # BUG: kept until the next step overwrites it
            self.total = self.total + outputs.loss  # BUG: no .detach()
            return (outputs.loss, outputs) if return_outputs else outputs.loss

    torch.manual_seed(0)
    config = transformers.GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=2048, n_positions=32, use_cache=False)
    ids = torch.randint(0, 2048, (64, 32), generator=torch.Generator().manual_seed(0))
    data = [{"input_ids": row, "labels": row} for row in ids]  # logits: 8 x 32 x 2048 float32 = 2 MiB
    args = transformers.TrainingArguments(
        output_dir=str(tmp_path / "out"), use_cpu=True, report_to=[], max_steps=8, per_device_train_batch_size=8,
        save_strategy="no", disable_tqdm=True, dataloader_num_workers=0, logging_steps=50,
    )
    monitor = MemoryMonitorCallback()
    trainer = MyTrainer(model=transformers.GPT2LMHeadModel(config), args=args, train_dataset=data, callbacks=[monitor])
    trainer.train()
    kept = by_key(monitor.findings, "lingering:outputs")
    assert any(h.startswith("MyTrainer._train_logits") for h in kept.holders), kept.holders
    chain = by_key(monitor.findings, "growth")
    assert chain.first_step <= 4 and chain.details["evidence"] == "graph_chain", str(chain)
    assert any(h.startswith("MyTrainer.total -> autograd graphs") for h in chain.holders), chain.holders
