"""``AccelerateMemoryMonitor`` with real ``Accelerator(cpu=True)`` loops, metrics read back from the TensorBoard files.

The 2-process test spawns two ranks with ``torch.multiprocessing`` (gloo); each builds its own
``Accelerator(cpu=True)`` from the usual environment variables.
"""

from __future__ import annotations

import dataclasses
import logging
from contextlib import nullcontext
from pathlib import Path
from typing import Any

import pandas as pd
import pytest
import torch
from torch import nn

from helpers import (
    GIB, MIB, BackwardTemporary, TemporaryNet, free_port, leave_rank, set_rank_environment, tensorboard_scalars, touch_temporary,
    run_ranks,
)
from memcallbacks._base.columns import frame_column
from memcallbacks import MonitorConfig
from memcallbacks.accelerate import AccelerateMemoryMonitor

accelerate = pytest.importorskip("accelerate")
from accelerate import Accelerator  # noqa: E402

pytestmark = pytest.mark.usefixtures("fresh_accelerate_state")

TEMP_MIB = 64
CPU = dict(advanced={"cpu_mmap_threshold": 1 << 20}, sample_every_n_steps=1)


def loader(batches: int, dim: int = 32) -> torch.utils.data.DataLoader:
    data = torch.randn(batches * 4, dim, generator=torch.Generator().manual_seed(0))
    return torch.utils.data.DataLoader(data, batch_size=4)


def run_loop(accelerator: Accelerator, model: nn.Module, optimizer: Any, data: Any, monitor: AccelerateMemoryMonitor | None, accumulate: bool = False) -> None:
    items = monitor.track(data) if monitor is not None else data
    for batch in items:
        with accelerator.accumulate(model) if accumulate else nullcontext():
            loss = model(batch).pow(2).mean()
            accelerator.backward(loss)
            optimizer.step()
            optimizer.zero_grad()


# ---------------------------------------------------------------------- one process
def test_tensorboard_tracker_receives_per_phase_peaks(tmp_path: Path) -> None:
    accelerator = Accelerator(cpu=True, log_with="tensorboard", project_dir=str(tmp_path))
    accelerator.init_trackers("exp")
    model = TemporaryNet(forward_mib=TEMP_MIB)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    model, optimizer, data = accelerator.prepare(model, optimizer, loader(6))
    monitor = AccelerateMemoryMonitor(accelerator, log_keys="all", log_every_n_steps=2, plot=False, **CPU)  # models found in accelerator._models
    run_loop(accelerator, model, optimizer, data, monitor)
    monitor.close()
    accelerator.end_training()

    # default output_dir: <project_dir>/memcallbacks
    history = pd.read_csv(tmp_path / "memcallbacks" / "history.csv").rename(columns=frame_column).set_index("step")
    assert list(history.index) == [0, 1, 2, 3, 4, 5]
    scalars = tensorboard_scalars(tmp_path / "exp")
    assert {"memory/peak_forward_GiB", "memory/peak_backward_GiB", "memory/peak_optimizer_GiB", "memory/peak_step_GiB"} <= set(scalars)
    for key, column in [("memory/peak_forward_GiB", "peak_forward"), ("memory/reserved_GiB", "reserved"), ("memory/peak_step_GiB", "peak_allocated")]:
        assert [s for s, _ in scalars[key]] == [1, 3, 5]
        for step, value in scalars[key]:
            assert value == pytest.approx(history.loc[step, column] / GIB, rel=1e-6)  # float32 in the event file
    forward = dict(scalars["memory/peak_forward_GiB"])
    backward = dict(scalars["memory/peak_backward_GiB"])
    start = dict(scalars["memory/reserved_GiB"])
    for step in (1, 3, 5):
        assert (forward[step] - start[step]) * GIB / MIB >= 0.85 * TEMP_MIB
        assert (backward[step] - start[step]) * GIB / MIB < 0.5 * TEMP_MIB


def test_loss_backward_counts_as_backward_through_accelerator_backward() -> None:
    # the temporary is in the loss's backward, before the gradient reaches the model's output: only
    # the accelerator.backward wrapper (not the output-tensor hook) can put it in peak_backward
    accelerator = Accelerator(cpu=True)
    model = TemporaryNet()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    model, optimizer = accelerator.prepare(model, optimizer)
    monitor = AccelerateMemoryMonitor(accelerator, model, write_files=False, **CPU)
    for x in monitor.track(list(loader(3))):
        loss = BackwardTemporary.apply(model(x), TEMP_MIB).pow(2).mean()
        accelerator.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
    monitor.close()

    h = monitor.history
    assert len(h) == 3
    assert ((h["peak_backward"] - h["reserved"]) / MIB >= 0.85 * TEMP_MIB).all()
    assert ((h["peak_forward"] - h["reserved"]) / MIB < 0.5 * TEMP_MIB).all()


