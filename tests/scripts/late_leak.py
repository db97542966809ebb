"""One training run, in a fresh process, with a leak that begins at ``--start``; prints a JSON line.

A user's training run is its own process. In a test session's process, earlier tests leave freed
heap still resident, which a late leak refills before the resident set moves: the RSS tripwire then
fires as late as that space allows (up to ~45 steps for 256 KiB/step, measured), not as it does in
a run of its own. ``tests/runtime/test_quiet_steps.py`` runs this script for the latency targets.

Usage: ``python late_leak.py OUTPUT_DIR {plain,plain_log_fn,lightning} RATE_BYTES START STEPS [FREE_AT]``

``FREE_AT``: the run holds a 400 MiB buffer from before the monitor starts (data loaded at start-up)
and frees it at that step. Started by ``exec`` from a process that had touched more than the run
then holds, the run's ``getrusage`` high-water mark stays at that process's for good (Linux keeps
the larger of the marks of the address space ``exec`` replaced and the new one's): once the buffer
is freed, the mark sits far above anything the run reaches, and the RSS tripwire must notice.
"""

from __future__ import annotations

import json
import sys
from typing import Any

import torch
from torch import nn

DIM, BATCH = 256, 128
STARTUP: list[torch.Tensor] = []  # the start-up buffer FREE_AT frees


def mlp() -> nn.Module:
    return nn.Sequential(nn.Linear(DIM, 512), nn.ReLU(), nn.Linear(512, 1))


def leak_tensor(nbytes: int) -> torch.Tensor:
    return torch.ones(nbytes // 4)  # written, so its pages are really in use


def plain(out: str, rate: int, start: int, steps: int, log_fn: bool, free_at: int) -> Any:
    from memcallbacks import Monitor

    kept: list[torch.Tensor] = []
    model = mlp()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    monitor = Monitor(model, optimizer, (lambda metrics, step: None) if log_fn else None, output_dir=out, plot=False)
    for step, x in enumerate(monitor.track(list(torch.randn(steps, BATCH, DIM)))):
        model(x).pow(2).mean().backward()
        optimizer.step()
        optimizer.zero_grad()
        if step >= start:
            kept.append(leak_tensor(rate))
        if step == free_at:
            STARTUP.clear()
    monitor.close()
    return monitor


def lightning(out: str, rate: int, start: int, steps: int, free_at: int) -> Any:
    import lightning.pytorch as L

    from memcallbacks import MemoryMonitor

    kept: list[torch.Tensor] = []

    class LateLeak(L.Callback):
        def on_train_batch_end(self, trainer: Any, *args: Any) -> None:
            if trainer.global_step > start:
                kept.append(leak_tensor(rate))
            if trainer.global_step == free_at:
                STARTUP.clear()

    class Net(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = mlp()

        def training_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
            return self.net(batch).pow(2).mean()

        def configure_optimizers(self) -> Any:
            return torch.optim.AdamW(self.parameters(), lr=1e-3)

    monitor = MemoryMonitor(output_dir=out, plot=False)
    trainer = L.Trainer(accelerator="cpu", devices=1, max_steps=steps, logger=False, callbacks=[monitor, LateLeak()], default_root_dir=out,
                        enable_progress_bar=False, enable_model_summary=False, enable_checkpointing=False)
    trainer.fit(Net(), torch.utils.data.DataLoader(torch.randn(steps * BATCH, DIM), batch_size=BATCH))
    return monitor


def main() -> None:
    out, adapter, rate, start, steps = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5])
    free_at = int(sys.argv[6]) if len(sys.argv) > 6 else -1  # -1: no start-up buffer
    torch.set_num_threads(1)
    if free_at >= 0:
        STARTUP.append(leak_tensor(400 << 20))
    if adapter == "lightning":
        monitor = lightning(out, rate, start, steps, free_at)
    else:
        monitor = plain(out, rate, start, steps, log_fn=adapter == "plain_log_fn", free_at=free_at)
    growth = [f for f in monitor.findings if f.kind == "growth"]
    found = (growth[0].first_step or growth[0].step) if growth else None
    print(json.dumps({"found": found, "holders": growth[0].holders if growth else [], "report": monitor.format_report()}))


if __name__ == "__main__":
    main()
