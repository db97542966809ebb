"""One rank of a 2-rank gloo run (a plain ``Monitor`` around a DDP model) whose rank 1 is killed with SIGKILL.

    RANK=r WORLD_SIZE=2 MASTER_ADDR=127.0.0.1 MASTER_PORT=p python tests/scripts/journal_ranks.py OUT --kill-at N

Rank 1 sends itself SIGKILL at the start of step N; rank 0's next gradient all-reduce then fails
("Connection closed by peer"), and ``with Monitor(...)`` records that exception and writes rank 0's
files. Each rank writes the step it reached to ``OUT/reached.rank{r}`` before training it.
"""

from __future__ import annotations

import argparse
import datetime
import os
import signal

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from memcallbacks import Monitor


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("out")
    parser.add_argument("--kill-at", type=int, default=20)
    args = parser.parse_args()
    torch.set_num_threads(1)
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
    rank = dist.get_rank()
    torch.manual_seed(rank)
    model = DistributedDataParallel(nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 32)))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    fd = os.open(os.path.join(args.out, f"reached.rank{rank}"), os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        with Monitor(model, optimizer, output_dir=os.path.join(args.out, "mem")) as monitor:
            for step, x in enumerate(monitor.track(torch.randn(400, 8, 32).unbind(0))):
                os.pwrite(fd, b"%10d\n" % step, 0)
                if rank == 1 and step == args.kill_at:
                    os.kill(os.getpid(), signal.SIGKILL)
                model(x).pow(2).mean().backward()
                optimizer.step()
                optimizer.zero_grad()
    finally:
        os._exit(1)  # no teardown: the process group has lost a peer


if __name__ == "__main__":
    main()
