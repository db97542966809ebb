"""The installed ``memcallbacks preflight`` command imports ``--model MODULE:CLASS`` from the current
folder (as ``python -m memcallbacks`` does), and ``--find-max-batch`` exits 1 when no batch fits."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
COMMAND = Path(sys.executable).parent / "memcallbacks"

MODEL = textwrap.dedent('''
    import torch

    class Net(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.layer = torch.nn.Linear(1024, 1024)

        def forward(self, x):
            return self.layer(x)
''')


def preflight(folder: Path, capacity: str) -> subprocess.CompletedProcess[str]:
    (folder / "local_models.py").write_text(MODEL)
    args = [str(COMMAND), "preflight", "--model", "local_models:Net", "--batch", "float32[8,1024]", "--device", "cpu",
            "--capacity", capacity, "--find-max-batch"]
    return subprocess.run(args, cwd=folder, capture_output=True, text=True, timeout=300,
                          env=dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1"))


@pytest.mark.skipif(not COMMAND.exists(), reason="the memcallbacks script is not installed in this environment")
def test_installed_command_imports_from_the_current_folder_and_no_fit_exits_1(tmp_path: Path) -> None:
    fits = preflight(tmp_path, "1GiB")
    assert fits.returncode == 0, fits.stderr[-2000:]
    assert "fits 1.0 GiB" in fits.stdout, fits.stdout
    too_small = preflight(tmp_path, "1MiB")
    assert too_small.returncode == 1, (too_small.returncode, too_small.stdout[-1000:], too_small.stderr[-1000:])
    assert "no batch fits 1.0 MiB" in too_small.stdout, too_small.stdout
