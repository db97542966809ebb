"""Runs that die before their end, each made once: what their folder says after (the record), and what the
monitor said before (the forecast). Issue 43's Done-when.

A run in a process of its own (``tests/scripts/dying_run.py``) keeps 2 MiB of tensors a step in the
module-level list ``LEAK`` and ends one of these ways:

- the kernel's OOM killer, in a memory cgroup below this process's own (v1 or v2; skipped with the reason
  where the machine allows none) whose limit is what the run holds plus 320 MiB: a Lightning fit at
  defaults (TensorBoard logger), one with ``logger=False``, and a plain ``Monitor`` with
  ``auto_snapshot=True`` (a snapshot taken before the end);
- ``RLIMIT_AS`` set likewise: an allocation fails ("can't allocate memory"; a plain ``Monitor`` at defaults);
- SIGKILL at step 60, on every machine: a plain ``Monitor`` and a Lightning fit, at defaults.

The record: ``memcallbacks report`` on the folder exits 0, says first that the run did not finish, gives a
step within 15 of the last one reached and names the list, and, where the cgroup counted the kill, says the
OOM killer was the likely end. The forecast, where memory ran out: logged 20 steps or more before the end and
within 20% of the step reached, and shown in the report. The step reached is the run's own: it writes
``STEP n`` to stderr as each step starts, and the monitor's lines come in between, in order, so a busy
machine (slower steps, a thinner watch) changes no assertion's footing.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

import pytest

from helpers import tensorboard_scalars
from memcallbacks._base.limits import Cgroup, oom_kills
from memcallbacks._files.journal import read_journal
from memcallbacks.cli import main
from test_limits import child_memory_cgroup

pytestmark = pytest.mark.usefixtures("one_thread")

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "dying_run.py"
KILL_AT = 60
WITHIN = 15  # the last step recorded is this close to the last one reached (a tick every 8 steps)
AHEAD = 20  # steps before the end the forecast must have been said
CLOSE = 0.2  # ... and how close to the step reached
HOLDER = "held by module __main__: global LEAK"

_FORECAST = re.compile(r"[Mm]emory runs out (?:at about step ([\d,]+)|now \(step ([\d,]+)\))")


@dataclass
class Run:
    returncode: int
    stderr: str
    out: Path

    @property
    def reached(self) -> int:
        """The last step the run started."""
        steps = [int(line.split()[1]) for line in self.stderr.splitlines() if line.startswith("STEP ")]
        assert steps, self.stderr[-3000:]
        return steps[-1]

    def forecasts(self) -> list[tuple[int, int]]:
        """Each forecast said: (the step it was said at, the step it named)."""
        at, out = -1, []
        for line in self.stderr.splitlines():
            if line.startswith("STEP "):
                at = int(line.split()[1])
            elif (match := _FORECAST.search(line)) is not None:
                out.append((at, forecast_step(match)))
        return out

    def journal(self) -> Path:
        found = list(self.out.rglob("journal.jsonl"))
        assert len(found) == 1, found
        return found[0]


def forecast_step(match: re.Match[str]) -> int:
    return int((match.group(1) or match.group(2)).replace(",", ""))


def dying_run(tmp_path: Path, shape: str, *args: str, cgroup: Path | None = None) -> Run:
    def join() -> None:
        if cgroup is not None:
            (cgroup / "cgroup.procs").write_text(str(os.getpid()))

    out = tmp_path / "out"
    env = {**os.environ, "PYTHONPATH": str(SCRIPT.parents[2]), "MPLBACKEND": "Agg", "OMP_NUM_THREADS": "1"}
    done = subprocess.run([sys.executable, str(SCRIPT), str(out), shape, *args], capture_output=True, text=True, timeout=300,
                          preexec_fn=join, env=env)
    return Run(done.returncode, done.stderr, out)


@pytest.fixture
def cgroup_dir() -> Iterator[Path]:
    with child_memory_cgroup("memcallbacks-dying") as child:
        yield child


def report(folder: Path, capsys: pytest.CaptureFixture[str]) -> str:
    capsys.readouterr()
    code = main(["report", str(folder)])
    text = capsys.readouterr().out
    assert code == 0, text
    return text


def check_record(run: Run, capsys: pytest.CaptureFixture[str]) -> str:
    """The report on the run's folder: it did not finish, where it stopped (within ``WITHIN`` steps), the holder."""
    assert "END" not in run.stderr.splitlines(), run.stderr[-3000:]
    text = report(run.out, capsys)
    assert text.splitlines()[0].startswith("memcallbacks: this run did not finish"), text
    line = next(x for x in text.splitlines() if x.strip().startswith("last step recorded"))
    assert 0 <= run.reached - int(line.split()[3]) <= WITHIN, (run.reached, text)
    assert HOLDER in text, text
    return text


def check_forecast(run: Run, text: str | None = None) -> None:
    """Every forecast said ``AHEAD`` steps or more before the end named a step within ``CLOSE`` of the step reached;
    and the report's (``text``), the last one recorded, too."""
    reached, said = run.reached, run.forecasts()
    assert reached > 100, run.stderr[-3000:]
    ahead = [(at, step) for at, step in said if at <= reached - AHEAD]
    assert ahead, f"no forecast said {AHEAD} steps before step {reached}: {said}\n{run.stderr[-3000:]}"
    for at, step in ahead:
        assert abs(step - reached) <= CLOSE * reached, f"said at step {at}: step {step}; reached {reached} ({said})"
    if text is not None:
        shown = [forecast_step(m) for m in _FORECAST.finditer(text.split("what it recorded until then")[0])]
        assert len(shown) == 1 and abs(shown[0] - reached) <= CLOSE * reached, (shown, reached, text)


