"""Under torch.distributed, the end-of-run files are neither killed with a failing peer nor written after ``fit()`` returned.

The Lightning DDP tests run ``tests/scripts/ddp_end_write.py`` (2 CPU processes, gloo, Lightning's
own "ddp" launcher) with one rank's write slowed down (a fault injected into the plot stage: a
slow disk). The others call :func:`write_detached` itself: the writer process
(``memcallbacks._files.writer_process``) writes what the rank would, reports a full disk as the
rank would, and is replaced by the rank's own write when it cannot give a result.
"""

from __future__ import annotations

import errno
import json
import logging
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pandas as pd
import pytest

import memcallbacks._runtime.end_write as end_write
from memcallbacks._files.outputs import write_outputs
from memcallbacks._runtime.end_write import write_detached

SCRIPTS = Path(__file__).parents[1] / "scripts"
SCRIPT = SCRIPTS / "ddp_end_write.py"
RANK0_FILES = {"history.rank0.csv", "report.rank0.json", "memory.rank0.png"}
RANK1_FILES = {"history.rank1.csv", "report.rank1.json", "memory.rank1.png"}

pytestmark = pytest.mark.slow


def run(tmp_path: Path, *args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    env.pop("MASTER_PORT", None)
    return subprocess.run([sys.executable, str(SCRIPT), str(tmp_path), *args], cwd=str(tmp_path), env=env,
                          capture_output=True, text=True, timeout=300)


def wait_for(folder: Path, names: set[str], timeout_s: float = 60.0) -> list[str]:
    """The folder's listing once ``names`` are all there and nothing is half-written (or at the timeout)."""
    deadline = time.monotonic() + timeout_s
    while True:
        listing = sorted(p.name for p in folder.iterdir()) if folder.exists() else []
        if (names <= set(listing) and not any(n.endswith(".tmp") for n in listing)) or time.monotonic() > deadline:
            return listing
        time.sleep(0.2)


def test_rank0_keeps_its_files_when_a_failing_peer_gets_it_killed(tmp_path: Path) -> None:
    # rank 1 raises at step 2; rank 0's collective fails, it writes its files (slowly: 8 s), and
    # Lightning's observer SIGKILLs it within 5 s of rank 1's exit: in the middle of that write
    proc = run(tmp_path, "--fail-at-step", "2", "--slow-rank", "0", "--slow-s", "8")
    assert proc.returncode != 0
    listing = wait_for(tmp_path / "mem", RANK0_FILES | RANK1_FILES)
    assert not [n for n in listing if n.endswith(".tmp")], listing  # the writer's payload included
    assert RANK0_FILES <= set(listing), listing
    report = json.loads((tmp_path / "mem" / "report.rank0.json").read_text())
    assert report["summary"]["rank"] == 0
    assert list(pd.read_csv(tmp_path / "mem" / "history.rank0.csv")["step"])[:2] == [0, 1]
    assert [e["kind"] for e in json.loads((tmp_path / "mem" / "report.rank1.json").read_text())["events"]] == ["exception"]


def test_fit_returns_on_rank0_only_once_every_rank_wrote_its_files(tmp_path: Path) -> None:
    proc = run(tmp_path, "--slow-rank", "1", "--slow-s", "4")
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    after_fit = json.loads((tmp_path / "rank0_after_fit.json").read_text())
    assert RANK0_FILES | RANK1_FILES | {"report.json"} <= set(after_fit), after_fit
    assert not [n for n in after_fit if n.endswith(".tmp")], after_fit


# ---------------------------------------------------------------------- write_detached itself
def arguments(rows: int = 50, **over):
    rng = np.random.default_rng(0)
    history = pd.DataFrame({"step": np.arange(rows), "allocated": rng.random(rows) * 1e9, "reserved": rng.random(rows) * 2e9,
                            "peak_forward": rng.random(rows) * 3e9, "peak_backward": rng.random(rows) * 3e9,
                            "peak_optimizer": [np.nan] * rows, "micro_batches": np.ones(rows, dtype=np.int64)})
    report = {"summary": {"rank": 0, "device": {"peak_source": "max_memory_allocated"}, "count": np.int64(3),
                          "ratio": float("nan"), "pair": (1, 2)}, "events": [], "files": {}}
    return dict(dict(rank=0, world_size=2, history=history, eval_history=pd.DataFrame({"step": [1, 2]}), report=report,
                     plot=True, title="probe, rank 0", ranks=[{"rank": 0, "peak": np.float32(1.5)}, {"rank": 1}]), **over)


class Spy:
    """``write_outputs`` in this process, counted (the fallback)."""

    def __init__(self) -> None:
        self.calls = 0

    def __call__(self, *args, **kwargs):
        self.calls += 1
        return write_outputs(*args, **kwargs)


def test_the_writer_process_writes_the_files_this_process_would(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.DEBUG, logger="memcallbacks")
    inline, detached = tmp_path / "inline", tmp_path / "detached"
    inline.mkdir()
    detached.mkdir()
    expected = write_outputs(inline, **arguments())
    spy = Spy()
    files = write_detached(spy, detached, detach=True, owner="test", **arguments())
    assert spy.calls == 0  # written by the writer process
    assert {k: Path(v).name for k, v in files.items()} == {k: Path(v).name for k, v in expected.items()}
    assert sorted(p.name for p in detached.iterdir()) == sorted(p.name for p in inline.iterdir())  # its payload removed
    for name in sorted(p.name for p in inline.iterdir()):
        assert (detached / name).read_bytes().replace(str(detached).encode(), str(inline).encode()) == (inline / name).read_bytes(), name
    timing = [r.getMessage() for r in caplog.records if "writer process" in r.getMessage() and "in all" in r.getMessage()]
    assert len(timing) == 1, [r.getMessage() for r in caplog.records]


def test_a_relative_folder_means_the_same_folder_to_the_writer(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    Path("rel").mkdir()
    files = write_detached(Spy(), Path("rel"), detach=True, owner="test", **arguments(plot=False))
    assert files["history"] == os.path.join("rel", "history.rank0.csv") and (tmp_path / files["history"]).exists()
    assert json.loads((tmp_path / "rel" / "report.rank0.json").read_text())["files"]["history"] == files["history"]


def test_the_writer_process_imports_no_torch(tmp_path: Path) -> None:
    payload = end_write.save_payload(tmp_path, 0, arguments(plot=False))
    proc = subprocess.run([sys.executable, "-m", end_write.WRITER_MODULE, payload], cwd=str(tmp_path),
                          env=end_write.writer_environment(), capture_output=True, timeout=120)
    result = json.loads(proc.stdout.decode().splitlines()[-1])
    assert proc.returncode == 0 and "files" in result, result
    assert result["torch_imported"] is False
    assert not os.path.exists(payload)


def test_a_full_disk_in_the_writer_process_is_an_oserror_here_and_the_first_set_stays_whole(tmp_path: Path) -> None:
    folder = tmp_path / "small"
    folder.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(folder)], capture_output=True).returncode != 0:
        pytest.skip("cannot mount a 1 MiB tmpfs here (needs root); the full-disk case is untested")
    try:
        first = write_outputs(folder, **arguments(rows=5, plot=False))
        before = {name: (folder / name).read_bytes() for name in os.listdir(folder)}
        with open(folder / "filler", "wb", buffering=0) as fh:  # fill the disk to the last byte
            try:
                while True:
                    fh.write(b"\0" * 4096)
            except OSError:
                pass
        # room for the payload (the frames pickled: 8 bytes a value), not for the CSV (~19 characters a value)
        big = arguments(rows=4000, plot=False)
        os.truncate(folder / "filler", (folder / "filler").stat().st_size - 70 * 4096)
        spy = Spy()
        with pytest.raises(OSError) as info:
            write_detached(spy, folder, detach=True, owner="test", **big)
        assert info.value.errno == errno.ENOSPC and spy.calls == 0, info.value
        assert {name: (folder / name).read_bytes() for name in os.listdir(folder) if name != "filler"} == before
        assert set(before) == {Path(p).name for p in first.values()} | {"report.json"}
    finally:
        subprocess.run(["umount", str(folder)], check=False)


