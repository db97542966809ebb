"""auto_snapshot on CPU with a real Trainer: every trigger that can fire on CPU, the bounds, a failing disk, OOM."""

from __future__ import annotations

import json
import logging
import os
import pickle
import subprocess
import sys
from pathlib import Path

import lightning.pytorch as L
import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

from helpers import csv_metrics, flat_settings
from memcallbacks import MemoryMonitor

SCRIPTS = Path(__file__).parents[1] / "scripts"


class Model(L.LightningModule):
    """A tiny regression; optionally keeps a growing cache (leak) or raises OOM at a step."""

    def __init__(self, leak_from: int | None = None, oom_at: int | None = None) -> None:
        super().__init__()
        self.layer = torch.nn.Linear(32, 32)
        self.leak_from, self.oom_at = leak_from, oom_at
        self.cache: list[torch.Tensor] = []

    def training_step(self, batch, batch_idx):
        if self.oom_at is not None and self.global_step == self.oom_at:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
        if self.leak_from is not None and self.global_step >= self.leak_from:
            self.cache.append(torch.ones(128 * 1024))  # 512 KiB per step
        return self.layer(batch[0]).pow(2).mean()

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.01)


def fit(tmp_path: Path, monitor: MemoryMonitor, model: L.LightningModule, steps: int) -> L.Trainer:
    trainer = L.Trainer(
        accelerator="cpu", max_steps=steps, callbacks=[monitor], logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, default_root_dir=tmp_path,
    )
    data = DataLoader(TensorDataset(torch.randn(64 * 16, 32)), batch_size=16)
    trainer.fit(model, data)
    return trainer


def snapshot_files(folder: Path) -> list[str]:
    return sorted(p.name for p in (folder / "snapshots").glob("*.pickle"))


def test_threshold_trigger_captures_the_next_steps_on_cpu(tmp_path):
    out = tmp_path / "mem"
    monitor = MemoryMonitor(auto_snapshot=True, sample_every_n_steps=1, output_dir=str(out), snapshot={"peak_bytes": 1, "steps": 2})
    fit(tmp_path, monitor, Model(), steps=8)
    records = monitor.report()["snapshots"]
    assert len(records) == 1 and "threshold" in records[0]["trigger"] and records[0]["step"] == 1
    files = records[0]["files"]
    assert {"snapshot", "census", "html", "png"} <= set(files)
    snap = pickle.loads(Path(files["snapshot"]).read_bytes())
    assert snap["device_traces"] and any(e["action"] == "alloc" for e in snap["device_traces"][0])
    html = Path(files["html"]).read_text()
    assert "http://" not in html and "https://" not in html and "<script src" not in html
    report = json.loads((out / "report.json").read_text())
    assert report["snapshots"][0]["files"]["snapshot"] == files["snapshot"]


def test_a_finding_triggers_a_snapshot_and_periodic_ones_respect_max_snapshots(tmp_path, caplog):
    caplog.set_level(logging.WARNING, logger="memcallbacks")
    out = tmp_path / "mem"
    monitor = MemoryMonitor(auto_snapshot=True, sample_every_n_steps=1, output_dir=str(out), snapshot={"capacity_fraction": None, "every_n_steps": 5, "steps": 1, "max_snapshots": 3}, leaks={"growth_warmup_steps": 2})
    fit(tmp_path, monitor, Model(leak_from=3), steps=60)
    records = monitor.report()["snapshots"]
    assert len(records) == 3 == len(snapshot_files(out))  # bounded
    assert records[0]["trigger"] == "every 5 steps"
    assert any(f.kind == "growth" for f in monitor.findings)
    budget = [r for r in caplog.records if "snapshot budget used up" in r.getMessage()]
    assert len(budget) == 1  # warned once, training went on
    assert monitor.summary()["steps_seen"] == 60


