"""The run's files at an out-of-memory error under an address-space limit (docs/oom.md): written, the user's error raised.

With little address space left after the failed allocation, drawing ``memory.png`` failed, and with matplotlib
already imported it ended the process: numpy's OpenBLAS calls ``exit(1)`` when its buffers cannot be allocated,
so the user's own error was never raised. The files are now built by the writer process, in an address space of
its own, plot included; where the training process builds them itself (the writer's fallback) it draws only with
room to draw, and says so otherwise.
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
    import memcallbacks._runtime.end_write as end_write

    end_write.WRITER = sys.argv[3] == "writer"

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


@pytest.mark.parametrize("preloaded,writer", [("nothing", "writer"), ("nothing", "in-process"), ("matplotlib", "in-process")])
def test_an_oom_at_the_address_space_limit_writes_the_files(tmp_path: Path, preloaded: str, writer: str) -> None:
    out = subprocess.run([sys.executable, "-c", SCRIPT, str(tmp_path / "mem"), preloaded, writer],
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-3000:]
    assert "raised: True" in out.stdout, out.stderr[-3000:]  # the user's own error reached the user
    assert "OpenBLAS" not in out.stderr
    files = sorted(p.name for p in (tmp_path / "mem").iterdir() if not p.name.startswith("."))
    report = json.loads((tmp_path / "mem" / "report.json").read_text())
    if writer == "writer":  # drawn by the writer process, in an address space of its own
        assert files == ["history.csv", "memory.png", "oom.json", "report.json"], out.stderr[-3000:]
        assert "plot" in report["files"] and "memory.png is not drawn" not in out.stderr
    else:
        assert files == ["history.csv", "oom.json", "report.json"], out.stderr[-3000:]
        assert "memory.png is not drawn" in out.stderr and "RLIMIT_AS" in out.stderr
        assert "plot" not in report["files"]
    assert "not installed" not in out.stderr  # a failed import is not a missing package
    assert report["events"][-1]["kind"] == "oom" and 20 <= report["events"][-1]["step"] <= 22
    assert any(f["kind"] == "oom" for f in report["findings"])
    history = (tmp_path / "mem" / "history.csv").read_text().splitlines()
    assert len(history) > 2  # the steps before the error, one row each (a header first)


def test_files_that_cannot_be_written_are_said_plainly(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    """At an OOM the files' write may fail in turn (importing pandas needs memory the process may not have): said in
    one line, with where the explanation is, never "training goes on", and nothing chained onto the user's error."""
    import logging

    import torch
    from torch import nn

    from memcallbacks import Monitor
    from memcallbacks._runtime import run_end

    def no_room(*args: object, **kwargs: object) -> None:
        raise ImportError("cannot import pandas (injected: no memory left to map it)")

    class Huge(nn.Module):  # a real CPU allocator failure: 4 EiB, refused whatever the machine
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x if x.shape[0] < 8 else torch.empty(1 << 62, dtype=torch.uint8)

    from memcallbacks._runtime import end_write

    monkeypatch.setattr(end_write, "WRITER", False)  # the files built here, where the import fails (the writer's own fallback)
    monkeypatch.setattr(run_end, "write_outputs", no_room)
    caplog.set_level(logging.DEBUG, logger="memcallbacks")
    model = nn.Sequential(nn.Linear(4, 4), Huge())
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(RuntimeError) as raised:
        with Monitor(model, optimizer, output_dir=str(tmp_path)) as monitor:
            for x in monitor.track([torch.randn(2, 4)] * 3 + [torch.randn(8, 4)]):
                model(x).sum().backward()
                optimizer.step()
                optimizer.zero_grad()
    assert "DefaultCPUAllocator: can't allocate memory" in str(raised.value)
    assert raised.value.__context__ is None and raised.value.__cause__ is None
    errors = [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR and "could not write" in r.getMessage()]
    assert len(errors) == 1 and "ImportError: cannot import pandas" in errors[0], caplog.text
    assert f"{tmp_path / 'oom.json'} holds the out-of-memory explanation" in errors[0] and "propagates unchanged" in errors[0]
    assert "training goes on" not in caplog.text and (tmp_path / "oom.json").is_file()
