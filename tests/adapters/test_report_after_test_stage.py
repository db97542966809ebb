"""After Lightning's ``fit()`` then ``test()`` (the pattern of Lightning's own examples), the report keeps
the training run's cadence: own time, overhead and the sampling interval the budget chose."""

from __future__ import annotations

import json

import lightning.pytorch as L

from helpers import BoringModel, RandomDataModule, trainer_kwargs
from memcallbacks import MemoryMonitor
from memcallbacks._files.verdict import VERDICT_ABOVE


def test_fit_then_test_keeps_the_cadence_section(tmp_path):
    monitor = MemoryMonitor(output_dir=str(tmp_path / "mem"), plot=False)
    model, data = BoringModel(), RandomDataModule()
    trainer = L.Trainer(callbacks=[monitor], **trainer_kwargs(tmp_path, max_steps=70))
    trainer.fit(model, datamodule=data)
    summary = json.loads((tmp_path / "mem" / "report.json").read_text())["summary"]
    after_fit = summary["cadence"]
    assert after_fit["overhead"] is not None and summary["step_time_median_s"] is not None
    trainer.test(model, datamodule=data)
    report = json.loads((tmp_path / "mem" / "report.json").read_text())
    cadence = report["summary"]["cadence"]
    # before the fix: overhead None, sample_every_n_steps 1, "own time ?" (a fresh cadence for test())
    # the training run's numbers; the monitor's work during test() (the collection watch) adds to its own time
    assert cadence["overhead"] is not None and cadence["overhead"] >= after_fit["overhead"], (cadence, after_fit)
    assert report["summary"]["step_time_median_s"] == summary["step_time_median_s"]  # one median, the training run's
    assert cadence["sample_every_n_steps"] == after_fit["sample_every_n_steps"] > 1, (cadence, after_fit)
    assert cadence["read_every_n_steps"] == after_fit["read_every_n_steps"]
    text = monitor.format_report()
    assert "own time ?" not in text and "monitor's own time " in text, text
    # the console showed the verdict when fit() ended: the text report points at it (issue 44 item 5)
    assert text.splitlines()[0] == VERDICT_ABOVE, text
    assert report["verdict"][0].startswith("memcallbacks: no problem found in 70 steps"), report["verdict"]
    assert "test" in set(monitor.eval_history["stage"]), monitor.eval_history


def test_fit_then_validate_and_test_keep_the_host_reads_and_the_per_rank_figures(tmp_path):
    monitor = MemoryMonitor(output_dir=str(tmp_path / "mem"), plot=False)
    model, data = BoringModel(), RandomDataModule()
    trainer = L.Trainer(callbacks=[monitor], **trainer_kwargs(tmp_path, max_steps=70))
    trainer.fit(model, datamodule=data)
    after_fit = json.loads((tmp_path / "mem" / "report.json").read_text())
    assert after_fit["host"]["reads"] > 0 and after_fit["summary"]["rank_figures"].get("host_private_bytes"), after_fit["host"]
    trainer.validate(model, datamodule=data)
    trainer.test(model, datamodule=data)
    report = json.loads((tmp_path / "mem" / "report.json").read_text())
    # before the fix: reads 0 and rank_figures {} (the test stage's setup made a new host channel)
    assert report["host"]["reads"] >= after_fit["host"]["reads"], (report["host"], after_fit["host"])
    figures = report["summary"]["rank_figures"]
    assert figures.get("host_private_bytes") and figures.get("host_python_bytes"), figures
    text = monitor.format_report()
    assert "no reading" not in text and "    private memory           " in text, text
