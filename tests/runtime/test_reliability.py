"""Regression tests of issue 12: process state after failures, one consistent set of files, restored
state, use after close, refused configs and runs with little to sample (real disks, real trainers)."""

from __future__ import annotations

import gc
import json
import os
import uuid
from pathlib import Path
from typing import Any

import lightning.pytorch as L
import pandas as pd
import pytest
import torch
from torch.optim import optimizer as optim_module

from helpers import BoringModel, RandomDataModule, TemporaryNet, fill_disk, tiny_tmpfs, trainer_kwargs
from memcallbacks import MemoryMonitor, Monitor, MonitorConfig
from memcallbacks._files.fileset import check_fingerprint, fingerprint
from memcallbacks._files.report import format_report, load_output_dir
from memcallbacks.cli import main

pytestmark = pytest.mark.usefixtures("one_thread")


def plain_run(folder: Path, steps: int, **config: Any) -> Monitor:
    model = TemporaryNet()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    monitor = Monitor(model, optimizer, output_dir=str(folder), sample_every_n_steps=1, **config)
    for batch in monitor.track(torch.randn(steps, 4, 32).unbind(0)):
        model(batch).sum().backward()
        optimizer.step()
        optimizer.zero_grad()
    monitor.close()
    return monitor


def hooks_registered() -> int:
    return len(optim_module._global_optimizer_pre_hooks) + len(optim_module._global_optimizer_post_hooks)


# ---------------------------------------------------------------------- 1. process state after a failure
class Step5Fails(BoringModel):
    def training_step(self, batch: Any, batch_idx: int) -> Any:
        if batch_idx == 5:
            raise ValueError("user bug at step 5")
        return super().training_step(batch, batch_idx)


def test_failed_lightning_fit_restores_gc_and_closes_the_backend(tmp_path: Path) -> None:
    monitor = MemoryMonitor(output_dir=str(tmp_path / "mem"), leaks={"gc_every_n_steps": 2, "gc_disable_automatic": True})
    trainer = L.Trainer(**trainer_kwargs(tmp_path, max_steps=8, callbacks=[monitor]))
    with pytest.raises(ValueError, match="user bug at step 5"):
        trainer.fit(Step5Fails(), RandomDataModule(batches=8))
    assert gc.isenabled()
    assert monitor._session.engine.backend is None and not monitor._session.live
    assert json.loads((tmp_path / "mem" / "report.json").read_text())["events"][0]["kind"] == "exception"


def test_monitor_dropped_without_close_removes_its_global_hooks(tmp_path: Path) -> None:
    before = hooks_registered()

    def loop() -> None:
        model = TemporaryNet()
        optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
        monitor = Monitor(model, optimizer, output_dir=str(tmp_path), leaks={"gc_every_n_steps": 1, "gc_disable_automatic": True})
        for batch in monitor.track(torch.randn(3, 4, 32).unbind(0)):
            model(batch).sum().backward()
            optimizer.step()
            raise KeyError("loop body fails; close() is never called")

    with pytest.raises(KeyError):
        loop()
    gc.collect()
    assert hooks_registered() == before and gc.isenabled()


# ---------------------------------------------------------------------- 2. one consistent set of files
def test_full_disk_keeps_the_first_run_whole(tmp_path: Path) -> None:
    with tiny_tmpfs(tmp_path / "small") as folder:
        plain_run(folder, 4, plot=False)
        fill_disk(folder / "filler")
        # two pages free: the second run's history.csv (2 pages) fits, its report.json (2 pages) does
        # not, even after the first history's page is freed by a rename (no gc records: a full collection
        # of this test process's heap is half a second a step)
        os.truncate(folder / "filler", (folder / "filler").stat().st_size - 2 * 4096)
        second = plain_run(tmp_path / "probe", 30, plot=False)
        assert os.path.getsize(second.files["history"]) > 4096 and os.path.getsize(second.files["report"]) > 4096
        plain_run(folder, 30, plot=False)  # must not raise, must not mix
        report = json.loads((folder / "report.json").read_text())
        assert report["summary"]["steps_seen"] == 4 and len(pd.read_csv(folder / "history.csv")) == 4
        check_fingerprint(folder / "history.csv", report["integrity"]["history"], folder / "report.json")
        assert not list(folder.glob(".*.tmp"))
        # what the second run recorded before the disk filled stays in its journal: the report reads that run
        unfinished, _ = load_output_dir(folder)
        assert unfinished["unfinished"]["ranks"][0]["journal"] == "journal.jsonl"


def test_a_stale_file_from_another_run_is_never_left_beside_the_new_set(tmp_path: Path) -> None:
    plain_run(tmp_path, 3)
    assert (tmp_path / "memory.png").exists()
    plain_run(tmp_path, 3, plot=False)
    assert not (tmp_path / "memory.png").exists()  # it was the first run's
    (tmp_path / "history.csv").write_text(pd.read_csv(tmp_path / "history.csv").head(1).to_csv(index=False))
    with pytest.raises(ValueError, match="not the file report.json was written with"):
        load_output_dir(tmp_path)


