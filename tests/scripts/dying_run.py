"""A monitored run that keeps 2 MiB of tensors a step and never reaches its end, in a process of its own.

    python tests/scripts/dying_run.py OUT SHAPE (--kill-at N | --limit cgroup|rlimit) [--room-mib M] [--cgroup DIR]

``SHAPE``: ``plain`` (a plain ``Monitor`` at its defaults), ``plain_snapshot`` (with ``auto_snapshot=True``),
``lightning`` (a fit at defaults: TensorBoard logger) or ``lightning_nologger`` (``logger=False``). Every step
keeps 2 MiB in the module-level list ``LEAK`` (the holder a report must name), and writes ``STEP <n>`` to
stderr (unbuffered) as it starts: the last one is the step the run reached, and the monitor's log lines
(the forecast among them) come in between, in order.

How it ends:

- ``--kill-at N``: it sends itself SIGKILL at the start of step N (any machine);
- ``--limit cgroup``: the memory cgroup ``--cgroup DIR`` (which the process joined before ``exec``, so every
  page it touched is charged there) gets a limit of its resident memory plus ``--room-mib``, once everything
  is imported and built and before the monitor starts; the kernel's OOM killer ends the run (SIGKILL);
- ``--limit rlimit``: ``RLIMIT_AS`` is set to its address space plus ``--room-mib`` likewise, and an
  allocation fails (``MemoryError`` or torch's "can't allocate memory").

The monitor's files (its journal) are in ``OUT/mem`` for the plain loop and under Lightning's folders in ``OUT``.
It prints ``END`` if it ever finishes (2000 steps: far past any limit given).
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
from typing import Any, Callable

os.environ.setdefault("MALLOC_ARENA_MAX", "1")  # one glibc arena: no 64 MiB of address space per thread
import torch  # noqa: E402
from torch import nn  # noqa: E402

torch.set_num_threads(1)
STEP_BYTES = 2 << 20
DIM, BATCH = 64, 32
LEAK: list[torch.Tensor] = []  # the leak: a global list that gets 2 MiB of tensors a step


def say(text: str) -> None:
    os.write(2, (text + "\n").encode())


def set_limit(kind: str, room: int, cgroup: str | None) -> None:
    """The limit: what the process holds now plus ``room`` bytes."""
    page = os.sysconf("SC_PAGE_SIZE")
    with open("/proc/self/statm") as f:
        size, rss = (int(v) * page for v in f.read().split()[:2])
    if kind == "rlimit":
        import resource

        resource.setrlimit(resource.RLIMIT_AS, (size + room, resource.RLIM_INFINITY))
        say(f"LIMIT rlimit_as {size + room}")
        return
    assert cgroup is not None
    name = "memory.limit_in_bytes" if os.path.exists(os.path.join(cgroup, "memory.limit_in_bytes")) else "memory.max"
    with open(os.path.join(cgroup, name), "w") as f:
        f.write(str(rss + room))
    say(f"LIMIT cgroup {rss + room}")


def step_start(kill_at: int | None) -> Callable[[int], None]:
    def start(step: int) -> None:
        say(f"STEP {step}")
        if kill_at is not None and step >= kill_at:
            os.kill(os.getpid(), signal.SIGKILL)

    return start


def leak() -> None:
    LEAK.append(torch.ones(STEP_BYTES // 4))  # written: its pages are resident


def mlp() -> nn.Module:
    return nn.Sequential(nn.Linear(DIM, 128), nn.ReLU(), nn.Linear(128, 1))


def plain(out: str, steps: int, arm: Callable[[], None], start: Callable[[int], None], **options: Any) -> None:
    from memcallbacks import Monitor

    model = mlp()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    data = [torch.randn(BATCH, DIM) for _ in range(8)]
    arm()
    monitor = Monitor(model, optimizer, output_dir=os.path.join(out, "mem"), **options)
    for step, x in enumerate(monitor.track(data[i % 8] for i in range(steps))):
        start(step)
        model(x).pow(2).mean().backward()
        optimizer.step()
        optimizer.zero_grad()
        leak()
    monitor.close()


def lightning(out: str, steps: int, arm: Callable[[], None], start: Callable[[int], None], logger: bool) -> None:
    import lightning.pytorch as L
    from torch.utils.data import DataLoader

    from memcallbacks import MemoryMonitor

    class Net(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = mlp()

        def training_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
            start(self.trainer.global_step)
            leak()
            return self.net(batch).pow(2).mean()

        def configure_optimizers(self) -> Any:
            return torch.optim.SGD(self.parameters(), lr=0.01)

    trainer = L.Trainer(max_steps=steps, callbacks=[MemoryMonitor()], default_root_dir=out, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, logger=None if logger else False,
                        accelerator="cpu", devices=1)
    loader = DataLoader(torch.randn(steps * BATCH, DIM), batch_size=BATCH)
    model = Net()
    arm()
    trainer.fit(model, loader)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("out")
    parser.add_argument("shape", choices=("plain", "plain_snapshot", "lightning", "lightning_nologger"))
    parser.add_argument("--kill-at", type=int, default=None)
    parser.add_argument("--limit", choices=("cgroup", "rlimit"), default=None)
    parser.add_argument("--room-mib", type=int, default=320)
    parser.add_argument("--cgroup", default=None)
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr, format="%(levelname)s %(name)s: %(message)s")
    torch.manual_seed(0)
    steps = 2000  # far past the limit: the run ends when memory runs out

    def arm() -> None:
        if args.limit is not None:
            set_limit(args.limit, args.room_mib << 20, args.cgroup)

    start = step_start(args.kill_at)
    if args.shape.startswith("plain"):
        plain(args.out, steps, arm, start, **({"auto_snapshot": True} if args.shape == "plain_snapshot" else {}))
    else:
        lightning(args.out, steps, arm, start, logger=args.shape == "lightning")
    say("END")


if __name__ == "__main__":
    main()
