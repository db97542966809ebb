"""Bare, MemoryMonitor and DeviceStatsMonitor side by side: what each costs a Lightning fit in process
CPU time and peak resident memory, where users compare them.

Each fit is a process of its own (imports, heap and caches as a user's script has them): the overhead
MLP (64 -> 128 -> 128 -> 10, batch 32, AdamW, one thread, ``CSVLogger``, fresh batches), ``--steps``
steps at ``log_every_n_steps`` ``--log-every``. The three variants run in interleaved rounds, the order
shuffled each round. Each process measures its own CPU time (``time.process_time``: every thread) in
spans: importing the callback's module and building it, the steps (from ``on_train_start`` to
``on_train_end``, timed by a callback ahead of the others), ``Trainer.fit`` whole (the steps, and the
run's end with the files of whichever callback writes them), the whole script; and its peak RSS
(``ru_maxrss``) before and after the fit. Per variant: the median over the rounds, [min, max], and
the difference from the same round's bare fit. The monitor's own report (its share and parts) is
printed beside it.

Usage::

    python benchmarks/side_by_side.py                       # 5 rounds of 400 steps at log every 50
    python benchmarks/side_by_side.py --log-every 1 --rounds 3
    python benchmarks/side_by_side.py --json side_by_side.json

Results: docs/benchmarks.md, "side_by_side.py".
"""

from __future__ import annotations

import argparse
import json
import os
import random
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any

VARIANTS = ("bare", "MemoryMonitor", "DeviceStatsMonitor")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=400)
    parser.add_argument("--log-every", type=int, default=50)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--json", help="write every fit's numbers here")
    parser.add_argument("--child", choices=VARIANTS, help=argparse.SUPPRESS)
    return parser.parse_args(argv)


def peak_rss() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


# ---------------------------------------------------------------------------- one fit, in its own process
def child(args: argparse.Namespace) -> dict[str, Any]:
    t_script = time.process_time()
    import logging
    import warnings

    warnings.filterwarnings("ignore")
    for name in ("lightning", "lightning.pytorch", "lightning.fabric"):
        logging.getLogger(name).setLevel(logging.ERROR)
    import lightning.pytorch as pl
    import torch
    from torch import nn

    torch.set_num_threads(1)
    torch.manual_seed(0)

    class MLP(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 128), nn.ReLU(), nn.Linear(128, 10))

        def training_step(self, batch: Any, batch_idx: int) -> Any:
            x, y = batch
            loss = nn.functional.cross_entropy(self.net(x), y)
            self.log("train_loss", loss)
            return loss

        def configure_optimizers(self) -> Any:
            return torch.optim.AdamW(self.parameters(), lr=1e-3)

    class Clock(pl.Callback):
        """First in the list: the CPU time from the first step's start to the last step's end."""

        def __init__(self) -> None:
            self.start = self.end = 0.0

        def on_train_start(self, trainer: Any, pl_module: Any) -> None:
            self.start = time.process_time()

        def on_train_end(self, trainer: Any, pl_module: Any) -> None:
            self.end = time.process_time()

    x, y = torch.randn(512, 64), torch.randint(0, 10, (512,))
    data = [(x[i % 16 * 32:(i % 16 + 1) * 32].clone(), y[i % 16 * 32:(i % 16 + 1) * 32].clone()) for i in range(args.steps)]
    folder = tempfile.mkdtemp(prefix="side-by-side-")
    rss_before = peak_rss()
    modules = len(sys.modules)
    t0 = time.process_time()
    clock = Clock()
    callbacks: list[Any] = [clock]
    monitor = None
    if args.child == "MemoryMonitor":
        from memcallbacks import MemoryMonitor

        monitor = MemoryMonitor(output_dir=os.path.join(folder, "mem"), console_summary=False)
        callbacks.append(monitor)
    elif args.child == "DeviceStatsMonitor":
        from lightning.pytorch.callbacks import DeviceStatsMonitor

        callbacks.append(DeviceStatsMonitor())
    build_s = time.process_time() - t0
    imported = len(sys.modules) - modules
    trainer = pl.Trainer(max_steps=args.steps, accelerator="cpu", devices=1, callbacks=callbacks, log_every_n_steps=args.log_every,
                         logger=pl.loggers.CSVLogger(folder), enable_progress_bar=False, enable_model_summary=False,
                         enable_checkpointing=False, default_root_dir=folder)
    t1 = time.process_time()
    trainer.fit(MLP(), torch.utils.data.DataLoader(data, batch_size=None))
    fit_s = time.process_time() - t1
    out = {"variant": args.child, "build_cpu_s": build_s, "fit_cpu_s": fit_s, "steps_cpu_s": clock.end - clock.start,
           "script_cpu_s": time.process_time() - t_script,
           "modules_imported_by_build": imported, "peak_rss_before_fit": rss_before, "peak_rss": peak_rss()}
    if monitor is not None:
        cadence = monitor.report()["summary"]["cadence"]
        out.update(overhead=cadence["overhead"], overhead_after_start=cadence["overhead_after_start"], end_of_run_s=cadence["end_of_run_s"],
                   own_time_by_part_s=cadence["own_time_by_part_s"], step_time_timed_s=cadence["step_time_timed_s"])
    return out


