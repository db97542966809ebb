"""Issue 13: the memory dashboard, findings, report and snapshots in the trackers a run already has.

Real fits write real TensorBoard event files, a real W&B offline run and a real MLflow file store;
every assertion reads those files back (event protobufs, the ``.wandb`` transaction log and its
media folder, ``MlflowClient`` over the file store).
"""

from __future__ import annotations

import base64
import glob
import hashlib
import json
import warnings
import logging
import os
import re
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import lightning.pytorch as L
import pytest
import torch
from lightning.pytorch.loggers import CSVLogger, MLFlowLogger, TensorBoardLogger, WandbLogger

from helpers import BoringModel, RandomDataModule, _wandb_records, trainer_kwargs
from memcallbacks import MemoryMonitor

pytestmark = pytest.mark.usefixtures("one_thread", "collected_heap")

SCRIPTS = Path(__file__).parents[1] / "scripts"
RISES = ["memory/peak_forward_above_start_GiB", "memory/peak_backward_above_start_GiB", "memory/peak_optimizer_above_start_GiB"]
SNAPSHOTS = dict(auto_snapshot=True, snapshot={"every_n_steps": 2, "steps": 1})


class KeepsLoss(BoringModel):
    """Keeps the last loss (and through its graph a 2 MiB leaf input and its grad) on the module: a lingering finding."""

    def training_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
        wide = batch.repeat(1, 64).detach().requires_grad_()
        loss = self(wide[:, : batch.shape[1]]).pow(2).mean()
        self.last_out = {"loss": loss}
        return loss


def fit(tmp_path: Path, monitor: MemoryMonitor, logger: Any, model: L.LightningModule | None = None, **overrides: Any) -> L.Trainer:
    overrides.setdefault("callbacks", [monitor])
    trainer = L.Trainer(**trainer_kwargs(tmp_path, logger=logger, **overrides))
    trainer.fit(model or KeepsLoss(), RandomDataModule(batch_size=256))
    return trainer


# ---------------------------------------------------------------------- readers
def tensorboard_events(log_dir: Path) -> dict[str, Any]:
    """Scalars, text entries and the custom-scalars layouts of every event file under ``log_dir``."""
    from tensorboard.backend.event_processing.event_file_loader import EventFileLoader
    from tensorboard.plugins.custom_scalar import layout_pb2

    out: dict[str, Any] = {"scalars": {}, "text": [], "layouts": []}
    files = sorted(glob.glob(str(log_dir / "**" / "events.out.tfevents.*"), recursive=True))
    assert files, f"no event file under {log_dir}"
    for path in files:
        for event in EventFileLoader(path).Load():
            for value in event.summary.value:
                plugin = value.metadata.plugin_data.plugin_name
                if plugin == "custom_scalars":
                    out["layouts"].append(layout_pb2.Layout.FromString(value.tensor.string_val[0]))
                elif plugin == "text":
                    # torch's add_text writes the tag as "<tag>/text_summary"
                    out["text"].append((value.tag.removesuffix("/text_summary"), event.step, value.tensor.string_val[0].decode()))
                elif plugin == "scalars" or value.HasField("simple_value"):
                    out["scalars"].setdefault(value.tag, []).append(event.step)
    return out


def charts(layout: Any) -> dict[str, list[str]]:
    return {chart.title: list(chart.multiline.tag) for category in layout.category for chart in category.chart}


def wandb_run(wandb_dir: Path, timeout_s: float = 60.0) -> tuple[Path, list[Any]]:
    """The offline run's folder and its records, once the run file is closed."""
    from wandb.proto import wandb_internal_pb2 as pb

    deadline = time.monotonic() + timeout_s
    while True:
        files = glob.glob(str(wandb_dir / "**" / "offline-run-*" / "*.wandb"), recursive=True)
        assert len(files) <= 1, files
        records = []
        for payload in _wandb_records(files[0], complete_only=True) if files else []:
            record = pb.Record()
            record.ParseFromString(payload)
            records.append(record)
        if any(r.WhichOneof("record_type") == "exit" for r in records):
            return Path(files[0]).parent, records
        assert time.monotonic() < deadline, f"the offline run under {wandb_dir} was not closed"
        time.sleep(0.2)


def wandb_items(records: list[Any], kind: str) -> dict[str, Any]:
    """Every key of every ``history`` or ``summary`` record, last value wins (media: their JSON dicts)."""
    out: dict[str, Any] = {}
    for record in records:
        if record.WhichOneof("record_type") != kind:
            continue
        items = record.history.item if kind == "history" else record.summary.update
        for item in items:
            out[item.key or "/".join(item.nested_key)] = json.loads(item.value_json)
    return out


