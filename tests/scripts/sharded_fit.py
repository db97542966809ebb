"""Train a small block model on 2 CPU processes (gloo), sharded for real, under the memory monitor.

    python tests/scripts/sharded_fit.py OUT_DIR --runner plain|lightning --strategy fsdp2|ddp
        [--steps 4] [--optimizer adam|sgd] [--mp none|bf16] [--dim 768] [--blocks 4] [--port P] [--no-warmup]

``--strategy fsdp2`` shards each block, then the root, with ``torch.distributed.fsdp.fully_shard``
(``--mp bf16``: a ``MixedPrecisionPolicy(param_dtype=bfloat16)``); ``ddp`` wraps the model in
``DistributedDataParallel``. ``--runner plain`` runs rank 0 here and rank 1 in a copy of this script, each a plain loop with
:class:`memcallbacks.Monitor`; ``--runner lightning`` fits a LightningModule with
:class:`memcallbacks.MemoryMonitor` under ``ModelParallelStrategy`` (its ``configure_model`` calls
``fully_shard``) or ``DDPStrategy`` (Lightning re-launches this script for rank 1).

Results come back through files only: the monitor's under OUT_DIR/mem, and one record per rank,
OUT_DIR/rank{R}.json (written atomically), for tests/adapters/test_sharding.py and any later comparison::

    {"rank", "world_size", "runner", "strategy", "mixed_precision", "optimizer", "steps",
     "model": {"num_params", "dim", "blocks", "layer_params", "param_shapes": {name: [global shape]}},
     "measured": measure_model_states(model, optimizer) at the end of training (same keys),
     "local_shards": {name: [local shape]},       # what this rank holds of each parameter
     "monitor": report["model_states"],          # the monitor's live theory check on this rank
     "steps": [{"step", "allocated", "peak_forward", "peak_backward", "peak_optimizer"}, ...],
     "device": report["summary"]["device"],      # CPU: allocated = glibc heap in use, peaks = RSS high-water
     "warmup": bool}                             # warm_up() ran before the monitor started
"""

from __future__ import annotations

import argparse
import faulthandler
import json
import os
import sys
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # tests/, for helpers

import torch  # noqa: E402
from torch import nn  # noqa: E402

WORLD_SIZE = 2
SEED = 0


class Blocks(nn.Module):
    """``blocks`` residual MLP blocks (dim -> 2 dim -> dim) and a head: what FSDP2 shards one by one."""

    def __init__(self, dim: int, blocks: int) -> None:
        super().__init__()
        self.layers = nn.ModuleList(
            nn.Sequential(nn.Linear(dim, 2 * dim), nn.ReLU(), nn.Linear(2 * dim, dim)) for _ in range(blocks)
        )
        self.head = nn.Linear(dim, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = x + layer(x)
        return self.head(x)


def shard(model: nn.Module, strategy: str, mp: str) -> nn.Module:
    """FSDP2 per block then the root, or DDP; the process group exists already."""
    if strategy == "ddp":
        return nn.parallel.DistributedDataParallel(model)
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    kwargs: dict[str, Any] = {}
    if mp == "bf16":
        kwargs["mp_policy"] = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for layer in model.layers:
        fully_shard(layer, **kwargs)
    fully_shard(model, **kwargs)
    return model


def make_optimizer(name: str, params: Any) -> torch.optim.Optimizer:
    return torch.optim.Adam(params, lr=1e-3) if name == "adam" else torch.optim.SGD(params, lr=1e-2)


def warm_up_blas(args: argparse.Namespace) -> None:
    """One forward and backward of a throwaway copy, before the monitor starts: a process's first
    matmul allocates the BLAS library's packing workspace (4.5-10 MiB here, kept for the life of
    the process), which the CPU heap comparison would otherwise count as unexplained."""
    if args.no_warmup:
        return
    dtype = torch.bfloat16 if args.mp == "bf16" else torch.float32
    Blocks(args.dim, args.blocks).to(dtype)(torch.randn(args.batch, args.dim, dtype=dtype)).sum().backward()


def batches(args: argparse.Namespace, rank: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(SEED + rank)
    return [torch.randn(args.batch, args.dim, generator=g) for _ in range(args.steps)]


def write_record(args: argparse.Namespace, rank: int, model: nn.Module, optimizer: Any, monitor: Any) -> None:
    from memcallbacks.estimate import measure_model_states

    report = monitor.report()
    columns = ["step", "allocated", "peak_forward", "peak_backward", "peak_optimizer"]
    steps = [{k: (None if v != v else int(v)) for k, v in row.items()} for row in monitor.history[columns].to_dict("records")]

    inner = model.module if isinstance(model, nn.parallel.DistributedDataParallel) else model
    local = {}
    for name, p in inner.named_parameters():
        t = p.to_local() if type(p).__name__ == "DTensor" else p
        local[name] = list(t.shape)
    record = {
        "warmup": not args.no_warmup,
        "rank": rank,
        "world_size": WORLD_SIZE,
        "runner": args.runner,
        "strategy": args.strategy,
        "mixed_precision": args.mp,
        "optimizer": args.optimizer,
        "max_steps": args.steps,
        "model": {
            "num_params": sum(p.numel() for p in inner.parameters()),
            "dim": args.dim,
            "blocks": args.blocks,
            "layer_params": sum(p.numel() for p in inner.layers[0].parameters()),
            "param_shapes": {name: list(p.shape) for name, p in inner.named_parameters()},
        },
        "measured": measure_model_states(model, optimizer),
        "local_shards": local,
        "monitor": report["model_states"],
        "steps": steps,
        "device": report["summary"]["device"],
    }
    path = os.path.join(args.out, f"rank{rank}.json")
    with open(path + ".tmp", "w") as fh:
        json.dump(record, fh, indent=1)
    os.replace(path + ".tmp", path)


# ---------------------------------------------------------------------- plain loop
def plain_worker(rank: int, args: argparse.Namespace) -> None:
    import torch.distributed as dist

    from memcallbacks import Monitor

    # a rank still alive after 240 s (a healthy run takes about 10) prints every thread's stack and exits: a hang at
    # the end (seen once under load, after both ranks had written their records) fails with where it hung, before the
    # test's 300 s timeout, which says nothing
    faulthandler.dump_traceback_later(240, exit=True)
    # what helpers.set_rank_environment does, without importing Lightning (helpers does) in each rank
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(args.port), RANK=str(rank), WORLD_SIZE=str(WORLD_SIZE))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=WORLD_SIZE)
    try:
        warm_up_blas(args)
        torch.manual_seed(SEED)
        model = shard(Blocks(args.dim, args.blocks), args.strategy, args.mp)
        optimizer = make_optimizer(args.optimizer, model.parameters())
        data = batches(args, rank)  # before the monitor: the dataset is not the run's to explain
        monitor = Monitor(
            model, optimizer, sample_every_n_steps=1, log_every_n_steps=1, plot=False, output_dir=os.path.join(args.out, "mem")
        )
        for batch in monitor.track(data):
            loss = model(batch).pow(2).mean()
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
        del batch, loss
        monitor.close()
        write_record(args, rank, model, optimizer, monitor)
        # the DDP model's reducer holds the process group: freed after destroy_process_group() (when this frame is
        # cleared), ~ProcessGroupGloo waited forever on a mutex (gdb, once under load: rank 1 alive 25 minutes on)
        del model, optimizer, monitor
    finally:
        dist.destroy_process_group()


