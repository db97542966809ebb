"""The overhead budget is a promise (issue 24, part 2): every cost the monitor takes is counted in its
own time, by part, and the costly part backs off; a graph root is found without scanning the heap.

The loop is benchmarks/nanogpt_budget.py's nanoGPT-style loop (``logits, loss = model(x, y)``,
``loss = loss / k``, logits kept to the next forward), trained for real on CPU. No timing assertion
beyond the monitor's own counters: the wall-time comparison is the benchmark's (docs/benchmarks.md).
"""

from __future__ import annotations

import importlib.util
import json
import logging
from pathlib import Path

import pytest
import torch
from torch import nn

from memcallbacks import Monitor
from memcallbacks._runtime.schedule import LINGERING_EVERY_STEP_UNTIL

_BENCH = Path(__file__).resolve().parents[2] / "benchmarks" / "nanogpt_budget.py"
_spec = importlib.util.spec_from_file_location("nanogpt_budget", _BENCH)
nanogpt = importlib.util.module_from_spec(_spec)  # type: ignore[arg-type]
_spec.loader.exec_module(nanogpt)  # type: ignore[union-attr]

pytestmark = pytest.mark.usefixtures("one_thread")

SMALL = dict(accumulation=2, batch_size=4, block_size=16)
STEADY = dict(accumulation=2, batch_size=8, block_size=16)  # ~80 ms steps here: a short run whose steady state is measurable


def _parts_add_up(cadence: dict) -> None:
    parts = cadence["own_time_by_part_s"]
    assert set(parts) == {"read", "sample", "watch", "lingering", "tripwire", "journal", "gc", "findings", "hooks", "imports", "dispatch", "end"}, parts
    assert sum(parts.values()) == pytest.approx(cadence["own_time_s"], abs=2e-3), cadence


def test_nanogpt_style_loop_stays_within_its_budget_at_defaults(tmp_path):
    """The issue's case: the model's own loss tensor dies (``loss = loss / k``) while its graph lives
    on through the user's ``loss``. Before the fix the graph root was searched by a heap scan at every
    lingering check after step 20 (the check was always "too early", so never backed off): the own
    time was 7-20% of step time. Now the root is found among the loop's variables, and the harmless
    situation is measured a few times and backed off."""
    r = nanogpt.train(110, monitored=True, output_dir=str(tmp_path / "mem"), **STEADY)
    c = r["cadence"]
    # The share of the step is a timing a second busy process moves, so it is measured in
    # benchmarks/nanogpt_budget.py, side by side with a bare loop (docs/benchmarks.md), not asserted here.
    # What made it 7-20% before the fix is behaviour, and is asserted: a heap scan at every lingering check.
    assert c["own_time_by_part_s"]["hooks"] > 0, c
    assert c["lingering_heap_scans"] == 0, c  # `loss` is a local of train(): found without the heap
    # the situation (last step's logits and divided loss alive) is measured, found harmless, backed off:
    # after the first 20 steps, far fewer checks than marks every 4th sampled step would give
    assert c["lingering_checks"] <= 20 + 30, c
    assert r["findings"] == [], r["findings"]  # 16x65 float logits are far below lingering_min_bytes
    assert c["finding_time_s"] == 0.0
    _parts_add_up(c)
    # what report.json says is what the monitor measured
    report = json.loads((tmp_path / "mem" / "report.json").read_text())
    assert report["summary"]["cadence"]["overhead"] == c["overhead"]
    assert "own time" in r["monitor"].format_report()


class _Keeper:
    """Holds the divided loss two containers deep, where the variables' search does not look."""

    def __init__(self) -> None:
        self.box: dict[str, list[torch.Tensor]] = {"last": []}


def test_a_root_only_the_heap_scan_finds_is_scanned_once_the_budget_pays_for_it(tmp_path):
    """A loop whose marked graph only a heap scan reaches (the loss derived from the model's output is
    kept two containers deep, the output itself in no variable), on a heap of real size: the first
    scan costs tens of milliseconds or more, far above the budget of a ~10 ms step. The next scan
    waits until the budget has paid for that one (at ~10 ms steps, thousands of steps), so the
    harmless situation is not re-measured at every check; the scan is counted, its cost is in the
    lingering check's part of the own time."""
    heap = [(i, str(i)) for i in range(300_000)]
    torch.manual_seed(0)
    model = nn.Sequential(*(nn.Linear(64, 64) for _ in range(6)))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    keeper = _Keeper()
    monitor = Monitor(model, optimizer, output_dir=str(tmp_path / "mem"), plot=False)
    for _ in range(160):
        keeper.box["last"] = [model(torch.randn(64, 64)).pow(2).mean() / 2]
        keeper.box["last"][0].backward()
        optimizer.step()
        optimizer.zero_grad()
    monitor.close()
    del heap
    c = monitor.report()["summary"]["cadence"]
    assert c["lingering_heap_scans"] == 1, c  # before: one at every check after step 20 (every 4th sampled step)
    assert c["lingering_checks"] >= LINGERING_EVERY_STEP_UNTIL, c  # the checks went on, without the scan
    assert c["own_time_by_part_s"]["lingering"] > 0
    # the share of the step is a timing a busy machine moves (benchmarks/, docs/benchmarks.md); the
    # behaviour is that the heap scan's cost is in the lingering part, not repeated at every check
    assert c["own_time_by_part_s"]["lingering"] >= c["own_time_by_part_s"]["findings"], c
    _parts_add_up(c)


