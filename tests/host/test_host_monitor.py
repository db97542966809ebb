"""The host channel at defaults, through the session every adapter drives (here the plain-loop Monitor): a real Python-object leak
in a real training loop is found and named by type and holder; a clean loop has no host finding.

Each run is a process of its own (see tests/scripts/host_leak.py: freed heap in a long-lived test
process is refilled before the resident set moves)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

SCRIPT = textwrap.dedent('''
    import json, sys
    from dataclasses import dataclass
    import torch
    from memcallbacks import Monitor

    @dataclass
    class Spec:
        name: str
        shape: tuple
        stride: tuple
        placement: list
        step: int

    cache = {}
    leak = sys.argv[1] == "leak"
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.ReLU(), torch.nn.Linear(128, 1))
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    monitor = Monitor(model, opt, write_files=False, device="cpu")
    for step in monitor.track(range(int(sys.argv[2]))):
        loss = model(torch.randn(32, 64)).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        if leak:
            for i in range(512):
                cache[(step, i)] = Spec(f"p{step}.{i}", (step, i, 3), (1, step, i), [step, i], step)
    monitor.close()
    host = monitor.report()["host"]
    print(json.dumps({"findings": [f.to_dict() for f in monitor.findings],
                      "host_seconds": host["seconds"], "census_seconds": host["census_seconds"], "reads": host["reads"]}))
''')


def run(tmp_path, mode: str, steps: int) -> dict:
    script = tmp_path / "loop.py"
    script.write_text(SCRIPT)
    proc = subprocess.run([sys.executable, str(script), mode, str(steps)], capture_output=True, text=True, timeout=300,
                          cwd=str(tmp_path), env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_monitor_finds_and_names_a_python_object_leak(tmp_path):
    out = run(tmp_path, "leak", 80)
    host = [f for f in out["findings"] if f["kind"] == "host_growth"]
    assert [f["key"] for f in host] == ["host_growth"], out["findings"]
    f = host[0]
    assert f["first_step"] <= 40, f
    assert f["holders"] and f["holders"][0].startswith("module __main__: global cache (dict) grew by "), f["holders"]
    assert "Spec objects" in f["holders"][0]
    assert f["details"]["census_cost_s"] > 0
    assert out["reads"] >= 48 and out["host_seconds"] > 0


def test_monitor_clean_loop_has_no_host_finding(tmp_path):
    out = run(tmp_path, "clean", 200)
    assert [f for f in out["findings"] if f["kind"].startswith(("host", "worker"))] == [], out["findings"]