def media(items: dict[str, Any], key: str) -> dict[str, Any]:
    """A media value as the run file stores it: flattened into ``key/_type``, ``key/path``, ..."""
    found = {k[len(key) + 1 :]: v for k, v in items.items() if k.startswith(key + "/")}
    assert found, f"no {key} in {sorted(items)}"
    return found


def md5_b64(path: Path) -> str:
    return base64.b64encode(hashlib.md5(path.read_bytes()).digest()).decode()


# ---------------------------------------------------------------------- TensorBoard
def test_tensorboard_gets_one_layout_and_each_finding_once(tmp_path: Path) -> None:
    monitor = MemoryMonitor(log_every_n_steps=1, sample_every_n_steps=1, **SNAPSHOTS)
    fit(tmp_path, monitor, TensorBoardLogger(str(tmp_path), name="tb", version=0))
    assert [f.kind for f in monitor.findings] == ["lingering"]

    events = tensorboard_events(tmp_path / "tb")
    assert len(events["layouts"]) == 1, "the layout is written once per run"
    layout = charts(events["layouts"][0])
    # CPU at defaults: each phase's rise above the step's start is logged, not its peak (one resident high-water mark)
    assert list(layout) == ["per phase, above the step's start", "reserved vs allocated", "leaks", "host"]
    assert events["layouts"][0].category[0].title == "memcallbacks"
    # each chart line is a regex matching exactly one tag this run logged
    logged = set(events["scalars"])
    for title, regexes in layout.items():
        for regex in regexes:
            matched = [tag for tag in logged if re.search(regex, tag)]
            if title == "leaks" and "gc_freed" in regex:
                assert matched == []  # gc_every_n_steps is off: no gc keys to plot
            elif title == "host" and "workers" in regex:
                assert matched == []  # no DataLoader workers: NaN, which the TensorBoard logger leaves out
            else:
                assert len(matched) == 1, (title, regex, matched)
    assert [t for r in layout["per phase, above the step's start"] for t in logged if re.search(r, t)] == RISES
    assert "capacity" not in " ".join(str(lines) for lines in layout.values())  # CPU: host RAM is no capacity line
    # the charts draw what log_keys logs: at defaults allocated and reserved, the findings, host RSS
    assert [len(layout[t]) for t in ("reserved vs allocated", "leaks", "host")] == [2, 1, 1]

    findings = [(tag, step, text) for tag, step, text in events["text"] if tag.startswith("memory/findings/")]
    assert len(findings) == 1, findings  # once, though the loss lingered at every step
    tag, step, text = findings[0]
    assert tag == "memory/findings/lingering" and step == monitor.findings[0].first_step
    assert "[lingering]" in text and "KeepsLoss.last_out['loss']" in text
    report = [text for tag, _, text in events["text"] if tag == "memory/report"]
    assert len(report) == 1 and "lingering" in report[0]


def test_the_layout_follows_log_keys_and_the_loggers_separator() -> None:
    from memcallbacks.trackers import Dashboard
    from memcallbacks.trackers.tensorboard import layout

    every = layout(Dashboard("memory"))["memcallbacks"]  # log_keys="all"
    titles = ("memory per phase", "per phase, above the step's start", "reserved vs allocated", "leaks", "host")
    assert [len(every[t][1]) for t in titles] == [4, 4, 4, 3, 4]
    short = layout(Dashboard("memory", keys=frozenset({"memory/findings", "memory/peak_forward_GiB"})), separator=".")["memcallbacks"]
    assert list(short) == ["memory per phase", "leaks"]  # a chart with no logged key is left out
    assert short["leaks"] == ["Multiline", [r"^memory\.findings$"]]


def test_transformers_tensorboard_layout_matches_train_prefixed_keys(tmp_path: Path, fresh_accelerate_state: Any) -> None:
    from test_transformers import TokenData, tiny_gpt2, training_args  # the Trainer set-up of the adapter's tests
    from transformers import Trainer

    from memcallbacks.transformers import MemoryMonitorCallback

    monitor = MemoryMonitorCallback(sample_every_n_steps=1)
    args = training_args(tmp_path, max_steps=4, gradient_accumulation_steps=1)
    trainer = Trainer(model=tiny_gpt2(), args=args, train_dataset=TokenData(), callbacks=[monitor])
    trainer.train()

    events = tensorboard_events(tmp_path / "out")
    assert len(events["layouts"]) == 1
    layout = charts(events["layouts"][0])
    logged = set(events["scalars"])
    phase_tags = [t for r in layout["per phase, above the step's start"] for t in logged if re.search(r, t)]
    assert phase_tags == [f"train/{key}" for key in RISES]  # the Trainer's TensorBoardCallback prefixes train/
    assert [t for t, _, _ in events["text"] if t == "memory/report"] == ["memory/report"]