def run_child(variant: str, args: argparse.Namespace) -> dict[str, Any]:
    cmd = [sys.executable, os.path.abspath(__file__), "--child", variant, "--steps", str(args.steps), "--log-every", str(args.log_every)]
    env = dict(os.environ, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1")
    done = subprocess.run(cmd, capture_output=True, text=True, env=env, check=False)
    if done.returncode:
        raise SystemExit(f"{variant} fit failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


# ---------------------------------------------------------------------------- the table
def spread(values: list[float], scale: float = 1.0, digits: int = 3) -> str:
    v = [x * scale for x in values]
    return f"{statistics.median(v):.{digits}f} [{min(v):.{digits}f}, {max(v):.{digits}f}]"


def main(args: argparse.Namespace) -> int:
    if args.child:
        print(json.dumps(child(args)))
        return 0
    order = random.Random(0)
    fits: list[dict[str, Any]] = []
    loads = [os.getloadavg()[0]]
    for round_ in range(args.rounds):
        variants = list(VARIANTS)
        order.shuffle(variants)
        for variant in variants:
            fits.append(dict(run_child(variant, args), round=round_))
        loads.append(os.getloadavg()[0])
        print(f"round {round_}: " + ", ".join(f"{f['variant']} fit {f['fit_cpu_s']:.3f} s" for f in fits if f["round"] == round_)
              + f"; load {loads[-1]:.2f}", flush=True)
    bare = {f["round"]: f for f in fits if f["variant"] == "bare"}
    print(f"\n{args.steps} steps, log every {args.log_every}, {args.rounds} rounds; load average {min(loads):.2f}-{max(loads):.2f}")
    print("| variant | build, CPU s | steps, CPU s | steps − bare, µs/step | fit's end − bare, CPU s | peak RSS, MiB | peak RSS − bare, MiB |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    for variant in VARIANTS:
        mine = [f for f in fits if f["variant"] == variant]
        steps = [f["steps_cpu_s"] - bare[f["round"]]["steps_cpu_s"] for f in mine]
        end = [(f["fit_cpu_s"] - f["steps_cpu_s"]) - (bare[f["round"]]["fit_cpu_s"] - bare[f["round"]]["steps_cpu_s"]) for f in mine]
        rss = [f["peak_rss"] - bare[f["round"]]["peak_rss"] for f in mine]
        print(f"| {variant} | {spread([f['build_cpu_s'] for f in mine])} | {spread([f['steps_cpu_s'] for f in mine])} | "
              f"{spread(steps, 1e6 / args.steps, 1)} | {spread(end)} | {spread([f['peak_rss'] for f in mine], 2 ** -20, 1)} | "
              f"{spread(rss, 2 ** -20, 1)} |")
    mm = [f for f in fits if f["variant"] == "MemoryMonitor"]
    if mm:
        print(f"\nMemoryMonitor's report: own time {spread([f['overhead'] for f in mm], 100, 2)}% of step time "
              f"({spread([f['overhead_after_start'] or 0.0 for f in mm], 100, 2)}% after the first steps), "
              f"end of run {spread([f['end_of_run_s'] for f in mm])} s up to its report")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "loadavg": loads, "fits": fits}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main(parse_args()))
