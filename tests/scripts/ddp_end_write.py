"""Lightning DDP (2 CPU processes, gloo) where one rank's end-of-run write is slow, and optionally rank 1 raises.

    python tests/scripts/ddp_end_write.py OUT_DIR --slow-rank R --slow-s S [--fail-at-step N]

The slow write is a fault injected into the plot stage of the file set (a slow disk, a busy
host): ``history_figure`` sleeps ``S`` seconds first on rank ``R``, in the rank's own process
and in the writer process it starts (``tests/scripts/slow_end_writer.py`` in its place). ``--fail-at-step``: rank 1's
``training_step`` raises at that step; Lightning's child-process observer in rank 0 then SIGKILLs
rank 0 within 5 s. Rank 0 writes ``OUT_DIR/rank0_after_fit.json`` right after ``fit()`` returns,
with the monitor folder's listing at that moment.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # tests/, for helpers

import lightning.pytorch as L  # noqa: E402

import memcallbacks._files.outputs as outputs  # noqa: E402
import memcallbacks._runtime.end_write as end_write  # noqa: E402
from helpers import BoringModel, RandomDataModule, end_process_group, trainer_kwargs  # noqa: E402
from memcallbacks import MemoryMonitor  # noqa: E402


class FailingModel(BoringModel):
    def __init__(self, fail_at_step: int | None) -> None:
        super().__init__()
        self.fail_at_step = fail_at_step

    def training_step(self, batch, batch_idx):
        if self.fail_at_step is not None and self.global_rank == 1 and self.global_step == self.fail_at_step:
            raise RuntimeError("rank 1 fails on purpose")
        return super().training_step(batch, batch_idx)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("out")
    parser.add_argument("--slow-rank", type=int, default=0)
    parser.add_argument("--slow-s", type=float, default=0.0)
    parser.add_argument("--fail-at-step", type=int, default=None)
    args = parser.parse_args()

    rank = int(os.environ.get("LOCAL_RANK", "0"))  # Lightning's "ddp" launcher sets it in the processes it starts
    if rank == args.slow_rank and args.slow_s:
        figure = outputs.history_figure

        def slow_figure(*a, **k):
            time.sleep(args.slow_s)
            return figure(*a, **k)

        outputs.history_figure = slow_figure
        os.environ["DDP_END_WRITE_SLOW_S"] = str(args.slow_s)
        end_write.WRITER_MODULE = "slow_end_writer"  # found on the writer's path: this script's folder
    mem = os.path.join(args.out, "mem")
    monitor = MemoryMonitor(sample_every_n_steps=1, output_dir=mem)
    trainer = L.Trainer(**trainer_kwargs(args.out, devices=2, strategy="ddp", max_steps=4, callbacks=[monitor]))
    trainer.fit(FailingModel(args.fail_at_step), RandomDataModule(batches=8))
    if trainer.global_rank == 0:
        with open(os.path.join(args.out, "rank0_after_fit.json"), "w") as fh:
            json.dump(sorted(os.listdir(mem)), fh)
    end_process_group()


if __name__ == "__main__":
    main()
