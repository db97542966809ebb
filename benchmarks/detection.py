"""Benchmark of the leak-detection building blocks: per-step cost, time to find a leak, census cost.

Run: ``python benchmarks/detection.py [--quick]``. CPU only; prints one table per part.
"""

from __future__ import annotations

import argparse
import gc
import random
import sys
import time
import warnings


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--quick", action="store_true", help="fewer rates and sizes")
    parser.add_argument("--no-adapters", action="store_true", help="skip the per-adapter runs at default settings")
    return parser.parse_args(argv)


if __name__ == "__main__":
    # --help and argument errors answer here, before torch loads (seconds)
    ARGS = parse_args()

import torch  # noqa: E402
from torch import nn  # noqa: E402

from memcallbacks._base.devices import heap_in_use_bytes  # noqa: E402
from memcallbacks.leaks import find_holders, take_census  # noqa: E402
from memcallbacks.leaks.growth import GrowthDetector  # noqa: E402
from memcallbacks.leaks.lingering import LingeringDetector  # noqa: E402

KiB, MiB = 1024, 1024 * 1024


def _best(fn, repeat: int = 5) -> float:
    return min(fn() for _ in range(repeat))


def machine_reference() -> float:
    """Seconds to build a dict of 1M ints: to compare numbers across machines."""
    objs = list(range(1_000_000))

    def run() -> float:
        t = time.perf_counter()
        dict(zip(objs, objs))
        return time.perf_counter() - t

    return _best(run, 3)


# ----------------------------------------------------------------------------------------------


def bench_lingering(n: int, repeat: int = 7) -> None:
    print("\n## LingeringDetector cost per step, nothing lingering (best of %d runs of %d steps)" % (repeat, n))
    model = nn.Sequential(nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 1))

    def fresh() -> list:
        # Fresh graphs and batches, built before timing (end_step marks each loss graph once).
        batches = [{"x": torch.randn(4, 16), "y": torch.randn(4, 1), "ids": torch.arange(4)} for _ in range(n)]
        return [[b, nn.functional.mse_loss(model(b["x"]), b["y"])] for b in batches]

    def run_end_step() -> float:
        det, pairs = LingeringDetector(), fresh()
        t0 = time.perf_counter()
        for step, (batch, loss) in enumerate(pairs):
            det.end_step(step, batch, loss)
        return (time.perf_counter() - t0) / n

    def run_check() -> float:
        det = LingeringDetector()
        det.end_step(0, {"x": torch.randn(2)}, (torch.randn(2, requires_grad=True) * 2).sum())
        t0 = time.perf_counter()
        for step in range(n):
            det.check(step)
        return (time.perf_counter() - t0) / n

    def run_loop() -> float:
        """end_step then check, the step's objects dying in between (the healthy case)."""
        det, pairs = LingeringDetector(), fresh()
        spent = 0.0
        for step in range(n):
            batch, loss = pairs[step]
            t0 = time.perf_counter()
            det.end_step(step, batch, loss)
            spent += time.perf_counter() - t0
            pairs[step] = None
            del batch, loss
            t0 = time.perf_counter()
            det.check(step + 1)
            spent += time.perf_counter() - t0
        return spent / n

    print(f"end_step (3-tensor batch, loss graph marked) : {_best(run_end_step, repeat) * 1e6:6.2f} µs")
    print(f"check (nothing alive)                          : {_best(run_check, repeat) * 1e6:6.2f} µs")
    print(f"end_step + check, healthy loop                 : {_best(run_loop, repeat) * 1e6:6.2f} µs/step")


def bench_growth_update(n: int, repeat: int = 5) -> None:
    print("\n## GrowthDetector.update cost (noisy flat baseline, includes block tests; best of %d)" % repeat)
    rng = random.Random(0)
    for label, amp in (("noise 1 MiB", 1 * MiB), ("noise 64 MiB (full test runs often)", 64 * MiB)):
        series = [1 << 30 | rng.randrange(amp) for _ in range(n)]

        def run() -> float:
            det = GrowthDetector()
            t0 = time.perf_counter()
            for step, b in enumerate(series):
                det.update(step, b)
            assert det.last is None
            return (time.perf_counter() - t0) / n

        print(f"{label:40s}: {_best(run, repeat) * 1e6:6.2f} µs/update, no finding")


# ----------------------------------------------------------------------------------------------


