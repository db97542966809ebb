"""MemoryMonitor() and DeviceStatsMonitor against no callback, all three in ONE fit.

``benchmarks/overhead.py`` compares separate fits (interleaved) or one callback against none (A/B
blocks). On a shared 2-vCPU VM both leave a few percent of noise, more than the difference between
the two monitors at ``log_every_n_steps=50``. Here one long fit switches between three arms every
block of steps: no callback, ``DeviceStatsMonitor(cpu_stats=True)``, ``MemoryMonitor()`` at its
defaults. Each *triple* of blocks holds the three arms in random order, a fraction of a second
apart, so the machine's drift cancels within it; the per-triple differences (µs per step) are
reported as median and IQR, and the step classes (logged steps, the others) at their medians.

Both monitors are attached for the first ``--skip-steps`` steps (their setup, the monitor's 48
dense-read steps) and then switched by block. When ``MemoryMonitor``'s arm comes back, the step
count has jumped past its plan, so that block's first step is busy: something that never happens
in a real fit. The first step of every block is therefore left out, in all three arms alike
(``--keep-first-step`` keeps it).

Usage::

    python benchmarks/overhead_three_arms.py                 # 40 triples of 50 steps, log every 50, 3 fits
    python benchmarks/overhead_three_arms.py --log-every 1   # the same at log_every_n_steps=1
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--triples", type=int, default=40, help="blocks of each arm per fit")
    p.add_argument("--block", type=int, default=50, help="steps per block (a multiple of --log-every)")
    p.add_argument("--fits", type=int, default=3, help="fits, each with its own random order")
    p.add_argument("--log-every", type=int, default=50, help="Trainer(log_every_n_steps=...)")
    p.add_argument("--skip-steps", type=int, default=50, help="untimed steps at the start, both monitors attached")
    p.add_argument("--keep-first-step", action="store_true", help="also time the first step of every block (MemoryMonitor's is busy there)")
    return p.parse_args(argv)


if __name__ == "__main__":
    # --help and argument errors answer here, before torch and Lightning load (seconds)
    ARGS = parse_args()

import torch  # noqa: E402

from lightning.pytorch.callbacks import DeviceStatsMonitor  # noqa: E402

import overhead as O  # noqa: E402
from memcallbacks import MemoryMonitor  # noqa: E402

ARMS = ("none", "DeviceStatsMonitor", "MemoryMonitor")


def _spread(values: list[float]) -> str:
    ordered = sorted(values)
    return f"{statistics.median(values) * 1e6:+.1f} [{ordered[len(ordered) // 4] * 1e6:+.0f} to {ordered[3 * len(ordered) // 4] * 1e6:+.0f}]"


def one_fit(args: argparse.Namespace, batches: Any, seed: int) -> dict[str, Any]:
    with tempfile.TemporaryDirectory() as workdir:
        monitor = MemoryMonitor(output_dir=workdir)
        arms = {"none": None, "DeviceStatsMonitor": DeviceStatsMonitor(cpu_stats=True), "MemoryMonitor": monitor}
        rng = random.Random(seed)
        plan: list[str] = []
        for _ in range(args.triples):
            triple = list(ARMS)
            rng.shuffle(triple)
            plan += triple
        # the timer attaches each block's arm: the first block of the plan onwards; both before it
        switch = O.StepTimer(args.skip_steps, None, arms=[arms["DeviceStatsMonitor"], monitor], block=args.block, plan=[arms[name] for name in plan])
        O.fit([arms["DeviceStatsMonitor"], monitor], args.log_every, len(plan) * args.block, args, batches, workdir, timer=switch)
        cadence = monitor.report()["summary"]["cadence"]  # the public report: what report.json holds
    durations = [b - a for a, b in zip(switch.stamps, switch.stamps[1:])]
    per_block: dict[str, list[float]] = {arm: [] for arm in ARMS}
    classes: dict[str, dict[str, list[float]]] = {arm: {"logged": [], "other": []} for arm in ARMS}
    first = 0 if args.keep_first_step else 1
    for b, arm in enumerate(plan):
        span = durations[b * args.block + first:(b + 1) * args.block]
        per_block[arm].append(sum(span) / len(span))
        for i, d in enumerate(span):
            step = args.skip_steps + b * args.block + first + i
            classes[arm]["logged" if (step + 1) % args.log_every == 0 else "other"].append(d)
    bare = statistics.median(per_block["none"])
    diff = {arm: [x - n for x, n in zip(per_block[arm], per_block["none"])] for arm in ARMS[1:]}
    mm_vs_dsm = [m - d for m, d in zip(per_block["MemoryMonitor"], per_block["DeviceStatsMonitor"])]
    medians = {arm: {k: statistics.median(v) for k, v in classes[arm].items() if v} for arm in ARMS}
    return {"bare_us": bare * 1e6, "diff": diff, "mm_vs_dsm": mm_vs_dsm, "medians": medians, "cadence": cadence}


def main(argv: list[str] | argparse.Namespace | None = None) -> int:
    args = argv if isinstance(argv, argparse.Namespace) else parse_args(argv)
    base = O.parse_args(["--quick"])
    for key in ("block", "skip_steps"):
        setattr(base, key, getattr(args, key))
    base.log_every, base.triples, base.keep_first_step = args.log_every, args.triples, args.keep_first_step
    torch.set_num_threads(base.threads)
    batches = O.make_data(base)
    print(f"log_every_n_steps={args.log_every}: {args.fits} fits x {args.triples} triples of {args.block}-step blocks "
          "(µs per step, median [IQR] over triples; per class: median step minus the bare arm's)")
    for k in range(args.fits):
        r = one_fit(base, batches, seed=k)
        ratio = {arm: 1 + statistics.median(v) / (r["bare_us"] / 1e6) for arm, v in r["diff"].items()}
        cls = {arm: {c: round((m - r["medians"]["none"][c]) * 1e6) for c, m in r["medians"][arm].items()} for arm in ARMS[1:]}
        print(f"fit {k}: bare step {r['bare_us']:.0f} µs | MemoryMonitor {_spread(r['diff']['MemoryMonitor'])} (ratio {ratio['MemoryMonitor']:.4f}) | "
              f"DeviceStatsMonitor {_spread(r['diff']['DeviceStatsMonitor'])} (ratio {ratio['DeviceStatsMonitor']:.4f}) | "
              f"MemoryMonitor - DeviceStatsMonitor {_spread(r['mm_vs_dsm'])}", flush=True)
        print(f"       per class: {cls} | MemoryMonitor's cadence: read every {r['cadence']['read_every_n_steps']}, "
              f"sample every {r['cadence']['sample_every_n_steps']}, own time {r['cadence']['overhead']}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main(ARGS))
