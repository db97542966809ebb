"""A Lightning fit on CPU with ``MemoryMonitor()`` at its defaults: a small convolutional net on 32x32
images, the batch size given. Two runs of it at batch 16 and 64 are the "same model, bigger batch"
comparison of ``memcallbacks compare`` (tests/cli/test_compare_runs.py); each run is its own process,
as a user's runs are (a second fit in the same process would start from the first one's heap).

    python tests/scripts/batch_fit.py OUT_DIR --batch-size 16 [--steps 6] [--cpu-mmap-threshold "256 KiB"]

The monitor's files land in OUT_DIR/run/version_0/memcallbacks (a ``CSVLogger`` run folder).
"""

from __future__ import annotations

import argparse
import logging
import warnings

import lightning.pytorch as L
import torch
from lightning.pytorch.loggers import CSVLogger
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from memcallbacks import AdvancedOptions, MemoryMonitor


class ConvNet(L.LightningModule):
    """Two 3x3 convolutions of 32 channels: the activations (batch x 32 x 32 x 32 floats each) are the step's memory."""

    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Conv2d(3, 32, 3, padding=1), nn.ReLU(), nn.Conv2d(32, 32, 3, padding=1), nn.ReLU(),
                                 nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(32, 10))

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = nn.functional.cross_entropy(self.net(x), y)
        self.log("loss", loss)
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=1e-3)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out")
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--cpu-mmap-threshold", default=None, help="AdvancedOptions.cpu_mmap_threshold (default: glibc's own)")
    args = parser.parse_args()
    warnings.filterwarnings("ignore")
    for name in ("lightning", "lightning.pytorch", "lightning.fabric"):
        logging.getLogger(name).setLevel(logging.ERROR)

    torch.manual_seed(0)
    n = 64 * args.steps
    data = TensorDataset(torch.randn(n, 3, 32, 32), torch.randint(0, 10, (n,)))
    trainer = L.Trainer(accelerator="cpu", max_steps=args.steps, logger=CSVLogger(args.out, name="run"), log_every_n_steps=2,
                        enable_progress_bar=False, enable_model_summary=False, enable_checkpointing=False,
                        callbacks=[MemoryMonitor(advanced=AdvancedOptions(cpu_mmap_threshold=args.cpu_mmap_threshold))])
    trainer.fit(ConvNet(), DataLoader(data, batch_size=args.batch_size))


if __name__ == "__main__":
    main()
