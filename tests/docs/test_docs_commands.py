"""Every ``memcallbacks ...`` and ``python ...`` command shown in README.md and docs/*.md runs as shown.

Commands are taken from fenced code blocks (a leading ``$ `` dropped, ``&&`` chains split) and from
inline code spans, and run in one scratch folder holding what they read: the snapshot pickles they
name (copies of tests/data/cuda_like_snapshot.pickle) and ``examples/``. The commands that read the
run the Lightning example writes (``memcallbacks report runs/example/version_0``) run in that
example's test, right after it: under pytest-xdist another test may run on another worker, whose
scratch folder has no run. A command another test runs exactly as shown, checking what it wrote
(``RUN_BY``), is left to that test.
"""

from __future__ import annotations

import contextlib
import re
import shlex
import shutil
from pathlib import Path

import pytest

import helpers

ROOT = Path(__file__).resolve().parents[2]
SNAPSHOTS = ("memory_snapshot_step12.pickle", "memory_snapshot_step120.pickle", "snap.pickle")

#: Shown but not run here, each with its reason. Everything else must exit 0.
#: Benchmarks (``python benchmarks/...``) are timed runs of minutes, some for a GPU: here each one's
#: exact command line is parsed (``--help`` appended: every option before it is checked), and
#: docs/benchmarks.md says when each was last run in full.
EXEMPT = {
    "python -m pytest -q -n 2 --dist worksteal": "the whole test suite (it includes this test)",
    "memcallbacks summary": "the name of a command in prose, not a command line",
    "memcallbacks report": "the name of a command in prose, not a command line",
    "memcallbacks estimate": "the name of a command in prose, not a command line",
    "memcallbacks render": "the name of a command in prose, not a command line",
    "memcallbacks compare": "the name of a command in prose, not a command line",
    "memcallbacks render: no such file: PATH": "an error message quoted in prose",
}

#: Run as shown by another test, which checks what they wrote (each named file holds the command): not run twice.
RUN_BY = {
    "python tests/scripts/sharded_fit.py /tmp/sharded --runner lightning --strategy fsdp2": "tests/adapters/test_sharding.py",
}


def documented_commands() -> list[str]:
    found: list[str] = []
    for doc in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]:
        text = doc.read_text()
        lines = [line for block in re.findall(r"```[^\n]*\n(.*?)```", text, re.S) for line in block.splitlines()]
        lines += re.findall(r"(?<!`)`([^`\n]+)`(?!`)", re.sub(r"```.*?```", "", text, flags=re.S))
        for line in lines:
            line = line.strip().removeprefix("$ ")
            for part in line.split("&&"):
                command = part.split("  #")[0].split(" # ")[0].strip()
                if re.match(r"(memcallbacks|python) \S", command) and command not in found:
                    found.append(command)
    return found


WRITES_RUNS = "python examples/lightning_cpu.py"  # writes runs/example/, which the commands naming it read


def reads_runs(command: str) -> bool:
    return "runs/example" in command


@pytest.fixture(scope="module")
def scratch(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("docs")
    for name in SNAPSHOTS:
        shutil.copy(ROOT / "tests" / "data" / "cuda_like_snapshot.pickle", folder / name)
    for name in ("examples", "benchmarks", "tests", "scripts"):
        (folder / name).symlink_to(ROOT / name)
    # what a later command reads (a saved model config) is made here too: under pytest-xdist the
    # command that writes it may run on another worker, in another scratch folder. Its Python code runs in this
    # process (transformers is imported here already: a new interpreter took ~2.5 s a command, on every worker);
    # the command itself runs as shown in its own test below
    for command in documented_commands():
        if "save_pretrained(" in command:
            python, flag, code = shlex.split(command)
            assert (python, flag) == ("python", "-c"), command
            with contextlib.chdir(folder):
                exec(compile(code, command, "exec"), {"__name__": "__main__"})
    return folder


def test_the_exempt_list_is_small_and_current() -> None:
    commands = documented_commands()
    assert len(EXEMPT) <= 10 and set(EXEMPT) <= set(commands), set(EXEMPT) - set(commands)
    assert len([c for c in commands if c not in EXEMPT]) >= 8


def run_as_shown(scratch: Path, command: str) -> None:
    if command.startswith(("python benchmarks/", "python scripts/compat_newest.py")):
        command += " --help"  # parse the documented arguments; the timed run (or the compatibility run's installs) is not a test
    helpers.run_as_shown(command, scratch)


def test_commands_run_by_other_tests_are_documented_and_run_there() -> None:
    commands = documented_commands()
    for command, test_file in RUN_BY.items():
        assert command in commands, f"{command!r} is no longer documented: drop it from RUN_BY"
        assert command in (ROOT / test_file).read_text(), f"{test_file} does not run {command!r}"


@pytest.mark.parametrize("command", [c for c in documented_commands() if c not in EXEMPT and c not in RUN_BY and not reads_runs(c)])
def test_documented_command_runs_as_shown(scratch: Path, command: str) -> None:
    run_as_shown(scratch, command)
    if command == WRITES_RUNS:  # then every command that reads its run, in the order the docs show them
        readers = [c for c in documented_commands() if reads_runs(c) and c not in EXEMPT]
        assert readers, "no documented command reads runs/example/ any more: drop WRITES_RUNS"
        for reader in readers:
            run_as_shown(scratch, reader)


def test_the_run_the_readers_read_is_written_by_a_documented_command() -> None:
    assert WRITES_RUNS in documented_commands()
