"""The record that streams (journal.py): a run that never reaches its end leaves a folder ``memcallbacks report`` reads.

The runs killed in a process of their own (SIGKILL at a step, the kernel's OOM killer in a memory cgroup,
``RLIMIT_AS``) are in test_killed_runs.py, each made once for its record and its forecast. Here: a rank of a
2-rank gloo run that SIGKILLs itself (``tests/scripts/journal_ranks.py``: its own record, "rank 1 stopped
first"), a dropped monitor (its files at exit; killed before, the report says where it was dropped), and
in-process runs: the clean end (today's set, no journal), the cap and its compaction, a torn last line,
memory near a limit, the rows' replay.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from helpers import free_port
from memcallbacks import Monitor
from memcallbacks._files import journal as journal_module
from memcallbacks._files.journal import read_journal, replay_rows
from memcallbacks.cli import main

pytestmark = pytest.mark.usefixtures("one_thread")

SCRIPTS = Path(__file__).parents[1] / "scripts"
WITHIN = 15  # the last step recorded is this close to the last one reached (ticks every 8 steps)


def report(folder: Path, capsys: pytest.CaptureFixture[str]) -> tuple[int, str]:
    capsys.readouterr()
    code = main(["report", str(folder)])
    return code, capsys.readouterr().out


def last_step(text: str) -> int:
    line = next(x for x in text.splitlines() if x.strip().startswith("last step recorded"))
    return int(line.split()[3])


def reached(path: Path) -> int:
    return int(path.read_text().split()[0])


def plain_run(folder: Path, steps: int, *, leak: list[Any] | None = None, close: bool = True, **config: Any) -> Monitor:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 32))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    monitor = Monitor(model, optimizer, output_dir=str(folder), **config)
    for x in monitor.track(list(torch.randn(steps, 4, 32))):
        model(x).pow(2).mean().backward()
        optimizer.step()
        optimizer.zero_grad()
        if leak is not None:
            leak.append(torch.ones(1 << 19))  # 2 MiB a step
    if close:
        monitor.close()
    return monitor


def test_a_clean_end_replaces_the_journal_with_the_file_set(tmp_path: Path) -> None:
    monitor = plain_run(tmp_path, 30, close=False)
    journal = read_journal(tmp_path / "journal.jsonl")  # while it runs: the record so far
    assert journal.start["framework"] == "torch" and journal.start["world_size"] == 1 and journal.rows
    assert journal.start["columns"][0] == "step" and journal.last_tick is not None and journal.end is None
    monitor.close()
    assert sorted(os.listdir(tmp_path)) == ["history.csv", "memory.png", "report.json"]
    assert json.loads((tmp_path / "report.json").read_text())["run"]["id"] == journal.run_id


def test_the_journal_keeps_its_cap_thinning_rows_never_findings(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(journal_module, "CAP_BYTES", 24 << 10)
    leak: list[Any] = []
    monitor = plain_run(tmp_path, 400, leak=leak, close=False, sample_every_n_steps=1)
    path = tmp_path / "journal.jsonl"
    record = read_journal(path)
    assert path.stat().st_size <= (24 << 10) + 8 * 1024  # the cap, and what came in since the last tick's check
    assert record.start.get("compacted") and record.start["run_id"] == monitor._session.schedule.journal.run_id
    assert "growth" in {f["kind"] for f in record.findings.values()}  # the finding survived every compaction
    steps = [int(r[0]) for r in record.rows]
    assert len(steps) < 400 and steps[-1] >= 390 and steps == sorted(steps)  # older rows thinned, the newest whole
    assert steps[-64:] == list(range(steps[-64], steps[-64] + 64))
    monitor.close()  # the end record carries the rows the journal thinned: the files are whole
    assert sorted(os.listdir(tmp_path)) == ["history.csv", "memory.png", "report.json"]
    assert len(monitor.history) == 400
    del leak


def test_a_torn_last_line_is_left_out(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    monitor = plain_run(tmp_path, 30, close=False)
    path = tmp_path / "journal.jsonl"
    whole = read_journal(path)
    with open(path, "ab") as fh:
        fh.write(b'{"t":"row","time":1.0,"r":[30, 0, 30, 1')  # the process died in the middle of this write
    torn = read_journal(path)
    assert torn.torn and torn.rows == whole.rows and torn.bad_lines == 0
    code, text = report(tmp_path, capsys)
    assert code == 0 and "its last record was cut short" in text, text
    monitor._session.schedule.journal.close()  # as if killed: the file stays as it is
    monitor._finalizer.detach()
    monitor._cleanup.run()


def test_rows_replay_as_the_engine_thins_them() -> None:
    rows = [[i] for i in range(1000)]
    kept: list[list[int]] = []
    for row in rows:  # MemoryEngine.end_step's halving, as written
        kept.append(row)
        if len(kept) > 100:
            kept = kept[1::2]
    assert replay_rows(rows, 100) == kept


def test_memory_near_a_limit_reads_as_the_oom_killer(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A record with no cgroup to ask (gone, or another host) whose resident memory grew by all but about 16 MiB of the
    room a limit left at the start: the OOM killer, likely. The same record with 1 GiB more room: not known. (In this
    process the leak reuses freed heap and its RSS hardly moves: the start's RSS is set 100 MiB below the records'.)"""
    monitor = plain_run(tmp_path, 40, close=False)
    monitor._session.schedule.journal.close()  # as if killed: the file stays as it is
    monitor._finalizer.detach()
    monitor._cleanup.run()
    path = tmp_path / "journal.jsonl"
    lines = path.read_text().splitlines()
    start = json.loads(lines[0])
    ticks = [json.loads(x).get("rss", 0) for x in lines if x.startswith('{"t":"tick"')]
    start["rss_bytes"] = max([r[7] for r in read_journal(path).rows] + ticks) - (100 << 20)  # host_rss of the rows
    start["cgroup"] = None
    near = "the kernel's OOM killer, likely: resident memory at the last record was"
    for room, said in ((116 << 20, near), ((116 << 20) + (1 << 30), "not known")):
        start["limits"] = [{"source": "cgroup", "limit_bytes": 4 << 30, "used_bytes": (4 << 30) - room, "room_bytes": room,
                            "where": "cgroup v2 /job", "limit": "the memory cgroup's limit (4.0 GiB, cgroup v2 /job)"}]
        path.write_text("\n".join([json.dumps(start), *lines[1:]]) + "\n")
        code, text = report(tmp_path, capsys)
        assert code == 0 and f"likely end                 {said}" in text, text
        assert said != near or "MiB under the memory cgroup's limit (4.0 GiB, cgroup v2 /job)" in text, text