class _Records(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


def test_over_budget_the_costliest_part_backs_off_and_says_so_once(tmp_path):
    """A budget no interval can keep (one millionth of the step time), over 300 steps (the guard's windows
    are at least 0.25 s of step time): every window of the guard is
    over it, and each doubles the interval of that window's costliest part that has one; the
    back-offs are in report.json, and the log says so once."""
    records = _Records()
    logger = logging.getLogger("memcallbacks")
    level = logger.level
    logger.setLevel(logging.INFO)
    logger.addHandler(records)
    try:
        r = nanogpt.train(300, monitored=True, output_dir=str(tmp_path / "mem"),
                          monitor_kwargs={"advanced": {"overhead_budget": 1e-6}, "log_every_n_steps": 1000}, **SMALL)
    finally:
        logger.removeHandler(records)
        logger.setLevel(level)
    c = r["cadence"]
    assert c["over_budget_windows"] >= 2, c
    assert c["backoffs"], c
    assert {b["part"] for b in c["backoffs"]} <= {"read", "sample", "lingering"}, c["backoffs"]
    assert all(b["own_time"] > 1e-6 for b in c["backoffs"]), c["backoffs"]
    if any(b["part"] == "read" for b in c["backoffs"]):
        assert c["read_every_n_steps"] > 32, c  # past the cap the intervals chosen from medians keep to
    said = [m for m in records.messages if "above overhead_budget" in m and "half as often" in m]
    assert len(said) == 1, records.messages  # said once, however many back-offs follow
    assert said[0].startswith("Monitor: "), said
    # a window with nothing left to widen (the logged steps remain) is said once too, in its own words
    assert len([m for m in records.messages if "above overhead_budget" in m]) <= 2, records.messages
    _parts_add_up(c)


def test_finding_time_is_the_censuses_time(tmp_path):
    """``finding_time_s`` counts the growth finding's two censuses (one when it is raised, one when the
    run ends), as the finding's own ``census_cost_s`` says, and both are in the own time."""
    kept: list[torch.Tensor] = []
    model = nn.Sequential(nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    monitor = Monitor(model, optimizer, output_dir=str(tmp_path / "mem"), plot=False)
    for x in monitor.track(list(torch.randn(14, 8, 32))):
        model(x).pow(2).mean().backward()
        optimizer.step()
        optimizer.zero_grad()
        kept.append(torch.ones(1 << 20))  # 4 MiB a step
    monitor.close()
    report = json.loads((tmp_path / "mem" / "report.json").read_text())
    growth = next(f for f in report["findings"] if f["kind"] == "growth")
    cadence = report["summary"]["cadence"]
    census = growth["details"]["census_cost_s"]
    assert census > 0
    assert cadence["finding_time_s"] == pytest.approx(census, abs=0.01 + 0.05 * census), (cadence, growth["details"])
    assert cadence["own_time_by_part_s"]["findings"] == pytest.approx(cadence["finding_time_s"], abs=1e-3)
    assert cadence["own_time_s"] >= cadence["finding_time_s"]
    del kept


def test_a_census_in_a_hook_is_counted_once(tmp_path):
    """A plain loop's step starts in its forward pre-hook and its own time is charged at the step's
    end, in a later hook call; the hooks' meter counts each call whole less what the timers inside
    it charged. A census at a step's start (a planted 1 MiB/step leak found) is finding time, once:
    before, the meter took it as the hooks' time too (0.28 s of each, own time 70% of the run)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(256, 512), nn.ReLU(), nn.Linear(512, 10))
    optimizer = torch.optim.AdamW(model.parameters())
    kept = []
    with Monitor(model, optimizer, output_dir=str(tmp_path / "mem"), plot=False) as monitor:
        for _ in range(60):
            loss = nn.functional.cross_entropy(model(torch.randn(64, 256)), torch.randint(10, (64,)))
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            kept.append(torch.ones(1 << 18))
    c = monitor.report()["summary"]["cadence"]
    parts = c["own_time_by_part_s"]
    assert parts["findings"] > 0, c  # the growth was found and its holders named
    assert parts["hooks"] < 0.25 * parts["findings"], parts
    _parts_add_up(c)


def test_the_benchmark_times_both_loops_side_by_side_each_in_its_own_process(tmp_path):
    """benchmarks/nanogpt_budget.py's harness (docs/benchmarks.md): a bare and a monitored loop, each
    in a process of its own (torch's optimizer-step hooks are global: in one process the monitor's
    hooks ran in the bare loop's steps too), every step of both timed; the monitor's cadence comes
    back from its process. No timing is asserted: the numbers are the benchmark's."""
    r = nanogpt.concurrent(6, str(tmp_path / "mem"), heap_objects=0, timeout_s=120, **SMALL)
    assert len(r["bare_s"]) == len(r["monitored_s"]) == 6
    assert all(t > 0 for t in r["bare_s"] + r["monitored_s"])
    assert r["cadence"]["own_time_s"] > 0 and r["findings"] == [], r
    assert (tmp_path / "mem" / "report.json").exists()  # written by the monitored loop's process
    control = nanogpt.concurrent(3, str(tmp_path / "none"), monitored=False, heap_objects=0, timeout_s=120, **SMALL)
    assert "cadence" not in control and len(control["monitored_s"]) == 3
    assert not (tmp_path / "none").exists()  # neither loop had a monitor
