"""Two CPU ranks (gloo) with a leak on one rank or on both, watched at defaults: what rank zero's verdict says.

    python tests/scripts/rank_findings.py OUT_DIR --case seed|fsdp2 [--runner plain|lightning] [--steps 40] [--port P]

``--case seed``: seed 000's loop (``train_one_step`` returns ``{"loss": loss}``, the loop keeps it until the next step
rebinds it: the loss's graph keeps the pulled embedding and its grad) on rank 1 only; rank 0 runs the fixed loop
(``loss.item()``). ``--runner plain`` under ``memcallbacks.Monitor``, DDP-wrapped; ``--runner lightning``: the same loop
as a LightningModule under ``MemoryMonitor``, ``strategy="ddp"`` (Lightning re-launches this script for rank 1).

``--case fsdp2``: a block model sharded with ``fully_shard`` (each block, then the root) whose list ``kept`` keeps each
step's loss on every rank, with its graph, a hand-made leaf input of 1 MiB and its grad (plain runner only).

The monitor's files go to OUT_DIR/mem; each rank writes OUT_DIR/rank{R}.json: ``{"rank", "findings"}`` (its
``monitor.findings``, as dicts).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # tests/, for helpers

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch import nn  # noqa: E402

WORLD_SIZE = 2
BATCH, EMB_DIM, ROWS = 256, 512, 4096  # seed 000's sizes: a pulled embedding is 512 KiB


class ParameterServer:
    def __init__(self) -> None:
        self.table = torch.randn(ROWS, EMB_DIM, generator=torch.Generator().manual_seed(1)) * 0.01

    def pull(self, g: torch.Generator) -> dict[str, torch.Tensor]:
        ids = torch.randint(0, ROWS, (BATCH,), generator=g)
        emb = self.table[ids].requires_grad_()  # requires_grad set by hand, as in the seed
        return {"ids": ids, "emb": emb, "label": torch.randint(0, 2, (BATCH,), generator=g).float()}

    def push(self, ids: torch.Tensor, grad: torch.Tensor) -> None:
        self.table.index_add_(0, ids, grad, alpha=-0.1)


class Ranker(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.mlp = nn.Sequential(nn.Linear(EMB_DIM, 32), nn.ReLU(), nn.Linear(32, 1))

    def forward(self, data: dict[str, torch.Tensor]) -> torch.Tensor:
        return F.binary_cross_entropy_with_logits(self.mlp(data["emb"]).squeeze(-1), data["label"])


class FSDPBlocks(nn.Module):
    def __init__(self, dim: int = 256, blocks: int = 2) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Sequential(nn.Linear(dim, dim), nn.ReLU()) for _ in range(blocks))
        self.head = nn.Linear(dim, 1)
        self.kept: list[torch.Tensor] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = x + layer(x)
        loss = self.head(x).pow(2).mean()
        self.kept.append(loss)  # BUG: every step's loss, its graph, the leaf input and its grad
        return loss


def write(out: str, rank: int, monitor: Any) -> None:
    path = os.path.join(out, f"rank{rank}.json")
    with open(path + ".tmp", "w") as fh:
        json.dump({"rank": rank, "findings": [f.to_dict() for f in monitor.findings]}, fh)
    os.replace(path + ".tmp", path)


# ---------------------------------------------------------------------- plain loops
def seed_loop(rank: int, args: argparse.Namespace) -> None:
    from memcallbacks import Monitor

    ps, g = ParameterServer(), torch.Generator().manual_seed(rank)
    model = nn.parallel.DistributedDataParallel(Ranker())
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    monitor = Monitor(model, optimizer, output_dir=os.path.join(args.out, "mem"), plot=False)
    keeps = rank == 1

    def train_one_step(data: dict[str, torch.Tensor]) -> dict[str, Any]:
        loss = model(data)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        ps.push(data["ids"], data["emb"].grad)
        return {"loss": loss} if keeps else {"loss": loss.item()}  # rank 1: BUG, the loss with its graph

    for data in monitor.track(ps.pull(g) for _ in range(args.steps)):
        outputs = train_one_step(data)
        float(outputs["loss"])
    monitor.close()
    write(args.out, rank, monitor)
    del data, outputs  # (model: the step function's closure keeps it until this function returns)


def fsdp2_loop(rank: int, args: argparse.Namespace) -> None:
    from torch.distributed.fsdp import fully_shard

    from memcallbacks import Monitor

    torch.manual_seed(0)
    model = FSDPBlocks()
    for layer in model.layers:
        fully_shard(layer)
    fully_shard(model)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-4)
    monitor = Monitor(model, optimizer, output_dir=os.path.join(args.out, "mem"), plot=False)
    g = torch.Generator().manual_seed(rank)
    for _ in monitor.track(range(args.steps)):
        emb = torch.randn(1024, 256, generator=g).requires_grad_()  # 1 MiB, as pulled embeddings
        model(emb).backward()
        optimizer.step()
        optimizer.zero_grad()
        del emb
    monitor.close()
    write(args.out, rank, monitor)
    del model.kept[:]


def plain_rank(rank: int, args: argparse.Namespace) -> None:
    import faulthandler

    import torch.distributed as dist

    faulthandler.dump_traceback_later(240, exit=True)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(args.port), RANK=str(rank), WORLD_SIZE=str(WORLD_SIZE))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=WORLD_SIZE)
    try:
        (seed_loop if args.case == "seed" else fsdp2_loop)(rank, args)
        dist.barrier()  # no rank closes its connections while the other still reads the last collective's bytes
    finally:
        dist.destroy_process_group()


def run_plain(args: argparse.Namespace) -> None:
    """This process is rank 0; rank 1 is a copy of this script."""
    if args.rank is not None:
        return plain_rank(args.rank, args)
    child = subprocess.Popen([sys.executable, *sys.argv, "--rank", "1"])
    try:
        plain_rank(0, args)
    finally:
        if child.wait(timeout=270) != 0:
            raise SystemExit(f"rank 1 failed with exit code {child.returncode}")


# ---------------------------------------------------------------------- Lightning
def run_lightning(args: argparse.Namespace) -> None:
    import lightning.pytorch as L
    from torch.utils.data import DataLoader

    from helpers import end_process_group, trainer_kwargs
    from memcallbacks import MemoryMonitor

    torch.set_num_threads(1)
    ps = ParameterServer()

    class SeedModule(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.automatic_optimization = False
            self.ranker = Ranker()
            self.outputs: dict[str, Any] = {}

        def train_one_step(self, data: dict[str, torch.Tensor]) -> dict[str, Any]:
            optimizer = self.optimizers()
            loss = self.ranker(data)
            optimizer.zero_grad()
            self.manual_backward(loss)
            optimizer.step()
            ps.push(data["ids"], data["emb"].grad)
            return {"loss": loss}

        def training_step(self, data: dict[str, torch.Tensor], batch_idx: int) -> None:
            outputs = self.train_one_step(data)
            if self.global_rank == 1:
                self.outputs = outputs  # BUG on rank 1: kept until the next step, with the graph

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.SGD(self.ranker.parameters(), lr=0.1)

    g = torch.Generator().manual_seed(int(os.environ.get("LOCAL_RANK", "0")))
    monitor = MemoryMonitor(output_dir=os.path.join(args.out, "mem"), plot=False)
    trainer = L.Trainer(**trainer_kwargs(args.out, devices=WORLD_SIZE, strategy="ddp", max_steps=args.steps, callbacks=[monitor]))
    loader = DataLoader(range(args.steps * WORLD_SIZE), batch_size=None, collate_fn=lambda _: ps.pull(g))
    trainer.fit(SeedModule(), loader)
    write(args.out, trainer.global_rank, monitor)
    end_process_group()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("out")
    parser.add_argument("--case", choices=("seed", "fsdp2"), required=True)
    parser.add_argument("--runner", choices=("plain", "lightning"), default="plain")
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--port", type=int, default=29533, help="rendezvous port on 127.0.0.1 (plain runner)")
    parser.add_argument("--rank", type=int, default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    args.out = os.path.abspath(args.out)
    if args.runner == "lightning" and args.case != "seed":
        parser.error("--runner lightning runs --case seed only")
    (run_plain if args.runner == "plain" else run_lightning)(args)


if __name__ == "__main__":
    main()
