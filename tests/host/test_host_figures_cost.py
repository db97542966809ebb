"""The host figures' measure of Python objects (pymalloc's pools, ~0.2-1.5 ms) is paid only where it is read.

At defaults no host key is logged: a training step never walks pymalloc's pools (the baseline's measure
aside), and the run's end measures once for the report. Where ``host_python_GiB`` is logged, a logged step
measures again when the last measure is 16 steps old, so the logged value is at most that stale.
"""

from __future__ import annotations

import math

import pytest
import torch

import memcallbacks.host.growth as host_growth
from memcallbacks import Monitor


@pytest.fixture
def measures(monkeypatch):
    """The steps at which the host figures walked pymalloc's pools (the real walk, counted)."""
    at: list[int] = []
    real = host_growth.pymalloc_bytes
    state = {"step": -1}

    def counted():
        at.append(state["step"])
        return real()

    monkeypatch.setattr(host_growth, "pymalloc_bytes", counted)
    return at, state


def _fit(state, steps: int, **kwargs):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    logged: dict[int, dict[str, float]] = {}
    monitor = Monitor(model, opt, lambda metrics, step: logged.__setitem__(step, metrics), write_files=False, device="cpu", **kwargs)
    for step in monitor.track(range(steps)):
        state["step"] = step
        model(torch.randn(16, 32)).sum().backward()
        opt.step()
        opt.zero_grad()
    state["step"] = steps  # the run's end
    monitor.close()
    return monitor, logged


def test_at_defaults_no_training_step_after_the_baseline_measures_python_objects(measures):
    at, state = measures
    monitor, logged = _fit(state, 130)
    assert sorted(logged) == [49, 99]  # the default log_every_n_steps
    assert not any("host_python_GiB" in m for m in logged.values())
    during = [s for s in at if s < 130]
    assert len(during) == 1 and during[0] < 48, at  # the baseline, the first read after the host warm-up
    assert at.count(130) == 1, at  # the run's end: the report's figures
    figures = monitor.report()["summary"]["rank_figures"]
    assert figures["host_python_bytes"] > 1 << 20  # this process's Python objects: measured, not missing


def test_a_logged_host_python_key_is_measured_at_most_16_steps_before(measures):
    at, state = measures
    monitor, logged = _fit(state, 90, log_every_n_steps=10, log_keys=["default", "host_python_GiB"])
    steps = sorted(logged)
    assert steps == list(range(9, 90, 10))
    for step in steps[2:]:  # after the baseline
        value = logged[step]["memory/host_python_GiB"]
        assert math.isfinite(value) and value > 1 / 1024, (step, value)  # over 1 MiB
        last = max(s for s in at if s <= step)
        assert step - last < 16, (step, at)
    during = [s for s in at if s < 90]
    assert 3 <= len(during) <= 1 + len(steps), at  # every other logged step at most, not every read
