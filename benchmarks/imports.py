"""The modules the monitor imports, when, and what each costs.

A fresh process per run (``--runs``, default 3; medians): ``import torch``, then the monitor's import
(``from memcallbacks import Monitor``, or ``MemoryMonitor`` with ``--adapter lightning``), building it on
a model and its optimizer, ``--steps`` plain-loop steps (MLP 256, batch 32, AdamW; the Lightning adapter
in a ``Trainer.fit``), and its end (``close()``; Lightning: ``on_fit_end``). For each phase: the modules
it imported (how many, by top-level package) and its CPU time. Then the memcallbacks modules by the
time their own import took (``python -X importtime``: self time, cumulative time).

What the monitor needs during the steps it imports when it is built (or never): the steps' row must
read no module of the monitor's (torch imports ``torch.profiler._cupti_monitor`` at the first optimizer
step, bare or monitored). The end's imports (pandas, matplotlib for the files) are the run's end's.

Usage::

    python benchmarks/imports.py
    python benchmarks/imports.py --adapter lightning --runs 5
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any

PHASES = ("import", "build", "steps", "end")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--adapter", choices=("plain", "lightning"), default="plain")
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--top", type=int, default=12, help="memcallbacks modules listed by import time")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    return parser.parse_args(argv)


def _by_package(names: set[str]) -> dict[str, int]:
    return dict(collections.Counter(n.split(".")[0] for n in names).most_common())


def child(args: argparse.Namespace) -> dict[str, Any]:
    import torch
    from torch import nn

    torch.set_num_threads(1)
    model = nn.Sequential(nn.Linear(256, 256), nn.ReLU(), nn.Linear(256, 256), nn.ReLU(), nn.Linear(256, 10))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)  # torch imports ~800 modules here, monitor or not
    folder = tempfile.mkdtemp(prefix="imports-")
    phases: dict[str, dict[str, Any]] = {}
    state = {"names": set(sys.modules), "t": time.process_time()}

    def mark(phase: str) -> None:
        now, names = time.process_time(), set(sys.modules)
        new = names - state["names"]
        phases[phase] = {"cpu_s": now - state["t"], "modules": len(new), "by_package": _by_package(new), "names": sorted(new)[:4]}
        state["names"], state["t"] = names, time.process_time()

    if args.adapter == "plain":
        from memcallbacks import Monitor

        mark("import")
        monitor = Monitor(model, optimizer, output_dir=os.path.join(folder, "mem"), console_summary=False)
        mark("build")
        x = torch.randn(32, 256)
        for _ in range(args.steps):
            model(x).pow(2).mean().backward()
            optimizer.step()
            optimizer.zero_grad()
        mark("steps")
        monitor.close()
        mark("end")
        return phases
    import lightning.pytorch as pl

    state["names"], state["t"] = set(sys.modules), time.process_time()
    from memcallbacks import MemoryMonitor

    mark("import")
    monitor = MemoryMonitor(output_dir=os.path.join(folder, "mem"), console_summary=False)

    class Phases(pl.Callback):
        def on_train_start(self, trainer: Any, pl_module: Any) -> None:
            mark("build")  # the monitor's setup() ran: its session started

        def on_train_end(self, trainer: Any, pl_module: Any) -> None:
            mark("steps")

    class Net(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = model

        def training_step(self, batch: Any, batch_idx: int) -> Any:
            return self.net(batch).pow(2).mean()

        def configure_optimizers(self) -> Any:
            return torch.optim.AdamW(self.parameters(), lr=1e-3)

    trainer = pl.Trainer(max_steps=args.steps, accelerator="cpu", devices=1, callbacks=[Phases(), monitor], logger=pl.loggers.CSVLogger(folder),
                         enable_progress_bar=False, enable_model_summary=False, enable_checkpointing=False, default_root_dir=folder)
    trainer.fit(Net(), torch.utils.data.DataLoader(torch.randn(args.steps * 32, 256), batch_size=32))
    mark("end")
    return phases


def importtime(adapter: str) -> list[tuple[str, float, float]]:
    """``python -X importtime`` of the monitor's import after torch's: (module, self µs, cumulative µs) of memcallbacks modules."""
    name = "Monitor" if adapter == "plain" else "MemoryMonitor"
    pre = "import torch" if adapter == "plain" else "import torch, lightning.pytorch"
    # automatic collections off: a full collection of torch's heap (~0.1-0.4 s) lands inside whichever module allocates then
    done = subprocess.run([sys.executable, "-X", "importtime", "-c", f"import gc; gc.disable(); {pre}; from memcallbacks import {name}"],
                          capture_output=True, text=True, check=True)
    rows = []
    for line in done.stderr.splitlines():
        if not line.startswith("import time:") or "|" not in line or "self [us]" in line:
            continue
        self_us, cumulative_us, module = line.split(":", 1)[1].split("|")
        if module.strip().startswith("memcallbacks"):
            rows.append((module.strip(), float(self_us), float(cumulative_us)))
    return rows


def main(args: argparse.Namespace) -> int:
    if args.child:
        print(json.dumps(child(args)))
        return 0
    runs = []
    for _ in range(args.runs):
        cmd = [sys.executable, os.path.abspath(__file__), "--child", "--adapter", args.adapter, "--steps", str(args.steps)]
        done = subprocess.run(cmd, capture_output=True, text=True, check=False, env=dict(os.environ, OMP_NUM_THREADS="1"))
        if done.returncode:
            raise SystemExit(done.stderr[-3000:])
        runs.append(json.loads(done.stdout.strip().splitlines()[-1]))
    print(f"{args.adapter} adapter, {args.steps} steps, {args.runs} runs (medians), load average {os.getloadavg()[0]:.2f}")
    print("| phase | modules imported | CPU s | by package (first run) |")
    print("|---|---:|---:|---|")
    for phase in PHASES:
        first = runs[0][phase]
        packages = ", ".join(first["names"]) if first["modules"] <= 3 else ", ".join(f"{k} {v}" for k, v in list(first["by_package"].items())[:6])
        print(f"| {phase} | {statistics.median(r[phase]['modules'] for r in runs):.0f} | "
              f"{statistics.median(r[phase]['cpu_s'] for r in runs):.3f} | {packages} |")
    times = collections.defaultdict(list)
    for _ in range(args.runs):
        for module, self_us, cumulative_us in importtime(args.adapter):
            times[module].append((self_us, cumulative_us))
    total = statistics.median(sum(v[0] for v in vals) for vals in zip(*[times[m] for m in times])) if times else 0.0
    print(f"\nmemcallbacks modules imported: {len(times)}, {total / 1e3:.0f} ms of their own (self) import time, wall clock, automatic\n"
          "collections off (with them on, a full collection of torch's heap lands inside whichever module allocates then); the costliest:")
    print("| module | self, ms | cumulative, ms |")
    print("|---|---:|---:|")
    ranked = sorted(times, key=lambda m: -statistics.median(v[0] for v in times[m]))
    for module in ranked[: args.top]:
        print(f"| {module} | {statistics.median(v[0] for v in times[module]) / 1e3:.1f} | {statistics.median(v[1] for v in times[module]) / 1e3:.1f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main(parse_args()))
