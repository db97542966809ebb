"""Run the frameworks' tests against the newest releases and say which release broke what.

The README's test command installs the versions the suite last passed with (constraints.txt), so a
new release cannot turn CI red unseen. This script is how new releases get seen: in a venv of its
own it installs the package with its test extras and no constraints (the newest releases
pyproject's ranges allow), lists what differs from constraints.txt, and runs the adapters' and the
pytest plugin's tests. A test that fails is run again with one changed package at a time put back to
its tested version: the release whose revert makes it pass is the one that broke it.

Usage, from the repository root (CI runs it before the suite; it never fails CI unless --strict):
    python scripts/compat_newest.py                      # report; exit 0
    python scripts/compat_newest.py --strict             # exit 1 when a test fails with the newest releases
    python scripts/compat_newest.py --write-constraints  # all passed: constraints.txt takes the newest versions
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import xml.etree.ElementTree as ET
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
CONSTRAINTS = ROOT / "constraints.txt"
TORCH = "torch==2.13.0"
WATCHED = ("lightning", "pytorch-lightning", "accelerate", "transformers", "torchmetrics", "pandas", "numpy",
           "psutil", "wandb", "mlflow-skinny", "tensorboard", "jsonargparse", "matplotlib", "pytest", "pytest-xdist")
TESTS = ("tests/adapters/test_lightning.py", "tests/adapters/test_accelerate.py", "tests/adapters/test_transformers.py",
         "tests/pytest_plugin/test_pytest_plugin.py", "tests/trackers/test_trackers.py")


def _pins(lines: list[str]) -> dict[str, str]:
    pins = {}
    for line in lines:
        line = line.split("#")[0].strip()
        if "==" in line and not line.startswith("-e"):
            name, version = line.split("==", 1)
            pins[name.strip().lower().replace("_", "-")] = version.strip()
    return pins


def _run(cmd: list[str], log: Path, timeout: float) -> int:
    with log.open("a") as out:
        out.write(f"\n$ {' '.join(cmd)}\n")
        out.flush()
        try:
            return subprocess.run(cmd, cwd=ROOT, stdout=out, stderr=subprocess.STDOUT, timeout=timeout).returncode
        except subprocess.TimeoutExpired:
            out.write(f"timed out after {timeout:.0f} s\n")
            return 124


def _failed(junit: Path) -> list[tuple[str, str]]:
    """``(test id, first line of its message)`` of every failed or errored test in a junit XML file."""
    if not junit.exists():
        return [("(no report)", "pytest wrote no junit report: see the log")]
    failed = []
    for case in ET.parse(junit).getroot().iter("testcase"):
        for bad in list(case.findall("failure")) + list(case.findall("error")):
            path = case.get("classname", "").replace(".", "/")
            message = (bad.get("message") or "").strip().splitlines()
            failed.append((f"{path}.py::{case.get('name')}", message[0][:160] if message else ""))
    return failed


def _pytest(python: str, tests: list[str], junit: Path, log: Path, workers: int) -> list[tuple[str, str]]:
    junit.unlink(missing_ok=True)
    cmd = [python, "-m", "pytest", "-q", "-p", "no:cacheprovider", f"--junitxml={junit}", *tests]
    if workers > 1:
        cmd[3:3] = ["-n", str(workers)]
    _run(cmd, log, timeout=1500)
    return _failed(junit)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--venv", default=os.path.join(tempfile.gettempdir(), "memcallbacks-compat-venv"))
    parser.add_argument("--constraints", type=Path, default=CONSTRAINTS, help="the tested versions (default constraints.txt)")
    parser.add_argument("--workers", type=int, default=2, help="pytest-xdist workers (default 2)")
    parser.add_argument("--strict", action="store_true", help="exit 1 when a test fails with the newest releases")
    parser.add_argument("--write-constraints", action="store_true",
                        help="when every test passed, rewrite constraints.txt with the newest versions")
    args = parser.parse_args(argv)
    log = Path(args.venv + ".log")
    log.write_text("")
    python = str(Path(args.venv) / "bin" / "python")
    print(f"compat: installing the newest releases in {args.venv} (log: {log})", flush=True)
    steps = ([sys.executable, "-m", "venv", "--clear", args.venv], [python, "-m", "pip", "install", "-q", TORCH],
             [python, "-m", "pip", "install", "-q", "--upgrade", "-e", ".[test]"])
    for cmd in steps:
        if _run(cmd, log, timeout=1200) != 0:
            print(f"compat: could not install ({' '.join(cmd[-3:])}); see {log}")
            return 1 if args.strict else 0
    tested = _pins(args.constraints.read_text().splitlines())
    newest = _pins(subprocess.run([python, "-m", "pip", "freeze"], capture_output=True, text=True).stdout.splitlines())
    changed = {name: (tested.get(name, "-"), newest[name]) for name in WATCHED if name in newest and newest[name] != tested.get(name)}
    print("compat: package            tested      newest")
    for name in WATCHED:
        if name in newest:
            mark = "  <- new" if name in changed else ""
            print(f"compat: {name:<20} {tested.get(name, '-'):<11} {newest[name]}{mark}")
    if not changed:
        print("compat: the newest releases are the tested ones; nothing to run")
        return 0
    junit = Path(args.venv + ".junit.xml")
    failed = _pytest(python, list(TESTS), junit, log, args.workers)
    if not failed:
        print(f"compat: every test of {len(TESTS)} files passed with the newest releases")
        if args.write_constraints:
            lines = args.constraints.read_text().splitlines()
            args.constraints.write_text("\n".join(
                f"{name}=={newest[name]}" if "==" in line and (name := line.split("==")[0].lower()) in changed else line
                for line in lines) + "\n")
            print("compat: constraints.txt now holds the newest versions")
        return 0
    print(f"compat: {len(failed)} test(s) failed with the newest releases:")
    ids = [test for test, _ in failed]
    blame: dict[str, list[str]] = {}
    for name, (old, _new) in changed.items():
        if old == "-":
            continue
        _run([python, "-m", "pip", "install", "-q", f"{name}=={old}"], log, timeout=600)
        still = {test for test, _ in _pytest(python, ids, junit, log, 1)}
        blame[name] = [test for test in ids if test not in still]
        _run([python, "-m", "pip", "install", "-q", f"{name}=={changed[name][1]}"], log, timeout=600)
    for test, message in failed:
        culprits = [f"{name} {changed[name][1]} (passes with {changed[name][0]})" for name, fixed in blame.items() if test in fixed]
        print(f"compat:   {test}\ncompat:     {message}")
        print(f"compat:     broken by: {', '.join(culprits) or 'no single release (reverting each alone did not fix it)'}")
    return 1 if args.strict else 0


if __name__ == "__main__":
    sys.exit(main())