def steps_to_find(rate: int, *, start: int = 30, max_steps: int = 300) -> tuple[int | None, int | None]:
    """A real CPU loop; the leak (a detached tensor of ``rate`` bytes per step) starts at ``start``."""
    torch.manual_seed(0)
    rng = random.Random(0)
    model = nn.Sequential(nn.Embedding(200, 32), nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 200))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    det = GrowthDetector()
    kept = []
    for step in range(max_steps):
        x = torch.randint(0, 200, (rng.choice([4, 8, 16, 32]), rng.randint(5, 48)))
        f = det.update(step, heap_in_use_bytes())
        if f is not None:
            kept.clear()
            return (step - start if step >= start else None), f.details["rate_bytes_per_step"]
        loss = nn.functional.cross_entropy(model(x).flatten(0, 1), x.flatten())
        loss.backward()
        opt.step()
        opt.zero_grad()
        if step >= start:
            kept.append(torch.ones(rate // 4))
        del x, loss
    kept.clear()
    return None, None


def bench_time_to_find(quick: bool) -> None:
    print("\n## Steps from leak start to growth finding (real CPU loop, mallinfo2 baseline, leak from step 30)")
    print(f"{'leak/step':>10s}  {'steps':>6s}  {'rate found':>12s}")
    rates = [64 * KiB, 256 * KiB, 1 * MiB, 4 * MiB, 16 * MiB, 64 * MiB]
    if quick:
        rates = [64 * KiB, 256 * KiB, 4 * MiB]
    for rate in rates:
        steps, found = steps_to_find(rate)
        gc.collect()
        shown = "not found" if steps is None else str(steps)
        rate_s = "-" if found is None else f"{found / KiB:.0f} KiB"
        print(f"{rate // KiB:>6d} KiB  {shown:>6s}  {rate_s:>12s}")


# ----------------------------------------------------------------------------------------------


class _Junk:
    __slots__ = ("payload", "tags")

    def __init__(self, i: int) -> None:
        self.payload = {"i": [i]}
        self.tags = [i]


def bench_census(sizes: list[int]) -> None:
    print("\n## Census and holder search cost vs live Python objects")
    print(
        f"{'gc objects':>11s}  {'census s':>9s}  {'s/M obj':>8s}  {'search hit s':>12s}  "
        f"{'search miss s':>13s}  {'s/M obj':>8s}  {'objects searched':>16s}"
    )
    model = nn.Sequential(nn.Linear(64, 64), nn.Linear(64, 8))
    held = {"leak": [torch.randn(256, 64)]}
    junk: list = []
    for size in sizes:
        while len(gc.get_objects()) < size:
            junk.extend(_Junk(i) for i in range(50_000))  # 3 tracked objects each
        n = len(gc.get_objects())
        census = take_census(model=model, time_budget_s=60)
        hit = _best(lambda: find_holders(held["leak"], time_budget_s=60).seconds, 2)
        miss = find_holders([torch.randn(3)], time_budget_s=60)  # unreachable: searches everything
        print(
            f"{n:>11d}  {census.seconds:>9.2f}  {census.seconds / n * 1e6:>8.2f}  {hit:>12.3f}  "
            f"{miss.seconds:>13.2f}  {miss.seconds / n * 1e6:>8.2f}  {miss.objects_scanned:>16d}"
        )
    junk.clear()


def main(argv: list[str] | argparse.Namespace | None = None) -> None:
    args = argv if isinstance(argv, argparse.Namespace) else parse_args(argv)
    warnings.simplefilter("ignore")
    torch.set_num_threads(1)
    print(f"python {sys.version.split()[0]}, torch {torch.__version__}")
    print(
        f"machine reference: dict of 1M ints built in {machine_reference() * 1e3:.0f} ms "
        "(an idle modern x86 core: ~50 ms)"
    )
    if heap_in_use_bytes() is None:
        print("glibc mallinfo2 not available: skipping the time-to-find part")
    bench_lingering(500 if args.quick else 2_000)
    bench_growth_update(20_000 if args.quick else 100_000)
    if heap_in_use_bytes() is not None:
        bench_time_to_find(args.quick)
    bench_census([300_000, 1_000_000] if args.quick else [250_000, 500_000, 1_000_000])
    if not args.no_adapters:
        from detection_adapters import bench_adapters  # this script's folder is sys.path[0]

        bench_adapters(args.quick)


if __name__ == "__main__":
    main(ARGS)