DROPPED = """
import sys, torch
from memcallbacks import Monitor
model = torch.nn.Linear(32, 32); optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
monitor = Monitor(model, optimizer, output_dir=sys.argv[1])
for x in monitor.track(torch.randn(40, 4, 32)):
    model(x).sum().backward(); optimizer.step(); optimizer.zero_grad()
if sys.argv[2] == "drop-and-kill":
    del monitor  # dropped: its journal ends here, its files are due at exit
    import os, signal
    os.kill(os.getpid(), signal.SIGKILL)
"""


def test_a_monitor_dropped_without_close_writes_its_files_at_exit(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    done = subprocess.run([sys.executable, "-c", DROPPED, str(tmp_path / "exit"), "keep"], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "dropped without close()" in done.stderr and "memcallbacks: no problem found in 40 steps" in done.stdout
    assert sorted(os.listdir(tmp_path / "exit")) == ["history.csv", "memory.png", "report.json"]
    assert json.loads((tmp_path / "exit" / "report.json").read_text())["run"]["ended"] == "dropped without close()"
    done = subprocess.run([sys.executable, "-c", DROPPED, str(tmp_path / "killed"), "drop-and-kill"], capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == -9 and os.listdir(tmp_path / "killed") == ["journal.jsonl"], done.stderr[-3000:]
    code, text = report(tmp_path / "killed", capsys)
    assert code == 0 and "its monitor was dropped without close() at step" in text, text


@pytest.mark.slow
def test_a_killed_rank_leaves_its_own_record_and_the_report_says_it_stopped_first(tmp_path: Path,
                                                                                  capsys: pytest.CaptureFixture[str]) -> None:
    port = str(free_port())
    procs = [subprocess.Popen([sys.executable, str(SCRIPTS / "journal_ranks.py"), str(tmp_path), "--kill-at", "30"],
                              env={**os.environ, "RANK": str(r), "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port,
                                   "OMP_NUM_THREADS": "1"}, stdout=subprocess.PIPE, stderr=subprocess.STDOUT) for r in (0, 1)]
    outs = [p.communicate(timeout=300)[0].decode(errors="replace") for p in procs]
    assert procs[1].returncode == -9, outs[1][-3000:]
    mem = tmp_path / "mem"
    rank0 = json.loads((mem / "report.rank0.json").read_text())  # rank 0's own record: its files, with the failure
    assert [e["kind"] for e in rank0["events"]] == ["exception"], outs[0][-3000:]
    rank1 = read_journal(mem / "journal.rank1.jsonl")  # rank 1's own record: its journal
    assert rank1.start["rank"] == 1 and rank1.start["world_size"] == 2 and rank1.end is None
    code, text = report(mem, capsys)
    assert code == 0 and text.splitlines()[0].startswith("memcallbacks: this run did not finish: rank 1 stopped first"), text
    assert "rank 0    ended with an exception at step" in text, text
    assert 0 <= reached(tmp_path / "reached.rank1") - last_step(text) <= WITHIN, text


def test_a_finding_that_joins_another_cause_leaves_the_journal(tmp_path: Path) -> None:
    """One cause, one finding in a run that did not finish: the step-1 lingering graph, then the growth it turns
    into (the cause's key changes): the journal reads back one finding each time, and a compaction keeps only it."""
    from memcallbacks._base.findings import Finding, FindingLog

    journal = journal_module.Journal()
    journal.open(tmp_path, {"framework": "torch"}, rank=0, world_size=1)
    log = FindingLog()
    log.add(Finding(kind="lingering", step=1, key="lingering:graph", message="Step 0's graph was alive.", bytes=1 << 20,
                    details={"graph_alive": True, "held_by": ["Net.kept"]}))
    journal.note_findings(log.findings, log.version)
    assert list(read_journal(journal.path).findings) == ["lingering:graph"]
    log.add(Finding(kind="growth", step=4, message="The graphs of steps 0..3 were alive.", bytes=4 << 20,
                    details={"evidence": "graph_chain", "held_by": ["Net.kept"]}))
    journal.note_findings(log.findings, log.version)
    record = read_journal(journal.path)
    assert list(record.findings) == ["growth"] and record.findings["growth"]["first_step"] == 1
    assert [e["key"] for e in record.findings["growth"]["evidence"]] == ["lingering:graph", "growth"]
    assert list(journal._findings) == ["growth"]  # what a compaction writes
    journal.close()


def test_ticks_are_stores_into_the_tick_file_beside_the_journal(tmp_path: Path) -> None:
    """A tick is a store into a mapped file beside the journal (a ``write`` after a step's compute costs it 20-50 µs):
    no tick line in the journal, the file's record within 8 steps of the last step, the file gone at a clean end."""
    monitor = plain_run(tmp_path, 200, close=False)
    assert not any(b'"t":"tick"' in line for line in (tmp_path / "journal.jsonl").read_bytes().splitlines())
    tick_file = tmp_path / "journal.tick"
    assert tick_file.stat().st_size == journal_module.TICK_BYTES
    tick = json.loads(tick_file.read_bytes())
    assert tick["t"] == "tick" and 200 - 8 <= tick["step"] < 200, tick
    assert read_journal(tmp_path / "journal.jsonl").last_step()[0] >= 200 - 8
    monitor.close()
    assert not tick_file.exists()