def run_plain(args: argparse.Namespace) -> None:
    """This process is rank 0; it starts rank 1 as a copy of itself (one torch import fewer than mp.spawn)."""
    import subprocess

    if args.rank is None:
        child = subprocess.Popen([sys.executable, *sys.argv, "--rank", "1"])
        try:
            plain_worker(0, args)
        finally:
            if child.wait(timeout=270) != 0:
                raise SystemExit(f"rank 1 failed with exit code {child.returncode}")
    else:
        plain_worker(args.rank, args)


# ---------------------------------------------------------------------- Lightning
def run_lightning(args: argparse.Namespace) -> None:
    import lightning.pytorch as L
    from lightning.pytorch.strategies import DDPStrategy, ModelParallelStrategy
    from torch.utils.data import DataLoader

    from helpers import trainer_kwargs
    from memcallbacks import MemoryMonitor

    torch.set_num_threads(1)
    warm_up_blas(args)

    class ShardedModule(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            torch.manual_seed(SEED)
            self.layers = Blocks(args.dim, args.blocks).layers
            self.head = nn.Linear(args.dim, 1)

        def configure_model(self) -> None:
            if args.strategy == "fsdp2":
                shard(self, "fsdp2", args.mp)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return Blocks.forward(self, x)  # type: ignore[arg-type]

        def training_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
            return self(batch).pow(2).mean()

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return make_optimizer(args.optimizer, self.parameters())

    strategy = ModelParallelStrategy(data_parallel_size=WORLD_SIZE, tensor_parallel_size=1) if args.strategy == "fsdp2" else DDPStrategy()
    monitor = MemoryMonitor(sample_every_n_steps=1, log_every_n_steps=1, plot=False, output_dir=os.path.join(args.out, "mem"))
    trainer = L.Trainer(**trainer_kwargs(args.out, devices=WORLD_SIZE, strategy=strategy, max_steps=args.steps, callbacks=[monitor]))
    data = DataLoader(torch.randn(args.steps * args.batch * WORLD_SIZE, args.dim, generator=torch.Generator().manual_seed(SEED)), batch_size=args.batch)
    module = ShardedModule()
    trainer.fit(module, data)
    write_record(args, trainer.global_rank, trainer.strategy.model, trainer.optimizers[0], monitor)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("out")
    parser.add_argument("--runner", choices=("plain", "lightning"), required=True)
    parser.add_argument("--strategy", choices=("fsdp2", "ddp"), required=True)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--optimizer", choices=("adam", "sgd"), default="adam")
    parser.add_argument("--mp", choices=("none", "bf16"), default="none")
    parser.add_argument("--dim", type=int, default=768)
    parser.add_argument("--blocks", type=int, default=4)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--port", type=int, default=29511, help="rendezvous port on 127.0.0.1 (plain runner)")
    parser.add_argument("--rank", type=int, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--no-warmup", action="store_true", help="skip warm_up_blas (to measure its cost)")
    args = parser.parse_args()
    args.out = os.path.abspath(args.out)
    (run_plain if args.runner == "plain" else run_lightning)(args)


if __name__ == "__main__":
    main()
