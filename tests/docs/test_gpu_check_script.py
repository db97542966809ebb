"""scripts/gpu_check.sh without a GPU: its stage budget adds up, its flags are the ones the first GPU run
needs, and the benchmarks' result files keep what was measured when a stage is cut short."""

from __future__ import annotations

import json
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "scripts" / "gpu_check.sh"
BUDGET_S = 450  # "at most 7.5 minutes" (issue 25, plus issue 23's host stage), every stage timing out and needing its SIGKILL included

sys.path.insert(0, str(ROOT / "benchmarks"))
from _common import ResultFile  # noqa: E402


def _stages(text: str) -> dict[str, int]:
    return {m.group(1): int(m.group(2)) for m in re.finditer(r"^stage (\w+) (\d+) ", text, re.M)}


def test_stage_budget_adds_up_and_matches_the_header() -> None:
    text = SCRIPT.read_text()
    stages = _stages(text)
    assert list(stages) == ["env", "oom", "pytest_cuda", "record_snapshot", "boundary_cost", "overhead", "snapshot_policies", "preflight", "host_channel"]
    kill_after = int(re.search(r"^KILL_AFTER=(\d+)$", text, re.M).group(1))
    total = sum(stages.values())
    assert total + kill_after * len(stages) <= BUDGET_S, (stages, kill_after)
    # the header says the same numbers: the total, and each stage's seconds
    assert f"adds up to {total} s" in text
    for name, seconds in stages.items():
        assert re.search(rf"^#\s+\d\. {name} \({seconds} s", text, re.M), name
    # every stage runs under the timeout, interrupted first (pytest prints its summary) and killed after
    assert 'timeout --signal=INT --kill-after="$KILL_AFTER" "$seconds" "$@"' in text


def test_flags_the_first_gpu_run_needs() -> None:
    text = SCRIPT.read_text()
    commands = [line for line in text.splitlines() if line.startswith("stage ")]
    assert all(" python3 " in line for line in commands) and not any(" python " in line for line in commands)
    pytest_line = next(line for line in commands if line.startswith("stage pytest_cuda"))
    for flag in ("--continue-on-collection-errors", "-rfEs", "--durations=20", "-o faulthandler_timeout=60", "-m cuda"):
        assert flag in pytest_line, flag
    faulthandler_s = int(re.search(r"faulthandler_timeout=(\d+)", pytest_line).group(1))
    assert faulthandler_s < _stages(text)["pytest_cuda"]  # a hung test's stacks are dumped before the stage ends
    assert re.search(r"^unset .*\bPYTORCH_CUDA_ALLOC_CONF\b.*\bPYTORCH_ALLOC_CONF\b", text, re.M)
    assert ". scripts/pytest_plugin_env.sh" in text and "memcallbacks_pytest_plugin_env" in text
    # "at most 7 files come back": the log, the snapshot pair and one JSON per benchmark stage
    outputs = re.findall(r'--json "\$out/([\w.]+)"', text)
    assert len(outputs) == 4 and len(set(outputs)) == 4
    assert "At most 7 files" in text and 1 + 2 + len(outputs) == 7
    subprocess.run(["bash", "-n", str(SCRIPT)], check=True)


def test_result_file_is_whole_after_every_measurement(tmp_path: Path) -> None:
    path = tmp_path / "out.json"
    results = ResultFile(path, environment={"device": "cuda"})
    for i in range(3):
        results.append("runs", {"variant": "bare", "i": i})
        saved = json.loads(path.read_text())
        assert saved["complete"] is False and [r["i"] for r in saved["runs"]] == list(range(i + 1))
    results.finish(summary=[1, 2])
    saved = json.loads(path.read_text())
    assert saved["complete"] is True and saved["summary"] == [1, 2] and saved["environment"] == {"device": "cuda"}
    assert not (tmp_path / "out.json.tmp").exists()
    ResultFile(None).append("runs", {"i": 0})  # no path: writes nothing, raises nothing


KILLED = '''
import os, signal, sys
sys.path.insert(0, {benchmarks!r})
from _common import ResultFile

results = ResultFile({path!r}, environment={{"device": "cuda"}})
for i in range(2):
    results.append("interleaved_runs", {{"variant": "bare", "i": i}})
os.kill(os.getpid(), signal.SIGKILL)  # a stage's timeout, at its hardest: no handler, no finally
results.finish()
'''


def test_a_killed_benchmark_leaves_what_it_measured(tmp_path: Path) -> None:
    path = tmp_path / "overhead_cuda.json"
    code = KILLED.format(benchmarks=str(ROOT / "benchmarks"), path=str(path))
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == -signal.SIGKILL, proc.stderr
    saved = json.loads(path.read_text())
    assert saved["complete"] is False and [r["i"] for r in saved["interleaved_runs"]] == [0, 1]


@pytest.mark.parametrize("device, expected", [("cpu", (200, 3, 6, [1, 50])), ("cuda", (100, 2, 2, [50]))])
def test_overhead_quick_is_smaller_on_cuda(device: str, expected: tuple[int, int, int, list[int]]) -> None:
    """--quick on CUDA: about 2,750 synchronized steps in 17 fits, to end inside the stage's 50 s."""
    overhead = pytest.importorskip("overhead", reason="benchmarks/overhead.py needs lightning")
    args = overhead.parse_args(["--quick", "--device", device], require_device=False)
    assert (args.steps, args.repeats, args.ab_pairs, args.log_every) == expected
    if device == "cuda":
        fits = len(args.variants) * (1 + args.repeats * len(args.log_every)) + 4 * len(args.log_every) + args.hook_repeats * len(args.log_every)
        steps = (len(args.variants) * (args.skip_steps + max(args.log_every))
                 + args.repeats * len(args.variants) * len(args.log_every) * (args.skip_steps + args.steps)
                 + 4 * len(args.log_every) * (args.skip_steps + args.ab_pairs * 2 * args.block)
                 + args.hook_repeats * len(args.log_every) * (args.skip_steps + args.steps))
        assert (fits, steps) == (17, 2750)


def test_the_cuda_stage_finds_the_cuda_tests_in_their_folders():
    """The script's own file list (its grep line, run as written): tests live in tests/<wing>/, and a
    pattern that matched nothing would leave the CUDA stage with no test files."""
    import re
    import subprocess

    script = (ROOT / "scripts" / "gpu_check.sh").read_text()
    line = next(l for l in script.splitlines() if l.startswith("cuda_tests="))
    command = re.match(r"cuda_tests=\$\((.*)\)$", line).group(1)
    files = subprocess.run(["bash", "-c", command], cwd=ROOT, capture_output=True, text=True, check=True).stdout.split()
    assert files, f"{command!r} found no test file"
    for name in files:
        text = (ROOT / name).read_text()
        assert "mark.cuda" in text, name
    assert any("snapshot" in name for name in files) and any("devices" in name for name in files), files