def test_byte_budget_stops_snapshots(tmp_path, caplog):
    caplog.set_level(logging.INFO, logger="memcallbacks")
    out = tmp_path / "mem"
    monitor = MemoryMonitor(auto_snapshot=True, sample_every_n_steps=1, output_dir=str(out), snapshot={"capacity_fraction": None, "every_n_steps": 2, "steps": 1, "max_snapshots": 50, "max_bytes": 1 << 20})
    fit(tmp_path, monitor, Model(), steps=40)
    records = monitor.report()["snapshots"]
    total = sum(r["bytes"] for r in records)
    assert 1 <= len(records) < 20
    # the last file may cross the budget only by its own size; nothing is written after it
    assert total - records[-1]["bytes"] < 1 << 20
    # once a snapshot no longer fits, it says so once and captures nothing more (no failed captures, no traceback)
    said = [r for r in caplog.records if "snapshot budget used up" in r.getMessage()]
    assert len(said) == 1, [r.getMessage() for r in caplog.records]
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR], [r.getMessage() for r in caplog.records]


def test_unwritable_snapshot_folder_is_reported_before_training(tmp_path):
    out = tmp_path / "mem"
    out.mkdir()
    (out / "snapshots").write_text("a file where the snapshot folder should be")
    monitor = MemoryMonitor(auto_snapshot=True, output_dir=str(out), snapshot={"peak_bytes": 1})
    model = Model()
    with pytest.raises(PermissionError, match="auto_snapshot: output_dir .*snapshots.* is not writable"):
        fit(tmp_path, monitor, model, steps=5)
    assert model.global_step == 0


class BreakSnapshotFolder(L.Callback):
    """The disk fails mid-run: the snapshot folder turns into a file before the first dump."""

    def __init__(self, folder: Path) -> None:
        self.folder = folder

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if trainer.global_step == 0 and self.folder.is_dir():
            for child in self.folder.iterdir():
                child.unlink()
            self.folder.rmdir()
            self.folder.write_text("not a folder any more")


def test_failing_disk_mid_run_warns_with_traceback_and_training_goes_on(tmp_path, caplog):
    caplog.set_level(logging.WARNING, logger="memcallbacks")
    out = tmp_path / "mem"
    monitor = MemoryMonitor(auto_snapshot=True, sample_every_n_steps=1, output_dir=str(out), snapshot={"peak_bytes": 1, "steps": 1})
    trainer = L.Trainer(
        accelerator="cpu", max_steps=6, callbacks=[BreakSnapshotFolder(out / "snapshots"), monitor], logger=False,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False, default_root_dir=tmp_path,
    )
    trainer.fit(Model(), DataLoader(TensorDataset(torch.randn(64 * 16, 32)), batch_size=16))
    assert trainer.global_step == 6 and monitor.enabled
    assert monitor.report()["snapshots"] == []
    assert any(r.exc_info for r in caplog.records if "snapshot" in r.getMessage()), "logged with its traceback"
    assert (out / "report.json").is_file()


def test_oom_writes_a_census_and_the_error_propagates(tmp_path):
    out = tmp_path / "mem"
    monitor = MemoryMonitor(auto_snapshot=True, sample_every_n_steps=1, output_dir=str(out), snapshot={"capacity_fraction": None})
    with pytest.raises(torch.OutOfMemoryError):
        fit(tmp_path, monitor, Model(oom_at=3), steps=10)
    report = json.loads((out / "report.json").read_text())
    assert report["events"][0]["kind"] == "oom" and report["events"][0]["step"] == 3
    (record,) = report["snapshots"]
    assert record["trigger"] == "oom"
    census = json.loads(Path(record["files"]["census"]).read_text())
    assert census["records"] or census.get("bytes_by_category")