# ---------------------------------------------------------------------- Weights & Biases
def test_wandb_offline_run_gets_axes_media_summary_and_artifact(tmp_path: Path) -> None:
    import wandb

    monitor = MemoryMonitor(log_every_n_steps=1, sample_every_n_steps=1, **SNAPSHOTS)
    try:
        fit(tmp_path, monitor, WandbLogger(save_dir=str(tmp_path), project="memcallbacks-tests", offline=True))
    finally:
        wandb.finish()
    run_dir, records = wandb_run(tmp_path)

    metrics = [r.metric for r in records if r.WhichOneof("record_type") == "metric"]
    memory = [m for m in metrics if m.glob_name == "memory/*"]
    assert len(memory) == 1 and memory[0].step_metric == "trainer/global_step" and memory[0].summary.max

    history = wandb_items(records, "history")
    plot = media(history, "memory/plot")
    assert plot["_type"] == "image-file" and (run_dir / "files" / plot["path"]).read_bytes() == Path(monitor.files["plot"]).read_bytes()
    snapshots = monitor.report()["snapshots"]
    assert [s["step"] for s in snapshots] == [2, 4]
    for record in snapshots:
        page = media(history, f"memory/snapshot_pages/{Path(record['files']['html']).stem.replace('.', '_')}")
        assert page["_type"] == "html-file"
        assert (run_dir / "files" / page["path"]).read_text() == Path(record["files"]["html"]).read_text()  # inject=False: as rendered
    table = media(history, "memory/findings_table")
    assert table["_type"] == "table-file" and table["nrows"] == 1

    summary = wandb_items(records, "summary")
    assert summary["memory/report/max_allocated_bytes"] == monitor.max_allocated
    assert summary["memory/report/steps_recorded"] == len(monitor.history)
    assert summary["memory/report/findings"] == 1
    assert summary["memory/finding/lingering:graph"].startswith("[lingering] step 1:")

    artifacts = [r.artifact for r in records if r.WhichOneof("record_type") == "artifact" and r.artifact.type == "memcallbacks"]
    assert len(artifacts) == 1  # (the findings table is W&B's own run_table artifact)
    entries = {e.path: e.digest for e in artifacts[0].manifest.contents}
    assert entries["report.json"] == md5_b64(Path(monitor.files["report"]))
    assert entries["history.csv"] == md5_b64(Path(monitor.files["history"]))
    for record in snapshots:
        for path in record["files"].values():
            assert entries[f"snapshots/{Path(path).name}"] == md5_b64(Path(path))


# ---------------------------------------------------------------------- MLflow
def mlflow_artifacts(client: Any, run_id: str, path: str = "") -> list[str]:
    out = []
    for info in client.list_artifacts(run_id, path or None):
        out += mlflow_artifacts(client, run_id, info.path) if info.is_dir else [info.path]
    return sorted(out)


def test_mlflow_file_store_gets_artifacts_and_finding_tags(tmp_path: Path) -> None:
    from mlflow.tracking import MlflowClient

    uri = f"file:{tmp_path / 'mlruns'}"
    logger = MLFlowLogger(experiment_name="memcallbacks-tests", tracking_uri=uri)
    monitor = MemoryMonitor(log_every_n_steps=1, sample_every_n_steps=1, **SNAPSHOTS)
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)  # the keys need no renaming for MLflow
        fit(tmp_path, monitor, logger)

    client = MlflowClient(tracking_uri=uri)
    names = mlflow_artifacts(client, logger.run_id)
    snapshot_files = sorted(Path(p).name for s in monitor.report()["snapshots"] for p in s["files"].values())
    assert names == sorted(["memcallbacks/history.csv", "memcallbacks/memory.png", "memcallbacks/report.json"]
                           + [f"memcallbacks/snapshots/{n}" for n in snapshot_files])
    local = Path(client.download_artifacts(logger.run_id, "memcallbacks/report.json", str(tmp_path / "dl")))
    assert json.loads(local.read_text())["summary"]["max_allocated_bytes"] == monitor.max_allocated

    tags = client.get_run(logger.run_id).data.tags
    assert tags["memory/findings"] == "1"
    assert tags["memory/finding/lingering:graph"].startswith("[lingering] step 1:")
    assert "KeepsLoss.last_out['loss']" in tags["memory/finding/lingering:graph"]


