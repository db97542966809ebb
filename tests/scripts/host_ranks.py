"""2-rank gloo DDP on CPU where only rank 1 leaks Python objects; each rank runs the host reader
and growth test, the figures are gathered and rank 0 looks for the rank that stands apart.

    python tests/scripts/host_ranks.py OUT_DIR [--steps 160] [--leak-rank 1] [--warmup-rank R] [--monitor]

``--warmup-rank R``: rank R alone keeps ~50 MiB of Python objects in its first 5 steps (a rank-0-only
warm-up: a logger, a metrics table), then nothing; ``--leak-rank -1``: no rank leaks.

``--monitor``: the same loop watched by a plain ``memcallbacks.Monitor`` at defaults instead of the
host parts by hand: each rank's findings and rank zero's report.json come back.

Started with ``torch.multiprocessing.spawn``; results come back through OUT_DIR/rank{r}.json.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import sys
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from memcallbacks.host import HostGrowth, HostReader, find_imbalance, gather_figures


@dataclass
class Spec:
    name: str
    shape: tuple
    stride: tuple
    placement: list
    step: int


KEPT: dict = {}
WARM: list = []
WARMUP_STEPS = 5
"""Steps of the ``--warmup-rank``'s warm-up: inside the host channel's warm-up (10 reads)."""


def work(rank: int, step: int, leak_rank: int, warmup_rank: int) -> None:
    """What a rank keeps at ``step``: 512 objects a step on the leaking rank, 24,000 a step for
    :data:`WARMUP_STEPS` steps on the warming-up rank."""
    if rank == leak_rank:
        for i in range(512):
            KEPT[(step, i)] = Spec(f"p{step}.{i}", (step, i, 3), (1, step, i), [step, i], step)
    if rank == warmup_rank and step < WARMUP_STEPS:
        WARM.extend(Spec(f"w{step}.{i}", (step, i, 3), (1, step, i), [step, i], step) for i in range(24_000))


def teardown() -> None:
    """Before the DDP model (its reducer holds the process group) and the process group go: a barrier.
    memcallbacks' own gathers keep their tensors alive from Python (``_base/distributed.py``
    ``_LAST_COLLECTIVE``: without this barrier the monitored run passed 4 of 4 after that fix, against
    4 of 6 hangs before it), but the unmonitored worker still aborted once at exit without it ("terminate
    called without an active exception", in CI's full run): gloo's teardown is not ours to fix here."""
    dist.barrier()


def worker(rank: int, world: int, port: int, out: str, steps: int, leak_rank: int, warmup_rank: int) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        torch.manual_seed(0)
        model = torch.nn.parallel.DistributedDataParallel(torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 1)))
        opt = torch.optim.SGD(model.parameters(), lr=1e-3)
        reader, growth = HostReader(), HostGrowth()
        found = None
        for step in range(steps):
            f = growth.update(reader.read(step))
            if f is not None and found is None and f.details.get("open"):
                found = step
            loss = model(torch.randn(16, 32)).pow(2).mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
            work(rank, step, leak_rank, warmup_rank)
        figures = gather_figures(growth.figures())
        assert growth.first is not None and growth.last is not None
        result = {"rank": rank, "found": found, "findings": [f.to_dict() for f in growth.findings.values()], "figures": figures,
                  "private_growth_from_step_0": growth.last.private_bytes - growth.first.private_bytes}
        if rank == 0:
            result["imbalance"] = [f.to_dict() for f in find_imbalance(figures or [], step=steps)]
        with open(os.path.join(out, f"rank{rank}.json"), "w") as fh:
            json.dump(result, fh)
        teardown()
        del model, opt
    finally:
        dist.destroy_process_group()


def monitored(rank: int, world: int, port: int, out: str, steps: int, leak_rank: int, warmup_rank: int) -> None:
    from memcallbacks import Monitor

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        torch.manual_seed(0)
        model = torch.nn.parallel.DistributedDataParallel(torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 1)))
        opt = torch.optim.SGD(model.parameters(), lr=1e-3)
        monitor = Monitor(model, opt, output_dir=out)
        for step in monitor.track(range(steps)):
            loss = model(torch.randn(16, 32)).pow(2).mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
            work(rank, step, leak_rank, warmup_rank)
        monitor.close()
        with open(os.path.join(out, f"rank{rank}.json"), "w") as fh:
            json.dump({"rank": rank, "findings": [f.to_dict() for f in monitor.findings]}, fh)
        teardown()
        del model, opt, monitor
    finally:
        dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("out")
    parser.add_argument("--steps", type=int, default=160)
    parser.add_argument("--leak-rank", type=int, default=1)
    parser.add_argument("--warmup-rank", type=int, default=-1)
    parser.add_argument("--monitor", action="store_true")
    args = parser.parse_args()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(monitored if args.monitor else worker, args=(2, port, args.out, args.steps, args.leak_rank, args.warmup_rank), nprocs=2, join=True)
    print("done", file=sys.stderr)


if __name__ == "__main__":
    main()
