"""Own time is what the user's clock sees, counted in parts (issue 45): the hooks, the reads and the
other step parts, the imports the monitor's code starts during the run, torch's dispatch of its hook
calls (an estimate), and, apart from the share of step time, the one-off diagnoses (each with its
step and time) and the run's end. Deterministic checks of the accounting on real runs; the timings
themselves are the benchmarks' (benchmarks/own_time_honesty.py, docs/benchmarks.md)."""

from __future__ import annotations

import importlib.machinery
import json
import subprocess
import sys

import pytest
import torch
from torch import nn

from memcallbacks import Monitor
from memcallbacks._base import cpu
from memcallbacks._files.report import _cost_lines
from memcallbacks._runtime.schedule import APART, PARTS

pytestmark = pytest.mark.usefixtures("one_thread")

SLOW_IMPORT_S = 0.03


def _slow_module(folder, name: str) -> None:
    """A module whose import costs SLOW_IMPORT_S of this thread's CPU."""
    (folder / f"{name}.py").write_text(
        "import time\n"
        f"_end = time.thread_time() + {SLOW_IMPORT_S}\n"
        "while time.thread_time() < _end:\n"
        "    pass\n"
    )


def _loop(monitor_kwargs: dict, steps: int, tmp_path, *, before_step=None, kept=None) -> Monitor:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    with Monitor(model, optimizer, output_dir=str(tmp_path / "mem"), plot=False, console_summary=False, **monitor_kwargs) as monitor:
        for i in range(steps):
            if before_step is not None:
                before_step(i)
            model(torch.randn(16, 32)).pow(2).mean().backward()
            optimizer.step()
            optimizer.zero_grad()
            if kept is not None:
                kept.append(torch.ones(1 << 20))  # 4 MiB a step: a growth finding, its holders named
    return monitor


def _track_loop(steps: int, tmp_path) -> Monitor:
    """The README's plain loop: ``track()``, then ``close()`` (no ``with``)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    monitor = Monitor(model, optimizer, output_dir=str(tmp_path / "mem"), plot=False, console_summary=False)
    for batch in monitor.track([torch.randn(16, 32) for _ in range(steps)]):
        model(batch).pow(2).mean().backward()
        optimizer.step()
        optimizer.zero_grad()
    monitor.close()
    return monitor


def _parts_add_up(c: dict) -> None:
    parts = c["own_time_by_part_s"]
    assert set(parts) == set(PARTS)
    assert sum(parts.values()) == pytest.approx(c["own_time_s"], abs=2e-3), c
    steady = c["own_time_s"] - sum(parts[k] for k in APART)
    assert c["overhead"] == pytest.approx(steady / c["step_time_timed_s"], rel=0.01, abs=2e-5), c


def test_an_import_the_monitor_starts_during_the_run_is_its_own_part(tmp_path, monkeypatch):
    """A module imported by code the monitor runs (here: the log_fn it calls at a logged step) is timed
    as the ``imports`` part, apart from the step part it happened in; one the user's loop imports is
    not the monitor's. The module keeps its real loader."""
    _slow_module(tmp_path, "imported_by_log_fn")
    _slow_module(tmp_path, "imported_by_the_loop")
    monkeypatch.syspath_prepend(str(tmp_path))

    def log_fn(metrics, step):
        import imported_by_log_fn  # noqa: F401

    def before_step(i):
        if i == 30:
            import imported_by_the_loop  # noqa: F401

    steps = 60
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    with Monitor(model, optimizer, log_fn, output_dir=str(tmp_path / "mem"), plot=False, console_summary=False,
                 log_every_n_steps=10) as monitor:
        for i in range(steps):
            before_step(i)
            model(torch.randn(16, 32)).pow(2).mean().backward()
            optimizer.step()
            optimizer.zero_grad()
    c = monitor.report()["summary"]["cadence"]
    assert c["imports_during_run"] == 1, c
    assert c["own_time_by_part_s"]["imports"] >= 0.8 * SLOW_IMPORT_S, c
    assert c["own_time_by_part_s"]["imports"] < 2 * SLOW_IMPORT_S + 0.05, c  # the loop's own import is not in it
    assert c["overhead_by_part"]["imports"] > 0, c
    for name in ("imported_by_log_fn", "imported_by_the_loop"):
        module = sys.modules.pop(name)
        assert type(module.__loader__) is importlib.machinery.SourceFileLoader, module.__loader__
        assert module.__spec__.loader is module.__loader__
    assert cpu.IMPORTS[1] >= 1
    _parts_add_up(c)


