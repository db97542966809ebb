"""At the end of a run, at defaults, every adapter shows the verdict and the files' folder on the
console without the user configuring logging (Lightning through its own ``rank_zero_info``, the
others with ``print``); ``console_summary=False`` shows nothing. Real fits; the lines are checked
against the report.json the run wrote."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest
import torch

from memcallbacks import Monitor
from memcallbacks._files.verdict import VERDICT_ABOVE

ROOT = Path(__file__).resolve().parents[2]

LIGHTNING_FIT = textwrap.dedent('''
    import sys
    sys.path.insert(0, sys.argv[1])
    import lightning.pytorch as L
    from helpers import BoringModel, RandomDataModule, trainer_kwargs
    from memcallbacks import MemoryMonitor

    monitor = MemoryMonitor() if sys.argv[3] == "on" else MemoryMonitor(console_summary=False)
    L.Trainer(**trainer_kwargs(sys.argv[2], max_steps=5, callbacks=[monitor])).fit(BoringModel(), datamodule=RandomDataModule())
''')


def check_lines(text: str, folder: Path) -> None:
    """The verdict line is report.json's, and the files' line names the folder it is in."""
    report = json.loads((folder / "report.json").read_text())
    lines = [line for line in text.splitlines() if line.startswith("memcallbacks: ")]
    assert lines[0] == report["verdict"][0], (lines, report["verdict"])
    assert lines[0].startswith("memcallbacks: no problem found in "), lines
    assert lines[-1].startswith(f"memcallbacks: files in {folder}"), lines
    assert len(lines) == 2, lines


@pytest.mark.parametrize("switch", ["on", "off"])
def test_lightning_shows_the_verdict_through_rank_zero_info(tmp_path: Path, switch: str) -> None:
    script = tmp_path / "fit.py"
    script.write_text(LIGHTNING_FIT)
    done = subprocess.run([sys.executable, str(script), str(ROOT / "tests"), str(tmp_path), switch], capture_output=True,
                          text=True, timeout=300, env=dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1"))
    assert done.returncode == 0, done.stderr[-3000:]
    if switch == "off":
        assert "memcallbacks: " not in done.stdout + done.stderr
        return
    # Lightning's logger writes INFO to stderr, as its "GPU available" lines
    assert "GPU available" in done.stderr and "memcallbacks: no problem found" in done.stderr, done.stderr[-2000:]
    check_lines(done.stderr, tmp_path / "memcallbacks")


def plain_run(tmp_path: Path) -> Monitor:
    """The README's plain loop, 5 steps, closed."""
    model = torch.nn.Linear(16, 1)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    monitor = Monitor(model, opt, output_dir=str(tmp_path), plot=False, device="cpu")
    for _ in monitor.track(range(5)):
        model(torch.randn(8, 16)).sum().backward()
        opt.step()
        opt.zero_grad()
    monitor.close()
    return monitor


def test_plain_monitor_prints_the_verdict(tmp_path: Path, capsys: Any) -> None:
    plain_run(tmp_path)
    check_lines(capsys.readouterr().out, tmp_path)


def test_plain_monitor_without_files_prints_the_verdict_only(capsys: Any) -> None:
    model = torch.nn.Linear(16, 1)
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    monitor = Monitor(model, opt, write_files=False, device="cpu")
    for _ in monitor.track(range(3)):
        model(torch.randn(8, 16)).sum().backward()
        opt.step()
    monitor.close()
    lines = [line for line in capsys.readouterr().out.splitlines() if line.startswith("memcallbacks: ")]
    assert len(lines) == 1 and lines[0].startswith("memcallbacks: no problem found in 3 steps"), lines


@pytest.mark.usefixtures("fresh_accelerate_state")
def test_accelerate_prints_the_verdict(tmp_path: Path, capsys: Any) -> None:
    accelerate = pytest.importorskip("accelerate")
    from memcallbacks.accelerate import AccelerateMemoryMonitor

    accelerator = accelerate.Accelerator(cpu=True, project_dir=str(tmp_path))
    model = torch.nn.Linear(16, 1)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model, opt = accelerator.prepare(model, opt)
    monitor = AccelerateMemoryMonitor(accelerator, plot=False)
    for _ in monitor.track(range(5)):
        accelerator.backward(model(torch.randn(8, 16)).sum())
        opt.step()
        opt.zero_grad()
    monitor.close()
    check_lines(capsys.readouterr().out, tmp_path / "memcallbacks")


@pytest.mark.usefixtures("fresh_accelerate_state")
def test_transformers_trainer_prints_the_verdict(tmp_path: Path, capsys: Any) -> None:
    transformers = pytest.importorskip("transformers")
    from memcallbacks.transformers import MemoryMonitorCallback

    torch.manual_seed(0)
    config = transformers.GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=64, n_positions=16, bos_token_id=0, eos_token_id=0)
    ids = torch.randint(0, 64, (16, 8), generator=torch.Generator().manual_seed(0))
    data = [{"input_ids": row, "labels": row} for row in ids]
    args = transformers.TrainingArguments(output_dir=str(tmp_path / "out"), use_cpu=True, report_to=[], max_steps=4,
                                          per_device_train_batch_size=4, save_strategy="no", disable_tqdm=True)
    trainer = transformers.Trainer(model=transformers.GPT2LMHeadModel(config), args=args, train_dataset=data,
                                   callbacks=[MemoryMonitorCallback(plot=False)])
    trainer.train()
    check_lines(capsys.readouterr().out, tmp_path / "out" / "memcallbacks")


