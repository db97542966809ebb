"""Seed 000 ("batch size won't go up"): its training loop, written as in the write-up, under the plain
``Monitor`` and as a Lightning module; the kept ``{"loss": loss}`` is a "lingering" finding naming
``outputs['loss']``, and the write-up's fixes find nothing.

The recommender pulls embeddings from a parameter server in the data flow, sets ``requires_grad``
by hand and pushes the gradients back after the step. ``train_one_step`` returns ``{"loss": loss}``:
the loss holds the graph, the graph holds the embedding (a leaf, 256x512 float32) and its grad, and
the loop variable ``outputs`` keeps all of it until it is rebound, after the next step's work.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any, Callable, Iterator

import lightning.pytorch as L
import pytest
import torch
import torch.nn.functional as F
from lightning.pytorch.loggers import CSVLogger
from torch import nn
from torch.utils.data import DataLoader

from helpers import MIB, announced, csv_metrics, trainer_kwargs
from memcallbacks import MemoryMonitor, Monitor

BATCH, EMB_DIM, ROWS = 256, 512, 4096
EMB_BYTES = BATCH * EMB_DIM * 4  # one pulled embedding: 512 KiB
HOLDER_TAIL = "-> autograd graph -> leaf tensor 256x512 float32"

pytestmark = pytest.mark.usefixtures("one_thread", "collected_heap")


class ParameterServer:
    """The embedding table lives outside the model: ``pull_sparse`` copies rows out, ``push_sparse`` applies grads."""

    def __init__(self, rows: int = ROWS, dim: int = EMB_DIM) -> None:
        self.table = torch.randn(rows, dim, generator=torch.Generator().manual_seed(1)) * 0.01

    def pull_sparse(self, ids: torch.Tensor) -> torch.Tensor:
        return self.table[ids]

    def push_sparse(self, ids: torch.Tensor, grad: torch.Tensor, lr: float = 0.1) -> None:
        self.table.index_add_(0, ids, grad, alpha=-lr)


class Ranker(nn.Module):
    """``model(data)`` returns the loss, as in the seed."""

    def __init__(self) -> None:
        super().__init__()
        self.mlp = nn.Sequential(nn.Linear(EMB_DIM, 32), nn.ReLU(), nn.Linear(32, 1))

    def forward(self, data: dict[str, torch.Tensor]) -> torch.Tensor:
        return F.binary_cross_entropy_with_logits(self.mlp(data["emb"]).squeeze(-1), data["label"])


def pull_batch(ps: ParameterServer, g: torch.Generator) -> dict[str, torch.Tensor]:
    """The data flow's lookup: embeddings pulled, ``requires_grad`` set by hand, put into the batch."""
    ids = torch.randint(0, ROWS, (BATCH,), generator=g)
    emb = ps.pull_sparse(ids).requires_grad_()
    return {"ids": ids, "emb": emb, "label": torch.randint(0, 2, (BATCH,), generator=g).float()}