class KeepsLosses(BoringModel):
    """Keeps every step's loss on the module, with its graph and a 2 MiB leaf input: lingering at step 1, then growth."""

    def __init__(self) -> None:
        super().__init__()
        self.kept: list[torch.Tensor] = []

    def training_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
        wide = batch.repeat(1, 64).detach().requires_grad_()
        loss = self(wide[:, : batch.shape[1]]).pow(2).mean()
        self.kept.append(loss)
        return loss


def test_mlflow_keeps_one_tag_per_cause(tmp_path: Path) -> None:
    """The lingering tag shown at step 1 goes when the growth it turned into takes it over (issue 44: trackers count causes)."""
    from mlflow.tracking import MlflowClient

    uri = f"file:{tmp_path / 'mlruns'}"
    logger = MLFlowLogger(experiment_name="memcallbacks-tests", tracking_uri=uri)
    monitor = MemoryMonitor(log_every_n_steps=1, plot=False)
    model = KeepsLosses()
    fit(tmp_path, monitor, logger, model=model, max_steps=8)
    tags = MlflowClient(tracking_uri=uri).get_run(logger.run_id).data.tags
    findings = {k: v for k, v in tags.items() if k.startswith("memory/finding/")}
    assert tags["memory/findings"] == "1" and list(findings) == ["memory/finding/growth"], findings
    assert findings["memory/finding/growth"].startswith("[growth] step 1 (confirmed again at step 4)"), findings
    assert "seen: lingering at step 1" in findings["memory/finding/growth"]
    del model.kept[:]


