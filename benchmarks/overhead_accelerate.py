"""Training-time overhead of ``AccelerateMemoryMonitor`` against a bare Accelerate loop.

A plain ``Accelerator(cpu=True)`` loop over the MLP of ``benchmarks/overhead.py`` (64-128-128-10, batch 32, AdamW)
logs its loss through ``accelerator.log`` every ``log_every`` steps, to a TensorBoard tracker
(``--tracker none``: no tracker, so ``accelerator.log`` does nothing). Variants: the bare loop,
``AccelerateMemoryMonitor`` with its defaults (on CPU per-phase peaks are taken on logged steps
only) and with ``sample_every_n_steps=1``; the monitor logs with the same ``log_every``.

Runs are interleaved: each repeat runs every (variant, log_every) pair once, in a shuffled order,
so slow phases of a noisy machine hit all variants alike; what counts is the ratio to the bare
run of the same repeat. Every step's start is stamped in the loop itself (same code in every
variant); the first ``--skip-steps`` steps and the end-of-run file writing are left out, and the
one-off cost around the steps (construction, ``close()`` with its files) is reported apart.

    python benchmarks/overhead_accelerate.py            # full run, a few minutes on 2 cores
    python benchmarks/overhead_accelerate.py --quick    # about a minute
    python benchmarks/overhead_accelerate.py --json out.json
"""

from __future__ import annotations

import argparse
import gc
import json
import logging
import os
import random
import statistics
import tempfile
import time
import types
import warnings
from typing import Any


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="smoke run: fewer steps and repeats")
    p.add_argument("--json", metavar="PATH", help="write environment, every run and the summary to PATH")
    p.add_argument("--steps", type=int, help="timed steps per run (a multiple of every --log-every)")
    p.add_argument("--skip-steps", type=int, default=50, help="untimed steps at the start of every run")
    p.add_argument("--repeats", type=int, help="interleaved repeats")
    p.add_argument("--log-every", type=int, nargs="+", default=[1, 50], help="accelerator.log interval (loss and memory)")
    p.add_argument("--threads", type=int, default=1, help="torch.set_num_threads (fixed to reduce noise)")
    p.add_argument("--tracker", default="tensorboard", choices=["tensorboard", "none"], help="what accelerator.log writes to")
    p.add_argument("--d-in", type=int, default=64)
    p.add_argument("--hidden", type=int, default=128)
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--seed", type=int, default=0, help="seed of the shuffled run order")
    p.add_argument("--hook-repeats", type=int, help="runs per (variant, log setting) with the monitor's own code timed")
    p.add_argument("--no-detection", action="store_true", help="monitor variants with detect_leaks=False, estimate_model_states=False")
    args = p.parse_args(argv)
    args.steps = args.steps or (300 if args.quick else 1000)
    args.repeats = args.repeats if args.repeats is not None else (3 if args.quick else 9)
    args.hook_repeats = args.hook_repeats if args.hook_repeats is not None else (1 if args.quick else 3)
    bad = [n for n in args.log_every if n < 1 or args.steps % n or args.skip_steps % n]
    if bad:
        p.error(f"--steps {args.steps} and --skip-steps {args.skip_steps} must be multiples of every --log-every; {bad} is not.")
    return args


if __name__ == "__main__":
    # --help and argument errors answer here, before torch and Accelerate load (seconds)
    ARGS = parse_args()

import torch  # noqa: E402
from torch import nn  # noqa: E402

import accelerate  # noqa: E402
from accelerate import Accelerator  # noqa: E402
from accelerate.state import AcceleratorState, GradientState  # noqa: E402

from memcallbacks.accelerate import AccelerateMemoryMonitor  # noqa: E402

# benchmarks/_common.py: run as a script, this file's folder is sys.path[0]
from _common import BARE, TARGET_LOG_EVERY, TARGET_RATIO, TARGET_US_PER_STEP  # noqa: E402
from _common import base_environment, interleaved_runs, load_average, mlp_layers, monitor_self_us, paired_with_bare, quantile, robust_step_us  # noqa: E402

MONITOR, MONITOR_EVERY_STEP = "AccelerateMemoryMonitor", "AccelerateMemoryMonitor(sample_every_n_steps=1)"
VARIANTS = (BARE, MONITOR, MONITOR_EVERY_STEP)
TARGET_VARIANT = MONITOR  # held to the Lightning adapter's targets (_common, benchmarks/overhead.py)
CLOCKS = {
    "robust": "wall time per step, each class of step (logged / not logged) at its median, weighted by its count",
    "cpu": "process CPU time (user + system) over the timed steps",
    "wall": "wall time over the timed steps",
}


