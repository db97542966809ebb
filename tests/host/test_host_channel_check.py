"""scripts/host_channel_check.py (the GPU check's host stage) run on CPU, so the script is kept working
without a GPU: a host-only Python-object leak from step 10 is found within 40 steps, type and holder named."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.skipif(not os.path.exists("/proc/self/statm"), reason="needs Linux /proc")


def test_host_channel_check_passes_on_cpu() -> None:
    env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    proc = subprocess.run([sys.executable, str(ROOT / "scripts" / "host_channel_check.py"), "--device", "cpu"],
                          capture_output=True, text=True, timeout=300, env=env, cwd=ROOT)
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert proc.returncode == 0, (result, proc.stderr[-2000:])
    assert result["problems"] == [] and 10 < result["host_growth_first_step"] <= 50
