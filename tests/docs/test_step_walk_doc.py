"""docs/architecture.md's list of the files a logged step enters is the one a real logged step enters.

A Lightning fit at default monitor settings is followed with ``sys.setprofile`` (as
``../shared/tools/step_walk.py`` does): the package files whose functions a logged step calls.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest

L = pytest.importorskip("lightning.pytorch")
import torch  # noqa: E402
from torch import nn  # noqa: E402
from torch.utils.data import DataLoader  # noqa: E402

import memcallbacks  # noqa: E402
from memcallbacks import MemoryMonitor  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
PKG = str(Path(memcallbacks.__file__).parent) + "/"
STEPS, LOG_EVERY = 110, 50  # logged steps 49 and 99; the run's end (step 109) is not one of them


class _Tiny(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 64))

    def training_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
        return self.net(batch).pow(2).mean()

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=1e-3)


def _documented() -> tuple[set[str], set[str]]:
    """The files every logged step enters, and those some steps also enter (docs/architecture.md)."""
    doc = (ROOT / "docs" / "architecture.md").read_text()
    block = re.search(r"A logged step of a Lightning fit.*?```\n(.*?)```.*?on some steps also these.*?```\n(.*?)```", doc, re.S)
    assert block is not None, "docs/architecture.md has no list of the files a logged step enters"
    return set(block.group(1).split()), set(block.group(2).split())


def test_logged_step_enters_the_documented_files(tmp_path: Path) -> None:
    files: dict[int, set[str]] = {}
    current: list[int | None] = [None]

    class Marker(L.Callback):
        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):  # type: ignore[no-untyped-def]
            current[0] = trainer.global_step

    def profile(frame, event, arg):  # type: ignore[no-untyped-def]
        if event == "call" and current[0] is not None:
            name = frame.f_code.co_filename
            if name.startswith(PKG):
                files.setdefault(current[0], set()).add(name[len(PKG):])

    torch.manual_seed(0)
    monitor = MemoryMonitor(output_dir=str(tmp_path / "mem"), plot=False)
    trainer = L.Trainer(max_steps=STEPS, default_root_dir=tmp_path, callbacks=[Marker(), monitor], accelerator="cpu", devices=1,
                        log_every_n_steps=LOG_EVERY, logger=L.loggers.CSVLogger(tmp_path), enable_progress_bar=False,
                        enable_model_summary=False, enable_checkpointing=False)
    sys.setprofile(profile)
    try:
        trainer.fit(_Tiny(), DataLoader(torch.randn(STEPS * 8, 64), batch_size=8))
    finally:
        sys.setprofile(None)
    logged = [s for s in files if (s + 1) % LOG_EVERY == 0]
    assert logged, "no logged step was followed"
    always, sometimes = _documented()
    for step in logged:
        # every file the step enters is listed, and it enters every file listed as entered always
        assert files[step] - always - sometimes == set(), f"docs/architecture.md does not list {sorted(files[step] - always - sometimes)}"
        assert always - files[step] == set(), f"docs/architecture.md lists {sorted(always - files[step])}, which step {step} did not enter"
