"""Bad command-line input: exit code 2 and one clear line on stderr, never a traceback or exit 0."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from memcallbacks.cli import main

LONG = "x" * 300  # longer than NAME_MAX (255): Path.exists() raises instead of answering


def snapshot_file(tmp_path: Path) -> Path:
    """The repository's allocator-format snapshot (tests/data, made by make_cuda_like_snapshot.py)."""
    return Path(__file__).parents[1] / "data" / "cuda_like_snapshot.pickle"


def report_dir(tmp_path: Path, report: Any, history: bytes | None = None) -> Path:
    folder = tmp_path / "out"
    folder.mkdir()
    (folder / "report.json").write_text(json.dumps(report))
    if history is not None:
        (folder / "history.csv").write_bytes(history)
    return folder


CASES = {
    "report: long name": lambda p: ["report", str(p / LONG)],
    "report: JSON list": lambda p: ["report", str(report_dir(p, [1, 2, 3]))],
    "report: summary not an object": lambda p: ["report", str(report_dir(p, {"summary": "x"}))],
    "report: binary history.csv": lambda p: ["report", str(report_dir(p, {"summary": {}}, b"\x00\xff\xfe binary \x00"))],
    "report: foreign history.csv": lambda p: ["report", str(report_dir(p, {"summary": {}}, b"name,age\nann,3\n"))],
    "summary: long name": lambda p: ["summary", str(p / LONG)],
    "render: long name": lambda p: ["render", str(p / LONG)],
    "summary --device 99": lambda p: ["summary", str(snapshot_file(p)), "--device", "99"],
    "summary --between -5 -1": lambda p: ["summary", str(snapshot_file(p)), "--between", "-5", "-1"],
    "summary --trigger -1": lambda p: ["summary", str(snapshot_file(p)), "--trigger", "-1"],
}


@pytest.mark.parametrize("case", list(CASES))
def test_bad_input_exits_2_with_one_line(tmp_path: Path, capsys: Any, case: str) -> None:
    assert main(CASES[case](tmp_path)) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("memcallbacks ") and "Traceback" not in err[0], err


def test_readme_headline_estimate_runs_and_states_its_assumption(capsys: Any) -> None:
    assert main("estimate --params 7e9 --strategies ddp,fsdp2,zero3 --world-sizes 8".split()) == 0
    out = capsys.readouterr().out
    assert "assuming --largest-layer 2.19e+08 (params/32" in out and "| zero3 x8 |" in out
