"""Every documented shape explains its out-of-memory error, and the error the user sees is the one torch raised.

The shapes of README.md and the docs: the plain loop without ``with`` (README's own code block, run as it is shown:
the error leaves the loop and ``close()`` is never reached; the chained ``sys.excepthook`` ends the run), ``with
Monitor(...)``, Lightning (``on_exception``), Accelerate (``close()`` after the loop, as its docstring shows it), the
Transformers Trainer (``trainer.train()``, nothing around it: the Trainer has no exception event) and the pytest
plugin. Each runs a model that keeps 16 MiB a step until, at step 30, its address space runs out in forward or in
backward (``oom_shapes.py``), in a fresh interpreter. What is checked: the exception that reached the user's own
excepthook (installed first) is the very object torch raised, with nothing chained onto it and no frame of the
monitor's in its traceback, printed once; ``oom.json`` says where and names the leak's holder first; report.json
holds the ``oom`` event and finding, and the text report (``memcallbacks report``'s) shows it; the trackers got it
(TensorBoard's event file); nothing imported between the failure and ``oom.json``; no "training goes on".
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="RLIMIT_AS and /proc are Linux's")
pytest_plugins = ["pytester"]

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
SHAPES = ["plain", "with", "lightning", "accelerate", "transformers"]
TRACKED = {"lightning", "accelerate", "transformers"}  # a TensorBoard tracker in the shape
UNCAUGHT = {"plain", "accelerate", "transformers"}  # nothing in the shape sees the error: the monitor's excepthook does


def run_shape(shape: str, phase: str, folder: Path) -> tuple[str, list[dict[str, Any]]]:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]), MPLBACKEND="Agg",
               TOKENIZERS_PARALLELISM="false", MALLOC_ARENA_MAX="1")
    done = subprocess.run([sys.executable, str(HERE / "oom_shapes.py"), shape, phase], cwd=folder, env=env, capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 1, done.stderr[-4000:]  # the error ended the script, as it would without the monitor
    result = folder / "result.json"
    assert result.is_file(), done.stderr[-4000:]
    return done.stderr, json.loads(result.read_text())


def output_folder(folder: Path) -> Path:
    found = [p.parent for p in folder.rglob("oom.json")]
    assert len(found) == 1, sorted(str(p) for p in folder.rglob("*"))[:50]
    return found[0]


def diagnosis(folder: Path, report: dict[str, Any], stderr: str) -> str:
    """What a failed explanation needs to be understood: the findings, the schedule's figures and the steps' reads."""
    history = folder / "history.csv"
    rows = history.read_text().splitlines()[:40] if history.is_file() else ["(no history.csv)"]
    summary = {k: v for k, v in report.get("summary", {}).items() if not isinstance(v, (dict, list))}
    return "\n".join([f"findings: {[(f['kind'], f['step'], f.get('state')) for f in report.get('findings', [])]}",
                      f"summary: {summary}", *rows, f"stderr tail: {stderr[-1500:]}"])


def check_explanation(oom: dict[str, Any], phase: str) -> None:
    assert oom["source"] == "cpu" and oom["step"] == 30 and oom["where"]["phase"] == phase, oom["text"]
    if phase == "forward":
        assert oom["where"]["module"] == "fc1" or oom["where"]["module"].endswith(".fc1"), oom["where"]
    first = oom["remedies"][0]
    assert first["kind"] == "leak" and any("Net.kept" in h for h in first["details"]["holders"]), oom["text"]


@pytest.mark.parametrize("phase", ["forward", "backward"])
@pytest.mark.parametrize("shape", SHAPES)
def test_the_error_is_unchanged_and_explained(shape: str, phase: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    stderr, seen = run_shape(shape, phase, tmp_path)
    assert len(seen) == 1, seen  # the user's own excepthook, called once
    (error,) = seen
    assert error["type"] == "RuntimeError" and "DefaultCPUAllocator: can't allocate memory" in error["error"]
    assert error["same_object"], error  # the very exception torch raised
    assert error["context"] == "None" and error["cause"] == "None" and error["notes"] is None, error  # nothing chained onto it
    # no frame of the monitor's: the exception's traceback is the user's, the framework's and torch's (Accelerate's
    # accelerator.backward is the monitor's wrapper of it: its frame is the one the user calls)
    assert all(f.endswith("accelerate.py:backward") for f in error["memcallbacks_frames"]), error["memcallbacks_frames"]
    assert stderr.count("Traceback (most recent call last)") == 1 and "During handling" not in stderr, stderr[-4000:]
    assert "training goes on" not in stderr and "Error in sys.excepthook" not in stderr and "dropped without close()" not in stderr
    if shape in UNCAUGHT:  # the excepthook: the traceback first, then the explanation (see lifecycle.ExceptHook)
        assert stderr.index("RuntimeError: [enforce fail") < stderr.index("out of memory at step 30"), stderr[-4000:]
    imported = json.loads((tmp_path / "imports.json").read_text())  # from the failing step's start to oom.json
    assert not [n for n in imported if n.startswith(("memcallbacks", "torch", "pandas", "numpy"))], imported
    folder = output_folder(tmp_path)
    oom = json.loads((folder / "oom.json").read_text())
    report = json.loads((folder / "report.json").read_text())
    try:
        check_explanation(oom, phase)
    except AssertionError as exc:  # a leak not found by step 30 (once in CI, under load): what the monitor saw
        raise AssertionError(f"{exc}\n{diagnosis(folder, report, stderr)}") from None
    assert [e["kind"] for e in report["events"]] == ["oom"] and report["events"][0]["oom_file"] == str(folder / "oom.json")
    assert any(f["kind"] == "oom" and "Net.kept" in f["message"] for f in report["findings"])
    from memcallbacks.cli import main as cli

    assert cli(["report", str(folder)]) == 0  # `memcallbacks report FOLDER`
    text = capsys.readouterr().out
    assert "out of memory at step 30" in text and "Net.kept" in text, text
    if shape in TRACKED:  # TensorBoard's TEXT tab got the finding (its strings are stored as they are)
        events = b"".join(p.read_bytes() for p in (tmp_path / "runs").rglob("events.out.tfevents.*"))
        assert b"out of memory at step 30" in events, sorted(str(p) for p in (tmp_path / "runs").rglob("*"))


INNER_TEST = '''
import sys
sys.path.insert(0, {here!r})
import pytest, torch
import oom_shapes as S

@pytest.mark.train_memory(max_leak="2 GiB")
def test_loop(train_memory):
    S.limit_to(8 << 30)
    torch.manual_seed(0)
    model = S.Net({phase!r})
    optimizer = torch.optim.AdamW(model.parameters())
    for batch in train_memory.track(model, optimizer, S.batches()):
        loss = model(batch)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
'''

INNER_CONFTEST = '''
import json, sys, pytest
sys.path.insert(0, {here!r})
import oom_shapes as S

def pytest_configure(config):
    torch = __import__("torch")
    torch.autograd.backward = S.recording_backward(torch.autograd.backward)

@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item, call):
    if call.when == "call" and call.excinfo is not None:  # what the test's report is made of
        exc = call.excinfo.value
        with open("result.json", "w") as fh:
            json.dump({{"same_object": id(exc) in S.RAISED, "context": repr(exc.__context__), "cause": repr(exc.__cause__),
                        "type": type(exc).__name__}}, fh)
    return (yield)
'''


@pytest.mark.parametrize("phase", ["forward", "backward"])
def test_the_pytest_plugin_fails_with_the_error_and_its_explanation(phase: str, pytester: pytest.Pytester) -> None:
    pytester.makeconftest(INNER_CONFTEST.format(here=str(HERE)))
    pytester.makepyfile(test_oom=INNER_TEST.format(here=str(HERE), phase=phase))
    result = pytester.runpytest_subprocess("-p", "no:randomly", "-p", "no:cacheprovider", "-W", "ignore")
    result.assert_outcomes(failed=1)
    out = result.stdout.str()
    seen = json.loads((pytester.path / "result.json").read_text())
    assert seen == {"same_object": True, "context": "None", "cause": "None", "type": "RuntimeError"}, seen
    # the test fails with its own error and traceback, then the explanation in a section of its own
    assert re.search(r"^E +RuntimeError: \[enforce fail at alloc_cpu.cpp", out, re.M) and "During handling" not in out, out[-4000:]
    section = out.index("memcallbacks: out of memory, explained")
    assert out.index("RuntimeError: [enforce fail") < section, out[-4000:]
    assert f"out of memory at step 30 on rank 0, in {phase}" in out[section:] and "Net.kept" in out[section:], out[section:]
    written = next(line.split("written to ", 1)[1].strip() for line in out[section:].splitlines() if "written to " in line)
    check_explanation(json.loads(Path(written).read_text()), phase)
    assert "training goes on" not in out


def test_an_excepthook_installed_later_keeps_the_chain(tmp_path: Path) -> None:
    """A hook installed after the monitor's (a crash reporter) chains to it: the monitor's hook passes the exception on
    once the monitor stopped, and a later monitor's hook goes on top; each stop restores what it replaced."""
    script = textwrap.dedent('''
        import sys
        import torch
        from memcallbacks import Monitor

        def mine(*exc_info):
            print("user hook", file=sys.stderr)

        sys.excepthook = mine
        first = Monitor(torch.nn.Linear(2, 2), write_files=False, console_summary=False)
        ours = sys.excepthook
        print("installed", ours is not mine and ours.previous is mine)

        def reporter(*exc_info):
            print("reporter", file=sys.stderr)
            ours(*exc_info)

        sys.excepthook = reporter
        first.close()
        print("kept", sys.excepthook is reporter, ours.active)  # a later hook chains to ours: left in place, passing on
        second = Monitor(torch.nn.Linear(2, 2), write_files=False, console_summary=False)
        print("on top", sys.excepthook.previous is reporter, sys.excepthook.active)
        second.close()
        print("restored", sys.excepthook is reporter)
        raise ValueError("the user's error")
    ''')
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120,
                          env=dict(os.environ, PYTHONPATH=str(ROOT)))
    lines = dict(line.split(" ", 1) for line in done.stdout.splitlines())
    assert lines == {"installed": "True", "kept": "True False", "on": "top True True", "restored": "True"}, done.stdout + done.stderr
    assert done.stderr.splitlines() == ["reporter", "user hook"], done.stderr


