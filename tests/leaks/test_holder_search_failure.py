"""A holder search that fails costs the holders, not the finding nor the monitor; ``explain()`` says what failed.

The fault is injected where the monitor calls into the heap walk (``find_holders`` and
``take_census`` as ``memcallbacks.leaks.attribution`` imported them), raising the ``OSError`` that a
file-backed user object raised in the probe of issue 24. Everything else is a real loop.
"""

from __future__ import annotations

import logging

import pytest
import torch
from torch import nn

import memcallbacks.leaks.attribution as watch
from memcallbacks import Monitor


def broken(*args: object, **kwargs: object) -> None:
    raise OSError(5, "Input/output error")


def _loop(steps: int, *, chain: bool = False, grow: bool = False) -> Monitor:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    monitor = Monitor(model, optimizer, write_files=False, sample_every_n_steps=1)
    total = 0
    kept = []
    for x in monitor.track([torch.randn(32, 64) for _ in range(steps)]):
        loss = model(x).pow(2).mean()
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        if chain:
            total = total + loss  # links every step's graph to the next
        if grow:
            kept.append(torch.ones(1 << 20))  # 4 MiB a step
    monitor.close()
    return monitor


def test_graph_chain_finding_kept_without_holders_when_their_search_fails(monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING, logger="memcallbacks")
    monkeypatch.setattr(watch, "find_holders", broken)
    monitor = _loop(10, chain=True)
    assert list(monitor.history["step"]) == list(range(10))  # the monitor did not switch itself off
    assert not [r for r in caplog.records if "disables itself" in r.getMessage()]
    (finding,) = [f for f in monitor.findings if "autograd graphs of steps" in f.message]
    assert finding.holders == []
    assert finding.details["holders_unavailable"] == "OSError: [Errno 5] Input/output error"
    assert "Holders unknown: the search for them failed with OSError: [Errno 5] Input/output error" in finding.message
    assert "Holders unknown" in monitor.format_report()


def test_growth_finding_says_why_it_has_no_holders_when_the_census_fails(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(watch, "take_census", broken)
    monitor = _loop(24, grow=True)
    assert list(monitor.history["step"]) == list(range(24))
    (finding,) = [f for f in monitor.findings if f.kind == "growth"]
    assert finding.holders == [] and finding.details["holders_unavailable"].startswith("OSError")
    assert "Holders unknown" in finding.message
    assert "holders_unavailable" in monitor.report()["findings"][0]["details"]


def test_explain_wraps_a_census_failure_in_a_clear_error(monkeypatch: pytest.MonkeyPatch) -> None:
    monitor = _loop(3)
    assert monitor.explain() is not None  # a working census first
    monkeypatch.setattr(watch, "take_census", broken)
    from memcallbacks.leaks.search_failure import CensusError

    with pytest.raises(CensusError) as info:
        monitor.explain()
    text = str(info.value)
    assert text.startswith("Monitor.explain() could not take its census of live tensors: OSError: [Errno 5] Input/output error.")
    assert "Training and the monitor are not affected" in text
    assert isinstance(info.value, RuntimeError) and isinstance(info.value.__cause__, OSError)