def check_oom_killed(run: Run, cgroup: Path, capsys: pytest.CaptureFixture[str]) -> str:
    """SIGKILL by the kernel's OOM killer, counted by the cgroup the journal's start record names; the record says so."""
    assert run.returncode == -9, (run.returncode, run.stderr[-3000:])
    start = read_journal(run.journal()).start
    recorded = Cgroup.from_dict(start["cgroup"])
    assert recorded is not None and recorded.dirs[0] == str(cgroup), start["cgroup"]
    assert oom_kills(recorded) == start["cgroup"]["oom_kills"] + 1
    assert "memory cgroup's limit" in run.stderr  # the forecast's limit
    text = check_record(run, capsys)
    assert "likely end                 the kernel's OOM killer: its memory cgroup (cgroup v" in text, text
    check_forecast(run, text)
    return text


def test_lightning_at_defaults_killed_by_the_oom_killer(tmp_path: Path, cgroup_dir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    run = dying_run(tmp_path, "lightning", "--limit", "cgroup", "--cgroup", str(cgroup_dir), cgroup=cgroup_dir)
    check_oom_killed(run, cgroup_dir, capsys)
    # TensorBoard got the steps left at the logged steps (Lightning's every 50; the logger flushes at each)
    scalars = tensorboard_scalars(run.out / "lightning_logs")
    left = [(step, value) for step, value in scalars["memory/runs_out_in_steps"] if step <= run.reached - AHEAD]
    assert left, scalars["memory/runs_out_in_steps"]
    for step, value in left:
        assert abs(step + value - run.reached) <= CLOSE * run.reached, (step, value, run.reached)


def test_lightning_without_a_logger_killed_by_the_oom_killer(tmp_path: Path, cgroup_dir: Path,
                                                             capsys: pytest.CaptureFixture[str]) -> None:
    run = dying_run(tmp_path, "lightning_nologger", "--limit", "cgroup", "--cgroup", str(cgroup_dir), cgroup=cgroup_dir)
    check_oom_killed(run, cgroup_dir, capsys)


def test_plain_monitor_killed_by_the_oom_killer_with_a_snapshot_before(tmp_path: Path, cgroup_dir: Path,
                                                                       capsys: pytest.CaptureFixture[str]) -> None:
    run = dying_run(tmp_path, "plain_snapshot", "--limit", "cgroup", "--cgroup", str(cgroup_dir), cgroup=cgroup_dir)
    check_oom_killed(run, cgroup_dir, capsys)
    taken = re.findall(r"memory snapshot \(memory runs out in about (\d+) steps[^\n]*\) at step (\d+) written to (\S+)", run.stderr)
    assert len(taken) == 1, run.stderr[-3000:]
    left, step, path = int(taken[0][0]), int(taken[0][1]), Path(taken[0][2])
    # taken when the forecast left about 20 steps or 15% of its horizon (more by the steps between two reads of a
    # thinned watch), at a read whether or not the finding updated, written before the end
    assert left <= 40 and run.reached - 60 <= step < run.reached and path.is_file(), (left, step, run.reached)


def test_plain_monitor_under_rlimit_as(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    run = dying_run(tmp_path, "plain", "--limit", "rlimit")
    assert run.returncode == 1 and "can't allocate memory" in run.stderr, (run.returncode, run.stderr[-3000:])
    assert "the address-space limit RLIMIT_AS" in run.stderr
    check_forecast(run)
    # the error came out of the loop: the monitor was dropped, and its files were written at the interpreter's exit
    text = report(run.out / "mem", capsys)
    assert HOLDER in text and "RLIMIT_AS" in text, text


def test_a_plain_loop_killed_at_a_step_is_read_plotted_and_compared(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    run = dying_run(tmp_path, "plain", "--kill-at", str(KILL_AT))
    assert run.returncode == -9 and run.reached == KILL_AT, run.stderr[-3000:]
    assert not list(run.out.rglob("report.json")) and run.journal().parent == run.out / "mem"
    text = check_record(run, capsys)
    assert "rising" in text and "likely end                 not known" in text, text  # a SIGKILL: far from any limit
    assert main(["plot", str(run.out / "mem"), "-o", str(tmp_path / "killed.png")]) == 0
    assert (tmp_path / "killed.png").read_bytes()[:4] == b"\x89PNG"
    from test_journal import plain_run

    plain_run(tmp_path / "finished", 30)
    capsys.readouterr()
    assert main(["compare", str(tmp_path / "finished"), str(run.out / "mem")]) == 0
    out = capsys.readouterr().out
    assert "B did not finish" in out and "peak" in out, out


def test_a_lightning_fit_killed_at_a_step_is_read_back(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    run = dying_run(tmp_path, "lightning", "--kill-at", str(KILL_AT))
    assert run.returncode == -9 and run.reached == KILL_AT, run.stderr[-3000:]
    assert not list(run.out.rglob("report.json"))
    text = check_record(run, capsys)  # the run folder: Lightning's version_0 holds the monitor's folder
    assert "rising" in text and "likely end                 not known" in text, text
