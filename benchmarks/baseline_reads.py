"""Which CPU memory read should the watch take at every step start (issue 11, item 3)?

A real CPU training loop (MLP 256 -> 512 -> 1, batch 128, AdamW, one thread, no monitor) reads, at
every step start, the process RSS from ``/proc/self/statm`` and glibc's in-use heap from
``mallinfo2`` (``uordblks + hblkhd``), timing each call. The series are then fed to the growth
detector at the monitor's default settings as each candidate would feed it:

* ``statm RSS``: RSS every step;
* ``mallinfo2``: the heap every step;
* ``mallinfo2 every 4``: the heap every 4th step (what the watch does when its cost is over budget).

Scenarios: a leak of one written tensor per step (1 MiB and 256 KiB); a 256 KiB/step leak made of
16 KiB tensors on a *reused heap* (an earlier phase freed 192 MiB of small tensors, as after a
validation pass or an earlier fit: the pages stay resident, so RSS does not move while the leak fills
them); and a clean run with variable batch sizes (a finding there is a false one).

Run: ``python benchmarks/baseline_reads.py [--steps N]``.
"""

from __future__ import annotations

import argparse
import gc
import statistics
import time
import warnings
from typing import Any, Callable


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=160, help="steps per scenario")
    return parser.parse_args(argv)


if __name__ == "__main__":
    # --help and argument errors answer here, before torch loads (seconds)
    ARGS = parse_args()

import torch  # noqa: E402
from torch import nn  # noqa: E402

from memcallbacks._base.devices import heap_in_use_bytes, host_rss_reader  # noqa: E402
from memcallbacks.leaks.growth import GrowthDetector  # noqa: E402

KiB, MiB = 1024, 1024 * 1024
DIM, BATCH = 256, 128
WARMUP = 4  # LeakOptions.growth_warmup_steps


def train(steps: int, leak: Callable[[list[Any]], None] | None, variable: bool) -> dict[str, list[float]]:
    """One loop; returns per-step reads and per-call costs (seconds)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(DIM, 512), nn.ReLU(), nn.Linear(512, 1))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    rss = host_rss_reader()
    out: dict[str, list[float]] = {"rss": [], "heap": [], "rss_us": [], "heap_us": []}
    kept: list[Any] = []
    for step in range(steps):
        t0 = time.perf_counter()
        r = rss()
        t1 = time.perf_counter()
        h = heap_in_use_bytes()
        t2 = time.perf_counter()
        out["rss"].append(r)
        out["heap"].append(h)
        out["rss_us"].append((t1 - t0) * 1e6)
        out["heap_us"].append((t2 - t1) * 1e6)
        n = BATCH // 2 + (step * 37) % BATCH if variable else BATCH
        model(torch.randn(n, DIM)).pow(2).mean().backward()
        optimizer.step()
        optimizer.zero_grad()
        if leak is not None:
            leak(kept)
    kept.clear()
    return out


def reused_heap() -> list[torch.Tensor]:
    """Leave 192 MiB of freed small-tensor chunks resident in the heap (pinned apart by small live tensors)."""
    big, pins = [], []
    for _ in range(192 * MiB // (48 * KiB)):
        big.append(torch.ones(48 * KiB // 4))
        pins.append(torch.ones(16))
    del big
    return pins


def first_finding(series: list[float], every: int = 1) -> int | None:
    det = GrowthDetector(warmup_steps=WARMUP)
    for step, value in enumerate(series):
        if step < 8 or step % every == 0:  # the watch's first 8 steps are always read
            if det.update(step, int(value)) is not None:
                return step
    return None


def main(argv: list[str] | argparse.Namespace | None = None) -> None:
    args = argv if isinstance(argv, argparse.Namespace) else parse_args(argv)
    warnings.simplefilter("ignore")
    torch.set_num_threads(1)
    if heap_in_use_bytes() is None:
        raise SystemExit("glibc mallinfo2 is not available here: nothing to compare.")

    def tensor_leak(rate: int) -> Callable[[list[Any]], None]:
        return lambda kept: kept.append(torch.ones(rate // 4))

    def small_leak(kept: list[Any]) -> None:
        kept.extend(torch.ones(16 * KiB // 4) for _ in range(16))

    train(20, None, False)  # warm-up: first-call costs
    runs: dict[str, dict[str, list[float]]] = {}
    runs["1 MiB/step"] = train(args.steps, tensor_leak(MiB), False)
    gc.collect()
    runs["256 KiB/step"] = train(args.steps, tensor_leak(256 * KiB), False)
    gc.collect()
    pins = reused_heap()
    runs["256 KiB/step, reused heap"] = train(args.steps, small_leak, False)
    del pins
    gc.collect()
    runs["clean, variable batch"] = train(args.steps, None, True)

    costs = {k: [c for r in runs.values() for c in r[k]] for k in ("rss_us", "heap_us")}
    candidates = [("statm RSS", "rss", 1, "rss_us"), ("mallinfo2", "heap", 1, "heap_us"), ("mallinfo2 every 4", "heap", 4, "heap_us")]
    print(f"torch {torch.__version__}; {args.steps} steps per scenario; leak from step 0; step found (none = not in {args.steps} steps)\n")
    print("| read | cost per call, in-fit median (p90) | amortized per step | " + " | ".join(runs) + " |")
    print("|---|---|---|" + "---|" * len(runs))
    for name, key, every, cost_key in candidates:
        c = sorted(costs[cost_key])
        median, p90 = statistics.median(c), c[int(0.9 * (len(c) - 1))]
        cells = []
        for scenario, r in runs.items():
            step = first_finding(r[key], every)
            clean = scenario.startswith("clean")
            cells.append(("none ✓" if clean else "none ✗") if step is None else (f"{step} ✗ (false)" if clean else str(step)))
        print(f"| {name} | {median:.1f} µs ({p90:.1f}) | {median / every:.1f} µs | " + " | ".join(cells) + " |")
    print("\nper-call cost by scenario, in-fit median (µs): " + "; ".join(
        f"{scenario}: statm {statistics.median(r['rss_us']):.1f}, mallinfo2 {statistics.median(r['heap_us']):.1f}" for scenario, r in runs.items()))
    rss_steps = runs["256 KiB/step, reused heap"]["rss"]
    print(f"\nRSS over the reused-heap run: {(rss_steps[-1] - rss_steps[WARMUP]) / MiB:+.1f} MiB while the leak kept "
          f"{args.steps * 256 * KiB / MiB:.0f} MiB")


if __name__ == "__main__":
    main(ARGS)