TRAINER_WITH_BARS = textwrap.dedent('''
    import sys
    import torch
    import transformers
    from memcallbacks.transformers import MemoryMonitorCallback

    torch.manual_seed(0)
    config = transformers.GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=64, n_positions=16, bos_token_id=0, eos_token_id=0)
    ids = torch.randint(0, 64, (16, 8), generator=torch.Generator().manual_seed(0))
    data = [{"input_ids": row, "labels": row} for row in ids]
    args = transformers.TrainingArguments(output_dir=sys.argv[1], use_cpu=True, report_to=[], max_steps=4,
                                          per_device_train_batch_size=4, save_strategy="no")  # tqdm's bars on: the default
    transformers.Trainer(model=transformers.GPT2LMHeadModel(config), args=args, train_dataset=data,
                         callbacks=[MemoryMonitorCallback(plot=False)]).train()
''')


def test_transformers_verdict_is_a_line_of_its_own_beside_the_progress_bar(tmp_path: Path) -> None:
    """The Trainer closes its progress bar after the callbacks' ``on_train_end``: a plain ``print`` there was
    glued to the bar's last state on the console (``4/4 [00:00<00:00, 9.1it/s]memcallbacks: no problem ...``)."""
    pytest.importorskip("transformers")
    env = dict(os.environ, PYTHONUNBUFFERED="1")  # stdout and stderr reach the pipe in the order written, as on a console
    done = subprocess.run([sys.executable, "-c", TRAINER_WITH_BARS, str(tmp_path / "out")], stdout=subprocess.PIPE,
                          stderr=subprocess.STDOUT, text=True, timeout=300, env=env, cwd=tmp_path)
    assert done.returncode == 0, done.stdout[-3000:]
    assert "it/s]" in done.stdout, done.stdout[-2000:]  # the bar was drawn
    assert "]memcallbacks:" not in done.stdout, done.stdout[-2000:]
    check_lines(done.stdout, tmp_path / "out" / "memcallbacks")


# ---------------------------------------------------------------------- said once (issue 44 item 5)
def test_close_then_format_report_prints_the_verdict_once(tmp_path: Path, capsys: Any) -> None:
    """docs/plain_pytorch.md's end: ``monitor.close()`` then ``print(monitor.format_report())``. The verdict is on the
    console once; the text report's first line points at it, and the report's other sections follow."""
    monitor = plain_run(tmp_path)
    print(monitor.format_report())
    out = capsys.readouterr().out
    verdict = json.loads((tmp_path / "report.json").read_text())["verdict"]
    assert out.count(verdict[0]) == 1, out
    assert VERDICT_ABOVE in out and "monitor's own time " in out, out
    # the files keep the verdict: memcallbacks report prints it whole
    from memcallbacks._files.report import format_report, load_output_dir

    assert format_report(*load_output_dir(str(tmp_path))).splitlines()[0] == verdict[0]


def test_lightning_test_after_fit_does_not_print_the_verdict_again(tmp_path: Path) -> None:
    """``fit()``, then ``validate()`` and ``test()`` (Lightning's own examples): each end writes the files, the verdict
    is printed once, at the end of ``fit()`` (through ``rank_zero_info``: Lightning's logger, on stderr)."""
    script = tmp_path / "fit.py"
    script.write_text(LIGHTNING_FIT.split("L.Trainer(")[0] + textwrap.dedent('''
        trainer = L.Trainer(**trainer_kwargs(sys.argv[2], max_steps=5, callbacks=[monitor]))
        model, data = BoringModel(), RandomDataModule()
        trainer.fit(model, datamodule=data)
        trainer.validate(model, datamodule=data)
        trainer.test(model, datamodule=data)
    '''))
    done = subprocess.run([sys.executable, str(script), str(ROOT / "tests"), str(tmp_path), "on"], capture_output=True,
                          text=True, timeout=300, env=dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1"))
    assert done.returncode == 0, done.stderr[-3000:]
    said = [line for line in done.stderr.splitlines() if line.startswith("memcallbacks: no problem found")]
    assert len(said) == 1, done.stderr[-3000:]


def test_an_oom_line_of_the_verdict_is_its_explanations_headline() -> None:
    """The explanation is several lines: the verdict's line is its first, without the words the line already says
    (a user check read "batch size 16384 cpu all..." with the next line run into it)."""
    from memcallbacks._files.verdict import verdict_lines

    oom = {"kind": "oom", "key": "oom:0", "step": 10, "first_step": 10, "state": "open", "severity": "problem", "holders": [],
           "message": "out of memory at step 10 on rank 0, in forward, in fc1 (Linear), batch size 16384\n"
                      "  cpu allocator asked for 256.0 MiB; address space in use (VmSize) 1.1 GiB of 1.1 GiB (RLIMIT_AS)",
           "details": {"fix": "Use batch size 2723 (the largest that fits)"}}
    report = {"summary": {"steps_seen": 11}, "findings": [oom], "events": [{"kind": "oom", "step": 10}]}
    lines = verdict_lines(report)
    assert lines[1] == "  - oom, step 10: in forward, in fc1 (Linear), batch size 16384; fix: Use batch size 2723 (the largest that fits)", lines