def test_leak_detection_marks_the_loss_given_to_accelerator_backward() -> None:
    # a loop variable `loss` is alive when the next step starts; marking that very tensor (not the
    # model's output) lets the lingering check find it without scanning the heap for it
    accelerator = Accelerator(cpu=True)
    model = TemporaryNet()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    model, optimizer = accelerator.prepare(model, optimizer)
    monitor = AccelerateMemoryMonitor(accelerator, model, write_files=False, **CPU)
    lingering = monitor._session.checks.watch.lingering
    for x in monitor.track(list(loader(4))):
        loss = model(x).pow(2).mean()
        accelerator.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
    monitor.close()
    assert lingering._loss_ref is not None and lingering._loss_ref() is loss
    # the graph was alive at each next step (with the batch, which the list keeps), and harmless
    assert sum(n for k, n in lingering.occurrences.items() if k.startswith("seen:") and "graph" in k) >= 3
    assert monitor.findings == []


def test_gradient_accumulation_one_row_per_optimizer_step() -> None:
    from torch.optim.optimizer import register_optimizer_step_post_hook

    accelerator = Accelerator(cpu=True, gradient_accumulation_steps=2)
    model = TemporaryNet(forward_mib=TEMP_MIB // 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    model, optimizer, data = accelerator.prepare(model, optimizer, loader(8))
    inner_steps: list[int] = []
    handle = register_optimizer_step_post_hook(lambda opt, args, kwargs: inner_steps.append(1))
    monitor = AccelerateMemoryMonitor(accelerator, write_files=False, **CPU)
    try:
        run_loop(accelerator, model, optimizer, data, monitor, accumulate=True)
    finally:
        handle.remove()
    monitor.close()

    h = monitor.history
    assert len(inner_steps) == 4  # the AcceleratedOptimizer stepped the inner optimizer on sync batches only
    assert list(h["step"]) == [0, 1, 2, 3]
    assert list(h["batch_idx"]) == [0, 2, 4, 6]
    assert (h["micro_batches"] == 2).all()
    assert (h["optimizer_steps"] == 1).all()
    assert ((h["peak_forward"] - h["reserved"]) / MIB >= 0.85 * TEMP_MIB / 2).all()


def test_auto_mode_without_track() -> None:
    accelerator = Accelerator(cpu=True)
    model = TemporaryNet(forward_mib=TEMP_MIB // 2)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    model, optimizer, data = accelerator.prepare(model, optimizer, loader(3))
    monitor = AccelerateMemoryMonitor(accelerator, write_files=False, **CPU)
    run_loop(accelerator, model, optimizer, data, None)
    monitor.close()
    h = monitor.history
    assert list(h["step"]) == [0, 1, 2]
    assert (h["optimizer_steps"] == 1).all()
    assert h[["peak_forward", "peak_backward", "peak_optimizer"]].notna().all().all()


def test_explicit_step_and_phase_for_loops_hooks_cannot_see(tmp_path: Path) -> None:
    calls: list[tuple[int, dict[str, float]]] = []
    accelerator = Accelerator(cpu=True)
    monitor = AccelerateMemoryMonitor(accelerator, log_fn=lambda m, s: calls.append((s, m)), log_every_n_steps=1, write_files=False, **CPU)
    for _ in range(3):
        with monitor.step():
            with monitor.phase("forward"):
                touch_temporary(TEMP_MIB)
            with monitor.phase("backward"):
                pass
            with monitor.phase("optimizer"):
                touch_temporary(TEMP_MIB // 2)
    monitor.close()

    h = monitor.history
    assert len(h) == 3 and [s for s, _ in calls] == [0, 1, 2]
    assert ((h["peak_forward"] - h["reserved"]) / MIB >= 0.85 * TEMP_MIB).all()
    optimizer_rise = (h["peak_optimizer"] - h["reserved"]) / MIB
    assert ((optimizer_rise >= 0.85 * TEMP_MIB / 2) & (optimizer_rise < 0.85 * TEMP_MIB)).all()
    # CPU's default list logs each phase's rise above the step's start (the resident memory then)
    assert calls[0][1]["memory/peak_forward_above_start_GiB"] == pytest.approx((h["peak_forward"][0] - h["reserved"][0]) / GIB)


def test_oom_inside_step_writes_report(tmp_path: Path) -> None:
    import json

    accelerator = Accelerator(cpu=True, project_dir=str(tmp_path))
    monitor = AccelerateMemoryMonitor(accelerator, plot=False)
    with pytest.raises(torch.OutOfMemoryError):
        with monitor.step():
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 8.00 GiB (simulated)")
    report = json.loads((tmp_path / "memcallbacks" / "report.json").read_text())
    assert report["framework"] == "accelerate"
    assert [e["kind"] for e in report["events"]] == ["oom"]
    monitor.close()


def test_close_twice_removes_hooks_and_backward_wrapper() -> None:
    from torch.optim import optimizer as optim_module

    pre_hooks = len(optim_module._global_optimizer_pre_hooks)
    accelerator = Accelerator(cpu=True)
    model = TemporaryNet()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    model, optimizer, data = accelerator.prepare(model, optimizer, loader(4))
    monitor = AccelerateMemoryMonitor(accelerator, write_files=False)
    assert "backward" in accelerator.__dict__ and model._forward_hooks
    run_loop(accelerator, model, optimizer, data, monitor)
    monitor.close()
    monitor.close()
    assert "backward" not in accelerator.__dict__  # Accelerator.backward is the class's again
    assert not model._forward_pre_hooks and not model._forward_hooks
    assert len(optim_module._global_optimizer_pre_hooks) == pre_hooks
    rows = len(monitor.history)
    run_loop(accelerator, model, optimizer, data, None)
    assert len(monitor.history) == rows


def test_no_tracker_warns_once_and_keeps_files(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    accelerator = Accelerator(cpu=True, project_dir=str(tmp_path))
    model = TemporaryNet()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    model, optimizer, data = accelerator.prepare(model, optimizer, loader(3))
    monitor = AccelerateMemoryMonitor(accelerator, log_every_n_steps=1, plot=False)
    with caplog.at_level(logging.WARNING, logger="memcallbacks.accelerate"):
        run_loop(accelerator, model, optimizer, data, monitor)
    monitor.close()
    assert sum("has no trackers" in r.getMessage() for r in caplog.records) == 1
    assert len(pd.read_csv(tmp_path / "memcallbacks" / "history.csv")) == 3


def test_arguments() -> None:
    accelerator = Accelerator(cpu=True)
    fields = {f.name: getattr(MonitorConfig(), f.name) for f in dataclasses.fields(MonitorConfig)}
    monitor = AccelerateMemoryMonitor(accelerator, **{**fields, "write_files": False})
    assert monitor.config.write_files is False and monitor.accelerator is accelerator
    monitor.close()
    with pytest.raises(TypeError, match=r"AccelerateMemoryMonitor\(accelerator=object\) must be an accelerate.Accelerator"):
        AccelerateMemoryMonitor(object())
    with pytest.raises(TypeError, match="unexpected keyword argument"):
        AccelerateMemoryMonitor(accelerator, log_every=2)
    assert "backward" not in accelerator.__dict__  # a failed construction installs nothing


# ---------------------------------------------------------------------- two processes
RANK_TEMP_MIB = 96


def _rank_main(rank: int, world_size: int, port: int, out: str) -> None:
    """One rank of the 2-process run: its own Accelerator(cpu=True) from the environment (gloo)."""
    set_rank_environment(rank, world_size, port)
    accelerator = Accelerator(cpu=True, log_with="tensorboard", project_dir=out)
    assert accelerator.num_processes == world_size and accelerator.process_index == rank
    accelerator.init_trackers("exp")
    model = TemporaryNet(forward_mib=RANK_TEMP_MIB if rank == 1 else 0)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    model, optimizer, data = accelerator.prepare(model, optimizer, loader(6))  # DDP; 3 batches per rank
    monitor = AccelerateMemoryMonitor(accelerator, log_keys="all", log_every_n_steps=1, plot=False, **CPU)
    run_loop(accelerator, model, optimizer, data, monitor)
    monitor.close()
    # gloo's teardown can deadlock when the process group goes (with the DDP model, at return) while its
    # worker thread still drops a finished all_gather's tensors: memcallbacks keeps its own gathers'
    # tensors alive (_base/distributed.py), but a rank still hung here once after that (a collective
    # of Accelerate's or DDP's, not identified); the barrier lets the worker thread finish first
    # (before end_training, which destroys the process group)
    torch.distributed.barrier()
    accelerator.end_training()
    leave_rank()  # before the DDP model is freed: see helpers.leave_rank


@pytest.mark.slow
def test_two_processes_log_max_over_ranks(tmp_path: Path) -> None:
    import torch._dynamo  # noqa: F401  - imported by every optimizer's __init__; forked ranks inherit it

    # fork: the ranks inherit the imports (a spawned rank spends ~10 s importing torch, accelerate and
    # torch._dynamo); they run single-threaded, so the parent's OpenMP pool does not matter
    run_ranks(_rank_main, (2, free_port(), str(tmp_path)))

    mem = tmp_path / "memcallbacks"
    ranks = [pd.read_csv(mem / f"history.rank{r}.csv").rename(columns=frame_column).set_index("step") for r in (0, 1)]
    assert [list(h.index) for h in ranks] == [[0, 1, 2], [0, 1, 2]]
    assert not (mem / "history.csv").exists()
    scalars = tensorboard_scalars(tmp_path / "exp")  # written by rank 0 only
    assert [s for s, _ in scalars["memory/peak_step_GiB"]] == [0, 1, 2]
    for step, value in scalars["memory/peak_step_GiB"]:
        per_rank = [h.loc[step, "peak_allocated"] for h in ranks]
        assert value == pytest.approx(max(per_rank) / GIB, rel=1e-6)
        assert (per_rank[1] - per_rank[0]) / MIB >= 0.5 * RANK_TEMP_MIB
    assert {v for _, v in scalars["memory/peak_step_rank"]} == {1.0}
    forward = ranks[1]["peak_forward"] - ranks[1]["reserved"]
    assert (forward / MIB >= 0.85 * RANK_TEMP_MIB).all()

    import json

    combined = json.loads((mem / "report.json").read_text())
    assert [r["rank"] for r in combined["ranks"]] == [0, 1]
    assert combined["framework"] == "accelerate" and combined["summary"]["world_size"] == 2
