"""MemoryMonitor with a real Lightning Trainer on CPU; assertions read what the loggers wrote to disk."""

from __future__ import annotations

import json
import logging
import os
import pickle
import signal
import subprocess
import sys
from pathlib import Path

import lightning.pytorch as L
import pandas as pd
import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.loggers import CSVLogger, MLFlowLogger, TensorBoardLogger, WandbLogger

from helpers import (
    GIB,
    MIB,
    BoringModel,
    TEARDOWN_ABORT,
    RandomDataModule,
    TwoOptimizerModel,
    csv_metrics,
    is_png,
    mlflow_metrics,
    tensorboard_scalars,
    trainer_kwargs,
    wandb_offline_history,
)
from memcallbacks._base.columns import frame_column
from memcallbacks import MemoryMonitor
from memcallbacks._base.columns import COLUMNS

# documented key -> history column it is computed from (bytes / 2**30)
STEP_KEY_COLUMNS = {
    "memory/allocated_GiB": "allocated",
    "memory/reserved_GiB": "reserved",
    "memory/peak_forward_GiB": "peak_forward",
    "memory/peak_backward_GiB": "peak_backward",
    "memory/peak_optimizer_GiB": "peak_optimizer",
    "memory/peak_step_GiB": "peak_allocated",
    "memory/peak_reserved_GiB": "peak_reserved",
    "memory/host_rss_GiB": "host_rss",
}
STEP_KEYS = [*STEP_KEY_COLUMNS, "memory/max_allocated_GiB", "memory/monitor_time_ms"]
VAL_KEY_COLUMNS = {
    "memory/val/allocated_GiB": "allocated",
    "memory/val/peak_step_GiB": "peak_allocated",
    "memory/val/peak_reserved_GiB": "peak_reserved",
}
SCRIPTS = Path(__file__).parents[1] / "scripts"


def fit(tmp_path, monitor, model=None, datamodule=None, *, ckpt_path=None, **overrides) -> L.Trainer:
    overrides.setdefault("callbacks", [monitor])
    trainer = L.Trainer(**trainer_kwargs(tmp_path, **overrides))
    trainer.fit(model if model is not None else BoringModel(), datamodule or RandomDataModule(), ckpt_path=ckpt_path)
    return trainer


def loggers(tmp_path):
    return [TensorBoardLogger(str(tmp_path), name="tb", version=0), CSVLogger(str(tmp_path), name="csv", version=0)]


def expected(row: pd.Series, key: str) -> float:
    if key == "memory/monitor_time_ms":
        return row["monitor_time_s"] * 1e3
    return row[STEP_KEY_COLUMNS[key]] / GIB


def assert_matches_history(logged: dict, history: pd.DataFrame, steps: list[int], rel: float) -> None:
    """Every documented step key was logged exactly at ``steps``, with the history row's value."""
    rows = history.set_index("step")
    for key in STEP_KEYS:
        assert [s for s, _ in logged[key]] == steps, key
        for step, value in logged[key]:
            if key == "memory/max_allocated_GiB":
                # the running lifetime peak: at least this step's peak, never more than the final one
                assert rows.loc[step, "peak_allocated"] / GIB * (1 - rel) <= value <= history["peak_allocated"].max() / GIB * (1 + rel) + 1
            else:
                assert value == pytest.approx(expected(rows.loc[step], key), rel=rel), (key, step)
    lifetime = [v for _, v in logged["memory/max_allocated_GiB"]]
    assert lifetime == sorted(lifetime)


# ---------------------------------------------------------------------- 1. keys, steps and values on disk
def test_metrics_land_in_tensorboard_and_csv_with_history_values(tmp_path):
    monitor = MemoryMonitor(log_keys="all", log_every_n_steps=2, sample_every_n_steps=1)
    trainer = fit(tmp_path, monitor, max_steps=6, logger=loggers(tmp_path), limit_val_batches=2, val_check_interval=3)

    history = monitor.history
    assert list(history["step"]) == [0, 1, 2, 3, 4, 5]
    assert (history["allocated"] > 1 * MIB).all() and (history["reserved"] > 50 * MIB).all()
    assert (history["peak_allocated"] >= history["reserved"] - 16 * MIB).all()
    assert (history["reserved"] == history["host_rss"]).all()  # CPU: reserved is the RSS

    tb = tensorboard_scalars(tmp_path / "tb")
    csv = csv_metrics(tmp_path / "csv" / "version_0" / "metrics.csv")
    assert_matches_history(tb, history, [1, 3, 5], rel=1e-6)  # TensorBoard stores float32
    assert_matches_history(csv, history, [1, 3, 5], rel=1e-12)
    assert trainer.global_step == 6

    # validation: apart from training rows, logged at the steps Lightning logs val_loss at
    evals = monitor.eval_history
    assert list(evals["stage"]) == ["validate", "validate"]
    assert list(evals["step"]) == [3, 6] and list(evals["batches"]) == [2, 2]
    for logged, rel in ((tb, 1e-6), (csv, 1e-12)):
        val_steps = [s for s, _ in logged["val_loss"]]
        assert val_steps == [2, 5]
        for key, column in VAL_KEY_COLUMNS.items():
            assert [s for s, _ in logged[key]] == val_steps
            assert [v for _, v in logged[key]] == pytest.approx(list(evals[column] / GIB), rel=rel)
    assert not any(k.startswith("memory/sanity") for k in csv)


def test_trainer_log_every_n_steps_is_followed_when_the_monitor_has_none(tmp_path):
    monitor = MemoryMonitor(log_keys="all", sample_every_n_steps=1)
    fit(tmp_path, monitor, max_steps=7, log_every_n_steps=3, logger=loggers(tmp_path))

    history = monitor.history
    assert list(history["step"]) == list(range(7))
    csv = csv_metrics(tmp_path / "csv" / "version_0" / "metrics.csv")
    train_loss_steps = [s for s, _ in csv["train_loss"]]
    assert train_loss_steps == [2, 5]  # what Lightning itself logs with log_every_n_steps=3
    assert_matches_history(csv, history, train_loss_steps, rel=1e-12)
    assert_matches_history(tensorboard_scalars(tmp_path / "tb"), history, train_loss_steps, rel=1e-6)


def test_cpu_default_samples_the_logged_steps_and_the_measuring_steps(tmp_path):
    # at defaults the first steps are sampled to measure the monitor's cost (the overhead budget then
    # picks the interval); logged steps are always sampled, and what is logged is the history's row
    monitor = MemoryMonitor(log_keys="all")
    fit(tmp_path, monitor, max_steps=6, log_every_n_steps=2, logger=loggers(tmp_path))

    history = monitor.history
    assert list(history["step"]) == [0, 1, 2, 3, 4, 5]
    assert monitor.summary()["steps_seen"] == 6 and monitor.summary()["steps_sampled"] == 6
    assert_matches_history(csv_metrics(tmp_path / "csv" / "version_0" / "metrics.csv"), history, [1, 3, 5], rel=1e-12)


