"""Train a small model with Accelerate on CPU, watched by AccelerateMemoryMonitor, and print where memory went.

    python examples/accelerate_cpu.py [--steps 60] [--out runs]
    torchrun --nproc_per_node 2 examples/accelerate_cpu.py                    # two processes (gloo)
    accelerate launch --multi_gpu --num_processes 2 examples/accelerate_cpu.py  # the same, on a CPU-only machine

(``accelerate launch --cpu --num_processes 2`` starts a single process in accelerate 1.x: its CPU
launcher only goes multi-process through an MPI hostfile.)

What it shows: per-phase peaks found without annotating the loop (module hooks on the prepared
model, the call to ``accelerator.backward``, torch's optimizer-step hooks), gradient accumulation
(one row per optimizer step), an evaluation loop recorded apart from training, metrics logged
through ``accelerator.log`` to TensorBoard, and the files the monitor leaves in
``<out>/memcallbacks``: history.csv, report.json and memory.png (``.rank{r}`` per process).
"""

from __future__ import annotations

import argparse

import torch
from accelerate import Accelerator
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from memcallbacks import AdvancedOptions
from memcallbacks.accelerate import AccelerateMemoryMonitor


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
        # explicit scores so the (batch, heads, seq, seq) temporary is visible in the forward peak
        attn_out, _ = self.attn(x, x, x, need_weights=True, average_attn_weights=False)
        x = x + attn_out
        x = x + self.mlp(x)
        return self.head(x)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=60, help="optimizer steps to train")
    parser.add_argument("--out", default="runs", help="project folder: TensorBoard logs and the monitor's files")
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--accumulate", type=int, default=2, help="gradient accumulation steps")
    args = parser.parse_args()

    accelerator = Accelerator(cpu=True, log_with="tensorboard", project_dir=args.out, gradient_accumulation_steps=args.accumulate)
    accelerator.init_trackers("example")

    torch.manual_seed(0)
    n = args.batch_size * args.accumulate * args.steps
    tokens = torch.randint(0, 1000, (n, 128))
    train = DataLoader(TensorDataset(tokens, tokens.roll(-1, dims=1)), batch_size=args.batch_size, shuffle=True)
    val = DataLoader(TensorDataset(tokens[:64], tokens[:64].roll(-1, dims=1)), batch_size=args.batch_size)
    model = TinyAttentionModel()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model, optimizer, train, val = accelerator.prepare(model, optimizer, train, val)

    # Built after prepare, the monitor hooks the prepared model itself (accelerator._models).
    # CPU only: tensors of 256 KiB or more go back to the OS when freed, so RSS peaks follow tensor
    # lifetimes (AdvancedOptions.cpu_mmap_threshold); on a GPU the allocator's own peaks are used.
    monitor = AccelerateMemoryMonitor(accelerator, log_every_n_steps=10, sample_every_n_steps=1,
                                      advanced=AdvancedOptions(cpu_mmap_threshold="256 KiB"))
    loss_fn = nn.CrossEntropyLoss()
    step = 0
    for tokens_batch, targets in monitor.track(train):  # marks step boundaries
        with accelerator.accumulate(model):
            loss = loss_fn(model(tokens_batch).flatten(0, 1), targets.flatten())
            accelerator.backward(loss)
            optimizer.step()
            optimizer.zero_grad()
        if accelerator.sync_gradients:
            step += 1
            if step % 10 == 0:
                accelerator.log({"train_loss": loss.item()}, step=step - 1)
            if step % 20 == 0:
                model.eval()
                with monitor.evaluate(), torch.no_grad():  # recorded apart from training rows
                    for tokens_val, _ in val:
                        model(tokens_val)
                model.train()
    monitor.close()  # every process: writes the files, gathers rank summaries
    accelerator.end_training()

    if accelerator.is_main_process:
        print()
        print(monitor.format_report())
        history = monitor.history
        cols = ["step", "micro_batches", "allocated", "reserved", "peak_forward", "peak_backward", "peak_optimizer"]
        table = history[cols].head(4).copy()
        for col in cols[2:]:
            table[col] = (table[col] / 2**20).round(1)
        print()
        print("first steps (MiB):")
        print(table.to_string(index=False))
        print()
        print(f"TensorBoard: tensorboard --logdir {args.out}   (keys under memory/)")


if __name__ == "__main__":
    main()