def test_accelerate_mlflow_tracker_gets_the_report(tmp_path: Path, fresh_accelerate_state: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    from accelerate import Accelerator
    from mlflow.tracking import MlflowClient
    from mlflow.tracking._tracking_service import utils as mlflow_utils

    from memcallbacks.accelerate import AccelerateMemoryMonitor

    uri = f"file:{tmp_path / 'mlruns'}"
    monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)  # how Accelerate's MLflowTracker is pointed at a store
    monkeypatch.setattr(mlflow_utils, "_tracking_uri", None)  # a Lightning MLFlowLogger earlier in the process set it
    accelerator = Accelerator(cpu=True, log_with="mlflow", project_dir=str(tmp_path))
    accelerator.init_trackers("memcallbacks-tests")
    model = torch.nn.Sequential(torch.nn.Linear(2048, 64), torch.nn.ReLU(), torch.nn.Linear(64, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    model, optimizer = accelerator.prepare(model, optimizer)
    monitor = AccelerateMemoryMonitor(accelerator, log_every_n_steps=1, sample_every_n_steps=1)
    for batch in monitor.track([torch.randn(256, 2048) for _ in range(4)]):
        loss = model(batch).pow(2).mean()
        accelerator.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
    run_id = accelerator.get_tracker("mlflow").active_run.info.run_id
    monitor.close()
    accelerator.end_training()

    client = MlflowClient(tracking_uri=uri)
    assert mlflow_artifacts(client, run_id) == ["memcallbacks/history.csv", "memcallbacks/memory.png", "memcallbacks/report.json"]
    local = Path(client.download_artifacts(run_id, "memcallbacks/history.csv", str(tmp_path / "dl")))
    assert local.read_bytes() == (tmp_path / "memcallbacks" / "history.csv").read_bytes()
    assert client.get_run(run_id).data.tags["memory/findings"] == "0"  # a clean loop


# ---------------------------------------------------------------------- only where the user logs; failures
def test_no_tracker_is_created_where_the_user_has_none(tmp_path: Path) -> None:
    monitor = MemoryMonitor(log_every_n_steps=1, sample_every_n_steps=1)
    fit(tmp_path, monitor, CSVLogger(str(tmp_path), name="csv", version=0))
    assert monitor._session.trackers is not None and monitor._session.trackers.trackers == []
    assert not list(tmp_path.rglob("events.out.tfevents.*")) and not (tmp_path / "wandb").exists() and not (tmp_path / "mlruns").exists()


class FinishesWandbEarly(L.Callback):
    """Listed before the monitor: ends the W&B run before the monitor's end-of-fit upload."""

    def on_fit_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        trainer.logger.experiment.finish()


def test_a_failing_tracker_is_one_warning_and_the_run_goes_on(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    import wandb

    caplog.set_level(logging.WARNING, logger="memcallbacks")
    monitor = MemoryMonitor(log_every_n_steps=1, sample_every_n_steps=1)
    logger = WandbLogger(save_dir=str(tmp_path), project="memcallbacks-tests", offline=True)
    try:
        trainer = fit(tmp_path, monitor, logger, callbacks=[FinishesWandbEarly(), monitor])
    finally:
        wandb.finish()
    assert trainer.state.finished
    warnings = [r for r in caplog.records if "could not attach the memory report" in r.getMessage()]
    assert len(warnings) == 1 and "WandbLogger" in warnings[0].getMessage()
    assert Path(monitor.files["report"]).is_file() and monitor.enabled


# ---------------------------------------------------------------------- DDP: rank 1's snapshot reaches rank 0's tracker
@pytest.mark.slow
def test_ddp_rank_one_snapshot_reaches_rank_zero_mlflow(tmp_path: Path) -> None:
    from mlflow.tracking import MlflowClient

    uri = f"file:{tmp_path / 'mlruns'}"
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "MLFLOW_ALLOW_FILE_STORE": "true"}
    env.pop("MASTER_PORT", None)
    proc = subprocess.run(
        [sys.executable, str(SCRIPTS / "ddp_fit.py"), str(tmp_path), "--steps", "3", "--rank-temp-mib", "512",
         "--snapshot-peak-mib", "650", "--mlflow", uri, "--per-rank-dirs"],
        cwd=str(tmp_path), env=env, capture_output=True, text=True, timeout=300,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    # rank 1 crossed the threshold and wrote its snapshot in its own folder; rank 0 wrote none
    rank1 = sorted(p.name for p in (tmp_path / "mem1" / "snapshots").iterdir())
    assert rank1 and all(".rank1." in name for name in rank1), rank1
    # rank 0 received the files into its folder and attached them to its MLflow run
    rank0 = sorted(p.name for p in (tmp_path / "mem0" / "snapshots").iterdir())
    assert rank0 == rank1
    for name in rank1:
        assert (tmp_path / "mem0" / "snapshots" / name).read_bytes() == (tmp_path / "mem1" / "snapshots" / name).read_bytes()
    client = MlflowClient(tracking_uri=uri)
    (run,) = client.search_runs([client.get_experiment_by_name("memcallbacks-ddp").experiment_id])
    names = mlflow_artifacts(client, run.info.run_id)
    assert [n for n in names if n.startswith("memcallbacks/snapshots/")] == [f"memcallbacks/snapshots/{n}" for n in rank1]
    assert "memcallbacks/report.json" in names


def test_a_logger_that_is_no_tracker_imports_no_tracker_module() -> None:
    """A CSV logger (or any object) is refused by class name before any tracker module is imported:
    those imports (~4 ms) fell on the first logged step of every run."""
    code = (
        "import json, sys\n"
        "from memcallbacks.trackers import recognise\n"
        "class CSVLogger: pass\n"
        "assert recognise(CSVLogger()) is None\n"
        "print(json.dumps(sorted(m for m in sys.modules if m.startswith('memcallbacks.trackers.'))))\n"
        "class TensorBoardLogger:\n"
        "    experiment = None\n"
        "assert type(recognise(TensorBoardLogger())).__name__ == 'TensorBoardTracker'\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert [m for m in json.loads(proc.stdout) if m != "memcallbacks.trackers._base"] == [], proc.stdout


class AsksTooMuch(BoringModel):
    """Step 3 asks the CPU allocator for 4 EiB: the allocator's own out-of-memory error, no limit needed."""

    def training_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
        if batch_idx == 3:
            torch.empty(1 << 62, dtype=torch.uint8)
        return super().training_step(batch, batch_idx)


def test_an_oom_explanation_reaches_tensorboard_text(tmp_path: Path) -> None:
    monitor = MemoryMonitor()
    with pytest.raises(RuntimeError, match="DefaultCPUAllocator: can't allocate memory"):  # propagated unchanged
        fit(tmp_path, monitor, TensorBoardLogger(str(tmp_path), name="tb", version=0), model=AsksTooMuch())
    events = tensorboard_events(tmp_path / "tb")
    oom = [(step, text) for tag, step, text in events["text"] if tag == "memory/findings/oom"]
    assert len(oom) == 1, events["text"]
    step, text = oom[0]
    # the model's training_step runs inside optimizer.step's closure: the phase is still its forward
    assert step == 3 and "out of memory at step 3 on rank 0, in forward" in text and "cpu allocator asked for" in text, text
    assert json.loads((Path(monitor.output_dir) / "oom.json").read_text())["step"] == 3
