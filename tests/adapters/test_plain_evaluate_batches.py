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
    assert len(monitor.history) >= 8  # the training rows are unchanged by the evaluation's forwards


def test_evaluate_counts_its_batches_under_track_on_quiet_steps(tmp_path):
    """Under ``track()``, the forward hooks are off on quiet steps (after step 48): evaluate() turns them on."""
    monitor = _train_and_evaluate(tmp_path, track=True)
    assert list(monitor.eval_history["batches"]) == [7], monitor.eval_history
