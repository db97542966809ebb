"""A plain PyTorch training loop watched by ``memcallbacks.Monitor``: no framework, no annotations.

    python examples/plain_loop.py [--steps 60] [--out runs_plain]

What it shows: per-phase peaks found by hooks alone (a forward pre-hook and a hook on the model's
output, an autograd-engine callback at the end of backward, torch's optimizer-step hooks), an
evaluation loop recorded apart from training, metrics handed to your own
``log_fn`` (here: TensorBoard's ``SummaryWriter`` when installed, else print), and the files the
monitor leaves in ``<out>/memcallbacks``: history.csv, report.json and memory.png.
"""

from __future__ import annotations

import argparse
import importlib.util
import os

import torch
from torch import nn

from memcallbacks import AdvancedOptions, Monitor


class TinyAttentionModel(nn.Module):
    """One self-attention block over sequences of 128 tokens: attention scores dominate the forward peak."""

    def __init__(self, dim: int = 64, heads: int = 4, vocab: int = 1000) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.attn = nn.MultiheadAttention(dim, heads, batch_first=True)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))
        self.head = nn.Linear(dim, vocab)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens)
        attn_out, _ = self.attn(x, x, x, need_weights=True, average_attn_weights=False)
        x = x + attn_out
        x = x + self.mlp(x)
        return self.head(x)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=60, help="optimizer steps to train")
    parser.add_argument("--out", default="runs_plain", help="folder for the monitor's files (and TensorBoard logs)")
    parser.add_argument("--batch-size", type=int, default=8)
    args = parser.parse_args()

    torch.manual_seed(0)
    tokens = torch.randint(0, 1000, (args.batch_size * args.steps, 128))
    targets = tokens.roll(-1, dims=1)
    batches = list(zip(tokens.split(args.batch_size), targets.split(args.batch_size)))
    model = TinyAttentionModel()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    loss_fn = nn.CrossEntropyLoss()

    if importlib.util.find_spec("tensorboard") is not None:
        from torch.utils.tensorboard import SummaryWriter

        writer = SummaryWriter(os.path.join(args.out, "tensorboard"))

        def log_fn(metrics: dict[str, float], step: int) -> None:
            for key, value in metrics.items():
                writer.add_scalar(key, value, step)
    else:
        writer = None

        def log_fn(metrics: dict[str, float], step: int) -> None:
            print(f"step {step}: peak {metrics['memory/peak_step_GiB']:.3f} GiB")

    # CPU only: tensors of 256 KiB or more go back to the OS when freed, so RSS peaks follow tensor
    # lifetimes (AdvancedOptions.cpu_mmap_threshold); on a GPU the allocator's own peaks are used.
    monitor = Monitor(
        model,
        optimizer,
        log_fn,
        log_every_n_steps=10,
        sample_every_n_steps=1,
        advanced=AdvancedOptions(cpu_mmap_threshold="256 KiB"),
        output_dir=os.path.join(args.out, "memcallbacks"),
    )
    for step, (x, y) in enumerate(monitor.track(batches)):  # marks step boundaries
        loss = loss_fn(model(x).flatten(0, 1), y.flatten())
        loss.backward()
        nn.utils.clip_grad_norm_(model.parameters(), 1.0)  # between backward and optimizer.step(): peak_other
        optimizer.step()
        optimizer.zero_grad()
        if (step + 1) % 20 == 0:
            model.eval()
            with monitor.evaluate(), torch.no_grad():
                for x_val, _ in batches[:4]:
                    model(x_val)
            model.train()
    monitor.close()
    if writer is not None:
        writer.close()

    print(monitor.format_report())
    history = monitor.history
    cols = ["step", "reserved", "peak_forward", "peak_backward", "peak_optimizer"]
    table = history[cols].head(4).copy()
    for col in cols[1:]:
        table[col] = (table[col] / 2**20).round(1)
    print()
    print("first steps (MiB; on CPU peaks are RSS, compare them with reserved):")
    print(table.to_string(index=False))


if __name__ == "__main__":
    main()
