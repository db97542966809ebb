"""The commands a user reaches for after a run, on real runs' files: ``report`` and ``plot`` given a
Lightning run folder (they find its ``memcallbacks/`` folder), and the text report's first line: the
verdict, with no resident-memory figure called "allocated" on CPU. ``compare``: test_compare_runs.py."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import lightning.pytorch as L
import pandas as pd
import pytest
import torch
from lightning.pytorch.loggers import CSVLogger

from helpers import BoringModel, RandomDataModule, trainer_kwargs
from memcallbacks import MemoryMonitor, Monitor
from memcallbacks.cli import main

@pytest.fixture(scope="module")
def run_folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A Lightning fit at defaults, logged by a CSVLogger: runs/example/version_0/memcallbacks."""
    root = tmp_path_factory.mktemp("lightning")
    trainer = L.Trainer(**trainer_kwargs(root, max_steps=12, limit_val_batches=2, val_check_interval=6,
                                         callbacks=[MemoryMonitor()], logger=CSVLogger(str(root / "runs"), name="example")))
    trainer.fit(BoringModel(), datamodule=RandomDataModule())
    folder = root / "runs" / "example" / "version_0"
    assert (folder / "memcallbacks" / "report.json").is_file()
    return folder


def test_report_finds_the_output_folder_inside_a_run_folder(run_folder: Path, capsys: Any) -> None:
    assert main(["report", str(run_folder)]) == 0
    text = capsys.readouterr().out
    lines = text.splitlines()
    assert lines[0].startswith("memcallbacks: no problem found in 12 steps; peak "), lines[0]
    assert "resident memory" in lines[0] and "step " in lines[0], lines[0]
    # on CPU every figure says what it is: resident memory (RSS) or the heap, never "allocated"
    assert not [line for line in lines if "allocated" in line], text
    assert any(line.startswith("  validate") for line in lines), text
    rows = next(line for line in lines if line.startswith("  rows in history.csv"))
    history = pd.read_csv(run_folder / "memcallbacks" / "history.csv")
    assert f"{len(history)} of 12 steps" in rows or (len(history) == 12 and "every step" in rows), (rows, list(history["step"]))


def test_report_refuses_a_folder_without_a_run(tmp_path: Path, capsys: Any) -> None:
    assert main(["report", str(tmp_path)]) == 2
    assert "no report.json in" in capsys.readouterr().err


def test_plot_redraws_memory_png_from_history_csv(run_folder: Path, tmp_path: Path, capsys: Any) -> None:
    out = tmp_path / "again.png"
    assert main(["plot", str(run_folder), "-o", str(out)]) == 0
    assert capsys.readouterr().out.strip() == str(out)
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and out.stat().st_size > 10_000
    png = run_folder / "memcallbacks" / "memory.png"
    before = png.stat().st_mtime_ns
    assert main(["plot", str(run_folder)]) == 0  # default: memory.png in the output folder, replaced
    assert png.stat().st_mtime_ns >= before and png.read_bytes()[:4] == b"\x89PNG"


def test_a_leaky_run_reports_its_problem_first_with_its_fix(tmp_path: Path, capsys: Any) -> None:
    """A loop keeping last step's loss dict (and its graph) until the next step: the verdict's first
    line counts the problem, the next names kind, step, holder and the fix's first words; the same
    lines went to the console when the run ended."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(256, 256), torch.nn.ReLU(), torch.nn.Linear(256, 1))
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    monitor = Monitor(model, opt, output_dir=str(tmp_path), device="cpu")
    for _ in monitor.track(range(12)):
        x = torch.randn(2048, 256, requires_grad=True)  # 2 MiB, and its grad: kept by the graph
        outputs = {"loss": model(x).pow(2).mean()}
        outputs["loss"].backward()
        opt.step()
        opt.zero_grad()
    monitor.close()
    console = [line for line in capsys.readouterr().out.splitlines() if line.startswith(("memcallbacks: ", "  - "))]
    assert main(["report", str(tmp_path)]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith("memcallbacks: 1 problem found in 12 steps; peak "), lines[:3]
    assert lines[1].startswith("  - lingering, step 1: held by ") and "outputs['loss']" in lines[1], lines[1]
    assert "; fix: Return `loss.item()`" in lines[1], lines[1]
    assert console[:2] == lines[:2] and console[2].startswith(f"memcallbacks: files in {tmp_path}"), console
    report = json.loads((tmp_path / "report.json").read_text())
    assert report["verdict"] == lines[:2]
    assert (tmp_path / "memory.png").read_bytes()[:4] == b"\x89PNG"


def test_reading_a_snapshot_offline_imports_no_torch(tmp_path: Path) -> None:
    """``summary`` and ``render`` read a pickle: on a laptop without a GPU build they start in a fraction of a
    second (torch's import alone is ~1 s); recording and CPU capture import it when first used."""
    import subprocess
    import sys

    snapshot = Path(__file__).parents[1] / "data" / "cuda_like_snapshot.pickle"
    code = ("import sys; from memcallbacks.cli import main\n"
            f"assert main(['summary', {str(snapshot)!r}]) in (0, None)\n"
            f"assert main(['render', {str(snapshot)!r}, '-o', {str(tmp_path / 'view.html')!r}]) in (0, None)\n"
            "import memcallbacks.snapshot as s; s.summarize_snapshot, s.load_snapshot\n"
            "print('TORCH', 'torch' in sys.modules)\n"
            "s.CpuCapture; print('AFTER', 'torch' in sys.modules)")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "TORCH False" in proc.stdout and "AFTER True" in proc.stdout, proc.stdout[-2000:]
    assert (tmp_path / "view.html").stat().st_size > 0 and (tmp_path / "view.png").exists()