def data_flow(ps: ParameterServer, steps: int) -> Iterator[dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(0)
    for _ in range(steps):
        yield pull_batch(ps, g)


# ---------------------------------------------------------------------- the plain loop
def run_seed_loop(tmp_path: Path, *, fix: str | None = None, steps: int = 12) -> tuple[Monitor, list[tuple[dict[str, float], int]]]:
    """Seed 000's loop under ``Monitor(model, optimizer)`` + ``monitor.track``.

    ``fix``: None (the bug), ``"item"`` (``return {"loss": loss.item()}``) or ``"del"``
    (``del data, outputs`` at the end of the loop body).
    """
    ps = ParameterServer()
    model = Ranker()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    logged: list[tuple[dict[str, float], int]] = []
    monitor = Monitor(
        model, optimizer, lambda metrics, step: logged.append((metrics, step)),
        sample_every_n_steps=1, log_every_n_steps=1, output_dir=str(tmp_path / "mem"), plot=False,
    )
    dataset = monitor.track(data_flow(ps, steps))
    losses: list[float] = []

    def train_one_step(data):
        loss = model(data)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        ps.push_sparse(data["ids"], data["emb"].grad)
        return {"loss": loss}

    def train_one_step_fixed(data):
        loss = model(data)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        ps.push_sparse(data["ids"], data["emb"].grad)
        return {"loss": loss.item()}

    def process_outputs(outputs):
        losses.append(float(outputs["loss"]))

    def train_not_end():
        return len(losses) < steps

    step_fn: Callable[[Any], dict[str, Any]] = train_one_step_fixed if fix == "item" else train_one_step
    while train_not_end():
        data = next(dataset)
        outputs = step_fn(data)
        process_outputs(outputs)
        if fix == "del":
            del data, outputs
    monitor.close()
    assert len(losses) == steps and len(monitor.history) == steps
    return monitor, logged


@pytest.mark.filterwarnings("ignore:Converting a tensor with requires_grad=True to a scalar")  # the seed's float(loss)
def test_seed_loop_kept_loss_is_lingering_from_the_first_step(tmp_path, caplog):
    caplog.set_level(logging.WARNING, logger="memcallbacks")
    monitor, logged = run_seed_loop(tmp_path)

    (finding,) = monitor.findings
    assert finding.kind == "lingering" and finding.key == "lingering:batch+graph"
    assert finding.step == finding.first_step == 1  # step 0's batch and graph, alive when step 1 starts
    assert finding.message.startswith("Step 0's 1 tensor of its batch (512.0 KiB) and its autograd graph (holding 512.0 KiB more)")
    assert finding.bytes == 2 * EMB_BYTES  # the embedding and its grad
    first = finding.holders[0]
    assert first.startswith("run_seed_loop() local outputs['loss'] (test_seed000.py:")
    assert first.endswith(f"{HOLDER_TAIL} (and its .grad)"), finding.holders

    # reported once: one warning, one report entry, and the count in every logged step from step 1
    records = announced(caplog)
    assert len(records) == 1 and "[lingering] step 1:" in records[0].getMessage()
    report = json.loads((tmp_path / "mem" / "report.json").read_text())
    assert [(f["key"], f["holders"]) for f in report["findings"]] == [(finding.key, finding.holders)]
    counts = [(step, metrics["memory/findings"]) for metrics, step in logged]
    assert counts == [(0, 0.0)] + [(s, 1.0) for s in range(1, 12)]


@pytest.mark.parametrize("fix", ["item", "del"])
def test_seed_fixes_find_nothing(tmp_path, caplog, fix):
    caplog.set_level(logging.WARNING, logger="memcallbacks")
    monitor, logged = run_seed_loop(tmp_path, fix=fix)
    assert [str(f) for f in monitor.findings] == []
    assert not announced(caplog)
    assert {metrics["memory/findings"] for metrics, _ in logged} == {0.0}


def test_track_loop_variable_is_not_lingering(tmp_path):
    """``for batch in monitor.track(loader)``: the previous batch is alive inside ``next()`` only
    because the loop variable is rebound after the generator yields; it is freed before the step
    does any work, so it is not held into the next step."""
    model = nn.Linear(1024, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    monitor = Monitor(model, optimizer, sample_every_n_steps=1, write_files=False)
    loader = (torch.randn(512, 1024) for _ in range(8))  # 2 MiB batches
    for batch in monitor.track(loader):
        loss = model(batch).pow(2).mean()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    monitor.close()
    assert [str(f) for f in monitor.findings] == []


# ---------------------------------------------------------------------- the same loop as a Lightning module
class SeedModule(L.LightningModule):
    """Seed 000 in Lightning, manual optimization so that ``train_one_step`` stays as written."""

    def __init__(self, ps: ParameterServer, keep_outputs: bool = True) -> None:
        super().__init__()
        self.automatic_optimization = False
        self.ranker = Ranker()
        self.ps = ps
        self.keep_outputs = keep_outputs
        self.outputs: dict[str, Any] = {}

    def train_one_step(self, data: dict[str, torch.Tensor]) -> dict[str, Any]:
        optimizer = self.optimizers()
        loss = self.ranker(data)
        optimizer.zero_grad()
        self.manual_backward(loss)
        optimizer.step()
        self.ps.push_sparse(data["ids"], data["emb"].grad)
        return {"loss": loss}

    def training_step(self, data: dict[str, torch.Tensor], batch_idx: int) -> None:
        outputs = self.train_one_step(data)
        self.log("loss", outputs["loss"].item())
        if self.keep_outputs:
            self.outputs = outputs  # kept for process_outputs at epoch end: the graph too

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.ranker.parameters(), lr=0.1)


def pulling_loader(ps: ParameterServer, batches: int) -> DataLoader:
    """The pull happens in the data flow (collate), as in the seed: the batch carries the leaf embedding."""
    g = torch.Generator().manual_seed(0)
    return DataLoader(range(batches), batch_size=None, collate_fn=lambda _: pull_batch(ps, g))


@pytest.mark.parametrize("keep_outputs", [True, False])
def test_seed_module_in_lightning(tmp_path, caplog, keep_outputs):
    caplog.set_level(logging.WARNING, logger="memcallbacks")
    ps = ParameterServer()
    monitor = MemoryMonitor(sample_every_n_steps=1, log_every_n_steps=1, output_dir=str(tmp_path / "mem"), plot=False)
    trainer = L.Trainer(**trainer_kwargs(tmp_path, max_steps=12, callbacks=[monitor], logger=CSVLogger(str(tmp_path), name="csv", version=0)))
    trainer.fit(SeedModule(ps, keep_outputs), pulling_loader(ps, 12))
    assert len(monitor.history) == 12
    findings = monitor.findings
    records = announced(caplog)
    counts = [v for _, v in csv_metrics(tmp_path / "csv" / "version_0" / "metrics.csv")["memory/findings"]]
    if not keep_outputs:
        assert [str(f) for f in findings] == [] and records == [] and set(counts) == {0.0}
        return
    (finding,) = findings
    assert finding.kind == "lingering" and finding.key == "lingering:batch+graph"
    assert finding.step == finding.first_step == 1 and finding.bytes == 2 * EMB_BYTES + 4  # + the kept loss
    assert finding.holders[0] == f"SeedModule.outputs['loss'] {HOLDER_TAIL} (and its .grad)"
    assert len(records) == 1 and counts == [0.0] + [1.0] * 11
    assert json.loads((tmp_path / "mem" / "report.json").read_text())["findings"][0]["holders"] == finding.holders
    assert finding.bytes >= 1 * MIB