class MLP(nn.Module):
    def __init__(self, d_in: int, hidden: int, n_classes: int = 10) -> None:
        super().__init__()
        self.net = mlp_layers(d_in, hidden, n_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)


class TimedMonitor(AccelerateMemoryMonitor):
    """``AccelerateMemoryMonitor`` that adds up the wall time spent in its own code (outermost calls only):
    the hooks torch calls, the step bookkeeping of ``track`` and the core calls of the backward wrapper."""

    _TIMED = ("_forward_pre", "_backward_starts", "_backward_ends", "_optimizer_pre", "_optimizer_post", "_step_complete", "_begin", "_end")

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self.spent = 0.0
        self._depth = 0
        gone = [name for name in self._TIMED if not hasattr(self, name)]
        if gone:  # the monitor's hook methods were renamed: time the new ones, or this benchmark times nothing
            raise SystemExit(f"overhead_accelerate.py: AccelerateMemoryMonitor has no {gone}; update TimedMonitor._TIMED")
        self._kept: list[Any] = []  # the timed methods' functions: the monitor holds its hooks by weak reference
        for name in self._TIMED:
            timed = self._timed(getattr(self, name))
            self._kept.append(timed)
            # a bound method, not a plain function: the monitor holds hook methods by weakref.WeakMethod
            setattr(self, name, types.MethodType(lambda _self, *a, _t=timed, **k: _t(*a, **k), self))
        super().__init__(*args, **kwargs)
        core = self._session
        for name in ("boundary", "begin_step", "end_step"):
            setattr(core, name, self._timed(getattr(core, name)))

    def _timed(self, fn: Any) -> Any:
        clock = time.perf_counter

        def timed(*args: Any, **kwargs: Any) -> Any:
            if self._depth:
                return fn(*args, **kwargs)
            self._depth = 1
            t0 = clock()
            try:
                return fn(*args, **kwargs)
            finally:
                self.spent += clock() - t0
                self._depth = 0

        return timed


def run(variant: str, log_every: int, args: argparse.Namespace, batches: list[tuple[torch.Tensor, torch.Tensor]], workdir: str, timed: bool = False) -> dict[str, Any]:
    """One loop of ``skip_steps + steps`` steps; returns its timings (and the monitor's own accounting).

    ``timed``: use :class:`TimedMonitor` and also return the time spent inside the monitor per step."""
    AcceleratorState._reset_state(True)
    GradientState._reset_state()
    run_dir = tempfile.mkdtemp(dir=workdir)
    t_setup = time.perf_counter()
    accelerator = Accelerator(cpu=True, log_with="tensorboard" if args.tracker == "tensorboard" else None, project_dir=run_dir)
    if args.tracker == "tensorboard":
        accelerator.init_trackers("bench")
    torch.manual_seed(0)
    model = MLP(args.d_in, args.hidden)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model, optimizer = accelerator.prepare(model, optimizer)
    monitor = None
    if variant != BARE:
        extra: dict[str, Any] = {"sample_every_n_steps": 1} if variant == MONITOR_EVERY_STEP else {}
        if args.no_detection:  # the adapter's own cost, without leak detection and the model-state check
            extra.update(detect_leaks=False, leaks={"estimate_model_states": False})
        cls = TimedMonitor if timed else AccelerateMemoryMonitor
        monitor = cls(accelerator, log_every_n_steps=log_every, output_dir=os.path.join(run_dir, "memcallbacks"), **extra)
    setup_s = time.perf_counter() - t_setup

    total = args.skip_steps + args.steps
    items = (batches[i % len(batches)] for i in range(total))
    loop = monitor.track(items) if monitor is not None else items
    stamps: list[float] = []
    spent: list[float] = []
    cpu0 = 0.0
    gc.collect()
    clock = time.perf_counter
    for step, (x, y) in enumerate(loop):
        if step >= args.skip_steps:
            if step == args.skip_steps:
                cpu0 = time.process_time()
            stamps.append(clock())
            if timed:
                spent.append(monitor.spent)  # type: ignore[union-attr]
        loss = nn.functional.cross_entropy(model(x), y)
        accelerator.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        if (step + 1) % log_every == 0:
            accelerator.log({"train_loss": loss.item()}, step=step)
    stamps.append(clock())
    cpu1 = time.process_time()
    if timed:
        spent.append(monitor.spent)  # type: ignore[union-attr]

    t_close = time.perf_counter()
    if monitor is not None:
        monitor.close()
    accelerator.end_training()
    close_s = time.perf_counter() - t_close

    durations = [b - a for a, b in zip(stamps, stamps[1:])]
    window = stamps[-1] - stamps[0]
    out: dict[str, Any] = {
        "variant": variant,
        "log_every": log_every,
        "steps": args.steps,
        "step_us_wall": window / args.steps * 1e6,
        "step_us_cpu": (cpu1 - cpu0) / args.steps * 1e6,
        "step_us_robust": robust_step_us(durations, args.skip_steps, log_every),
        "setup_s": setup_s,
        "close_s": close_s,
    }
    if monitor is not None:
        summary = monitor.summary()
        if len(monitor.history) == 0 or not monitor.enabled:
            raise RuntimeError(f"{variant}: the monitor recorded nothing (enabled={monitor.enabled}); the benchmark is broken")
        out["monitor_self_us_per_sampled_step"], out["monitor_self_us_per_step"] = monitor_self_us(summary)
        out["steps_sampled"] = summary["steps_sampled"]
    if timed:
        per_step = [b - a for a, b in zip(spent, spent[1:])]
        out["in_monitor_us_per_step_robust"] = robust_step_us(per_step, args.skip_steps, log_every)
        out["in_monitor_us_per_step_mean"] = sum(per_step) / len(per_step) * 1e6
    return out


