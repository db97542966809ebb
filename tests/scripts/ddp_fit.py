"""Fit BoringModel on 2 CPU processes (DDP, gloo) with MemoryMonitor; rank 1 allocates a large forward temporary.

    python tests/scripts/ddp_fit.py OUT_DIR [--strategy ddp|ddp_spawn] [--steps 3] [--rank-temp-mib 192] [--snapshot-peak-mib N]
        [--mlflow TRACKING_URI] [--per-rank-dirs]

Lightning's "ddp" strategy re-launches this script for rank 1 (and "ddp_spawn" imports it in its
children), so it must be a standalone file; results come back only through files.
Leaves TensorBoard and CSV logs under OUT_DIR/logs and the monitor's files under OUT_DIR/mem.
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # tests/, for helpers

import lightning.pytorch as L  # noqa: E402
from lightning.pytorch.loggers import CSVLogger, TensorBoardLogger  # noqa: E402

from helpers import BoringModel, RandomDataModule, end_process_group, trainer_kwargs  # noqa: E402
from memcallbacks import MemoryMonitor  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("out")
    parser.add_argument("--strategy", default="ddp")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--rank-temp-mib", type=int, default=192)
    parser.add_argument("--snapshot-peak-mib", type=int, default=None, help="auto_snapshot with this snapshot peak_bytes")
    parser.add_argument("--mlflow", default=None, help="also log to an MLFlowLogger with this tracking URI")
    parser.add_argument("--per-rank-dirs", action="store_true", help="output_dir OUT_DIR/mem{rank}, as on separate nodes (ddp only)")
    args = parser.parse_args()

    snapshots = {} if args.snapshot_peak_mib is None else {
        "auto_snapshot": True, "snapshot": {"peak_bytes": args.snapshot_peak_mib << 20, "steps": 1, "capacity_fraction": None},
    }
    # Lightning's "ddp" launcher sets LOCAL_RANK in the processes it starts; the first process has none
    mem = f"mem{os.environ.get('LOCAL_RANK', '0')}" if args.per_rank_dirs else "mem"
    monitor = MemoryMonitor(log_keys="all", log_every_n_steps=1, sample_every_n_steps=1, output_dir=os.path.join(args.out, mem), **snapshots)
    logs = os.path.join(args.out, "logs")
    loggers = [TensorBoardLogger(logs, name="tb", version=0), CSVLogger(logs, name="csv", version=0)]
    if args.mlflow:
        from lightning.pytorch.loggers import MLFlowLogger

        loggers.append(MLFlowLogger(experiment_name="memcallbacks-ddp", tracking_uri=args.mlflow))
    trainer = L.Trainer(
        **trainer_kwargs(
            args.out,
            devices=2,
            strategy=args.strategy,
            max_steps=args.steps,
            callbacks=[monitor],
            logger=loggers,
        )
    )
    trainer.fit(BoringModel(rank_temp_mib=args.rank_temp_mib), RandomDataModule(batches=2 * args.steps))
    print(f"rank {trainer.global_rank}: {len(monitor.history)} rows, files {sorted(monitor.files)}", flush=True)
    end_process_group()


if __name__ == "__main__":
    main()