# ---------------------------------------------------------------------- 2. phase attribution
def test_forward_temporary_shows_in_forward_peak_not_backward(tmp_path):
    monitor = MemoryMonitor(log_every_n_steps=1, sample_every_n_steps=1, write_files=False)
    fit(tmp_path, monitor, BoringModel(forward_temp_mib=256), max_steps=2)

    history = monitor.history
    assert len(history) == 2
    # CPU peaks are RSS high-water marks: measure them against the RSS at step start ("reserved")
    above = history[["peak_forward", "peak_backward", "peak_optimizer", "peak_allocated"]].sub(history["reserved"], axis=0)
    assert (above["peak_forward"] >= 240 * MIB).all(), above / MIB
    assert (above["peak_backward"] < 64 * MIB).all(), above / MIB
    assert (above["peak_optimizer"] < 64 * MIB).all(), above / MIB
    assert (history["peak_allocated"] == history["peak_forward"]).all()


def test_backward_temporary_shows_in_backward_peak_not_forward(tmp_path):
    monitor = MemoryMonitor(log_every_n_steps=1, sample_every_n_steps=1, write_files=False)
    fit(tmp_path, monitor, BoringModel(backward_temp_mib=256), max_steps=2)

    history = monitor.history
    assert len(history) == 2
    above = history[["peak_forward", "peak_backward", "peak_optimizer"]].sub(history["reserved"], axis=0)
    assert (above["peak_backward"] >= 240 * MIB).all(), above / MIB
    assert (above["peak_forward"] < 64 * MIB).all(), above / MIB
    assert (above["peak_optimizer"] < 64 * MIB).all(), above / MIB
    assert (history["peak_allocated"] == history["peak_backward"]).all()


# ---------------------------------------------------------------------- 3. loop shapes
def test_gradient_accumulation_gives_one_row_per_optimizer_step(tmp_path):
    monitor = MemoryMonitor(log_keys="all", log_every_n_steps=1, sample_every_n_steps=1)
    # 8 batches, accumulate 3: optimizer steps after batches 2, 5 and (end of epoch) 7
    trainer = fit(
        tmp_path, monitor, datamodule=RandomDataModule(batches=8), max_steps=-1, max_epochs=1,
        accumulate_grad_batches=3, logger=CSVLogger(str(tmp_path), name="csv", version=0),
    )
    assert trainer.global_step == 3
    history = monitor.history
    assert list(history["step"]) == [0, 1, 2]
    assert list(history["micro_batches"]) == [3, 3, 2]
    assert list(history["batch_idx"]) == [0, 3, 6]
    assert list(history["optimizer_steps"]) == [1, 1, 1]
    assert history[["peak_forward", "peak_backward", "peak_optimizer"]].notna().all().all()
    assert_matches_history(csv_metrics(tmp_path / "csv" / "version_0" / "metrics.csv"), history, [0, 1, 2], rel=1e-12)


def test_manual_optimization_with_two_optimizers(tmp_path):
    monitor = MemoryMonitor(log_keys="all", log_every_n_steps=1, sample_every_n_steps=1)
    model = TwoOptimizerModel()
    # every opt.step() advances global_step: 3 batches = 6 optimizer steps
    trainer = fit(tmp_path, monitor, model, max_steps=6, logger=CSVLogger(str(tmp_path), name="csv", version=0), log_every_n_steps=1)
    assert model.training_steps_run == 3 and trainer.global_step == 6

    history = monitor.history
    assert list(history["step"]) == [0, 2, 4]  # global steps at the start of each batch
    assert list(history["optimizer_steps"]) == [2, 2, 2]
    assert list(history["micro_batches"]) == [1, 1, 1]
    peaks = history[["peak_forward", "peak_backward", "peak_optimizer", "peak_allocated"]]
    assert peaks.notna().all().all() and (peaks > 50 * MIB).all().all()

    csv = csv_metrics(tmp_path / "csv" / "version_0" / "metrics.csv")
    # logged where Lightning logs the model's own losses (one logger step per batch)
    assert [s for s, _ in csv["memory/peak_step_GiB"]] == [s for s, _ in csv["loss_d"]] == [0, 1, 2]
    assert [v for _, v in csv["memory/peak_step_GiB"]] == pytest.approx(list(history["peak_allocated"] / GIB), rel=1e-12)


def test_manual_optimization_monitor_log_every_n_steps_means_what_the_trainers_does(tmp_path):
    """With two optimizers global_step is always even at batch start; ``(global_step + 1) % 2`` never hits."""
    monitor = MemoryMonitor(log_keys="all", log_every_n_steps=2, sample_every_n_steps=2)
    fit(tmp_path, monitor, TwoOptimizerModel(), max_steps=8, log_every_n_steps=2, logger=CSVLogger(str(tmp_path), name="csv", version=0))

    csv = csv_metrics(tmp_path / "csv" / "version_0" / "metrics.csv")
    lightning_steps = [s for s, _ in csv["loss_d"]]
    assert lightning_steps == [1, 3]
    assert len(monitor.history) == 2, "sample_every_n_steps=2 sampled no step of a 2-optimizer manual loop"
    assert [s for s, _ in csv.get("memory/peak_step_GiB", [])] == lightning_steps


def test_fast_dev_run(tmp_path):
    monitor = MemoryMonitor(log_every_n_steps=1, sample_every_n_steps=1)
    trainer = L.Trainer(**trainer_kwargs(tmp_path, fast_dev_run=True, max_steps=-1, limit_val_batches=None, callbacks=[monitor]))
    trainer.fit(BoringModel(), RandomDataModule())

    history = monitor.history
    assert list(history["step"]) == [0] and history["peak_forward"].notna().all()
    assert list(monitor.eval_history["stage"]) == ["validate"]
    assert list(monitor.eval_history["batches"]) == [1]
    assert pd.read_csv(monitor.output_dir / "history.csv")["step"].tolist() == [0]


def test_max_steps_mid_epoch(tmp_path):
    monitor = MemoryMonitor(log_every_n_steps=1, sample_every_n_steps=1)
    trainer = fit(tmp_path, monitor, datamodule=RandomDataModule(batches=8), max_steps=5)
    assert trainer.global_step == 5
    history = monitor.history
    assert list(history["step"]) == [0, 1, 2, 3, 4]
    assert list(history["batch_idx"]) == [0, 1, 2, 3, 4]
    assert list(history["epoch"]) == [0] * 5
    assert monitor.summary()["steps_seen"] == 5