def summarize(runs: list[dict[str, Any]], log_settings: list[int], clock: str) -> list[dict[str, Any]]:
    """Per (variant, log setting): medians over repeats of paired (same-repeat) comparisons with bare."""
    key = f"step_us_{clock}"
    rows = []
    for log_every, variant, mine, bare in paired_with_bare(runs, log_settings, VARIANTS):
        ratios = [r[key] / bare[r["repeat"]][key] for r in mine]
        deltas = [r[key] - bare[r["repeat"]][key] for r in mine]
        row: dict[str, Any] = {
            "variant": variant,
            "log_every": log_every,
            "clock": clock,
            "repeats": len(mine),
            "step_us_median": statistics.median(r[key] for r in mine),
            "ratio_median": statistics.median(ratios),
            "ratio_q25": quantile(ratios, 0.25),
            "ratio_q75": quantile(ratios, 0.75),
            "delta_us_median": statistics.median(deltas),
            "setup_ms_median": statistics.median(r["setup_s"] for r in mine) * 1e3,
            "close_ms_median": statistics.median(r["close_s"] for r in mine) * 1e3,
        }
        if "monitor_self_us_per_step" in mine[0]:
            row["monitor_self_us_per_step"] = statistics.median(r["monitor_self_us_per_step"] for r in mine)
            row["monitor_self_us_per_sampled_step"] = statistics.median(r["monitor_self_us_per_sampled_step"] for r in mine)
        rows.append(row)
    return rows


def format_table(rows: list[dict[str, Any]]) -> str:
    lines = [
        "| variant | log every | step (µs, median) | ratio vs bare: median [IQR] | Δ µs/step vs bare | monitor self-time µs/step (per sampled step) | setup / close (ms) |",
        "|---|---:|---:|---|---:|---:|---:|",
    ]
    for r in rows:
        self_time = "–"
        if "monitor_self_us_per_step" in r:
            self_time = f"{r['monitor_self_us_per_step']:.1f} ({r['monitor_self_us_per_sampled_step']:.0f})"
        bare = r["variant"] == BARE
        ratio = "1" if bare else f"{r['ratio_median']:.3f} [{r['ratio_q25']:.3f}–{r['ratio_q75']:.3f}]"
        delta = "0" if bare else f"{r['delta_us_median']:+.1f}"
        lines.append(f"| {r['variant']} | {r['log_every']} | {r['step_us_median']:.0f} | {ratio} | {delta} | {self_time} | "
                     f"{r['setup_ms_median']:.0f} / {r['close_ms_median']:.0f} |")
    return "\n".join(lines)


