"""What one call between two training steps costs the training loop, against what it costs alone.

The monitor's reads on CPU are system calls (``/proc/self/statm``, ``getrusage``, a write to
``/proc/self/clear_refs``) or walks of malloc's heap, each about a microsecond when timed back to
back. Between two training steps they cost more: the step that follows runs slower, because the
call has evicted the caches and branch predictors the step's interpreter and kernels had warmed.
This is why the monitor's budget counts its measured time twice (``COLD_FACTOR``), and why its RSS
tripwire looks on every 8th quiet step rather than every step (docs/benchmarks.md).

Each variant runs blocks of ``--steps`` plain-PyTorch training steps (the overhead benchmark's
MLP: 64->128->128->10, batch 32, AdamW, one thread) with the call made once before every step;
blocks of all variants are interleaved in a shuffled order, ``--blocks`` times, and each variant's
median step time is compared with the block of steps that make no call.

Usage::

    python benchmarks/syscall_cost.py
    python benchmarks/syscall_cost.py --blocks 40 --steps 50
"""

from __future__ import annotations

import argparse
import os
import random
import resource
import statistics
import sys
import time
import timeit
from typing import Callable


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--blocks", type=int, default=120, help="interleaved blocks per variant")
    p.add_argument("--steps", type=int, default=50, help="training steps per block, one call before each")
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args(argv)


if __name__ == "__main__":
    # --help and argument errors answer here, before torch loads (seconds)
    ARGS = parse_args()

import torch  # noqa: E402
from torch import nn  # noqa: E402

from _common import mlp_layers  # noqa: E402


def calls() -> dict[str, Callable[[], object]]:
    from memcallbacks._base.devices import heap_in_use_bytes, host_rss_reader

    found: dict[str, Callable[[], object]] = {"no call": lambda: None, "os.getpid()": os.getpid}
    rss = host_rss_reader()
    found["RSS read (/proc/self/statm, the tripwire's)"] = rss
    found["getrusage(RUSAGE_SELF)"] = lambda: resource.getrusage(resource.RUSAGE_SELF)
    if hasattr(resource, "RUSAGE_THREAD"):
        found["getrusage(RUSAGE_THREAD) (the CPU peaks')"] = lambda: resource.getrusage(resource.RUSAGE_THREAD)
    if heap_in_use_bytes() is not None:
        found["mallinfo2 (the watch's heap read)"] = heap_in_use_bytes
    found["pure Python, ~0.5 µs (sum(range(30)))"] = lambda: sum(range(30))
    return found


def main(argv: list[str] | argparse.Namespace | None = None) -> int:
    args = argv if isinstance(argv, argparse.Namespace) else parse_args(argv)
    torch.set_num_threads(1)
    torch.manual_seed(args.seed)
    model = mlp_layers(64, 128)
    optimizer = torch.optim.AdamW(model.parameters())
    x, y = torch.randn(32, 64), torch.randint(0, 10, (32,))

    def step() -> None:
        optimizer.zero_grad()
        nn.functional.cross_entropy(model(x), y).backward()
        optimizer.step()

    variants = calls()
    for _ in range(200):
        step()
    per_step: dict[str, list[float]] = {name: [] for name in variants}
    order = random.Random(args.seed)
    names = list(variants)
    for _ in range(args.blocks):
        order.shuffle(names)
        for name in names:
            call = variants[name]
            t0 = time.perf_counter()
            for _ in range(args.steps):
                call()
                step()
            per_step[name].append((time.perf_counter() - t0) / args.steps * 1e6)
    base = statistics.median(per_step["no call"])
    print(f"python {sys.version.split()[0]}, torch {torch.__version__}, {args.blocks} blocks x {args.steps} steps, step ≈ {base:.0f} µs with no call\n")
    print("| call before every step | alone, back to back (µs) | added to the step (µs, median over blocks) | ratio |")
    print("|---|---:|---:|---:|")
    for name, call in variants.items():
        if name == "no call":
            continue
        alone = min(timeit.repeat(call, number=2000, repeat=5)) / 2000 * 1e6
        added = statistics.median(per_step[name]) - base
        print(f"| {name} | {alone:.2f} | {added:+.1f} | {added / alone:.0f}x |")
    return 0


if __name__ == "__main__":
    sys.exit(main(ARGS))