def test_validation_and_sanity_check_are_kept_apart_from_training_rows(tmp_path):
    monitor = MemoryMonitor(log_every_n_steps=1, sample_every_n_steps=1)
    fit(
        tmp_path, monitor, max_steps=4, limit_val_batches=2, val_check_interval=2, num_sanity_val_steps=1,
        logger=CSVLogger(str(tmp_path), name="csv", version=0),
    )
    assert list(monitor.history["step"]) == [0, 1, 2, 3]
    evals = monitor.eval_history
    assert list(evals["stage"]) == ["sanity_check", "validate", "validate"]
    assert list(evals["step"]) == [0, 2, 4]
    assert list(evals["batches"]) == [1, 2, 2]
    assert (evals["peak_allocated"] >= evals["allocated"]).all()

    csv = csv_metrics(tmp_path / "csv" / "version_0" / "metrics.csv")
    assert [s for s, _ in csv["memory/val/peak_step_GiB"]] == [s for s, _ in csv["val_loss"]] == [1, 3]  # no sanity-check point
    assert [v for _, v in csv["memory/val/peak_step_GiB"]] == pytest.approx(list(evals["peak_allocated"][1:] / GIB), rel=1e-12)
    on_disk = pd.read_csv(monitor.output_dir / "eval_history.csv")
    assert list(on_disk["stage"]) == ["sanity_check", "validate", "validate"]


def test_validate_test_predict_on_a_fresh_trainer(tmp_path):
    monitor = MemoryMonitor(log_keys="all", log_every_n_steps=1, sample_every_n_steps=1)
    trainer = L.Trainer(**trainer_kwargs(tmp_path, limit_val_batches=None, callbacks=[monitor], logger=CSVLogger(str(tmp_path), name="csv", version=0)))
    model, dm = BoringModel(), RandomDataModule(eval_batches=3)
    trainer.validate(model, dm)
    trainer.test(model, dm)
    trainer.predict(model, dm)

    assert monitor.enabled
    assert monitor.history.empty  # no training rows
    evals = monitor.eval_history
    assert list(evals["stage"]) == ["validate", "test", "predict"]
    assert list(evals["batches"]) == [3, 3, 3]
    assert (evals["allocated"] > 1 * MIB).all() and (evals["peak_reserved"] >= evals["host_rss"] - 16 * MIB).all()

    csv = csv_metrics(tmp_path / "csv" / "version_0" / "metrics.csv")
    for stage, row in zip(("val", "test", "predict"), evals.itertuples()):
        assert [v for _, v in csv[f"memory/{stage}/allocated_GiB"]] == pytest.approx([row.allocated / GIB], rel=1e-12)
        assert [v for _, v in csv[f"memory/{stage}/peak_step_GiB"]] == pytest.approx([row.peak_allocated / GIB], rel=1e-12)


def test_validate_and_test_after_fit_on_the_same_trainer(tmp_path, caplog):
    """Trainer.fit then Trainer.validate/test on the same Trainer: the backend closed at fit teardown is reused."""
    caplog.set_level(logging.ERROR, logger="memcallbacks")
    monitor = MemoryMonitor(log_every_n_steps=1, sample_every_n_steps=1)
    model, dm = BoringModel(), RandomDataModule()
    trainer = L.Trainer(**trainer_kwargs(tmp_path, max_steps=2, limit_val_batches=None, callbacks=[monitor]))
    trainer.fit(model, dm)
    trainer.validate(model, dm)
    trainer.test(model, dm)

    assert [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR] == []
    assert monitor.enabled
    assert list(monitor.history["step"]) == [0, 1]
    assert list(monitor.eval_history["stage"])[-2:] == ["validate", "test"]


# ---------------------------------------------------------------------- 4. loggers
def test_logger_false_warns_once_and_still_writes_history(tmp_path, caplog):
    caplog.set_level(logging.WARNING, logger="memcallbacks")
    monitor = MemoryMonitor(log_every_n_steps=1, sample_every_n_steps=1)
    trainer = fit(tmp_path, monitor, max_steps=3, limit_val_batches=1, val_check_interval=1)
    assert trainer.loggers == []

    warnings = [r for r in caplog.records if r.name.startswith("memcallbacks") and r.levelno == logging.WARNING]
    assert len(warnings) == 1, [r.getMessage() for r in warnings]
    assert "logger=False" in warnings[0].getMessage()
    assert list(monitor.history["step"]) == [0, 1, 2]
    assert monitor.output_dir == tmp_path / "memcallbacks"  # trainer.log_dir is default_root_dir without a logger
    assert pd.read_csv(tmp_path / "memcallbacks" / "history.csv")["step"].tolist() == [0, 1, 2]
    assert json.loads((tmp_path / "memcallbacks" / "report.json").read_text())["summary"]["steps_recorded"] == 3
    # the adapter's own logger, so users can filter per framework
    assert warnings[0].name == "memcallbacks.lightning"


LOGGER_FALSE_SCRIPT = """
import lightning.pytorch as L
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset
from memcallbacks import MemoryMonitor


class Net(L.LightningModule):
    def __init__(self):
        super().__init__()
        self.layer = nn.Linear(8, 1)

    def training_step(self, batch, batch_idx):
        return self.layer(batch[0]).pow(2).mean()

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.01)


data = DataLoader(TensorDataset(torch.randn(64, 8)), batch_size=8)
trainer = L.Trainer(max_steps=4, logger=False, accelerator="cpu", enable_progress_bar=False, enable_model_summary=False,
                    enable_checkpointing=False, callbacks=[MemoryMonitor()])
trainer.fit(Net(), data)
"""


