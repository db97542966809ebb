"""auto_snapshot on a real CUDA device (run by ``scripts/gpu_check.sh``; skipped without CUDA).

- allocator retries (the cache had to be flushed: fragmentation) trigger a snapshot whose history
  shows the flush;
- a real out-of-memory error in a Lightning fit: the allocator's OOM observer writes the pickle
  inside the failing allocation, the monitor records the event, renders the summary, writes
  ``report.json`` and the error still reaches the caller;
- the same with the plain-loop ``Monitor``;
- each recording policy (``always`` / ``armed`` / ``off``) does what docs/snapshots.md says;
- two processes (gloo, one GPU): the rank whose peak crosses the threshold dumps, the other rank
  writes nothing and trains every step.
"""

from __future__ import annotations

import json
import os
import pickle
from pathlib import Path

import lightning.pytorch as L
import pytest
import torch
import torch.multiprocessing as mp
from lightning.pytorch.loggers import CSVLogger
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from helpers import csv_metrics, free_port
from memcallbacks import MemoryMonitor, Monitor
from memcallbacks.snapshot import load_snapshot, summarize_snapshot

pytestmark = [pytest.mark.cuda, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

MIB = 1 << 20
GIB = 1 << 30


class Model(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.layer = nn.Linear(32, 32)

    def training_step(self, batch, batch_idx):
        return self.layer(batch[0]).pow(2).mean()

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.01)


def cuda_fit(tmp_path: Path, monitor: MemoryMonitor, model: L.LightningModule, steps: int, **kwargs) -> L.Trainer:
    trainer = L.Trainer(
        accelerator="gpu", devices=1, max_steps=steps, callbacks=[monitor], enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, default_root_dir=tmp_path, **{"logger": False, **kwargs},
    )
    trainer.fit(model, DataLoader(TensorDataset(torch.randn(64 * 16, 32)), batch_size=16))
    return trainer


def trace_actions(snapshot: dict) -> list[tuple[str, int]]:
    return [(e["action"], int(e.get("size", 0))) for trace in snapshot["device_traces"] for e in trace]


@pytest.fixture(autouse=True)
def clean_allocator():
    """Each test starts from an empty cache and no memory limit, and leaves it so."""
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    yield
    torch.cuda.set_per_process_memory_fraction(1.0)
    torch.cuda.synchronize()
    torch.cuda.empty_cache()


# ---------------------------------------------------------------------- allocator retries
class Fragmenting(Model):
    """From step ``at``: a 600 MiB block is freed (cached), then 1 GiB is asked for under a limit of
    1.5 GiB above what the run held at the start: the cached block is too small, cudaMalloc would
    exceed the limit, so the allocator frees its cache and retries (``num_alloc_retries`` + 1 per
    step; the cache is emptied after each step so the next one fragments the same way)."""

    def __init__(self, at: int) -> None:
        super().__init__()
        self.at = at

    def on_train_start(self) -> None:
        torch.cuda.synchronize()
        total = torch.cuda.get_device_properties(self.device).total_memory
        limit = torch.cuda.memory_reserved(self.device) + 1536 * MIB
        torch.cuda.set_per_process_memory_fraction(limit / total, self.device)

    def on_train_end(self) -> None:
        torch.cuda.set_per_process_memory_fraction(1.0, self.device)

    def training_step(self, batch, batch_idx):
        if self.global_step >= self.at:
            torch.empty(600 * MIB, dtype=torch.uint8, device=self.device)  # freed at once: a cached 600 MiB block
            torch.empty(GIB, dtype=torch.uint8, device=self.device)
            torch.cuda.empty_cache()  # the same flush happens again next step
        return super().training_step(batch, batch_idx)


def test_alloc_retries_trigger_a_snapshot_that_shows_the_flush(tmp_path):
    out = tmp_path / "mem"
    monitor = MemoryMonitor(auto_snapshot=True, log_every_n_steps=1, output_dir=str(out), snapshot={"capacity_fraction": None, "steps": 2})
    cuda_fit(tmp_path, monitor, Fragmenting(at=3), steps=10, logger=CSVLogger(str(tmp_path), name="csv", version=0))

    history = monitor.history
    retries = list(history["alloc_retries"] - history["alloc_retries"].iloc[0])
    assert retries[:3] == [0, 0, 0] and retries[3] >= 1 and retries[-1] >= 7, retries  # one flush per step from step 3
    logged = csv_metrics(tmp_path / "csv" / "version_0" / "metrics.csv")
    assert [v for _, v in logged["memory/alloc_retries"]] == list(history["alloc_retries"])

    (record,) = monitor.report()["snapshots"]  # a burst of retries is one event
    assert "allocator flushed its cache" in record["trigger"] and "expandable_segments:True" in record["trigger"]
    assert record["step"] == 3 + 2  # armed: recording starts at the trigger, the dump comes snapshot_steps later
    assert {"snapshot", "html"} <= set(record["files"]) and record["bytes"] > 0
    snapshot = load_snapshot(record["files"]["snapshot"])
    actions = trace_actions(snapshot)
    assert ("alloc", GIB) in actions and ("segment_free", 600 * MIB) in actions, "the history shows the 600 MiB segment given back"
    report = json.loads((out / "report.json").read_text())
    assert report["snapshots"][0]["files"]["snapshot"] == record["files"]["snapshot"]


def test_retries_from_before_the_run_do_not_fire(tmp_path):
    # leave retries in this process's counters, as an earlier fit or a caught OOM would
    total = torch.cuda.get_device_properties(0).total_memory
    torch.cuda.set_per_process_memory_fraction((torch.cuda.memory_reserved() + 1536 * MIB) / total)
    torch.empty(600 * MIB, dtype=torch.uint8, device="cuda")
    torch.empty(GIB, dtype=torch.uint8, device="cuda")
    torch.cuda.set_per_process_memory_fraction(1.0)
    assert torch.cuda.memory_stats()["num_alloc_retries"] >= 1

    monitor = MemoryMonitor(auto_snapshot=True, output_dir=str(tmp_path / "mem"), snapshot={"capacity_fraction": None})
    cuda_fit(tmp_path, monitor, Model(), steps=6)
    assert monitor.report()["snapshots"] == []


# ---------------------------------------------------------------------- a real out-of-memory error
class OomAt(Model):
    def __init__(self, at: int) -> None:
        super().__init__()
        self.at = at

    def training_step(self, batch, batch_idx):
        if self.global_step == self.at:
            too_much = 2 * torch.cuda.get_device_properties(self.device).total_memory
            torch.empty(too_much, dtype=torch.uint8, device=self.device)
        return super().training_step(batch, batch_idx)


@pytest.mark.parametrize("policy", ["armed", "always", "off"])
def test_real_oom_in_a_fit_is_dumped_recorded_and_reraised(tmp_path, policy):
    out = tmp_path / "mem"
    monitor = MemoryMonitor(auto_snapshot=True, output_dir=str(out), snapshot={"policy": policy})
    with pytest.raises(torch.OutOfMemoryError):
        cuda_fit(tmp_path, monitor, OomAt(at=3), steps=10)

    report = json.loads((out / "report.json").read_text())
    (event,) = report["events"]
    assert (event["kind"], event["step"], event["rank"]) == ("oom", 3, 0)
    assert "OutOfMemoryError" in event["error"]
    (record,) = report["snapshots"]  # the observer's dump; the hook does not write a second one
    assert record["trigger"] == "oom (allocator observer)" and record["step"] == 3
    assert record["bytes"] > 0 and {"snapshot", "html"} <= set(record["files"])
    assert Path(record["files"]["snapshot"]).name.startswith("memory_snapshot_oom")
    summary = summarize_snapshot(load_snapshot(record["files"]["snapshot"])).devices[0]
    assert summary.trigger is not None and summary.trigger[1].startswith("out of memory on cuda:")
    if policy == "always":  # history since the start: the trace ends with the failing request
        assert summary.ooms and summary.ooms[-1][1] >= torch.cuda.get_device_properties(0).total_memory
    else:  # no history was recording: the segments at the moment of failure
        assert load_snapshot(record["files"]["snapshot"])["segments"]


def test_after_an_oom_the_next_fit_starts_clean(tmp_path):
    first = MemoryMonitor(auto_snapshot=True, output_dir=str(tmp_path / "a"), snapshot={"policy": "always"})
    with pytest.raises(torch.OutOfMemoryError):
        cuda_fit(tmp_path, first, OomAt(at=1), steps=4)
    # the observer and the recording were removed: a second OOM outside any monitor writes nothing
    with pytest.raises(torch.OutOfMemoryError):
        torch.empty(2 * torch.cuda.get_device_properties(0).total_memory, dtype=torch.uint8, device="cuda")
    assert len(list((tmp_path / "a" / "snapshots").glob("*.pickle"))) == 1
    second = MemoryMonitor(auto_snapshot=True, output_dir=str(tmp_path / "b"), snapshot={"capacity_fraction": None})
    trainer = cuda_fit(tmp_path, second, Model(), steps=4)
    assert trainer.global_step == 4 and second.report()["snapshots"] == [] and second.events == []


def test_plain_monitor_records_a_real_oom_and_reraises(tmp_path):
    model = nn.Linear(256, 256).cuda()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    monitor = Monitor(model, optimizer, auto_snapshot=True, output_dir=str(tmp_path / "mem"), plot=False)
    with pytest.raises(torch.OutOfMemoryError):
        for step in range(6):
            with monitor.step():
                loss = model(torch.randn(32, 256, device="cuda")).pow(2).mean()
                if step == 2:
                    torch.empty(2 * torch.cuda.get_device_properties(0).total_memory, dtype=torch.uint8, device="cuda")
                loss.backward()
                optimizer.step()
                optimizer.zero_grad()
    report = json.loads((tmp_path / "mem" / "report.json").read_text())
    assert [(e["kind"], e["step"]) for e in report["events"]] == [("oom", 2)]
    assert report["snapshots"][0]["trigger"] == "oom (allocator observer)" and report["snapshots"][0]["bytes"] > 0
    monitor.close()  # after the error: harmless, nothing is written twice
    assert len(list((tmp_path / "mem" / "snapshots").glob("*.pickle"))) == 1


# ---------------------------------------------------------------------- policies
MARKER = 777 * 1024  # a size nothing else allocates: shows whether step 0 is in the history


class Rising(Model):
    """Step 0 frees a marker block; steps 1-2 a 54 MiB temporary (above 80% of the threshold, below
    it); from step 3 a 96 MiB one (above). The threshold is set 64 MiB above the run's own reserved
    peak, measured first, so the cuBLAS workspace and the cache do not move the crossing."""

    def training_step(self, batch, batch_idx):
        size = MARKER if self.global_step == 0 else 54 * MIB if self.global_step < 3 else 96 * MIB
        torch.ones(size, dtype=torch.uint8, device=self.device)  # a temporary, freed at once
        return super().training_step(batch, batch_idx)


def reserved_peak_of_a_plain_fit(tmp_path: Path) -> int:
    probe = MemoryMonitor(write_files=False)
    cuda_fit(tmp_path, probe, Model(), steps=3)
    torch.cuda.empty_cache()
    return int(probe.history["peak_reserved"].max())


@pytest.mark.parametrize("policy", ["always", "armed", "off"])
def test_policies_on_a_threshold_crossing(tmp_path, policy):
    from memcallbacks.snapshot import is_recording

    threshold = reserved_peak_of_a_plain_fit(tmp_path) + 64 * MIB
    monitor = MemoryMonitor(auto_snapshot=True, output_dir=str(tmp_path / "mem"), snapshot={"policy": policy, "peak_bytes": threshold, "steps": 2})
    cuda_fit(tmp_path, monitor, Rising(), steps=8)
    assert not is_recording(), "recording stopped with the run"
    peaks = list(monitor.history["peak_reserved"])
    assert max(peaks[:3]) < threshold <= peaks[3], (peaks, threshold)
    records = monitor.report()["snapshots"]
    if policy == "off":
        assert records == []  # nothing was recording, so there is no history to dump (an OOM still dumps the segments)
        return
    (record,) = records
    assert "threshold" in record["trigger"] and record["step"] == 3  # recording was on at the crossing: dumped at once
    sizes = [size for action, size in trace_actions(load_snapshot(record["files"]["snapshot"])) if action == "alloc"]
    assert 54 * MIB in sizes and 96 * MIB in sizes
    if policy == "always":
        assert MARKER in sizes  # recording since the start
    else:
        assert MARKER not in sizes  # armed at step 1 (54 MiB is above 80% of the threshold), after step 0


# ---------------------------------------------------------------------- two ranks, one GPU
def _two_rank_worker(rank: int, world: int, port: int, out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.distributed.init_process_group("gloo", rank=rank, world_size=world)  # NCCL refuses two ranks on one GPU
    try:
        torch.cuda.set_device(0)
        model = nn.Sequential(nn.Linear(256, 256), nn.ReLU(), nn.Linear(256, 1)).cuda()
        optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
        logged: list[tuple[int, dict]] = []
        monitor = Monitor(model, optimizer, lambda metrics, step: logged.append((step, dict(metrics))), auto_snapshot=True, log_every_n_steps=1, output_dir=os.path.join(out, "mem"), plot=False, snapshot={"peak_bytes": 256 * MIB, "steps": 2})
        for step in range(10):
            with monitor.step():
                if rank == 1 and step >= 2:
                    torch.ones(512 * MIB, dtype=torch.uint8, device="cuda")  # a temporary above the threshold
                loss = model(torch.randn(64, 256, device="cuda")).pow(2).mean()
                loss.backward()
                optimizer.step()
                optimizer.zero_grad()
                total = loss.detach().cpu()
                torch.distributed.all_reduce(total)  # the ranks move in lockstep, as in data parallel training
        monitor.close()
        result = {
            "rank": rank,
            "steps": list(monitor.history["step"]),
            "snapshots": monitor.report()["snapshots"],
            "logged_snapshots": [(s, m.get("memory/snapshots")) for s, m in logged],
        }
        Path(out, f"result.rank{rank}.json").write_text(json.dumps(result))
    finally:
        torch.distributed.destroy_process_group()


def test_two_ranks_only_the_rank_that_crossed_dumps(tmp_path):
    mp.spawn(_two_rank_worker, args=(2, free_port(), str(tmp_path)), nprocs=2, join=True)
    r0, r1 = (json.loads((tmp_path / f"result.rank{r}.json").read_text()) for r in (0, 1))
    assert r0["steps"] == r1["steps"] == list(range(10))  # nobody waited forever, nobody skipped a step
    assert r0["snapshots"] == []
    (record,) = r1["snapshots"]
    assert "threshold" in record["trigger"] and ".rank1" in Path(record["files"]["snapshot"]).name
    names = [p.name for p in (tmp_path / "mem" / "snapshots").iterdir()]
    assert names and all("rank1" in n for n in names), names
    sizes = [size for action, size in trace_actions(load_snapshot(record["files"]["snapshot"])) if action == "alloc"]
    assert 512 * MIB in sizes
    # rank 0 logs the max over ranks: the snapshot count shows rank 1's dump
    assert max(v for _, v in r0["logged_snapshots"] if v is not None) == 1.0
    assert pickle.loads(Path(record["files"]["snapshot"]).read_bytes())["segments"]