LEAK_SCRIPT = textwrap.dedent('''
    import resource, sys
    import torch
    from torch import nn
    from memcallbacks import Monitor

    MODE, STEP = sys.argv[1], 30
    KEPT = []

    def limit(room):
        vm = next(int(line.split()[1]) << 10 for line in open("/proc/self/status") if line.startswith("VmSize:"))
        resource.setrlimit(resource.RLIMIT_AS, (vm + room, resource.RLIM_INFINITY))

    torch.manual_seed(0)
    torch.set_num_threads(1)
    model = nn.Sequential(nn.Linear(512, 1024), nn.ReLU(), nn.Linear(1024, 512))
    optimizer = torch.optim.AdamW(model.parameters())
    limit(8 << 30)  # a limit from the start: the monitor keeps its address-space reserve
    monitor = Monitor(model, optimizer)
    for step, batch in enumerate(monitor.track(torch.randn(1024, 512) for _ in range(STEP + 2))):
        out = model(batch)
        if MODE == "graphs":
            KEPT.append(out)  # 2 MiB a step, with its graph
        loss = out.mean()
        if step == STEP and MODE == "graphs":
            limit(1 << 20)  # backward's first 2 MiB fails (mmapped, MALLOC_MMAP_THRESHOLD_: new address space)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        if step == STEP and MODE == "loop":
            limit(1 << 20)
        if MODE == "loop":
            KEPT.append(torch.ones(512 * 1024))  # 2 MiB a step, outside the model's call: the append fails
    monitor.close()
''')