def test_second_noop_fit_keeps_the_first_fits_files(tmp_path: Path) -> None:
    monitor = MemoryMonitor(output_dir=str(tmp_path / "mem"), sample_every_n_steps=1)
    trainer = L.Trainer(**trainer_kwargs(tmp_path, max_steps=3, callbacks=[monitor]))
    model, dm = BoringModel(), RandomDataModule()
    trainer.fit(model, dm)
    first = fingerprint(tmp_path / "mem" / "history.csv")
    trainer.fit(model, dm)  # max_steps already reached: nothing runs
    assert fingerprint(tmp_path / "mem" / "history.csv") == first
    assert len(pd.read_csv(tmp_path / "mem" / "history.csv")) == 3


# ---------------------------------------------------------------------- 3. restored state
def test_old_state_without_a_column_loads_and_writes_its_files(tmp_path: Path) -> None:
    state = plain_run(tmp_path / "a", 3).state_dict()
    drop = state["columns"].index("micro_batches")
    old = dict(state, columns=[c for i, c in enumerate(state["columns"]) if i != drop], rows=[[v for i, v in enumerate(r) if i != drop] for r in state["rows"]])
    del old["version"]  # older checkpoints had none
    monitor = Monitor(output_dir=str(tmp_path / "b"))
    monitor.load_state_dict(old)
    monitor.close()
    history = pd.read_csv(tmp_path / "b" / "history.csv")
    assert list(history["micro_batches"]) == [1, 1, 1] and history["step"].dtype == "int64"


@pytest.mark.parametrize("state", [[1, 2], {"rows": "x"}, {"columns": ["step"], "rows": [[1, 2]]}, {"version": "2"}, {"rows": [], "stride": None}])
def test_garbage_state_is_one_clear_error_naming_the_key(tmp_path: Path, state: Any) -> None:
    monitor = MemoryMonitor(write_files=False)
    with pytest.raises(ValueError, match=r"under 'MemoryMonitor' is not one this version can read"):
        monitor.load_state_dict(state)


# ---------------------------------------------------------------------- 4. use after close, is_oom
def test_use_after_close_warns_and_passes_the_loop_through(tmp_path: Path, caplog: Any) -> None:
    monitor = Monitor(output_dir=str(tmp_path))
    monitor.close()
    assert list(monitor.track([1, 2])) == [1, 2]
    with monitor.step():
        pass
    assert "called after close()" in caplog.text and "internal error" not in caplog.text


# ---------------------------------------------------------------------- 6. refused configuration
@pytest.mark.parametrize("bad", [dict(snapshot={"every_n_steps": 10}), dict(snapshot={"peak_bytes": 1 << 30}), dict(output_dir="")])
def test_silently_ignored_settings_are_refused(bad: dict[str, Any]) -> None:
    name = next(iter(bad))
    with pytest.raises(ValueError, match=f"MonitorConfig.{name}="):
        MonitorConfig(**bad)


def test_nonsense_device_names_the_field() -> None:
    with pytest.raises(ValueError, match=r"Monitor\(device='nonsense'\) is not a torch device"):
        Monitor(device="nonsense", write_files=False)


def test_two_live_monitors_on_one_folder_are_refused(tmp_path: Path) -> None:
    first = Monitor(output_dir=str(tmp_path))
    with pytest.raises(PermissionError, match="already used by a running Monitor"):
        Monitor(output_dir=str(tmp_path / "." ))
    first.close()
    Monitor(output_dir=str(tmp_path)).close()  # free again once the first is closed


def test_relative_output_dir_is_resolved_once(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    name = f"rel-{uuid.uuid4().hex[:6]}"
    monitor = Monitor(output_dir=name)
    (tmp_path / "elsewhere").mkdir()
    os.chdir(tmp_path / "elsewhere")
    with monitor.step():
        torch.ones(4).sum()
    monitor.close()
    assert (tmp_path / name / "report.json").exists() and not (tmp_path / "elsewhere" / name).exists()


# ---------------------------------------------------------------------- 7. runs with little to sample
def test_fast_dev_run_on_cpu_defaults_leaves_a_row(tmp_path: Path) -> None:
    monitor = MemoryMonitor()
    trainer = L.Trainer(**trainer_kwargs(tmp_path, fast_dev_run=True, max_steps=-1, callbacks=[monitor]))
    trainer.fit(BoringModel(), RandomDataModule())
    assert len(pd.read_csv(monitor.output_dir / "history.csv")) == 1


def test_validate_only_run_writes_its_files(tmp_path: Path) -> None:
    monitor = MemoryMonitor(output_dir=str(tmp_path / "mem"))
    trainer = L.Trainer(**trainer_kwargs(tmp_path, limit_val_batches=2, callbacks=[monitor]))
    trainer.validate(BoringModel(), RandomDataModule(eval_batches=2))
    assert list(pd.read_csv(tmp_path / "mem" / "eval_history.csv")["stage"]) == ["validate"]
    assert (tmp_path / "mem" / "report.json").exists()


def test_report_prints_negative_changes_with_one_sign() -> None:
    text = format_report({"summary": {"first_allocated_bytes": 300 << 10, "last_allocated_bytes": 92 << 10}})
    assert "change -208" in text and "+-" not in text


def test_cli_report_refuses_a_mixed_folder_with_one_line(tmp_path: Path, capsys: Any) -> None:
    plain_run(tmp_path / "a", 3, plot=False)
    plain_run(tmp_path / "b", 5, plot=False)
    os.replace(tmp_path / "b" / "history.csv", tmp_path / "a" / "history.csv")  # one run's rows under another's header
    assert main(["report", str(tmp_path / "a")]) == 2
    assert len(capsys.readouterr().err.strip().splitlines()) == 1
