"""Train a tiny GPT-2 (built from a config: nothing is downloaded) with the transformers Trainer on CPU,
watched by MemoryMonitorCallback, and print where memory went.

    python examples/transformers_cpu.py [--steps 40] [--out runs_hf]

What it shows: memory metrics in the Trainer's own logs (the console, ``trainer.state.log_history``
and every ``report_to`` tracker; TensorBoard shows them as ``train/memory/...``), gradient
accumulation (one row per optimizer step, ``micro_batches`` = accumulation steps), and the files
the monitor leaves in ``<out>/memcallbacks``: history.csv, report.json and memory.png.
"""

from __future__ import annotations

import argparse
import importlib.util

import torch
from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments

from memcallbacks import AdvancedOptions
from memcallbacks.transformers import MemoryMonitorCallback


class RepeatingTokens(torch.utils.data.Dataset):
    """Sequences that repeat a short random pattern, so the loss has something to learn."""

    def __init__(self, n: int, length: int = 64, vocab: int = 256) -> None:
        g = torch.Generator().manual_seed(0)
        patterns = torch.randint(0, vocab, (n, 8), generator=g)
        self.ids = patterns.repeat(1, length // 8)

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=40, help="optimizer steps to train")
    parser.add_argument("--out", default="runs_hf", help="TrainingArguments.output_dir")
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--accumulate", type=int, default=2, help="gradient accumulation steps")
    args = parser.parse_args()

    torch.manual_seed(0)
    config = GPT2Config(n_layer=4, n_embd=128, n_head=4, vocab_size=256, n_positions=64, bos_token_id=0, eos_token_id=0)
    model = GPT2LMHeadModel(config)
    data = RepeatingTokens(args.batch_size * args.accumulate * args.steps)

    # CPU only: tensors of 256 KiB or more go back to the OS when freed, so RSS peaks follow tensor
    # lifetimes (AdvancedOptions.cpu_mmap_threshold); on a GPU the allocator's own peaks are used.
    monitor = MemoryMonitorCallback(sample_every_n_steps=1, advanced=AdvancedOptions(cpu_mmap_threshold="256 KiB"))
    training_args = TrainingArguments(
        output_dir=args.out,
        use_cpu=True,
        max_steps=args.steps,
        per_device_train_batch_size=args.batch_size,
        gradient_accumulation_steps=args.accumulate,
        learning_rate=1e-3,
        logging_steps=10,  # memory metrics follow the Trainer's logging interval
        report_to=["tensorboard"] if importlib.util.find_spec("tensorboard") else [],
        save_strategy="no",
        disable_tqdm=True,
    )
    trainer = Trainer(model=model, args=training_args, train_dataset=data, callbacks=[monitor])
    trainer.train()

    if trainer.is_world_process_zero():
        print()
        print(monitor.format_report())
        history = monitor.history
        cols = ["step", "micro_batches", "reserved", "peak_forward", "peak_backward", "peak_optimizer"]
        table = history[cols].head(4).copy()
        for col in cols[2:]:
            table[col] = (table[col] / 2**20).round(1)
        print()
        print("first steps (MiB):")
        print(table.to_string(index=False))
        logged = [h for h in trainer.state.log_history if "memory/peak_step_GiB" in h]
        print()
        print(f"{len(logged)} Trainer log entries carry memory/ keys, e.g. step {logged[0]['step']}: "
              f"loss {logged[0]['loss']:.3f}, peak {logged[0]['memory/peak_step_GiB']:.3f} GiB")
        print(f"TensorBoard: tensorboard --logdir {args.out}   (keys under train/memory/)")


if __name__ == "__main__":
    main()
