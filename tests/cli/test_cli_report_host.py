"""``memcallbacks report`` shows the host section of a real run's report.json: private memory and
Python objects with their change, the DataLoader workers, the host findings with their holder, and
the channel's cost; a run with ``watch_host=False`` says the channel was off.

The run is a process of its own (as every host-channel test: tests/host/test_host_monitor.py): a
plain loop over a DataLoader with 2 persistent workers, and a module-level dict gaining 512
dataclass objects a step (no tensors)."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

from memcallbacks.cli import main

SCRIPT = textwrap.dedent('''
    import sys
    from dataclasses import dataclass
    import torch
    from torch.utils.data import DataLoader, TensorDataset
    from memcallbacks import Monitor

    @dataclass
    class Spec:
        name: str
        shape: tuple
        step: int

    cache = {}
    if __name__ == "__main__":
        out, steps, watch_host = sys.argv[1], int(sys.argv[2]), sys.argv[3] == "on"
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.ReLU(), torch.nn.Linear(128, 1))
        opt = torch.optim.Adam(model.parameters(), lr=1e-3)
        data = TensorDataset(torch.randn(4096, 64), torch.randn(4096, 1))
        loader = DataLoader(data, batch_size=32, num_workers=2, persistent_workers=True)
        monitor = Monitor(model, opt, output_dir=out, plot=False, device="cpu", watch_host=watch_host)
        batches = iter(loader)
        for step in monitor.track(range(steps)):
            x, y = next(batches)
            loss = (model(x) - y).pow(2).mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
            for i in range(512):
                cache[(step, i)] = Spec(f"p{step}.{i}", (step, i, 3), step)
        monitor.close()
''')


def real_run(tmp_path: Path, steps: int, watch_host: str) -> Path:
    script = tmp_path / "loop.py"
    script.write_text(SCRIPT)
    out = tmp_path / f"out_{watch_host}"
    proc = subprocess.run([sys.executable, str(script), str(out), str(steps), watch_host], capture_output=True, text=True,
                          timeout=300, cwd=str(tmp_path), env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert (out / "report.json").is_file()
    return out


def host_section(text: str) -> list[str]:
    lines = text.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("  host"))
    end = next((i for i in range(start + 1, len(lines)) if not lines[i].startswith("    ")), len(lines))
    return lines[start:end]


def test_report_shows_the_host_section_of_a_real_run(tmp_path: Path, capsys: Any) -> None:
    out = real_run(tmp_path, 80, "on")
    assert main(["report", str(out)]) == 0
    section = host_section(capsys.readouterr().out)
    text = "\n".join(section)
    assert section[0] == "  host (docs/host.md)", text
    assert any(line.startswith("    private memory           ") and "change +" in line for line in section), text
    # the Python-object change runs from the first block read after the warm-up (host/growth.py figures): in an
    # 80-step run whose block reads are on a cost-chosen stride there may be none yet, so the change is optional
    assert any(line.startswith("    Python objects           ~") for line in section), text
    assert any(line.startswith("    DataLoader workers       2 live: ") and "private (USS)" in line for line in section), text
    assert any(line.startswith("    host findings            ") for line in section), text
    # the kind once: the key only where it says more (host_growth:native, rank_imbalance:host; issue 44 item 5)
    growth = [line for line in section if line.startswith("      [host_growth] step ")]
    assert growth and "held by module __main__: global cache (dict) grew by " in growth[0] and "Spec objects" in growth[0], text
    assert section[-1].startswith("    cost                     ") and " reads, " in section[-1], text


def test_report_says_the_host_channel_was_off(tmp_path: Path, capsys: Any) -> None:
    out = real_run(tmp_path, 12, "off")
    assert main(["report", str(out)]) == 0
    text = capsys.readouterr().out
    assert host_section(text) == ["  host                       off (watch_host=False)"], text
