"""A clean 2-process DDP fit (CPU, gloo) with leak detection on, for tests/scenarios/test_leak_zoo.py.

    python tests/scripts/zoo_ddp_fit.py OUT_DIR [--steps 64]

Every step is sampled; 1 MiB batches (so a lingering batch would cross the 1 MiB threshold), Adam.
Lightning's "ddp" strategy re-launches this script for rank 1, so it must be a standalone file;
results come back only through files: the monitor's under OUT_DIR/mem, a CSV log under OUT_DIR/logs.
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # tests/, for helpers

import lightning.pytorch as L  # noqa: E402
import torch  # noqa: E402
from lightning.pytorch.loggers import CSVLogger  # noqa: E402
from torch import nn  # noqa: E402
from torch.utils.data import DataLoader  # noqa: E402

from helpers import end_process_group, trainer_kwargs  # noqa: E402
from memcallbacks import MemoryMonitor  # noqa: E402


class CleanModel(L.LightningModule):
    def __init__(self, dim: int = 1024) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(dim, 64), nn.ReLU(), nn.Linear(64, 1))

    def training_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
        loss = self.net(batch).pow(2).mean()
        self.log("train_loss", loss)
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.Adam(self.parameters(), lr=1e-3)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("out")
    parser.add_argument("--steps", type=int, default=64)
    args = parser.parse_args()
    torch.set_num_threads(1)

    monitor = MemoryMonitor(log_every_n_steps=4, sample_every_n_steps=1, plot=False, output_dir=os.path.join(args.out, "mem"))
    trainer = L.Trainer(
        **trainer_kwargs(
            args.out,
            devices=2,
            strategy="ddp",
            max_steps=args.steps,
            callbacks=[monitor],
            logger=CSVLogger(os.path.join(args.out, "logs"), name="csv", version=0),
        )
    )
    data = torch.randn(16 * 256, 1024, generator=torch.Generator().manual_seed(0))
    trainer.fit(CleanModel(), DataLoader(data, batch_size=256))
    print(f"rank {trainer.global_rank}: {len(monitor.history)} rows, {len(monitor.findings)} findings", flush=True)
    end_process_group()


if __name__ == "__main__":
    main()
