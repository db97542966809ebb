"""The run's files at an out-of-memory error under an address-space limit (docs/oom.md): written, the plot left out.

With little address space left after the failed allocation, drawing ``memory.png`` failed, and with matplotlib
already imported it ended the process: numpy's OpenBLAS calls ``exit(1)`` when its buffers cannot be allocated,
so the user's own error was never raised. The run's end now draws only with room to draw, and says so otherwise.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="RLIMIT_AS and /proc are Linux's")

SCRIPT = textwrap.dedent('''
    import resource, sys
    import torch
    from torch import nn
    from memcallbacks import Monitor

    if sys.argv[2] == "matplotlib":
        import matplotlib.pyplot  # a script that plots its own curves: numpy's BLAS is loaded before the error

    def vm():
        return next(int(line.split()[1]) << 10 for line in open("/proc/self/status") if line.startswith("VmSize:"))

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 64))
    opt = torch.optim.AdamW(model.parameters())
    resource.setrlimit(resource.RLIMIT_AS, (vm() + (8 << 30), resource.RLIM_INFINITY))  # the monitor keeps its reserve
    try:
        with Monitor(model, optimizer=opt, output_dir=sys.argv[1]):
            for step in range(24):
                if step == 20:  # a container's limit, reached: 64 MiB left, then a step that asks for 1 GiB
                    resource.setrlimit(resource.RLIMIT_AS, (vm() + (64 << 20), resource.RLIM_INFINITY))
                rows = (1 << 30) // (4 * 64) if step == 22 else 32
                loss = model(torch.randn(rows, 64)).pow(2).mean()
                loss.backward()
                opt.step()
                opt.zero_grad()
    except RuntimeError as exc:
        print("raised:", "can't allocate memory" in str(exc))
''')


@pytest.mark.parametrize("preloaded", ["nothing", "matplotlib"])
def test_an_oom_at_the_address_space_limit_writes_the_files_without_the_plot(tmp_path: Path, preloaded: str) -> None:
    out = subprocess.run([sys.executable, "-c", SCRIPT, str(tmp_path / "mem"), preloaded],
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-3000:]
    assert "raised: True" in out.stdout, out.stderr[-3000:]  # the user's own error reached the user
    assert "OpenBLAS" not in out.stderr
    files = sorted(p.name for p in (tmp_path / "mem").iterdir() if not p.name.startswith("."))
    assert files == ["history.csv", "oom.json", "report.json"], out.stderr[-3000:]
    assert "memory.png is not drawn" in out.stderr and "RLIMIT_AS" in out.stderr
    assert "not installed" not in out.stderr  # a failed import is not a missing package
    report = json.loads((tmp_path / "mem" / "report.json").read_text())
    assert report["events"][-1]["kind"] == "oom" and 20 <= report["events"][-1]["step"] <= 22
    assert "plot" not in report["files"]
    assert any(f["kind"] == "oom" for f in report["findings"])
    history = (tmp_path / "mem" / "history.csv").read_text().splitlines()
    assert len(history) > 2  # the steps before the error, one row each (a header first)
