"""Before it happens: ``memcallbacks preflight --capacity`` explains a step predicted above the capacity, with its remedies."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def preflight(tmp_path: Path, *args: str) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    return subprocess.run([sys.executable, "-m", "memcallbacks", "preflight", "--model", "oom_model:Tiny", "--batch", "float32[64,512,256]",
                           "--device", "cpu", *args], cwd=tmp_path, env=dict(env, PYTHONPATH=f"{tmp_path}{os.pathsep}{ROOT}"),
                          capture_output=True, text=True, timeout=300)


def test_over_capacity_is_explained_and_a_fit_is_not(tmp_path: Path) -> None:
    (tmp_path / "oom_model.py").write_text(
        "from torch import nn\n"
        "class Tiny(nn.Sequential):\n"
        "    def __init__(self):\n"
        "        super().__init__(*[nn.Sequential(nn.Linear(256, 1024), nn.GELU(), nn.Linear(1024, 256)) for _ in range(3)])\n"
    )
    over = preflight(tmp_path, "--capacity", "256MiB")
    assert over.returncode == 0, over.stderr
    text = over.stdout
    assert "the step would run out of memory: predicted peak" in text and "above the 256.0 MiB of --capacity, batch size 64" in text
    assert "what fills it at the peak:" in text and "activations" in text
    for remedy in ("[batch_size] batch size", "[checkpointing] activation checkpointing of 0, 1, 2", "[optimizer] a lighter optimizer"):
        assert remedy in text, text
    data = json.loads(preflight(tmp_path, "--capacity", "256MiB", "--json").stdout)
    fit = next(r for r in data["explanation"]["remedies"] if r["kind"] == "batch_size")
    assert 0 < fit["details"]["batch_size"] < 64 and fit["details"]["predicted_peak_bytes"] <= 256 << 20
    roomy = preflight(tmp_path, "--capacity", "64GiB")
    assert roomy.returncode == 0 and "would run out of memory" not in roomy.stdout