def test_logger_false_run_twice_from_its_folder(tmp_path):
    """A user check: with ``logger=False`` the files went to ``./memcallbacks`` (``default_root_dir`` is the working
    directory), and the script's next run from the same folder failed, ``ImportError: cannot import name
    'MemoryMonitor' from 'memcallbacks' (unknown location)``: the folder, first on ``sys.path``, is a namespace package
    that hides an editable install's package. There the default folder is ``memcallbacks_output``."""
    (tmp_path / "train.py").write_text(LOGGER_FALSE_SCRIPT)
    env = dict(os.environ, PYTHONWARNINGS="ignore")
    env.pop("PYTHONPATH", None)  # the package as the user's install finds it, not through the test's path
    for run in (1, 2):
        done = subprocess.run([sys.executable, "train.py"], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
        assert done.returncode == 0, (run, done.stderr[-3000:])
        assert "no problem found in 4 steps" in done.stdout + done.stderr, done.stdout[-2000:]
    assert not (tmp_path / "memcallbacks").exists()
    assert (tmp_path / "memcallbacks_output" / "report.json").is_file(), sorted(p.name for p in tmp_path.iterdir())


def test_wandb_offline_run_receives_the_keys(tmp_path):
    import wandb

    monitor = MemoryMonitor(log_keys="all", log_every_n_steps=1, sample_every_n_steps=1, write_files=False)
    logger = WandbLogger(save_dir=str(tmp_path), project="memcallbacks-tests", offline=True)
    try:
        fit(tmp_path, monitor, max_steps=3, logger=logger)
    finally:
        wandb.finish()

    logged = wandb_offline_history(tmp_path)
    rows = [r for r in logged if "memory/allocated_GiB" in r]
    history = monitor.history.set_index("step")
    assert [r["trainer/global_step"] for r in rows] == [0, 1, 2], logged
    for r in rows:
        row = history.loc[r["trainer/global_step"]]
        assert set(STEP_KEYS) <= set(r)
        for key in STEP_KEY_COLUMNS:
            assert r[key] == pytest.approx(expected(row, key), rel=1e-12), key


def test_mlflow_file_store_receives_the_keys(tmp_path):
    uri = f"file:{tmp_path / 'mlruns'}"
    monitor = MemoryMonitor(log_keys="all", log_every_n_steps=1, sample_every_n_steps=1, write_files=False)
    logger = MLFlowLogger(experiment_name="memcallbacks-tests", tracking_uri=uri)
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)  # MLflow takes the keys as they are: no renaming warning
        fit(tmp_path, monitor, max_steps=3, logger=logger)

    metrics = mlflow_metrics(uri, logger.run_id)
    history = monitor.history.set_index("step")
    for key in STEP_KEY_COLUMNS:  # the keys arrive under their own names
        assert [s for s, _ in metrics[key]] == [0, 1, 2], key
        for step, value in metrics[key]:
            assert value == pytest.approx(expected(history.loc[step], key), rel=1e-12), key
    assert "memory/monitor_time_ms" in metrics and "memory/max_allocated_GiB" in metrics


# ---------------------------------------------------------------------- 5. output files
def test_output_files_in_default_dir(tmp_path):
    monitor = MemoryMonitor(log_every_n_steps=1, sample_every_n_steps=1)
    trainer = fit(tmp_path, monitor, max_steps=4, logger=loggers(tmp_path), limit_val_batches=1, val_check_interval=2)

    out = Path(trainer.log_dir) / "memcallbacks"
    assert out == tmp_path / "tb" / "version_0" / "memcallbacks" == monitor.output_dir
    assert sorted(p.name for p in out.iterdir()) == ["eval_history.csv", "history.csv", "memory.png", "report.json"]

    history = monitor.history
    on_disk = pd.read_csv(out / "history.csv").rename(columns=frame_column)
    pd.testing.assert_frame_equal(on_disk, history, check_exact=False, rtol=1e-12)
    assert list(on_disk.columns) == [c for c in COLUMNS if c not in ("alloc_retries", "ooms", "inactive_split")]
    assert list(pd.read_csv(out / "eval_history.csv")["stage"]) == list(monitor.eval_history["stage"]) == ["validate", "validate"]

    report = json.loads((out / "report.json").read_text())
    assert report["version"] == 2
    assert report["config"] == dict(monitor.config.to_dict(), output_dir=str(out))  # the folder used, resolved
    assert report["findings"] == []
    assert report["events"] == []
    summary = report["summary"]
    assert summary["steps_recorded"] == len(history) == 4
    for phase in ("forward", "backward", "optimizer"):
        assert summary[f"peak_{phase}_bytes"] == int(history[f"peak_{phase}"].max())
    assert summary["peak_other_bytes"] is None  # no accumulation, nothing between steps
    assert summary["max_allocated_bytes"] == monitor.max_allocated >= history["peak_allocated"].max()
    assert summary["device"]["kind"] == "cpu" and summary["device"]["peak_source"] == "rss_high_water_mark"
    assert summary["eval"]["validate"]["runs"] == 2
    assert Path(report["files"]["history"]) == out / "history.csv"
    assert is_png(out / "memory.png")


