"""The host census names what grew: a real leak of dataclass objects into a module-level dict,
in a real (small) training loop, found by type and holder from a stable root."""

from __future__ import annotations

import re
from dataclasses import dataclass

import pytest
import torch

from memcallbacks._base.findings import FindingLog
from memcallbacks._base.units import MiB
from memcallbacks.host import TracemallocWindow, explain_host_growth, take_host_census


@dataclass
class Spec:
    name: str
    shape: tuple
    stride: tuple
    placement: list
    step: int


SPECS: dict = {}
BOUNDED: list = []


def train(steps: int, start: int = 0, *, window: TracemallocWindow | None = None, window_steps: int = 0) -> None:
    torch.manual_seed(0)
    model = torch.nn.Linear(16, 4)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in range(start, start + steps):
        if window is not None and step == start:
            window.start()
        loss = model(torch.randn(8, 16)).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        for i in range(512):
            SPECS[(step, i)] = Spec(f"layer{i}.weight", (step, i, 3), (1, step, i), [step, i], step)
        BOUNDED.append(loss.item())
        del BOUNDED[:-32]  # bounded: not growth
        if window is not None and step == start + window_steps - 1:
            window.lines = window.stop()


@pytest.fixture(autouse=True)
def _clean():
    SPECS.clear()
    yield
    SPECS.clear()


def test_leak_into_a_module_dict_is_named_by_type_and_holder():
    train(10)
    before = take_host_census(step=10)
    assert before.seconds > 0 and before.objects > 1000 and not before.truncated
    window = TracemallocWindow()
    train(50, 10, window=window, window_steps=3)
    result = explain_host_growth(before, step=60, lines=window.lines)
    top = result.holders[0]
    assert top.path == f"module {__name__}: global SPECS", result.holders
    assert (top.container, top.value_type.rsplit(".", 1)[-1]) == ("dict", "Spec")
    assert top.grown_by == top.value_count == 50 * 512
    assert 5 * MiB < top.nbytes < 40 * MiB, top  # ~370-490 bytes a Spec with its tuples, list and name
    sentence = str(top)
    assert re.fullmatch(rf"module {re.escape(__name__)}: global SPECS \(dict\) grew by 25,600 Spec objects / \d+\.\d MiB", sentence), sentence
    assert not any("BOUNDED" in h.path for h in result.holders), result.holders
    # the type census diff sees the same objects
    types = {name.rsplit(".", 1)[-1]: count for name, count, _ in result.types}
    assert types.get("Spec") == 25_600, result.types
    # the tracemalloc window names the allocating line in this file
    assert window.lines and "test_host_census.py" in window.lines[0], window.lines
    assert window.seconds > 0
    # one finding, with its cost
    finding = result.finding(60)
    assert finding.kind == "host_growth" and finding.key == "host_growth"
    assert finding.holders[0] == sentence and sentence in finding.message
    assert 0 < finding.details["census_cost_s"] < 30
    log = FindingLog()
    assert log.add(finding) and str(log.get("host_growth")).startswith("[host_growth] step 60:")


def test_a_local_in_a_user_frame_is_a_stable_root():
    kept = []
    before = take_host_census(step=0)
    for step in range(200):
        kept.append({"step": step, "payload": [step] * 8})
    result = explain_host_growth(before, step=200)
    paths = [h.path for h in result.holders]
    assert any(p.startswith("test_a_local_in_a_user_frame_is_a_stable_root() local kept") for p in paths), paths
    assert len(kept) == 200


def test_census_cost_is_bounded_by_its_budget():
    census = take_host_census(time_budget_s=0.001, max_objects=10_000)
    assert census.truncated and census.objects <= 10_000
    assert census.seconds < 5


def test_bad_parameters_name_the_parameter_and_the_fix():
    with pytest.raises(ValueError, match=r"take_host_census\(time_budget_s\)=0 is invalid; use a positive"):
        take_host_census(time_budget_s=0)
    before = take_host_census()
    with pytest.raises(ValueError, match=r"explain_host_growth\(top\)=0"):
        explain_host_growth(before, top=0)
    with pytest.raises(ValueError, match=r"TracemallocWindow\(frames\)=0"):
        TracemallocWindow(frames=0)


KEPT_WITH_MONITOR: dict = {}


def test_the_monitors_own_records_are_never_named_as_holders(tmp_path):
    """A user who keeps the monitor in a global reaches its history rows and readers' reads from a
    stable root; they grow every sampled step, but they are the monitor's records, not the run's
    (before: ``module ...: global mon._session.engine.rows`` headed the list, above the user's dict)."""
    from memcallbacks import Monitor

    global MON
    model = torch.nn.Linear(16, 4)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    MON = Monitor(model, opt, output_dir=str(tmp_path), sample_every_n_steps=1)
    try:
        def step(s: int) -> None:
            loss = model(torch.randn(8, 16)).pow(2).mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
            if s % 4 == 0:
                KEPT_WITH_MONITOR[s] = [s] * 3

        for s in range(20):
            step(s)
        before = take_host_census(step=20)
        for s in range(20, 400):
            step(s)
        result = explain_host_growth(before, step=400, top=5)
        paths = [h.path for h in result.holders]
        assert paths and paths[0] == f"module {__name__}: global KEPT_WITH_MONITOR", paths
        assert not [p for p in paths if "MON." in p or "_session" in p], paths
    finally:
        MON.close()
        MON = None
        KEPT_WITH_MONITOR.clear()
