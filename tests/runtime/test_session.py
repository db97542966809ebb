"""The session driven directly (issue 22): no framework, a tiny real model and optimizer on CPU.

``attach``/``observe``, the step protocol (``begin_step`` → ``boundary`` → ``end_step``) split into
quiet, watched and sampled steps, ``finish``/``stop``, a planted leak, checkpointing and the output
folder rule. Expected step numbers come from the documented cadence: with ``log_every_n_steps=10``
the logged steps are those with ``(step + 1) % 10 == 0``; the first ``MEASURE_STEPS`` (4) steps are
sampled; no step before ``QUIET_FROM`` (24) is quiet.
"""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from helpers import flat_settings
from memcallbacks._base.columns import BACKWARD, FORWARD, MICRO_BATCHES, OPTIMIZER, STEP
from memcallbacks._runtime.adapter_support import rank_zero_trackers
from memcallbacks._runtime.lifecycle import output_folder
from memcallbacks._runtime.schedule import QUIET_FROM
from memcallbacks._runtime.session import Session

pytestmark = pytest.mark.usefixtures("one_thread")

MIB = 1 << 20
LEAKED: list[torch.Tensor] = []  # the planted leak's holder: a module-level list


class Recorder:
    """An observer (the pytest plugin's probe's interface) that records every call, in order."""

    def __init__(self) -> None:
        self.calls: list[tuple[Any, ...]] = []

    def step_beginning(self, micro_batch: bool) -> None:
        self.calls.append(("step_beginning", micro_batch))

    def phase_closed(self, phase: int) -> None:
        self.calls.append(("phase_closed", int(phase)))

    def step_ended(self, batch: Any, loss: Any) -> None:
        self.calls.append(("step_ended", batch is not None, loss is not None))

    def run_finishing(self) -> None:
        self.calls.append(("run_finishing",))