# ---------------------------------------------------------------------- 6. DDP on two CPU processes
def run_ddp_script(tmp_path, strategy: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    env.pop("MASTER_PORT", None)
    return subprocess.run(
        [sys.executable, str(SCRIPTS / "ddp_fit.py"), str(tmp_path), "--strategy", strategy, "--steps", "3", "--rank-temp-mib", "192"],
        cwd=str(tmp_path), env=env, capture_output=True, text=True, timeout=300,
    )


@pytest.mark.slow
@pytest.mark.parametrize("strategy", ["ddp", "ddp_spawn"])
def test_ddp_two_processes_log_the_max_over_ranks(tmp_path, strategy):
    proc = run_ddp_script(tmp_path, strategy)
    if proc.returncode != 0:
        # gloo's abort at a rank's exit, after its work (a std::thread destroyed while joinable; as in
        # tests/host/test_host_ranks.py), and only that: no traceback came before the abort, and what follows it
        # is the launcher's report of the signal (ddp_spawn: seen once beside a busy loop, rank 1) or nothing, the
        # first process itself ending on SIGABRT (ddp: seen once in a quiet fresh-clone run). The files below are the test
        before, _, after = proc.stderr.partition(TEARDOWN_ABORT)
        launcher = "terminated with signal SIGABRT" in after
        # ddp: both processes run the script on past fit() and print their line, the one that aborted too. Rank 0
        # ends on that signal, or on the SIGKILL Lightning's observer sends it when rank 1 is the one
        itself = (proc.returncode in (-signal.SIGABRT, -signal.SIGKILL) and not after.strip()
                  and "rank 0: 3 rows" in proc.stdout and "rank 1: 3 rows" in proc.stdout)
        assert (launcher or itself) and "Traceback" not in before, (proc.returncode, proc.stdout[-3000:] + proc.stderr[-6000:])

    mem = tmp_path / "mem"
    names = sorted(p.name for p in mem.iterdir())
    assert {"history.rank0.csv", "history.rank1.csv", "report.rank0.json", "report.rank1.json", "report.json"} <= set(names), names
    assert "history.csv" not in names
    h = [pd.read_csv(mem / f"history.rank{r}.csv").rename(columns=frame_column) for r in (0, 1)]
    for frame in h:
        assert list(frame["step"]) == [0, 1, 2]
    # rank 1 carries a 192 MiB forward temporary; rank 0 does not
    assert ((h[1]["peak_forward"] - h[1]["reserved"]) >= 176 * MIB).all()
    assert ((h[0]["peak_forward"] - h[0]["reserved"]) < 64 * MIB).all()

    combined = json.loads((mem / "report.json").read_text())
    assert [s["rank"] for s in combined["ranks"]] == [0, 1]
    assert all(s["world_size"] == 2 for s in combined["ranks"])
    for r in (0, 1):
        assert combined["ranks"][r]["peak_forward_bytes"] == int(h[r]["peak_forward"].max())
        assert json.loads((mem / f"report.rank{r}.json").read_text())["summary"]["rank"] == r

    # rank zero logged the max over ranks, and which rank held it
    csv = csv_metrics(tmp_path / "logs" / "csv" / "version_0" / "metrics.csv")
    tb = tensorboard_scalars(tmp_path / "logs" / "tb")
    for logged, rel in ((csv, 1e-12), (tb, 1e-6)):
        for key, column in STEP_KEY_COLUMNS.items():
            assert [s for s, _ in logged[key]] == [0, 1, 2], key
            want = [max(h[0][column][i], h[1][column][i]) / GIB for i in range(3)]
            assert [v for _, v in logged[key]] == pytest.approx(want, rel=rel), key
        assert [v for _, v in logged["memory/peak_step_rank"]] == [1.0, 1.0, 1.0]
        want_rank = [0.0 if h[0]["allocated"][i] >= h[1]["allocated"][i] else 1.0 for i in range(3)]
        assert [v for _, v in logged["memory/allocated_rank"]] == want_rank


def test_monitor_pickles_for_ddp_spawn():
    """ddp_spawn (and any spawn-based launcher) pickles the Trainer's callbacks into the children."""
    monitor = MemoryMonitor(log_every_n_steps=3)
    clone = pickle.loads(pickle.dumps(monitor))
    assert clone.config == monitor.config


# ---------------------------------------------------------------------- 7. checkpoint resume
def test_resume_from_checkpoint_continues_the_history(tmp_path):
    first = MemoryMonitor(log_every_n_steps=1, sample_every_n_steps=1, write_files=False)
    ckpt = ModelCheckpoint(dirpath=str(tmp_path / "ckpt"), save_last=True)
    fit(tmp_path, first, datamodule=RandomDataModule(batches=4), max_steps=4, callbacks=[first, ckpt], enable_checkpointing=True)
    assert list(first.history["step"]) == [0, 1, 2, 3]

    second = MemoryMonitor(log_every_n_steps=1, sample_every_n_steps=1, output_dir=str(tmp_path / "resumed"))
    trainer = fit(
        tmp_path, second, datamodule=RandomDataModule(batches=4), max_steps=8,
        callbacks=[second, ModelCheckpoint(dirpath=str(tmp_path / "ckpt2"))], enable_checkpointing=True,
        ckpt_path=str(tmp_path / "ckpt" / "last.ckpt"),
    )
    assert trainer.global_step == 8
    history = second.history
    assert list(history["step"]) == list(range(8))
    pd.testing.assert_frame_equal(history.iloc[:4], first.history)  # restored rows, bit for bit
    assert history["peak_forward"].notna().all()
    assert pd.read_csv(tmp_path / "resumed" / "history.csv")["step"].tolist() == list(range(8))


def _logged_with_prefix(logged: dict, prefix: str) -> dict:
    """``logged`` with ``prefix/...`` keys renamed to the documented ``memory/...`` ones."""
    return {"memory/" + k[len(prefix) + 1:]: v for k, v in logged.items() if k.startswith(prefix + "/")}


def _ckpt_states(path: Path) -> dict:
    return torch.load(str(path), map_location="cpu", weights_only=False)["callbacks"]


def test_two_monitors_in_one_trainer_log_and_checkpoint_apart(tmp_path):
    """Each monitor has its own prefix (its keys, its state_key) and output_dir; a resumed fit gives each its own history back."""
    every = MemoryMonitor(log_keys="all", log_every_n_steps=1, sample_every_n_steps=1, output_dir=str(tmp_path / "every"))
    second = MemoryMonitor(log_keys="all", log_every_n_steps=2, sample_every_n_steps=2, output_dir=str(tmp_path / "second"), advanced={"prefix": "mem2"})
    assert every.state_key == "MemoryMonitor"  # the key of earlier releases: their checkpoints still load
    assert second.state_key == "MemoryMonitor{'prefix': 'mem2'}"
    ckpt = ModelCheckpoint(dirpath=str(tmp_path / "ckpt"), save_last=True)
    csv_logger = CSVLogger(str(tmp_path), name="csv", version=0)
    fit(tmp_path, every, max_steps=4, callbacks=[every, second, ckpt], logger=csv_logger, enable_checkpointing=True)

    assert list(every.history["step"]) == [0, 1, 2, 3]
    assert list(second.history["step"]) == [1, 3]
    csv = csv_metrics(tmp_path / "csv" / "version_0" / "metrics.csv")
    assert_matches_history(_logged_with_prefix(csv, "memory"), every.history, [0, 1, 2, 3], rel=1e-12)
    assert_matches_history(_logged_with_prefix(csv, "mem2"), second.history, [1, 3], rel=1e-12)
    for name, monitor in (("every", every), ("second", second)):
        assert monitor.output_dir == tmp_path / name
        assert pd.read_csv(tmp_path / name / "history.csv")["step"].tolist() == list(monitor.history["step"])
    states = _ckpt_states(tmp_path / "ckpt" / "last.ckpt")
    assert {"MemoryMonitor", "MemoryMonitor{'prefix': 'mem2'}"} <= set(states)

    # resume with the monitors in the other order, into new folders: each state finds its monitor
    every2 = MemoryMonitor(log_keys="all", log_every_n_steps=1, sample_every_n_steps=1, output_dir=str(tmp_path / "every2"))
    second2 = MemoryMonitor(log_keys="all", log_every_n_steps=2, sample_every_n_steps=2, output_dir=str(tmp_path / "second2"), advanced={"prefix": "mem2"})
    trainer = fit(
        tmp_path, every2, max_steps=6, callbacks=[second2, every2, ModelCheckpoint(dirpath=str(tmp_path / "ckpt"), save_last=True)],
        enable_checkpointing=True, ckpt_path=str(tmp_path / "ckpt" / "last.ckpt"),
    )
    assert trainer.global_step == 6
    assert list(every2.history["step"]) == [0, 1, 2, 3, 4, 5]
    assert list(second2.history["step"]) == [1, 3, 5]
    pd.testing.assert_frame_equal(every2.history.iloc[:4], every.history)
    pd.testing.assert_frame_equal(second2.history.iloc[:2], second.history)


def test_resume_restores_a_state_saved_under_the_old_key(tmp_path):
    """Earlier releases keyed every monitor by the class name: a monitor with another prefix still gets its history back."""
    first = MemoryMonitor(log_every_n_steps=1, sample_every_n_steps=1, write_files=False, advanced={"prefix": "gpu_mem"})
    ckpt = ModelCheckpoint(dirpath=str(tmp_path / "ckpt"), save_last=True)
    fit(tmp_path, first, max_steps=3, callbacks=[first, ckpt], enable_checkpointing=True)
    checkpoint = torch.load(str(tmp_path / "ckpt" / "last.ckpt"), map_location="cpu", weights_only=False)
    checkpoint["callbacks"]["MemoryMonitor"] = checkpoint["callbacks"].pop("MemoryMonitor{'prefix': 'gpu_mem'}")
    old = tmp_path / "old_key.ckpt"
    torch.save(checkpoint, str(old))

    second = MemoryMonitor(log_every_n_steps=1, sample_every_n_steps=1, write_files=False, advanced={"prefix": "gpu_mem"})
    with pytest.warns(UserWarning, match="callbacks used to create the checkpoint"):  # Lightning's own note on the unknown key
        fit(tmp_path, second, max_steps=5, ckpt_path=str(old))
    assert list(second.history["step"]) == [0, 1, 2, 3, 4]
    pd.testing.assert_frame_equal(second.history.iloc[:3], first.history)


@pytest.mark.parametrize("output_dir", [None, "shared"])
def test_two_monitors_writing_to_one_folder_are_refused_before_training(tmp_path, output_dir):
    folder = None if output_dir is None else str(tmp_path / output_dir)
    first = MemoryMonitor(output_dir=folder)
    second = MemoryMonitor(output_dir=folder, advanced={"prefix": "mem2"})
    model = BoringModel()
    with pytest.raises(ValueError) as info:
        fit(tmp_path, first, model, callbacks=[first, second], logger=loggers(tmp_path))
    message = str(info.value)
    assert f"output_dir={folder!r}" in message and "prefix='mem2'" in message
    assert "its own output_dir=" in message and "write_files=False" in message
    want = tmp_path / "tb" / "version_0" / "memcallbacks" if folder is None else tmp_path / output_dir
    assert os.path.realpath(want) in message
    assert model.training_steps_run == 0 and first.history.empty and second.history.empty

    # one of them without files is fine
    quiet = MemoryMonitor(output_dir=folder, write_files=False, log_every_n_steps=1, sample_every_n_steps=1, advanced={"prefix": "mem2"})
    fit(tmp_path / "ok", first, max_steps=2, callbacks=[first, quiet])
    assert len(quiet.history) == 2 and len(first.history) > 0


def test_two_monitors_with_one_prefix_are_refused_by_either_trainer(tmp_path):
    import pytorch_lightning as pl

    for trainer_cls in (L.Trainer, pl.Trainer):
        same = [MemoryMonitor(output_dir=str(tmp_path / "a")), MemoryMonitor(output_dir=str(tmp_path / "b"))]
        with pytest.raises(RuntimeError, match="state_key"):
            trainer_cls(**trainer_kwargs(tmp_path, callbacks=same))
        apart = [MemoryMonitor(output_dir=str(tmp_path / "a")), MemoryMonitor(output_dir=str(tmp_path / "b"), advanced={"prefix": "b"})]
        trainer = trainer_cls(**trainer_kwargs(tmp_path, callbacks=apart))
        assert [cb.state_key for cb in trainer.callbacks if isinstance(cb, MemoryMonitor)] == ["MemoryMonitor", "MemoryMonitor{'prefix': 'b'}"]


# ---------------------------------------------------------------------- 8. LightningCLI
def _cli_config(tmp_path, init_args: str) -> Path:
    path = tmp_path / "config.yaml"
    path.write_text(
        f"""
trainer:
  accelerator: cpu
  devices: 1
  max_steps: 3
  logger: false
  enable_progress_bar: false
  enable_model_summary: false
  enable_checkpointing: false
  default_root_dir: {tmp_path}
  callbacks:
    - class_path: memcallbacks.MemoryMonitor
      init_args:
{init_args}
"""
    )
    return path


def _run_cli(tmp_path, config: Path, capsys, monkeypatch):
    from lightning.pytorch.cli import LightningCLI

    monkeypatch.setattr(sys, "argv", ["train.py"])  # pytest's own arguments are not the CLI's
    try:
        return LightningCLI(BoringModel, RandomDataModule, args=["fit", "--config", str(config)], save_config_callback=None)
    except SystemExit:
        pytest.fail("LightningCLI rejected memcallbacks.MemoryMonitor's init_args:\n" + capsys.readouterr().err[-2500:])


def test_lightning_cli_passes_monitor_fields_as_init_args(tmp_path, capsys, monkeypatch):
    out = tmp_path / "mem"
    config = _cli_config(tmp_path, f"        log_every_n_steps: 1\n        sample_every_n_steps: 1\n        output_dir: {out}")
    cli = _run_cli(tmp_path, config, capsys, monkeypatch)

    (monitor,) = [c for c in cli.trainer.callbacks if isinstance(c, MemoryMonitor)]
    assert monitor.config.log_every_n_steps == 1 and monitor.config.sample_every_n_steps == 1
    assert monitor.config.output_dir == str(out)
    assert list(monitor.history["step"]) == [0, 1, 2]
    assert pd.read_csv(out / "history.csv")["step"].tolist() == [0, 1, 2]


def test_lightning_cli_accepts_a_config_mapping(tmp_path, capsys, monkeypatch):
    out = tmp_path / "mem"
    config = _cli_config(tmp_path, f"        config:\n          sample_every_n_steps: 1\n          output_dir: {out}")
    cli = _run_cli(tmp_path, config, capsys, monkeypatch)

    (monitor,) = [c for c in cli.trainer.callbacks if isinstance(c, MemoryMonitor)]
    assert monitor.config.sample_every_n_steps == 1 and monitor.config.output_dir == str(out)
    assert pd.read_csv(out / "history.csv")["step"].tolist() == [0, 1, 2]


def test_lightning_cli_sets_grouped_settings_and_sizes_from_yaml(tmp_path, capsys, monkeypatch):
    out = tmp_path / "mem"
    init_args = "\n".join("        " + line for line in f"""sample_every_n_steps: 1
preflight: true
capacity_bytes: 80 GiB
log_keys: [default, peak_step_GiB]
output_dir: {out}
leaks:
  growth_warmup_steps: 7
  lingering_min_bytes: 2 MiB
advanced:
  prefix: gpu_mem
  cpu_mmap_threshold: 256 KiB""".splitlines())
    cli = _run_cli(tmp_path, _cli_config(tmp_path, init_args), capsys, monkeypatch)

    (monitor,) = [c for c in cli.trainer.callbacks if isinstance(c, MemoryMonitor)]
    config = monitor.config
    assert config.capacity_bytes == 80 * 2**30 and config.preflight and config.log_keys == ("default", "peak_step_GiB")
    assert (config.leaks.growth_warmup_steps, config.leaks.lingering_min_bytes) == (7, 2 << 20)
    assert config.leaks.gc_every_n_steps is None and config.snapshot == type(config.snapshot)()  # the rest at defaults
    assert (config.advanced.prefix, config.advanced.cpu_mmap_threshold) == ("gpu_mem", 256 << 10)
    assert pd.read_csv(out / "history.csv")["step"].tolist() == [0, 1, 2]


def test_lightning_cli_refuses_a_snapshot_setting_without_auto_snapshot(tmp_path, capsys, monkeypatch):
    from lightning.pytorch.cli import LightningCLI

    config = _cli_config(tmp_path, "        snapshot:\n          max_snapshots: 2")
    monkeypatch.setattr(sys, "argv", ["train.py"])
    with pytest.raises(ValueError, match=r"auto_snapshot=True"):
        LightningCLI(BoringModel, RandomDataModule, args=["fit", "--config", str(config)], save_config_callback=None)


# ---------------------------------------------------------------------- 9. what a logger receives at defaults
def memory_keys_per_step(logged: dict) -> dict[int, set[str]]:
    """``{step: {memory key, ...}}`` from what a logger wrote (``tensorboard_scalars``/``csv_metrics``)."""
    steps: dict[int, set[str]] = {}
    for key, points in logged.items():
        if key.startswith("memory/"):
            for step, _ in points:
                steps.setdefault(step, set()).add(key)
    return steps


def test_at_defaults_a_logger_receives_at_most_eight_memory_keys_per_step(tmp_path):
    """On CPU the default list has each phase's rise above the step's start in place of its peak: figures
    that differ per phase (a 48 MiB forward temporary, a 40 MiB backward one), each the history's peak
    less the resident memory at the step's start."""
    monitor = MemoryMonitor()
    fit(tmp_path, monitor, BoringModel(forward_temp_mib=48, backward_temp_mib=40), max_steps=12, log_every_n_steps=2,
        logger=loggers(tmp_path), limit_val_batches=2, val_check_interval=4)

    rises = [f"memory/peak_{phase}_above_start_GiB" for phase in ("forward", "backward", "optimizer")]
    default = {*rises, "memory/reserved_GiB", "memory/allocated_GiB", "memory/findings", "memory/host_rss_GiB", "memory/val/peak_step_GiB"}
    history = monitor.history.set_index("step")
    for logged in (tensorboard_scalars(tmp_path / "tb"), csv_metrics(tmp_path / "csv" / "version_0" / "metrics.csv")):
        per_step = memory_keys_per_step(logged)
        assert len(per_step) >= 6, per_step  # six logged training steps, and the validation runs
        assert max(len(keys) for keys in per_step.values()) <= 8, per_step
        assert set().union(*per_step.values()) <= default, set().union(*per_step.values()) - default
        assert set(rises) <= per_step[1] and "memory/val/peak_step_GiB" in set().union(*per_step.values())
        forward, backward, optimizer = (dict(logged[key]) for key in rises)
        for step, value in forward.items():
            row = history.loc[step]
            assert value == pytest.approx(max(row["peak_forward"] - row["reserved"], 0) / GIB, rel=1e-6, abs=1e-9)
            assert forward[step] * GIB >= 0.85 * 48 * MIB and 0.85 * 40 * MIB <= backward[step] * GIB < forward[step] * GIB
            assert optimizer[step] < backward[step]
    # the files keep everything: the history has every column whatever is logged
    assert {"peak_allocated", "peak_reserved", "monitor_time_s"} <= set(monitor.history.columns)


class DottedCSVLogger(CSVLogger):
    """A logger that groups its keys with '.', as a logger may (Lightning's ``Logger.group_separator``)."""

    @property
    def group_separator(self) -> str:
        return "."


def test_keys_are_joined_with_the_loggers_group_separator(tmp_path):
    monitor = MemoryMonitor(log_every_n_steps=1, sample_every_n_steps=1, write_files=False)
    logger = DottedCSVLogger(str(tmp_path), name="dotted", version=0)
    fit(tmp_path, monitor, max_steps=3, logger=[logger, CSVLogger(str(tmp_path), name="csv", version=0)],
        limit_val_batches=1, val_check_interval=2)

    dotted = csv_metrics(tmp_path / "dotted" / "version_0" / "metrics.csv")
    plain = csv_metrics(tmp_path / "csv" / "version_0" / "metrics.csv")
    assert "memory.peak_forward_above_start_GiB" in dotted and "memory.val.peak_step_GiB" in dotted
    assert not any(key.startswith("memory/") for key in dotted)
    assert {k.replace("/", ".") for k in plain if k.startswith("memory/")} == {k for k in dotted if k.startswith("memory.")}


# ---------------------------------------------------------------------- 10. failures
def device_backend(monitor: MemoryMonitor):
    """The monitor's device backend object (the one seam fault injection goes through)."""
    backend = monitor._session.engine.backend
    assert backend is not None, "the backend is chosen in setup()"
    return backend


class InjectBackendFault(L.Callback):
    """Fault injection: from ``at_step`` on, the monitor's device backend raises on every interval read."""

    def __init__(self, monitor: MemoryMonitor, at_step: int) -> None:
        self.monitor, self.at_step = monitor, at_step

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if trainer.global_step == self.at_step:
            def broken_interval():
                raise RuntimeError("injected backend fault")

            device_backend(self.monitor).interval = broken_interval


def test_internal_error_is_logged_once_and_training_goes_on(tmp_path, caplog):
    caplog.set_level(logging.WARNING, logger="memcallbacks")
    monitor = MemoryMonitor(log_keys="all", log_every_n_steps=1, sample_every_n_steps=1, write_files=False)
    model = BoringModel()
    trainer = fit(tmp_path, monitor, model, max_steps=5, callbacks=[InjectBackendFault(monitor, 2), monitor], log_every_n_steps=1, logger=CSVLogger(str(tmp_path), name="csv", version=0))

    assert trainer.global_step == 5 and model.training_steps_run == 5
    assert monitor.enabled is False
    errors = [r for r in caplog.records if r.levelno >= logging.ERROR]
    assert len(errors) == 1, [r.getMessage() for r in errors]
    assert errors[0].name.startswith("memcallbacks") and "internal error" in errors[0].getMessage()
    assert errors[0].exc_info is not None and str(errors[0].exc_info[1]) == "injected backend fault"
    steps = list(monitor.history["step"])
    assert steps[:2] == [0, 1] and max(steps) <= 2
    # nothing logged after the monitor turned itself off
    csv = csv_metrics(tmp_path / "csv" / "version_0" / "metrics.csv")
    assert [s for s, _ in csv["memory/peak_step_GiB"]] == [0, 1]
    assert [s for s, _ in csv["train_loss"]] == [0, 1, 2, 3, 4]


def test_internal_error_still_leaves_a_report(tmp_path):
    """report.json's summary has ``disabled_after_error``; it must reach disk after an internal error."""
    monitor = MemoryMonitor(log_every_n_steps=1, sample_every_n_steps=1, output_dir=str(tmp_path / "mem"))
    fit(tmp_path, monitor, max_steps=4, callbacks=[InjectBackendFault(monitor, 2), monitor])

    assert monitor.enabled is False
    report_path = tmp_path / "mem" / "report.json"
    assert report_path.exists(), f"no report.json; output_dir holds {sorted(p.name for p in (tmp_path / 'mem').iterdir())}"
    report = json.loads(report_path.read_text())
    assert report["summary"]["disabled_after_error"] is True
    assert pd.read_csv(tmp_path / "mem" / "history.csv")["step"].tolist()[:2] == [0, 1]


def test_strict_reraises_internal_errors(tmp_path):
    monitor = MemoryMonitor(log_every_n_steps=1, sample_every_n_steps=1, write_files=False, advanced={"strict": True})
    model = BoringModel()
    with pytest.raises(RuntimeError, match="injected backend fault"):
        fit(tmp_path, monitor, model, max_steps=5, callbacks=[InjectBackendFault(monitor, 2), monitor])
    assert model.training_steps_run == 3  # step 2's forward ran; its backward boundary raised


def test_oom_is_recorded_in_the_report_before_it_propagates(tmp_path, caplog):
    caplog.set_level(logging.ERROR, logger="memcallbacks")
    monitor = MemoryMonitor(log_every_n_steps=1, sample_every_n_steps=1)
    model = BoringModel(oom_at_step=3)
    with pytest.raises(torch.OutOfMemoryError, match="CUDA out of memory"):
        fit(tmp_path, monitor, model, max_steps=6)
    assert model.training_steps_run == 4

    report = json.loads((tmp_path / "memcallbacks" / "report.json").read_text())
    (event,) = report["events"]
    assert event["kind"] == "oom" and event["step"] == 3 and event["rank"] == 0
    assert "CUDA out of memory" in event["error"]
    assert event["max_allocated_bytes"] == monitor.max_allocated > 50 * MIB
    steps = pd.read_csv(tmp_path / "memcallbacks" / "history.csv")["step"].tolist()
    assert steps[:3] == [0, 1, 2] and max(steps) <= 3
    assert any("out of memory at step 3" in r.getMessage() for r in caplog.records)


# ---------------------------------------------------------------------- 11. both package names
def test_works_with_pytorch_lightning_package(tmp_path):
    import pytorch_lightning as pl
    from pytorch_lightning.loggers import CSVLogger as PLCSVLogger

    class PLModel(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.layer = torch.nn.Linear(32, 1)

        def training_step(self, batch, batch_idx):
            loss = self.layer(batch).pow(2).mean()
            self.log("train_loss", loss)
            return loss

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)

    monitor = MemoryMonitor(log_keys="all", log_every_n_steps=1, sample_every_n_steps=1)
    assert isinstance(monitor, pl.Callback) and isinstance(monitor, L.Callback)
    trainer = pl.Trainer(**trainer_kwargs(tmp_path, max_steps=3, callbacks=[monitor], logger=PLCSVLogger(str(tmp_path), name="csv", version=0)))
    trainer.fit(PLModel(), RandomDataModule().train_dataloader())

    history = monitor.history
    assert list(history["step"]) == [0, 1, 2]
    csv = csv_metrics(tmp_path / "csv" / "version_0" / "metrics.csv")
    for key in STEP_KEY_COLUMNS:
        assert [s for s, _ in csv[key]] == [0, 1, 2]
        assert [v for _, v in csv[key]] == pytest.approx([expected(r, key) for _, r in history.iterrows()], rel=1e-12)
    assert (monitor.output_dir / "report.json").exists()


# ---------------------------------------------------------------------- 12. contract
def test_contract_construct_refit_and_stop_twice(tmp_path):
    monitor = MemoryMonitor(log_every_n_steps=1, sample_every_n_steps=1)
    assert list(monitor.history.columns)[:5] == ["step", "epoch", "batch_idx", "micro_batches", "optimizer_steps"]
    assert monitor.history.empty and monitor.report()["summary"]["steps_recorded"] == 0

    model = BoringModel()
    fit(tmp_path / "a", monitor, model, max_steps=3)
    assert list(monitor.history["step"]) == [0, 1, 2]
    first_max = monitor.max_allocated

    second = fit(tmp_path / "b", monitor, BoringModel(), max_steps=2)  # same instance, new Trainer
    assert monitor.enabled
    assert list(monitor.history["step"]) == [0, 1]  # history restarts per fit
    assert pd.read_csv(tmp_path / "b" / "memcallbacks" / "history.csv")["step"].tolist() == [0, 1]
    assert pd.read_csv(tmp_path / "a" / "memcallbacks" / "history.csv")["step"].tolist() == [0, 1, 2]
    assert monitor.max_allocated > 0 and first_max > 0

    for _ in range(2):  # the Trainer already called teardown once; more calls are harmless
        monitor.teardown(second, model, "fit")
    assert monitor._session.engine.backend is None  # OS handles released at teardown, a later fit picks a new backend
    assert monitor.events == []
    assert list(monitor.history["step"]) == [0, 1]

    clone = MemoryMonitor()  # what a checkpoint carries
    clone.load_state_dict(monitor.state_dict())
    pd.testing.assert_frame_equal(clone.history, monitor.history)
    assert clone.summary()["max_allocated_bytes"] == monitor.max_allocated


# ---------------------------------------------------------------------- CUDA (run on a GPU machine)
@pytest.mark.cuda
def test_cuda_forward_temporary_in_forward_peak(tmp_path):
    monitor = MemoryMonitor(log_every_n_steps=1, sample_every_n_steps=1, write_files=False)
    trainer = L.Trainer(**trainer_kwargs(tmp_path, accelerator="gpu", max_steps=2, callbacks=[monitor], logger=CSVLogger(str(tmp_path), name="csv", version=0)))
    trainer.fit(BoringModel(forward_temp_mib=256, backward_temp_mib=128), RandomDataModule())

    history = monitor.history
    assert len(history) == 2
    fwd = history["peak_forward"] - history["allocated"]
    bwd = history["peak_backward"] - history["allocated"]
    assert (fwd >= 256 * MIB).all() and (fwd < 300 * MIB).all()
    assert (bwd >= 128 * MIB).all() and (bwd < 160 * MIB).all()
    assert {"alloc_retries", "ooms", "inactive_split"} <= set(history.columns)
    csv = csv_metrics(tmp_path / "csv" / "version_0" / "metrics.csv")
    assert {"memory/alloc_retries", "memory/ooms", "memory/inactive_split_GiB"} <= set(csv)
    assert [v for _, v in csv["memory/peak_forward_GiB"]] == pytest.approx(list(history["peak_forward"] / GIB), rel=1e-12)