@pytest.mark.slow
def test_ddp_only_the_rank_that_crossed_the_threshold_snapshots(tmp_path):
    """Two CPU processes (gloo): rank 1 carries a 512 MiB forward temporary (peak ~0.9 GiB), rank 0
    does not (~0.4 GiB). Snapshots are rank-local: rank 1 captures, rank 0 writes nothing and
    trains every step; the logged count is the max over ranks."""
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    env.pop("MASTER_PORT", None)
    proc = subprocess.run(
        [sys.executable, str(SCRIPTS / "ddp_fit.py"), str(tmp_path), "--steps", "4", "--rank-temp-mib", "512", "--snapshot-peak-mib", "650"],
        cwd=str(tmp_path), env=env, capture_output=True, text=True, timeout=300,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    mem = tmp_path / "mem"
    reports = [json.loads((mem / f"report.rank{r}.json").read_text()) for r in (0, 1)]
    for r in (0, 1):
        assert reports[r]["summary"]["steps_seen"] == 4, r
    assert reports[0]["snapshots"] == []
    (record,) = reports[1]["snapshots"]
    assert "threshold" in record["trigger"] and record["step"] == 1  # crossed at step 0, captured step 1
    assert {"snapshot", "census"} <= set(record["files"])
    names = sorted(p.name for p in (mem / "snapshots").iterdir())
    assert names and all(".rank1." in n for n in names), names
    logged = csv_metrics(tmp_path / "logs" / "csv" / "version_0" / "metrics.csv")
    assert [v for _, v in logged["memory/snapshots"]][-1] == 1.0


def test_auto_snapshot_needs_files():
    with pytest.raises(ValueError, match="MonitorConfig.auto_snapshot=True"):
        MemoryMonitor(auto_snapshot=True, write_files=False)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_threshold_with_armed_history(tmp_path):
    out = tmp_path / "mem"
    monitor = MemoryMonitor(auto_snapshot=True, output_dir=str(out), snapshot={"peak_bytes": 64 << 20, "steps": 2})

    class Big(Model):
        def training_step(self, batch, batch_idx):
            tmp = torch.empty(int(12 * self.global_step) << 20, dtype=torch.uint8, device=self.device)  # grows 12 MiB/step
            del tmp
            return super().training_step(batch, batch_idx)

    trainer = L.Trainer(accelerator="gpu", devices=1, max_steps=12, callbacks=[monitor], logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, default_root_dir=tmp_path)
    trainer.fit(Big(), DataLoader(TensorDataset(torch.randn(64 * 16, 32)), batch_size=16))
    records = monitor.report()["snapshots"]
    assert records and "threshold" in records[0]["trigger"]
    snap = pickle.loads(Path(records[0]["files"]["snapshot"]).read_bytes())
    assert snap["device_traces"][0], "armed recording captured allocator history before the dump"
    assert os.path.getsize(records[0]["files"]["snapshot"]) > 0


def test_oom_observer_dump_is_accounted_and_rendered_when_the_error_arrives(tmp_path, caplog):
    """The CUDA OOM observer writes its pickle inside the failing allocation (nothing else may run
    there); the dump is accounted against the budget and rendered when the error reaches the hooks.
    The observer's own call is replayed with a real snapshot file (the CUDA test does it for real)."""
    from memcallbacks._runtime.auto_snapshot import OBSERVER_TRIGGER, AutoSnapshot

    caplog.set_level(logging.WARNING, logger="memcallbacks")
    snap = AutoSnapshot(flat_settings(auto_snapshot=True), device_kind="cuda", capacity=80 << 30, output_dir=tmp_path, rank=1, world_size=2)
    snap.folder.mkdir(parents=True)
    snap.step = 7
    path = snap._oom_path()  # what the observer asks for, inside the failing allocation
    assert path.name == "memory_snapshot_oom_step7.rank1.pickle"
    path.write_bytes((Path(__file__).parents[1] / "data" / "cuda_like_snapshot.pickle").read_bytes())
    snap.on_exception(torch.OutOfMemoryError("CUDA out of memory."), 7)
    (record,) = snap.records  # no second dump from the hook
    assert record["trigger"] == OBSERVER_TRIGGER and record["step"] == 7
    assert record["bytes"] >= path.stat().st_size and {"snapshot", "html", "png"} <= set(record["files"])
    assert Path(record["files"]["html"]).is_file() and snap._bytes == record["bytes"]
    snap.stop()  # finishing twice does not count it twice
    assert snap._bytes == record["bytes"]


def test_oom_observer_dump_that_failed_is_reported_not_counted(tmp_path):
    from memcallbacks._runtime.auto_snapshot import AutoSnapshot

    snap = AutoSnapshot(flat_settings(auto_snapshot=True), device_kind="cuda", capacity=80 << 30, output_dir=tmp_path)
    snap._oom_path()  # the observer's dump then failed: no file
    snap.stop()  # an OOM the training code caught: the run ends normally
    (record,) = snap.records
    assert record["bytes"] == 0 and record["files"] == {} and "failed" in record["error"]