def test_no_module_is_imported_by_the_monitor_during_a_plain_run(tmp_path):
    """What the monitor needs during the steps it imports when it is built: a plain run at defaults
    imports nothing from its code while it trains (the run's end may: its files)."""
    monitor = _loop({}, 70, tmp_path)
    c = monitor.report()["summary"]["cadence"]
    assert c["own_time_by_part_s"]["imports"] == 0.0, c


def test_the_run_end_is_a_part_apart_from_the_share(tmp_path):
    monitor = _loop({}, 60, tmp_path)
    c = monitor.report()["summary"]["cadence"]
    assert c["end_of_run_s"] > 0 and c["own_time_by_part_s"]["end"] == pytest.approx(c["end_of_run_s"], abs=1e-4)
    written = json.loads((tmp_path / "mem" / "report.json").read_text())["summary"]["cadence"]
    assert 0 < written["end_of_run_s"] <= c["end_of_run_s"]  # report.json has the end up to its report
    # ...and the wall time the end took up to it: the writer process's (an interpreter, pandas) that close() waits for,
    # which this process's own time leaves out (a user check: "plus 0.00 s at the end" after a 1.26 s close())
    assert written["end_wall_s"] >= written["end_of_run_s"] + 0.05, written
    text = subprocess.run([sys.executable, "-m", "memcallbacks", "report", str(tmp_path / "mem")], capture_output=True, text=True,
                          timeout=120).stdout
    assert f"the end took {written['end_wall_s']:.2f} s up to this report, most of it the writer process" in text, text
    _parts_add_up(c)


def test_torch_dispatch_of_the_hook_calls_is_estimated_from_their_count(tmp_path):
    """Every forward of a hooked model goes through torch's hooked call path, past both of the monitor's
    gates: the ``dispatch`` part is their count times the cost measured once per process, and the caches
    the hook calls evict, at the hooks' measured time again (the budget's COLD_FACTOR of 2)."""
    steps = 60
    monitor = _loop({}, steps, tmp_path)
    c = monitor.report()["summary"]["cadence"]
    parts = c["own_time_by_part_s"]
    # a forward pre-hook and a forward hook, one forward a step, and a quiet step's light optimizer post-hook call
    assert 2 * steps < c["hooked_calls"] < 3 * steps, c
    assert c["dispatch_call_cost_us"] is not None and c["dispatch_call_cost_us"] >= 0
    expected = c["hooked_calls"] * c["dispatch_call_cost_us"] * 1e-6 + parts["hooks"]
    assert parts["dispatch"] == pytest.approx(expected, rel=0.01, abs=2e-4), c  # each figure rounded
    _parts_add_up(c)


def test_a_quiet_step_reads_no_cpu_clock(tmp_path):
    """The CPU clock is a system call, which slows the step after it: a quiet step's hook calls are timed
    on the wall clock and read the CPU clock not once."""
    reads: list[int] = []

    def before_step(i):
        reads.append(cpu.CLOCK_READS[0])

    # a budget no interval can keep: the reads and samples as far apart as they go, most steps quiet
    monitor = _loop({"log_every_n_steps": 1000, "advanced": {"overhead_budget": 1e-6}}, 120, tmp_path, before_step=before_step)
    c = monitor.report()["summary"]["cadence"]
    per_step = [b - a for a, b in zip(reads[60:], reads[61:])]
    assert per_step.count(0) >= len(per_step) // 2, (per_step, c["read_every_n_steps"], c["sample_every_n_steps"])
    assert c["own_time_by_part_s"]["hooks"] > 0, c


def test_a_diagnosis_is_reported_apart_with_its_step_and_time(tmp_path):
    """Naming what holds a growth (two censuses) is one-off work: listed with its step and time, out of
    the share of step time, and said so in the text report."""
    kept: list[torch.Tensor] = []
    monitor = _loop({}, 40, tmp_path, kept=kept)
    report = monitor.report()
    c = report["summary"]["cadence"]
    growth = next(f for f in report["findings"] if f["kind"] == "growth")
    assert c["diagnoses"], c
    assert sum(d["seconds"] for d in c["diagnoses"]) == pytest.approx(c["finding_time_s"], abs=2e-3), c
    assert all(d["step"] >= growth["first_step"] for d in c["diagnoses"]), (c["diagnoses"], growth)
    text = monitor.format_report()
    assert "to name what holds the growth found" in text, text
    assert "naming holders for findings" not in text
    _parts_add_up(c)
    del kept


