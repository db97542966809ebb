"""Under Lightning DDP, the end-of-run files are neither killed with a failing peer nor written after ``fit()`` returned.

Both tests run ``tests/scripts/ddp_end_write.py`` (2 CPU processes, gloo, Lightning's own "ddp"
launcher) with one rank's write slowed down (a fault injected into the plot stage: a slow disk).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pandas as pd
import pytest

SCRIPT = Path(__file__).parents[1] / "scripts" / "ddp_end_write.py"
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


@pytest.mark.xfail(strict=True, reason="the forked writer is off (end_write.DETACH_WRITER): it hung and aborted after fork "
                   "in gloo runs (OpenBLAS/OpenMP, gloo threads); rank 0 killed by the launcher still loses its files")
def test_rank0_keeps_its_files_when_a_failing_peer_gets_it_killed(tmp_path: Path) -> None:
    # rank 1 raises at step 2; rank 0's collective fails, it writes its files (slowly: 8 s), and
    # Lightning's observer SIGKILLs it within 5 s of rank 1's exit: in the middle of that write
    proc = run(tmp_path, "--fail-at-step", "2", "--slow-rank", "0", "--slow-s", "8")
    assert proc.returncode != 0
    listing = wait_for(tmp_path / "mem", RANK0_FILES | RANK1_FILES)
    assert not [n for n in listing if n.endswith(".tmp")], listing
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
