"""The main job: train a small model on CPU with MemoryMonitor and print where memory went.

    python examples/lightning_cpu.py [--steps 60] [--out runs]

What it shows: per-phase peaks on every step (forward holds the activations and a deliberately
large attention-score temporary, backward the gradients, the optimizer its Adam state on the
first step), the validation loop recorded apart from training, and the files the monitor leaves:
history.csv, report.json and memory.png next to the TensorBoard and CSV logs.
"""

from __future__ import annotations

import argparse
import math

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

try:
    import lightning.pytorch as L
    from lightning.pytorch.loggers import CSVLogger, TensorBoardLogger
except ImportError:  # the older package name works the same way
    import pytorch_lightning as L  # type: ignore[no-redef]
    from pytorch_lightning.loggers import CSVLogger, TensorBoardLogger  # type: ignore[no-redef]

from memcallbacks import AdvancedOptions, MemoryMonitor


class TinyAttentionModel(L.LightningModule):
    """One self-attention block over sequences of 128 tokens: attention scores dominate the forward peak."""

    def __init__(self, dim: int = 64, heads: int = 4, vocab: int = 1000) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.attn = nn.MultiheadAttention(dim, heads, batch_first=True)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))
        self.head = nn.Linear(dim, vocab)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens)
        # explicit scores so the (batch, heads, seq, seq) temporary is visible in the forward peak
        attn_out, _ = self.attn(x, x, x, need_weights=True, average_attn_weights=False)
        x = x + attn_out
        x = x + self.mlp(x)
        return self.head(x)

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        tokens, targets = batch
        loss = nn.functional.cross_entropy(self(tokens).flatten(0, 1), targets.flatten())
        self.log("train_loss", loss)
        return loss

    def validation_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> None:
        tokens, targets = batch
        self.log("val_loss", nn.functional.cross_entropy(self(tokens).flatten(0, 1), targets.flatten()))

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=1e-3)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=60, help="optimizer steps to train")
    parser.add_argument("--out", default="runs", help="folder for logs and the monitor's files")
    parser.add_argument("--batch-size", type=int, default=8)
    args = parser.parse_args()

    torch.manual_seed(0)
    n = args.batch_size * 40
    tokens = torch.randint(0, 1000, (n, 128))
    data = TensorDataset(tokens, tokens.roll(-1, dims=1))
    train = DataLoader(data, batch_size=args.batch_size, shuffle=True)
    val = DataLoader(TensorDataset(tokens[:64], tokens[:64].roll(-1, dims=1)), batch_size=args.batch_size)

    # CPU only: return tensors of 256 KiB or more to the OS when freed, so RSS peaks follow tensor
    # lifetimes (see AdvancedOptions.cpu_mmap_threshold); on a GPU the allocator's own peaks are used.
    monitor = MemoryMonitor(advanced=AdvancedOptions(cpu_mmap_threshold="256 KiB"))  # logs with the Trainer (every 10 steps)
    trainer = L.Trainer(
        accelerator="cpu",
        max_steps=args.steps,
        val_check_interval=math.ceil(args.steps / 3) if args.steps < len(train) else 1.0,
        callbacks=[monitor],
        logger=[TensorBoardLogger(args.out, name="example"), CSVLogger(args.out, name="example")],
        log_every_n_steps=10,
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=False,
    )
    trainer.fit(TinyAttentionModel(), train, val)

    print()
    print(monitor.format_report())
    # on CPU the peaks and the floor are resident memory (RSS): what each phase added on top of
    # the step's start is the part the model's code decides
    history = monitor.history
    table = history[["step"]].copy()
    table["resident at start"] = history["reserved"] / 2**20
    for phase in ("forward", "backward", "optimizer"):
        table[f"{phase} rise"] = ((history[f"peak_{phase}"] - history["reserved"]).clip(lower=0)) / 2**20
    print()
    print("first steps (MiB):")
    print(table.head(4).round(1).to_string(index=False))
    print()
    print(f"TensorBoard: tensorboard --logdir {args.out}   (keys under memory/)")

if __name__ == "__main__":
    main()