def test_a_writer_that_gives_no_result_is_replaced_by_this_process(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                                    caplog: pytest.LogCaptureFixture) -> None:
    monkeypatch.setattr(end_write, "WRITER_MODULE", "memcallbacks._files.no_such_module")
    spy = Spy()
    files = write_detached(spy, tmp_path, detach=True, owner="test", **arguments(plot=False))
    assert spy.calls == 1 and Path(files["report"]).exists()
    assert not list(tmp_path.glob("*.tmp")) and not list(tmp_path.glob(".*.tmp"))
    assert any("without a result; writing the memory files in this process" in r.getMessage() for r in caplog.records)


def test_past_the_timeout_the_rank_goes_on_and_the_writer_finishes_alone(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.syspath_prepend(str(SCRIPTS))
    monkeypatch.setattr(end_write, "WRITER_MODULE", "slow_end_writer")
    monkeypatch.setenv("DDP_END_WRITE_SLOW_S", "4")
    spy = Spy()
    assert write_detached(spy, tmp_path, detach=True, owner="test", timeout_s=0.5, **arguments()) == {}
    # the rank went on without waiting: the writer, 4 s slow, has not written its report yet (no clock read here)
    assert spy.calls == 0 and not (tmp_path / "report.json").exists()
    listing = wait_for(tmp_path, {"history.rank0.csv", "memory.rank0.png", "report.rank0.json", "report.json"})
    assert {"history.rank0.csv", "memory.rank0.png", "report.rank0.json", "report.json"} <= set(listing), listing
    assert not [n for n in listing if n.endswith(".tmp")], listing


def test_a_plot_that_fails_in_the_writer_is_logged_here(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    history = arguments()["history"].drop(columns=["allocated"])  # history_figure needs it
    files = write_detached(write_outputs, tmp_path, detach=True, owner="test", **arguments(history=history))
    assert "plot" not in files and Path(files["history"]).exists()
    assert any(r.levelno == logging.ERROR and "could not draw memory.rank0.png" in r.getMessage() and "KeyError" in r.getMessage()
               for r in caplog.records), [r.getMessage() for r in caplog.records]