class Tiny:
    """A tiny real model, optimizer and one step of training, with the session's calls around it."""

    def __init__(self) -> None:
        torch.manual_seed(0)
        self.model = nn.Sequential(nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 1))
        self.optimizer = torch.optim.SGD(self.model.parameters(), lr=0.01)
        self.x = torch.randn(8, 16)

    def step(self, session: Session, step: int, leak: bool = False) -> tuple[bool, list[Any] | None]:
        """One training step; returns (quiet between begin and end, end_step's row)."""
        session.begin_step(step)
        quiet = session.quiet_step
        if leak:
            LEAKED.append(torch.ones(MIB // 4))  # 1 MiB of float32, every page written
        loss = self.model(self.x).pow(2).mean()
        session.boundary(FORWARD)
        loss.backward()
        session.boundary(BACKWARD)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        quiet = quiet and session.quiet_step  # still quiet right before end_step
        row = session.end_step(OPTIMIZER, batch=self.x, loss=loss)
        return quiet, row


def new_session(tmp_path: Path, **config: Any) -> Session:
    config.setdefault("output_dir", str(tmp_path / "out"))
    return Session(flat_settings(**config), "plain", "Monitor", logging.getLogger("memcallbacks.test_session"))


@pytest.fixture
def sessions():
    """Sessions to stop at the test's end, whatever happens in it."""
    made: list[Session] = []
    yield made
    for s in made:
        s.stop()


# ---------------------------------------------------------------------- attach()
def test_attach_sets_what_is_given_and_keeps_the_rest(tmp_path, sessions):
    s = new_session(tmp_path)
    sessions.append(s)
    assert s.log_fn is None and s.trackers is None and s.title == ""

    def log_fn(metrics: dict[str, float], step: int) -> None:
        pass

    trackers = rank_zero_trackers(True, lambda: [], "Monitor", logging.getLogger("t"))
    s.attach(log_fn=log_fn, trackers=trackers, title="run A")
    assert s.log_fn is log_fn and s.trackers is trackers and s.title == "run A"
    s.attach(title="run B")  # only the title
    assert s.log_fn is log_fn and s.trackers is trackers and s.title == "run B"
    s.attach(title=None)  # None keeps the title
    assert s.title == "run B"
    s.attach(log_fn=None, trackers=None)  # explicitly None: cleared
    assert s.log_fn is None and s.trackers is None and s.title == "run B"

    s.start(torch.device("cpu"))
    tiny = Tiny()
    s.attach(model=tiny.model, optimizer=tiny.optimizer)
    assert s.checks.state.model is tiny.model and s.checks.state.optimizer is tiny.optimizer
    assert s.checks.watch is not None and s.checks.watch.attribution.model is tiny.model and s.checks.watch.attribution.optimizer is tiny.optimizer
    s.attach(log_fn=log_fn)  # the model is kept
    assert s.checks.state.model is tiny.model and s.checks.watch.attribution.model is tiny.model and s.log_fn is log_fn


def test_attach_with_a_model_sets_the_training_objects_together(tmp_path, sessions):
    """``model=`` is one part with its optimizer, precision, strategy and world size (as the adapters
    know them together): a second ``attach(model=...)`` without them clears them (documented)."""
    s = new_session(tmp_path)
    sessions.append(s)
    s.start(torch.device("cpu"))
    tiny = Tiny()
    s.attach(model=tiny.model, optimizer=tiny.optimizer, precision="bf16-mixed")
    assert s.checks.state.optimizer is tiny.optimizer and s.checks.state.precision == "bf16-mixed"
    s.attach(title="kept")  # no model: the training objects are kept
    assert s.checks.state.optimizer is tiny.optimizer and s.checks.state.precision == "bf16-mixed"
    s.attach(model=tiny.model)
    assert s.checks.state.optimizer is None and s.checks.state.precision is None


# ---------------------------------------------------------------------- the step protocol
def test_sixty_steps_at_defaults_sample_log_and_go_quiet(tmp_path, sessions):
    s = new_session(tmp_path, log_every_n_steps=10)
    sessions.append(s)
    logged: list[int] = []
    s.attach(log_fn=lambda metrics, step: logged.append(step))
    s.start(torch.device("cpu"))
    tiny = Tiny()
    s.attach(model=tiny.model, optimizer=tiny.optimizer)
    quiet: list[int] = []
    returned: list[int] = []
    for step in range(60):
        was_quiet, row = tiny.step(s, step)
        if was_quiet:
            quiet.append(step)
            assert row is None  # a quiet step's end_step returns None
        if row is not None:
            assert row[STEP] == step
            returned.append(step)
        assert not s.step_open and not s.quiet_step
    logged_steps = [9, 19, 29, 39, 49, 59]
    assert logged == logged_steps  # log_fn on logged steps only
    rows = [int(r[STEP]) for r in s.rows]
    assert rows == returned  # end_step returns the row it appended
    # sampled: the first MEASURE_STEPS (0-3), and every logged step
    assert set(range(4)) | set(logged_steps) <= set(rows)
    assert rows == sorted(rows)
    # quiet steps appear, only from QUIET_FROM on (24: after the dense reads), never on a logged or sampled step
    assert len(quiet) >= 5, f"too few quiet steps in 60 steps at defaults: {quiet}"  # 24, 25, ... planned
    assert min(quiet) >= QUIET_FROM == 24
    assert not set(quiet) & set(rows) and not set(quiet) & set(logged_steps)
    assert s.engine.seen_steps == 60  # quiet steps are counted too


def test_quiet_steps_boundary_and_end_step_do_nothing(tmp_path, sessions):
    s = new_session(tmp_path, log_every_n_steps=10)
    sessions.append(s)
    s.start(torch.device("cpu"))
    tiny = Tiny()
    s.attach(model=tiny.model, optimizer=tiny.optimizer)
    for step in range(50):  # 0..49: step 49 is logged; the plan after it covers 50..58
        tiny.step(s, step)
    rows_before = len(s.rows)
    s.schedule.trip = None  # the schedule as planned, without the RSS tripwire cutting the stretch short
    s.begin_step(50)
    assert s.quiet_step and s.step_open and not s.sampling
    s.boundary(FORWARD)
    s.boundary(BACKWARD)
    assert s.end_step(OPTIMIZER) is None
    assert not s.quiet_step and not s.step_open and len(s.rows) == rows_before


def test_observer_sees_the_protocol_in_order(tmp_path, sessions):
    s = new_session(tmp_path, log_every_n_steps=10, plot=False)
    sessions.append(s)
    s.start(torch.device("cpu"))
    probe = Recorder()
    s.observe(probe)
    tiny = Tiny()
    tiny.step(s, 0)
    one_step = [
        ("step_beginning", False),
        ("phase_closed", int(FORWARD)),
        ("phase_closed", int(BACKWARD)),
        ("phase_closed", int(OPTIMIZER)),  # end_step's closing phase
        ("step_ended", True, True),
    ]
    assert probe.calls == one_step
    tiny.step(s, 1)
    assert probe.calls == one_step * 2
    s.finish(gather=False)
    assert probe.calls[-1] == ("run_finishing",) and len(probe.calls) == 11
    # end_step with no open step: no phase_closed, no step_ended
    probe.calls.clear()
    assert s.end_step(OPTIMIZER) is None
    assert probe.calls == []


def test_micro_batches_are_counted_in_the_row(tmp_path, sessions):
    s = new_session(tmp_path)
    sessions.append(s)
    s.start(torch.device("cpu"))
    probe = Recorder()
    s.observe(probe)
    tiny = Tiny()
    for _ in range(3):  # three micro-batches: the step's begin_step, then two more while it is open
        s.begin_step(0)
        loss = tiny.model(tiny.x).pow(2).mean()
        s.boundary(FORWARD)
        loss.backward()
        s.boundary(BACKWARD)
    tiny.optimizer.step()
    row = s.end_step(OPTIMIZER)
    assert row is not None and row[MICRO_BATCHES] == 3
    beginnings = [c for c in probe.calls if c[0] == "step_beginning"]
    assert beginnings == [("step_beginning", False), ("step_beginning", True), ("step_beginning", True)]
    assert s.engine.seen_steps == 1  # one optimizer step, however many micro-batches


# ---------------------------------------------------------------------- finish() and stop()
def test_finish_writes_the_files_and_stop_is_safe_twice(tmp_path):
    out = tmp_path / "files"
    s = new_session(tmp_path, output_dir=str(out), log_every_n_steps=5, plot=False)
    s.start(torch.device("cpu"))
    tiny = Tiny()
    s.attach(model=tiny.model, optimizer=tiny.optimizer, title="direct")
    for step in range(10):
        tiny.step(s, step)
    files = s.finish(gather=False)
    assert Path(files["history"]) == out / "history.csv" and Path(files["report"]) == out / "report.json"
    assert (out / "history.csv").is_file() and (out / "report.json").is_file()
    report = json.loads((out / "report.json").read_text())
    assert report["framework"] == "plain"
    history = (out / "history.csv").read_text().splitlines()
    assert history[0].split(",")[0] == "step" and len(history) - 1 == len(s.rows)
    assert s.live and s.started
    s.stop()
    assert not s.live and not s.started
    s.stop()  # a second stop: no error
    assert not s.live and not s.started


def test_stop_before_start_is_safe(tmp_path):
    s = new_session(tmp_path)
    s.stop()
    s.stop()
    assert not s.started


# ---------------------------------------------------------------------- leak detection
def test_a_planted_leak_is_found_within_20_steps(tmp_path, sessions):
    s = new_session(tmp_path)  # defaults: the plain loop's 50-step logging interval
    sessions.append(s)
    s.start(torch.device("cpu"))
    tiny = Tiny()
    s.attach(model=tiny.model, optimizer=tiny.optimizer)
    LEAKED.clear()
    try:
        for step in range(20):
            tiny.step(s, step, leak=True)
            if any(f.kind == "growth" for f in s.findings):
                break
        growth = [f for f in s.findings if f.kind == "growth"]
        assert growth, f"no growth finding in 20 steps of a 1 MiB/step leak: {s.findings}"
        assert growth[0].step < 20
        assert growth[0].details["rate_bytes_per_step"] == pytest.approx(MIB, rel=0.25)
    finally:
        LEAKED.clear()


# ---------------------------------------------------------------------- checkpointing
def test_state_dict_round_trip_restores_findings_and_events(tmp_path, sessions):
    s = new_session(tmp_path)
    sessions.append(s)
    s.start(torch.device("cpu"))
    tiny = Tiny()
    s.attach(model=tiny.model, optimizer=tiny.optimizer)
    LEAKED.clear()
    try:
        for step in range(20):
            tiny.step(s, step, leak=True)
            if s.findings:
                break
    finally:
        LEAKED.clear()
    s.record_exception(RuntimeError("boom"), 7)
    assert s.findings and s.events
    state = s.state_dict()
    findings, events, rows = s.sink.to_list(), list(s.events), len(s.rows)

    fresh = new_session(tmp_path, output_dir=str(tmp_path / "other"))
    sessions.append(fresh)
    fresh.load_state_dict(json.loads(json.dumps(state)))  # as a checkpoint would carry it
    assert fresh.sink.to_list() == findings
    assert [(f.kind, f.step) for f in fresh.findings] == [(f.kind, f.step) for f in s.findings]
    assert fresh.events == events
    assert fresh.events[0]["kind"] == "exception" and fresh.events[0]["step"] == 7
    assert fresh.events[0]["error"] == "RuntimeError: boom"
    assert len(fresh.rows) == rows and fresh.engine.seen_steps == s.engine.seen_steps


def test_a_bad_state_raises_one_value_error_naming_the_key(tmp_path):
    s = new_session(tmp_path)
    with pytest.raises(ValueError, match="my_key"):
        s.load_state_dict({"version": 1, "rows": "not rows"}, key="my_key")


# ---------------------------------------------------------------------- the output folder rule
def test_output_folder_rule(tmp_path, monkeypatch):
    real = tmp_path / "real"
    real.mkdir()
    link = tmp_path / "link"
    link.symlink_to(real)
    default = tmp_path / "default"
    monkeypatch.chdir(tmp_path)
    assert output_folder(str(link), str(default)) == str(real.resolve())  # output_dir first, links resolved
    assert output_folder(None, str(link)) == str(real.resolve())  # else the adapter's default
    assert output_folder(None, None) == os.path.realpath(tmp_path / "memcallbacks_output")  # else cwd
    assert output_folder("", None) == os.path.realpath(tmp_path / "memcallbacks_output")
    assert output_folder("rel", None) == os.path.realpath(tmp_path / "rel")  # absolute, from cwd now
    assert os.path.isabs(output_folder(None, "relative_default"))


def test_start_writes_into_the_output_folder_the_rule_names(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    s = Session(flat_settings(), "plain", "Monitor")
    try:
        s.start(torch.device("cpu"))
        assert s.output_dir is not None
        assert os.path.realpath(s.output_dir) == os.path.realpath(tmp_path / "memcallbacks_output")
    finally:
        s.stop()
    d = Session(flat_settings(), "plain", "Monitor")
    try:
        d.start(torch.device("cpu"), default_output_dir=str(tmp_path / "logs"))
        assert os.path.realpath(d.output_dir) == os.path.realpath(tmp_path / "logs")
    finally:
        d.stop()
