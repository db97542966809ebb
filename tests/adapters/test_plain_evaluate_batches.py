"""``Monitor.evaluate()`` counts its batches: each forward of the monitored model inside the block is one."""

from __future__ import annotations

import torch
from torch import nn

from memcallbacks import Monitor


def _train_and_evaluate(tmp_path, track: bool):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    monitor = Monitor(model, optimizer, output_dir=str(tmp_path / "mem"), plot=False)
    data = list(torch.randn(60, 4, 16))
    for x in (monitor.track(data) if track else data):
        model(x).pow(2).mean().backward()
        optimizer.step()
        optimizer.zero_grad()
    model.eval()
    with monitor.evaluate(), torch.no_grad():
        for x in torch.randn(7, 4, 16):
            model(x)
    model.train()
    for x in (monitor.track(data[:3]) if track else data[:3]):  # training goes on after the evaluation
        model(x).pow(2).mean().backward()
        optimizer.step()
        optimizer.zero_grad()
    monitor.close()
    return monitor


def test_evaluate_counts_its_batches(tmp_path):
    monitor = _train_and_evaluate(tmp_path, track=False)
    ev = monitor.eval_history
    assert list(ev["batches"]) == [7], ev  # before the fix: 0
    # the training steps are unchanged by the evaluation's forwards: 60 before it, 3 after (which rows the history
    # keeps of them is the schedule's choice, by the time budget)
    assert monitor.report()["summary"]["steps_seen"] == 63
    assert set(monitor.history["step"]) <= set(range(63)) and len(monitor.history) >= 5


def test_evaluate_counts_its_batches_under_track_on_quiet_steps(tmp_path):
    """Under ``track()``, the forward hooks are off on quiet steps (after step 48): evaluate() turns them on."""
    monitor = _train_and_evaluate(tmp_path, track=True)
    assert list(monitor.eval_history["batches"]) == [7], monitor.eval_history


def test_a_tentative_evaluation_leaves_a_row_only_where_the_model_ran(tmp_path):
    """``begin_evaluation(tentative=True)`` (the Trainer's next eval dataset, which may not come): ended with
    forwards in it, a row; ended by the next ``open_step()`` or by ``close()`` with none, nothing."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    monitor = Monitor(model, optimizer, output_dir=str(tmp_path / "mem"), plot=False)
    logged: list[int] = []
    monitor.attach(log_fn=lambda metrics, step: logged.append(step) if "memory/val/peak_step_GiB" in metrics else None)

    def train_step(step: int) -> None:
        monitor.open_step(step)
        model(torch.randn(4, 16)).pow(2).mean().backward()
        optimizer.step()
        optimizer.zero_grad()
        monitor.close_step(log_step=step)

    train_step(0)
    monitor.begin_evaluation("validate", 1, tentative=True)
    with torch.no_grad():
        model(torch.randn(4, 16))
    monitor.end_evaluation(log_step=1)  # it came: a row
    monitor.begin_evaluation("validate", 1, tentative=True)
    assert monitor.evaluating
    train_step(1)  # none came: the step's opening drops it
    assert not monitor.evaluating
    monitor.begin_evaluation("validate", 2, tentative=True)
    monitor.close()
    assert list(monitor.eval_history["step"]) == [1] and list(monitor.eval_history["batches"]) == [1], monitor.eval_history
    assert logged == [1]