def test_the_text_report_lists_the_parts_and_what_was_spent_once():
    cadence = {"overhead": 0.006, "overhead_after_start": 0.005, "overhead_budget": 0.01, "dense_read_steps": 48,
               "overhead_by_part": {"hooks": 0.003, "dispatch": 0.001, "read": 0.001, "sample": 0.001, "imports": 0.0},
               "diagnoses": [{"step": 39, "seconds": 1.04}, {"step": 55, "seconds": 0.5}, {"step": 80, "seconds": 0.001}],
               "end_of_run_s": 0.12}
    findings = [{"kind": "growth", "first_step": 39, "step": 90}]
    text = "\n".join(_cost_lines({"cadence": cadence}, {}, findings))
    assert "0.60% of step time (0.50% after the first 48 steps), budget 1%" in text
    assert "by part: hooks 0.30%, torch's dispatch (estimate) 0.10%" in text and "imports 0.00%" in text
    assert "plus 1.04 s once at step 39, to name what holds the growth found there" in text
    assert "plus 0.50 s once at step 55, to name what holds the growth found at step 39" in text
    assert "step 80" not in text  # under 5 ms: in report.json only
    assert "plus 0.12 s at the end of the run" in text
    alone = "\n".join(_cost_lines({"cadence": dict(cadence, diagnoses=[{"step": 20, "seconds": 0.35}])}, {}, []))
    assert "a census for a suspicion that raised no finding" in alone


def test_finding_work_under_a_millisecond_is_no_diagnosis_of_its_own():
    """A user check read a 0.00 s diagnosis at a clean run's last step, and 0.0001 s entries at every step
    a leak stayed open: work under 1 ms joins the last diagnosis, or waits for the next; the total keeps it."""
    from helpers import flat_settings
    from memcallbacks._runtime.schedule import MIN_DIAGNOSIS_S, Schedule

    s = Schedule(flat_settings())
    for count, seconds in ((5, 2e-5), (9, 0.4), (10, 1e-4), (11, 1e-4), (30, 0.2)):
        s.count_now = count
        s._diagnosed(seconds)
    assert [d["step"] for d in s.diagnoses] == [9, 30], s.diagnoses
    assert s.diagnoses[0]["seconds"] == pytest.approx(0.4 + 2e-5 + 2e-4)
    assert sum(d["seconds"] for d in s.diagnoses) == pytest.approx(0.6 + 2.2e-4)
    clean = Schedule(flat_settings())
    clean.count_now = 59
    clean._diagnosed(MIN_DIAGNOSIS_S / 100)
    assert clean.diagnoses == []


def test_the_quiet_steps_tripwire_checks_and_journal_ticks_are_timed(tmp_path):
    """A quiet step's tripwire check and the journal's tick every 8th step cost 10-50 µs of cold caches after the
    step's compute, several times their warm cost: each is timed on the wall clock (no CPU clock on a quiet step)
    and booked as the ``tripwire`` and ``journal`` parts, under track() (no hook meter around them) too."""
    monitor = _track_loop(200, tmp_path)
    c = monitor.report()["summary"]["cadence"]
    parts = c["own_time_by_part_s"]
    assert parts["journal"] > 0 and c["rss_checks"] > 0 and parts["tripwire"] > 0, c
    _parts_add_up(c)


def test_a_track_loops_quiet_steps_are_its_own_time_and_take_the_fast_path(tmp_path, monkeypatch):
    """Under track(), a step's bookkeeping runs after the user's optimizer step (30-60 µs of cold caches a step): it is
    metered as the hooks' part, as auto mode's pre-hook is (it was counted nowhere). A quiet step after a quiet one,
    with no tripwire check or journal tick due, is begun without the step's end and start (Session.quiet_next);
    every step is still counted."""
    from memcallbacks._runtime.session import Session

    begun = []
    begin = Session.begin_step

    def counting(self, *args, **kwargs):
        begun.append(args[0] if args else kwargs.get("step"))
        return begin(self, *args, **kwargs)

    monkeypatch.setattr(Session, "begin_step", counting)
    monitor = _track_loop(300, tmp_path)
    report = monitor.report()
    c = report["summary"]["cadence"]
    assert report["summary"]["steps_seen"] == 300 and int(monitor.history["optimizer_steps"].sum()) + 300 - len(monitor.history) == 300
    assert c["own_time_by_part_s"]["hooks"] > 0, c
    assert len(begun) < 300 // 2, len(begun)  # the quiet stretch's steps after the first 48 mostly take the fast path
    _parts_add_up(c)
