"""Own time, honestly: the share the monitor's report gives against the extra CPU a bare loop measures.

A plain loop of fast steps (the MLP 256 -> 256 -> 256 -> 10, batch 32, AdamW, one thread: ~0.25-0.5 ms a
step) runs bare and under a default ``Monitor(model, optimizer)``, each run in a fresh process of its
own (imports, heap and caches as a user's script has them). The two runs of a pair train **side by
side**, started together once both are built (one intra-op thread each; the one that finishes first
trains on, untimed, until the other is done), so the machine's drift falls on both alike; which one
starts first alternates. Each process measures its own CPU time (``time.process_time``: every
thread) in three spans: building the monitor, the steps, ``close()``. Per pair:

- the **measured extra**: the monitored steps' CPU over the bare steps' CPU, less one;
- the **measured share**: that extra over the monitored steps' CPU (the report's shares are over the
  monitored step time, the monitor's included);
- the **reported share**: report.json's ``summary.cadence.overhead`` (own time during the steps,
  over the step time the pauses leave) and its parts; and the same own time over the monitored
  steps' CPU time (on a loaded machine the wall-clock step time the report divides by is longer than
  the CPU time: this one compares like with like);
- their ratio. Done (issue 45) when the reported share is within ±30% of the measured share.

``close()`` and the build are measured apart (CPU seconds, and each process's peak RSS).

Usage::

    python benchmarks/own_time_honesty.py                  # 3 pairs of 3,000 steps
    python benchmarks/own_time_honesty.py --pairs 5 --steps 2000 --json honesty.json
    python benchmarks/own_time_honesty.py --batch 128 --hidden 1024 --steps 200   # a few-ms step

Results: docs/benchmarks.md, "own_time_honesty.py".
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import select
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
TARGET = 0.30  # the reported share within +-30% of the measured extra


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=3000)
    parser.add_argument("--pairs", type=int, default=3, help="alternating (bare, monitored) pairs, each run its own process")
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--hidden", type=int, default=256, help="the MLP's width (input and hidden layers)")
    parser.add_argument("--monitor-kwargs", default="{}", help="JSON keyword arguments for Monitor (default: none, the defaults)")
    parser.add_argument("--json", help="write every run's numbers here")
    parser.add_argument("--child", choices=("bare", "monitored"), help=argparse.SUPPRESS)
    return parser.parse_args(argv)


# ---------------------------------------------------------------------------- one run, in its own process
def child(args: argparse.Namespace) -> dict[str, Any]:
    import torch
    from torch import nn

    torch.set_num_threads(1)
    torch.manual_seed(0)
    h = args.hidden
    model = nn.Sequential(nn.Linear(h, h), nn.ReLU(), nn.Linear(h, h), nn.ReLU(), nn.Linear(h, 10))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    batches = [torch.randn(args.batch, h) for _ in range(16)]
    out: dict[str, Any] = {"variant": args.child}
    modules = len(sys.modules)
    t0 = time.process_time()
    monitor = None
    if args.child == "monitored":
        from memcallbacks import Monitor

        folder = tempfile.mkdtemp(prefix="honesty-")
        monitor = Monitor(model, optimizer, output_dir=folder, console_summary=False, **json.loads(args.monitor_kwargs))
    out["build_cpu_s"] = time.process_time() - t0
    before_steps = len(sys.modules)
    print("ready", flush=True)
    sys.stdin.readline()  # "go": the other run of the pair is built too
    t1 = time.process_time()

    def step(i: int) -> None:
        loss = model(batches[i & 15]).pow(2).mean()
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()

    for i in range(args.steps):
        step(i)
    t2 = time.process_time()
    out["modules_imported_during_steps"] = len(sys.modules) - before_steps
    print(json.dumps({"steps_cpu_s": t2 - t1}), flush=True)
    t3 = time.process_time()
    if monitor is not None:
        monitor.close()
    t4 = time.process_time()
    if monitor is not None:
        out["cadence"] = monitor.report()["summary"]["cadence"]
    i = args.steps
    while not select.select([sys.stdin], [], [], 0)[0]:  # train on, untimed, until the other run is done too
        for _ in range(8):
            step(i)
            i += 1
    out.update(steps_cpu_s=t2 - t1, close_cpu_s=t4 - t3,
               modules_imported_at_build=before_steps - modules, peak_rss_bytes=resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024)
    return out


def run_pair(order: tuple[str, str], args: argparse.Namespace) -> dict[str, dict[str, Any]]:
    """Both runs of a pair, side by side: built, started together (in ``order``), stopped together."""
    env = dict(os.environ, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1")
    procs = {}
    for variant in order:
        cmd = [sys.executable, os.path.abspath(__file__), "--child", variant, "--steps", str(args.steps), "--batch", str(args.batch),
               "--hidden", str(args.hidden), "--monitor-kwargs", args.monitor_kwargs]
        procs[variant] = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    for variant, proc in procs.items():
        if proc.stdout.readline().strip() != "ready":  # type: ignore[union-attr]
            raise SystemExit(f"{variant} run failed:\n{proc.communicate()[1][-3000:]}")
    for proc in procs.values():
        proc.stdin.write("go\n")  # type: ignore[union-attr]
        proc.stdin.flush()  # type: ignore[union-attr]
    for proc in procs.values():
        proc.stdout.readline()  # type: ignore[union-attr]  # its timed steps are done
    results = {}
    for variant, proc in procs.items():
        out, err = proc.communicate("stop\n")
        if proc.returncode:
            raise SystemExit(f"{variant} run failed:\n{err[-3000:]}")
        results[variant] = json.loads(out.strip().splitlines()[-1])
    return results


# ---------------------------------------------------------------------------- the pairs
def pair_row(bare: dict[str, Any], mon: dict[str, Any]) -> dict[str, Any]:
    cadence = mon["cadence"]
    extra = mon["steps_cpu_s"] / bare["steps_cpu_s"] - 1
    measured = 1 - bare["steps_cpu_s"] / mon["steps_cpu_s"]  # the extra's share of the monitored steps
    reported = cadence["overhead"]
    steady_s = reported * cadence["step_time_timed_s"]  # own time during the steps
    reported_cpu = steady_s / mon["steps_cpu_s"]
    return {
        "bare_steps_cpu_s": bare["steps_cpu_s"], "monitored_steps_cpu_s": mon["steps_cpu_s"], "measured_extra": extra,
        "measured_share": measured, "reported": reported, "reported_over_cpu": reported_cpu,
        "ratio": reported_cpu / measured if measured > 0 else None,
        "reported_by_part": cadence.get("overhead_by_part"), "end_of_run_s": cadence.get("end_of_run_s"),
        "close_cpu_s": mon["close_cpu_s"], "build_cpu_s": mon["build_cpu_s"],
        "bare_peak_rss_bytes": bare["peak_rss_bytes"], "monitored_peak_rss_bytes": mon["peak_rss_bytes"],
        "modules_imported_during_steps": mon["modules_imported_during_steps"], "modules_imported_at_build": mon["modules_imported_at_build"],
    }


def spread(values: list[float]) -> str:
    return f"{statistics.median(values):.4f} [{min(values):.4f}, {max(values):.4f}]"


def main(args: argparse.Namespace) -> int:
    if args.child:
        print(json.dumps(child(args), default=str))
        return 0
    env = {"loadavg_before": os.getloadavg(), "python": sys.version.split()[0]}
    rows: list[dict[str, Any]] = []
    for pair in range(args.pairs):
        order = ("bare", "monitored") if pair % 2 == 0 else ("monitored", "bare")
        results = run_pair(order, args)
        row = pair_row(results["bare"], results["monitored"])
        row.update(pair=pair, order=list(order), loadavg=os.getloadavg()[0])
        rows.append(row)
        parts = row["reported_by_part"] or {}
        print(f"pair {pair} ({order[0]} first): steps {row['bare_steps_cpu_s']:.3f} s bare, {row['monitored_steps_cpu_s']:.3f} s monitored: "
              f"measured extra {100 * row['measured_extra']:.2f}% (share {100 * row['measured_share']:.2f}%), reported {100 * row['reported']:.2f}% "
              f"({100 * row['reported_over_cpu']:.2f}% of the steps' CPU) "
              f"(ratio {row['ratio'] if row['ratio'] is None else round(row['ratio'], 2)}); by part "
              + ", ".join(f"{k} {100 * v:.2f}%" for k, v in parts.items() if v)
              + f"; close {row['close_cpu_s']:.3f} s CPU, build {row['build_cpu_s']:.3f} s; load {row['loadavg']:.2f}", flush=True)
    ratios = [r["ratio"] for r in rows if r["ratio"] is not None]
    extras, shares = [r["measured_extra"] for r in rows], [r["measured_share"] for r in rows]
    reported, reported_cpu = [r["reported"] for r in rows], [r["reported_over_cpu"] for r in rows]
    print(f"measured extra CPU of the steps, median [min, max]: {spread(extras)}; as a share of the monitored steps {spread(shares)}")
    print(f"reported own share, median [min, max]:           {spread(reported)}; own time over the steps' CPU {spread(reported_cpu)}")
    met = bool(ratios) and abs(statistics.median(ratios) - 1) <= TARGET
    if ratios:
        print(f"reported / measured, median [min, max]:           {spread(ratios)}: "
              f"{'met' if met else 'not met'} (target within +-{100 * TARGET:.0f}%)")
    print(f"close(): {spread([r['close_cpu_s'] for r in rows])} s CPU; peak RSS bare {spread([r['bare_peak_rss_bytes'] / 2**20 for r in rows])} MiB, "
          f"monitored {spread([r['monitored_peak_rss_bytes'] / 2**20 for r in rows])} MiB")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "environment": dict(env, loadavg_after=os.getloadavg()), "pairs": rows, "met": met}, f, indent=1)
    return 0 if met else 1


if __name__ == "__main__":
    sys.exit(main(parse_args()))