def format_accounting(accounts: list[dict[str, Any]], log_settings: list[int]) -> str:
    lines = [
        "| variant | log every | time inside the monitor, µs/step: robust (mean) | of which on sampled steps: engine self-time µs/step |",
        "|---|---:|---:|---:|",
    ]
    for variant in VARIANTS[1:]:
        for log_every in log_settings:
            mine = [a for a in accounts if a["variant"] == variant and a["log_every"] == log_every]
            if mine:
                robust = statistics.median(a["in_monitor_us_per_step_robust"] for a in mine)
                mean = statistics.median(a["in_monitor_us_per_step_mean"] for a in mine)
                engine = statistics.median(a["monitor_self_us_per_step"] for a in mine)
                lines.append(f"| {variant} | {log_every} | {robust:.1f} ({mean:.1f}) | {engine:.1f} |")
    return "\n".join(lines)


def judge(rows: list[dict[str, Any]], clock: str) -> list[str]:
    target = next((r for r in rows if r["variant"] == TARGET_VARIANT and r["log_every"] == TARGET_LOG_EVERY), None)
    if target is None:
        return []
    ok_us = target["delta_us_median"] <= TARGET_US_PER_STEP
    ok_ratio = target["ratio_median"] <= TARGET_RATIO
    return [f"[{clock} clock] {TARGET_VARIANT} at log_every={TARGET_LOG_EVERY}: {target['delta_us_median']:+.1f} µs/step "
            f"(target ≤ {TARGET_US_PER_STEP:.0f}: {'met' if ok_us else 'MISSED'}), ratio {target['ratio_median']:.3f} "
            f"(target ≤ {TARGET_RATIO}: {'met' if ok_ratio else 'MISSED'})"]


def environment(args: argparse.Namespace) -> dict[str, Any]:
    return {
        **base_environment(accelerate=accelerate.__version__),
        "tracker": args.tracker,
        "leak_detection": not args.no_detection,
        "load_average_at_start": load_average(),
    }


def main(argv: list[str] | argparse.Namespace | None = None) -> int:
    args = argv if isinstance(argv, argparse.Namespace) else parse_args(argv)
    torch.set_num_threads(args.threads)
    warnings.filterwarnings("ignore")
    logging.getLogger("memcallbacks").setLevel(logging.ERROR)  # --tracker none: the no-tracker warning
    env = environment(args)
    print("environment:", json.dumps(env))
    print(f"model: MLP {args.d_in}->{args.hidden}->{args.hidden}->10, batch {args.batch_size}, AdamW; "
          f"{args.skip_steps} untimed + {args.steps} timed steps per run; {args.repeats} repeats; tracker {args.tracker}")
    g = torch.Generator().manual_seed(0)
    batches = [(torch.randn(args.batch_size, args.d_in, generator=g), torch.randint(0, 10, (args.batch_size,), generator=g)) for _ in range(16)]
    began = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="memcallbacks-bench-acc-") as workdir:
        warm = argparse.Namespace(**{**vars(args), "steps": max(args.log_every)})
        for variant in VARIANTS if args.repeats else ():  # imports, first-run costs, matplotlib's font cache; discarded
            run(variant, max(args.log_every), warm, batches, workdir)

        def progress(repeat: int, bare: list[dict[str, Any]]) -> None:
            print(f"repeat {repeat + 1}/{args.repeats} ({time.perf_counter() - began:.0f} s; bare step "
                  + ", ".join(f"L={r['log_every']}: {r['step_us_wall']:.0f} µs" for r in bare) + ")", flush=True)

        runs = interleaved_runs(lambda variant, log_every: run(variant, log_every, args, batches, workdir),
                                VARIANTS, args.log_every, args.repeats, random.Random(args.seed), progress)
        accounts = []
        for _ in range(args.hook_repeats):
            for variant in VARIANTS[1:]:
                for log_every in args.log_every:
                    accounts.append(run(variant, log_every, args, batches, workdir, timed=True))
    print("\n## time inside the monitor's own code (hooks, track bookkeeping, core calls), per step\n")
    print(format_accounting(accounts, args.log_every))
    if not runs:
        return 0
    summaries = {clock: summarize(runs, args.log_every, clock) for clock in CLOCKS}
    for clock, rows in summaries.items():
        print(f"\n## clock: {clock} — {CLOCKS[clock]}\n")
        print(format_table(rows))
    print()
    # the robust clock drops rare expensive steps (preemption, but also the monitor's own rare work):
    # read it together with the CPU clock
    for clock in ("robust", "cpu"):
        for line in judge(summaries[clock], clock):
            print(line)
    if args.json:
        with open(args.json, "w") as fh:
            json.dump({"environment": env, "args": vars(args), "runs": runs, "accounting": accounts, "summary": summaries}, fh, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main(ARGS))