@pytest.mark.parametrize("mode", ["graphs", "loop"])
def test_a_leak_is_the_first_remedy_whatever_phase_failed(mode: str, tmp_path: Path) -> None:
    """README's loop (no ``with``) keeping 2 MiB a step in a global list until, at step 30, the address space runs out:
    ``graphs`` keeps each step's output with its graph and fails in backward, where the 60 MiB held is under a tenth of
    the figure (the process's 700+ MiB in it: the rule once missed it); ``loop`` keeps plain tensors and fails at its
    ``append``, outside the model's call (once "in unknown", the leak counted as this step's activations and no remedy
    but "no saving is predicted"). Both: the leak first, its holder the growth finding's, the verdict's fix the leak's."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]), MPLBACKEND="Agg",
               MALLOC_MMAP_THRESHOLD_="1048576")
    done = subprocess.run([sys.executable, "-c", LEAK_SCRIPT, mode], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 1 and "DefaultCPUAllocator: can't allocate memory" in done.stderr, done.stderr[-4000:]
    folder = output_folder(tmp_path)
    oom = json.loads((folder / "oom.json").read_text())
    cats = oom["memory"]["categories"]
    assert oom["step"] == 30 and oom["where"]["phase"] == ("backward" if mode == "graphs" else "loop"), oom["text"]
    first = oom["remedies"][0]
    assert first["kind"] == "leak" and any("global KEPT" in h for h in first["details"]["holders"]), oom["text"]
    assert "held by module __main__: global KEPT" in first["advice"], first
    assert cats["held from earlier steps"] >= 0.8 * 27 * (2 << 20), oom["text"]  # 2 MiB a step since step 1
    if mode == "loop":  # said plainly; the loop's frame (its globals: the list) is not this step's memory
        assert "in the training loop's own code (outside the model's forward, backward and the optimizer step)" in oom["text"]
        assert cats["activations and temporaries"] < (4 << 20), oom["text"]
    # the verdict: one cause, the growth, the OOM its consequence (counted once: a user check read "2 problems found")
    assert re.search(r"1 problem found .*; out of memory at step 30, caused by the growth found at step \d+", done.stdout), done.stdout[-3000:]
    assert re.search(r"- growth, step \d+ .*: held by module __main__: global KEPT", done.stdout) and "- oom," not in done.stdout, done.stdout[-3000:]
    assert [(f["kind"], f["details"].get("caused_by")) for f in json.loads((folder / "report.json").read_text())["findings"]
            if f["kind"] in ("growth", "oom")] == [("growth", None), ("oom", ["growth"])]
    report = json.loads((folder / "report.json").read_text())
    assert report["files"]["oom"] == str(folder / "oom.json"), report["files"]
    if mode == "loop":  # the text report: the limit the run ran into, and oom.json among the files
        text = subprocess.run([sys.executable, "-m", "memcallbacks", "report", str(folder)], capture_output=True, text=True,
                              env=env, timeout=120).stdout
        assert re.search(r"capacity +[\d.]+ MiB \(the address-space limit, RLIMIT_AS, at the out-of-memory error\)", text), text
        assert re.search(r"^    oom +.*oom\.json$", text, re.M), text
