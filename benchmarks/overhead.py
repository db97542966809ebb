"""Training-time overhead of ``MemoryMonitor`` against a bare fit and Lightning's ``DeviceStatsMonitor``.

Real ``Trainer.fit`` calls on a small MLP (about 1-2 ms per step on one quiet CPU thread); every
variant shares the model, the data, the logger type and ``log_every_n_steps``. Four measurements:

1. **Interleaved fits** (what the issue asks for): each repeat runs every (variant, logging
   interval) once, in shuffled order, and each variant's step time is divided by the bare fit's of
   the same repeat. Only the training steps are timed: a timing callback, first in every callback
   list, stamps ``perf_counter`` at the start of every step from ``--skip-steps`` on and at
   ``on_train_end``, so setup, the first steps and the end-of-fit files are left out (the one-off
   cost around the steps is reported separately).
2. **A/B blocks inside one fit**: the timing callback swaps the callback under test in and out of
   ``trainer.callbacks`` every ``--block`` steps (one "on" and one "off" block per pair, in random
   order). Both arms run seconds apart in the same process, so the slow drift of a shared machine
   cancels; this resolves differences of a few tenths of a percent where (1) cannot.
3. **Time inside the hooks**: one fit with an empty ``Callback``, ``DeviceStatsMonitor`` and two
   ``MemoryMonitor`` configurations side by side, every hook wrapped in a timer; plus Lightning's
   own cost of dispatching the six step hooks to one more callback. With ``--host``, a third
   ``MemoryMonitor(watch_host=False)`` joins the same fit: the difference between the default
   monitor and that one, step by step under the same load, is the host channel's cost (issue 23).
4. **Micro-benchmarks** of the CPU backend's reads, back to back and right after a burst of compute.

Usage::

    python benchmarks/overhead.py                 # full run, about 5 minutes on 2 quiet cores
    python benchmarks/overhead.py --quick         # about 1 minute smoke run (CUDA: about 30 s, log 50 only)
    python benchmarks/overhead.py --json out.json # also save every measurement, rewritten after each one
    python benchmarks/overhead.py --device cuda   # the same on a CUDA device, larger model
    python benchmarks/overhead.py --host --repeats 0 --ab-pairs 0 --no-micro
                                                  # only (3), MemoryMonitor with and without the host channel

Results and how to read them: docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import gc
import json
import logging
import os
import random
import resource
import statistics
import sys
import tempfile
import time
import warnings
from pathlib import Path
from typing import Any, Callable

# benchmarks/_common.py (no torch at import): run as a script, this file's folder is sys.path[0]
from _common import BARE, TARGET_LOG_EVERY, TARGET_RATIO, TARGET_US_PER_STEP
from _common import ResultFile, base_environment, interleaved_runs, is_logged, load_average, median_ci, mlp_layers, monitor_self_us, paired_with_bare, quantile, robust_mean, robust_step_us

NOOP = "empty Callback"
DEVICE_STATS = "DeviceStatsMonitor"
MONITOR = "MemoryMonitor"
MONITOR_EVERY_STEP = "MemoryMonitor(sample_every_n_steps=1)"
MONITOR_NO_HOST = "MemoryMonitor(watch_host=False)"
HOOK_NAMES = (DEVICE_STATS, MONITOR, MONITOR_EVERY_STEP, MONITOR_NO_HOST)
"""The callbacks section 3 can time; MONITOR_NO_HOST only with ``--host``."""
VARIANTS = (BARE, NOOP, DEVICE_STATS, MONITOR, MONITOR_EVERY_STEP)
FIT_VARIANTS = (BARE, DEVICE_STATS, MONITOR, MONITOR_EVERY_STEP)
AB_VARIANTS = (NOOP, DEVICE_STATS, MONITOR, MONITOR_EVERY_STEP)


def parse_args(argv: list[str] | None = None, *, require_device: bool = True) -> argparse.Namespace:
    """The arguments, with the defaults --quick and --device imply; ``require_device=False`` reads them without a GPU."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="smoke run: fewer steps and repeats (about a minute; on CUDA about "
                   "30 s: 2 repeats of 100 steps, 2 A/B pairs, log_every 50 only, since every step synchronizes)")
    p.add_argument("--json", metavar="PATH", help="write environment, every run and the summaries to PATH")
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"], help="train on this device (cuda: a larger model)")
    p.add_argument("--log-every", type=int, nargs="+", help=f"Trainer(log_every_n_steps=...) settings (default 1 {TARGET_LOG_EVERY}; "
                   f"{TARGET_LOG_EVERY} with --quick on CUDA)")
    p.add_argument("--steps", type=int, help="timed steps per interleaved fit (a multiple of every --log-every)")
    p.add_argument("--skip-steps", type=int, default=50, help="untimed steps at the start of every fit")
    p.add_argument("--repeats", type=int, help="interleaved repeats (0 skips the interleaved fits)")
    p.add_argument("--variants", nargs="+", choices=VARIANTS, default=list(FIT_VARIANTS), metavar="VARIANT", help=f"interleaved-fit variants, of {VARIANTS}")
    p.add_argument("--ab-pairs", type=int, help="A/B block pairs per fit (0 skips the A/B fits)")
    p.add_argument("--block", type=int, default=50, help="steps per A/B block (a multiple of every --log-every)")
    p.add_argument("--hook-repeats", type=int, help="fits per log setting with every hook timed (0 skips them)")
    p.add_argument("--no-micro", action="store_true", help="skip the micro-benchmarks")
    p.add_argument("--host", action="store_true", help=f"section 3 also times {MONITOR_NO_HOST} in the same fit: the default "
                   "monitor's extra time over it is the host channel's cost")
    p.add_argument("--threads", type=int, default=1, help="torch.set_num_threads (fixed, to reduce noise)")
    p.add_argument("--logger", default="csv", choices=["csv", "tensorboard"], help="the logger every variant uses")
    p.add_argument("--reuse-batches", action="store_true", help="hand out the same few batch tensors every step (a pre-batched in-memory dataset) instead of fresh ones")
    p.add_argument("--seed", type=int, default=0, help="seed of the run order and the A/B plans")
    args = p.parse_args(argv)
    if require_device and args.device == "cuda":
        import torch  # here, not above: --help answers before torch loads

        if not torch.cuda.is_available():
            p.error("--device cuda: no CUDA device is available.")
    quick = args.quick
    # a synchronized CUDA step of the larger model is slower than a CPU one: --quick there is sized to
    # end within gpu_check.sh's stage (about 2,750 steps in 17 fits instead of about 12,000 in 46)
    cuda_quick = quick and args.device == "cuda"
    args.log_every = args.log_every or ([TARGET_LOG_EVERY] if cuda_quick else [1, TARGET_LOG_EVERY])
    args.steps = args.steps or (100 if cuda_quick else 200 if quick else 600)
    # 15 repeats: enough for the paired difference of two monitors to have a 95% interval (sign test)
    args.repeats = args.repeats if args.repeats is not None else (2 if cuda_quick else 3 if quick else 15)
    args.ab_pairs = args.ab_pairs if args.ab_pairs is not None else (2 if cuda_quick else 6 if quick else 20)
    args.hook_repeats = args.hook_repeats if args.hook_repeats is not None else (1 if quick else 3)
    args.d_in, args.hidden, args.batch_size = (1024, 4096, 512) if args.device == "cuda" else (64, 128, 32)
    args.micro_calls = 400 if quick else 2000
    args.micro_matmul = 2048 if args.device == "cuda" else 256
    for name in ("steps", "skip_steps", "block"):
        bad = [n for n in args.log_every if n < 1 or getattr(args, name) % n]
        if bad:
            p.error(f"--{name.replace('_', '-')} {getattr(args, name)} must be a multiple of every --log-every; {bad} is not a divisor.")
    if BARE not in args.variants:
        args.variants.insert(0, BARE)
    return args


if __name__ == "__main__":
    # --help and argument errors answer here, before torch and Lightning load (seconds)
    ARGS = parse_args()

import torch  # noqa: E402
from torch import nn  # noqa: E402

import lightning.pytorch as pl  # noqa: E402
from lightning.pytorch.callbacks import Callback, DeviceStatsMonitor  # noqa: E402
from lightning.pytorch.loggers import CSVLogger, TensorBoardLogger  # noqa: E402

from memcallbacks import MemoryMonitor  # noqa: E402
from memcallbacks._base import devices as _devices  # noqa: E402
from memcallbacks._base.devices import CpuBackend, host_rss_reader, select_backend  # noqa: E402
from memcallbacks._runtime.schedule import QUIET_FROM  # noqa: E402

FROM_BATCH = 20  # issue 45's mean of the step hooks: from batch 20 of a fit, the monitor's first steps included


# ---------------------------------------------------------------------------- the workload
class MLP(pl.LightningModule):
    """A plain classifier; logs its loss every step like a typical LightningModule."""

    def __init__(self, d_in: int, hidden: int, n_classes: int = 10) -> None:
        super().__init__()
        self.net = mlp_layers(d_in, hidden, n_classes)

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = nn.functional.cross_entropy(self.net(x), y)
        self.log("train_loss", loss)
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=1e-3)


class Batches(torch.utils.data.Dataset):
    """``length`` batches gathered from a fixed pool of samples on the device.

    Every step gets fresh tensors (one gather, as a DataLoader's collate would make them), which
    die when the step ends; ``reuse=True`` hands out the same few tensor objects again and again
    instead (a pre-batched in-memory dataset), which keeps every batch alive.
    """

    def __init__(self, x: torch.Tensor, y: torch.Tensor, batch_size: int, length: int, reuse: bool = False) -> None:
        self.x, self.y, self.batch_size, self.length = x, y, batch_size, length
        self.order = torch.randperm(len(x), generator=torch.Generator().manual_seed(0)).to(x.device)
        self.n_batches = len(x) // batch_size
        self.fixed = [self._gather(k) for k in range(self.n_batches)] if reuse else None

    def _gather(self, k: int) -> tuple[torch.Tensor, torch.Tensor]:
        idx = self.order[k * self.batch_size : (k + 1) * self.batch_size]
        return self.x[idx], self.y[idx]

    def __len__(self) -> int:
        return self.length

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        k = index % self.n_batches
        return self.fixed[k] if self.fixed is not None else self._gather(k)


def make_data(args: argparse.Namespace) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    n = 16 * args.batch_size
    device = torch.device(args.device)
    return torch.randn(n, args.d_in, generator=g).to(device), torch.randint(0, 10, (n,), generator=g).to(device)


class StepTimer(Callback):
    """Stamps the start of every timed step and the end of training; first in every callback list.

    On CUDA it synchronizes at every step end (in every variant alike). With ``plan`` set, it also
    switches callbacks in and out of ``trainer.callbacks`` between steps: ``plan`` names, for each
    block of ``block`` timed steps, the one callback of ``arms`` attached during it (or None); the
    switch replaces the list, so the hook loop in progress is not disturbed.
    """

    def __init__(
        self,
        skip_steps: int,
        synchronize: Callable[[], None] | None,
        arms: list[Callback] | None = None,
        block: int = 50,
        plan: list[Callback | None] | None = None,
    ) -> None:
        self.skip_steps = skip_steps
        self.synchronize = synchronize
        self.stamps: list[float] = []
        self.arms, self.block, self.plan = arms or [], block, plan or []

    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int) -> None:
        if trainer.global_step >= self.skip_steps:
            self.stamps.append(time.perf_counter())

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int) -> None:
        if self.synchronize is not None:
            self.synchronize()
        if not self.plan:
            return
        done = trainer.global_step - self.skip_steps  # steps completed since timing began = index of the next step
        if done >= 0 and done % self.block == 0 and done // self.block < len(self.plan):
            chosen = self.plan[done // self.block]
            others = [cb for cb in trainer.callbacks if not any(cb is arm for arm in self.arms)]
            trainer.callbacks = others + ([chosen] if chosen is not None else [])

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self.synchronize is not None:
            self.synchronize()
        self.stamps.append(time.perf_counter())

    def durations(self) -> list[float]:
        return [b - a for a, b in zip(self.stamps, self.stamps[1:])]


class _SecondMonitor(MemoryMonitor):
    """A second MemoryMonitor in one Trainer needs its own ``state_key`` (Lightning refuses two equal ones)."""


class _ThirdMonitor(MemoryMonitor):
    """The third MemoryMonitor of ``--host`` (its own ``state_key``, as :class:`_SecondMonitor`)."""


def make_callback(variant: str, output_dir: str) -> Callback | None:
    if variant == BARE:
        return None
    if variant == NOOP:
        return Callback()
    if variant == DEVICE_STATS:
        return DeviceStatsMonitor(cpu_stats=True)  # on CPU it logs nothing without cpu_stats
    if variant == MONITOR:
        return MemoryMonitor(output_dir=output_dir)
    if variant == MONITOR_EVERY_STEP:
        return MemoryMonitor(output_dir=output_dir, sample_every_n_steps=1)
    raise ValueError(f"unknown variant {variant!r}")


def fit(callbacks: list[Callback], log_every: int, steps: int, args: argparse.Namespace, batches: tuple[torch.Tensor, torch.Tensor], run_dir: str, timer: StepTimer | None = None) -> tuple[pl.Trainer, StepTimer, float]:
    """One ``Trainer.fit`` of ``args.skip_steps + steps`` steps; returns the trainer, the timer and the fit's wall time."""
    total_steps = args.skip_steps + steps
    device = torch.device(args.device)
    model = MLP(args.d_in, args.hidden).to(device)
    x, y = batches
    loader = torch.utils.data.DataLoader(Batches(x, y, args.batch_size, total_steps, reuse=args.reuse_batches), batch_size=None, shuffle=False, num_workers=0)
    logger: Any = CSVLogger(run_dir, name="logs") if args.logger == "csv" else TensorBoardLogger(run_dir, name="logs")
    timer = timer or StepTimer(args.skip_steps, torch.cuda.synchronize if device.type == "cuda" else None)
    trainer = pl.Trainer(
        accelerator=device.type,
        devices=1,
        logger=logger,
        callbacks=[timer, *callbacks],
        max_steps=total_steps,
        max_epochs=1,
        log_every_n_steps=log_every,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
    )
    gc.collect()
    t0 = time.perf_counter()
    trainer.fit(model, train_dataloaders=loader)
    fit_s = time.perf_counter() - t0
    if trainer.global_step != total_steps or len(timer.stamps) != steps + 1:
        raise RuntimeError(f"the fit ran {trainer.global_step} steps, expected {total_steps}: the benchmark is broken")
    return trainer, timer, fit_s


# ---------------------------------------------------------------------------- statistics (more in _common)
def spread(values: list[float]) -> dict[str, float]:
    """Median, IQR (one repeat's noise), min-max and the median's 95% interval (its uncertainty; None below 6 values)."""
    ci = median_ci(values)
    return {"median": statistics.median(values), "q25": quantile(values, 0.25), "q75": quantile(values, 0.75), "min": min(values), "max": max(values),
            "ci_lo": ci[0] if ci else None, "ci_hi": ci[1] if ci else None}


# ---------------------------------------------------------------------------- 1. interleaved fits
def run_fit(variant: str, log_every: int, args: argparse.Namespace, batches: tuple[torch.Tensor, torch.Tensor], workdir: str) -> dict[str, Any]:
    """One timed fit of ``variant``; for MemoryMonitor also the engine's own accounting."""
    run_dir = tempfile.mkdtemp(dir=workdir)
    extra = make_callback(variant, os.path.join(run_dir, "memcallbacks"))
    _, timer, fit_s = fit([extra] if extra is not None else [], log_every, args.steps, args, batches, run_dir)
    durations = timer.durations()
    window_s = timer.stamps[-1] - timer.stamps[0]
    out: dict[str, Any] = {
        "variant": variant,
        "log_every": log_every,
        "steps": args.steps,
        "step_us_mean": window_s / args.steps * 1e6,
        "step_us_robust": robust_step_us(durations, args.skip_steps, log_every),
        "outside_steps_s": fit_s - window_s,
    }
    if isinstance(extra, MemoryMonitor):
        # the engine times itself on sampled steps only (begin_step .. end_step: not the adapter, the logging or unsampled steps)
        out["engine_us_per_sampled_step"], out["engine_us_per_step"] = monitor_self_us(extra.summary())
        out["monitor_enabled"] = extra.enabled
    return out


def summarize_fits(runs: list[dict[str, Any]], log_settings: list[int], variants: list[str]) -> list[dict[str, Any]]:
    """Per (variant, log setting): medians over repeats of same-repeat comparisons with the bare fit."""
    rows = []
    for log_every, variant, mine, bare in paired_with_bare(runs, log_settings, variants):
        row: dict[str, Any] = {"variant": variant, "log_every": log_every, "repeats": len(mine), "step_us": statistics.median(r["step_us_mean"] for r in mine)}
        for kind in ("mean", "robust"):
            key = f"step_us_{kind}"
            row[f"ratio_{kind}"] = spread([r[key] / bare[r["repeat"]][key] for r in mine])
            row[f"delta_us_{kind}"] = statistics.median(r[key] - bare[r["repeat"]][key] for r in mine)
        row["one_off_ms"] = statistics.median((r["outside_steps_s"] - bare[r["repeat"]]["outside_steps_s"]) * 1e3 for r in mine)
        if "engine_us_per_step" in mine[0]:
            row["engine_us_per_step"] = statistics.median(r["engine_us_per_step"] for r in mine)
            row["engine_us_per_sampled_step"] = statistics.median(r["engine_us_per_sampled_step"] for r in mine)
        rows.append(row)
    return rows


def _ratio_text(s: dict[str, float]) -> str:
    return f"{s['median']:.3f} [{s['q25']:.3f}–{s['q75']:.3f}] ({s['min']:.3f}–{s['max']:.3f})"


def format_fits(rows: list[dict[str, Any]]) -> str:
    lines = [
        "| variant | log every | step µs (median) | ratio vs bare, mean step: median [IQR] (min–max) | ratio vs bare, robust | Δ µs/step mean / robust | one-off ms | engine self-time µs/step (per sampled step) |",
        "|---|---:|---:|---|---|---:|---:|---:|",
    ]
    for r in rows:
        engine = f"{r['engine_us_per_step']:.1f} ({r['engine_us_per_sampled_step']:.0f})" if "engine_us_per_step" in r else "–"
        if r["variant"] == BARE:
            lines.append(f"| {r['variant']} | {r['log_every']} | {r['step_us']:.0f} | 1 | 1 | 0 | 0 | – |")
            continue
        lines.append(
            f"| {r['variant']} | {r['log_every']} | {r['step_us']:.0f} | {_ratio_text(r['ratio_mean'])} | {_ratio_text(r['ratio_robust'])} "
            f"| {r['delta_us_mean']:+.0f} / {r['delta_us_robust']:+.0f} | {r['one_off_ms']:+.0f} | {engine} |"
        )
    return "\n".join(lines)


# ---------------------------------------------------------------------------- 2. A/B blocks in one fit
def run_ab(variant: str, log_every: int, args: argparse.Namespace, batches: tuple[torch.Tensor, torch.Tensor], workdir: str, seed: int) -> dict[str, Any]:
    """One fit alternating blocks with and without ``variant``'s callback; paired per block pair."""
    run_dir = tempfile.mkdtemp(dir=workdir)
    target = make_callback(variant, os.path.join(run_dir, "memcallbacks"))
    assert target is not None
    rng = random.Random(seed)
    plan: list[bool] = []
    for _ in range(args.ab_pairs):
        plan += [True, False] if rng.random() < 0.5 else [False, True]
    timer = StepTimer(args.skip_steps, torch.cuda.synchronize if args.device == "cuda" else None, arms=[target], block=args.block,
                      plan=[target if on else None for on in plan])
    steps = args.ab_pairs * 2 * args.block
    fit([target], log_every, steps, args, batches, run_dir, timer=timer)
    durations = timer.durations()
    logged = [is_logged(args.skip_steps + i, log_every) for i in range(steps)]
    arm = [plan[i // args.block] for i in range(steps)]
    pair_ratios, pair_deltas = [], []
    for p in range(args.ab_pairs):
        span = range(2 * p * args.block, 2 * (p + 1) * args.block)
        on = [durations[i] for i in span if arm[i]]
        off = [durations[i] for i in span if not arm[i]]
        pair_ratios.append(sum(on) / sum(off))
        pair_deltas.append((sum(on) - sum(off)) / len(on) * 1e6)
    pooled = {}
    for flag in (True, False):
        idx = [i for i in range(steps) if arm[i] is flag]
        pooled[flag] = robust_mean([durations[i] for i in idx], [logged[i] for i in idx]) * 1e6
    return {
        "variant": variant,
        "log_every": log_every,
        "pairs": args.ab_pairs,
        "block": args.block,
        "off_step_us": pooled[False],
        "ratio_pairs": spread(pair_ratios),
        "delta_us_pairs": statistics.median(pair_deltas),
        "ratio_robust": pooled[True] / pooled[False],
        "delta_us_robust": pooled[True] - pooled[False],
    }


def format_ab(rows: list[dict[str, Any]]) -> str:
    lines = [
        "| variant | log every | step µs without | ratio, per block pair: median [IQR] (min–max) | ratio, robust pooled | Δ µs/step pairs / robust |",
        "|---|---:|---:|---|---:|---:|",
    ]
    for r in rows:
        lines.append(
            f"| {r['variant']} | {r['log_every']} | {r['off_step_us']:.0f} | {_ratio_text(r['ratio_pairs'])} | {r['ratio_robust']:.3f} "
            f"| {r['delta_us_pairs']:+.1f} / {r['delta_us_robust']:+.1f} |"
        )
    return "\n".join(lines)


# ---------------------------------------------------------------------------- 3. time inside each hook
STEP_HOOKS = ("on_train_batch_start", "on_before_backward", "on_after_backward", "on_before_optimizer_step", "on_before_zero_grad", "on_train_batch_end")
ONE_OFF_HOOKS = ("setup", "on_fit_start", "on_train_start", "on_train_epoch_start", "on_train_epoch_end", "on_train_end", "on_fit_end", "teardown")
_HOOK_ARGS: dict[str, tuple[Any, ...]] = {
    "on_train_batch_start": (None, 0),
    "on_before_backward": (None,),
    "on_after_backward": (),
    "on_before_optimizer_step": (None,),
    "on_before_zero_grad": (None,),
    "on_train_batch_end": (None, None, 0),
}


class HookClock:
    """Wraps the hooks of one callback instance and records the wall time of every call."""

    def __init__(self, callback: Callback) -> None:
        self.calls: dict[str, list[float]] = {name: [] for name in STEP_HOOKS + ONE_OFF_HOOKS}
        for name, calls in self.calls.items():
            setattr(callback, name, self._wrap(calls, getattr(callback, name)))

    @staticmethod
    def _wrap(calls: list[float], hook: Callable[..., Any]) -> Callable[..., Any]:
        clock = time.perf_counter

        def timed(*args: Any, **kwargs: Any) -> Any:
            t0 = clock()
            try:
                return hook(*args, **kwargs)
            finally:
                calls.append(clock() - t0)

        return timed

    def step_us(self, hook: str, log_every: int) -> float:
        """µs per step spent in ``hook``: logged and other steps each at their median (one call per step)."""
        return robust_step_us(self.calls[hook], 0, log_every)

    def mean_step_us(self, first: int = 0) -> float:
        """µs per step over every step from the ``first`` on (all calls, logged and start-up steps alike)."""
        return sum(sum(self.calls[h][first:]) for h in STEP_HOOKS) / max(1, len(self.calls[STEP_HOOKS[0]]) - first) * 1e6

    def start_ms(self, until: int) -> float:
        """ms spent in the step hooks of the steps before ``until`` (the monitor's start-up: dense reads, measuring)."""
        return sum(sum(self.calls[h][:until]) for h in STEP_HOOKS) * 1e3


def dispatch_us_per_callback(trainer: pl.Trainer, n: int = 2000, extra: int = 4) -> float:
    """Lightning's own cost, per training step, of one more callback (the six step hooks of an empty ``Callback``)."""
    from lightning.pytorch.trainer import call

    saved = trainer.callbacks
    per_step = {}
    try:
        for k in (0, extra):
            trainer.callbacks = [Callback() for _ in range(k)]
            samples = []
            for _ in range(n):
                t0 = time.perf_counter()
                for hook in STEP_HOOKS:
                    call._call_callback_hooks(trainer, hook, *_HOOK_ARGS[hook])
                samples.append(time.perf_counter() - t0)
            per_step[k] = statistics.median(samples)
    finally:
        trainer.callbacks = saved
    return (per_step[extra] - per_step[0]) / extra * 1e6


def hook_accounting(log_every: int, args: argparse.Namespace, batches: tuple[torch.Tensor, torch.Tensor], workdir: str, rotation: int) -> dict[str, Any]:
    """One fit with an empty Callback, DeviceStatsMonitor and two MemoryMonitors side by side, every hook timed
    (with ``args.host`` a third, ``watch_host=False``: the default monitor's extra time over it is the host channel's).

    All see the same steps under the same machine load, so their times compare directly; the empty
    callback's time (the wrapper's own cost) is subtracted from the others. The first callback to
    read the kernel after the step's compute pays for cold caches, so the order is rotated between
    repeats.
    """
    run_dir = tempfile.mkdtemp(dir=workdir)
    measured = {
        DEVICE_STATS: DeviceStatsMonitor(cpu_stats=True),
        MONITOR: MemoryMonitor(output_dir=os.path.join(run_dir, "default")),
        MONITOR_EVERY_STEP: _SecondMonitor(output_dir=os.path.join(run_dir, "every_step"), sample_every_n_steps=1),
    }
    if getattr(args, "host", False):
        measured[MONITOR_NO_HOST] = _ThirdMonitor(output_dir=os.path.join(run_dir, "no_host"), watch_host=False)
    names = list(measured)
    names = names[rotation % len(names):] + names[: rotation % len(names)]
    empty = Callback()
    clocks = {NOOP: HookClock(empty), **{name: HookClock(measured[name]) for name in names}}
    trainer, timer, _ = fit([empty, *(measured[name] for name in names)], log_every, args.steps, args, batches, run_dir)
    wrapper = {h: clocks[NOOP].step_us(h, log_every) for h in STEP_HOOKS}
    dispatch = dispatch_us_per_callback(trainer)
    # the timed window's steps, less everything the four extra callbacks cost: what a bare step would take
    step_us = robust_step_us(timer.durations(), args.skip_steps, log_every)
    inside = sum(clock.step_us(h, log_every) for clock in clocks.values() for h in STEP_HOOKS)
    out: dict[str, Any] = {
        "log_every": log_every,
        "order": names,
        "wrapper_us_per_step": sum(wrapper.values()),
        "steps": len(clocks[NOOP].calls[STEP_HOOKS[0]]),
        "dispatch_us_per_callback_step": dispatch,
        "bare_step_us_estimate": step_us - inside - len(clocks) * dispatch,
    }
    for name in names:
        clock = clocks[name]
        per_hook = {h: clock.step_us(h, log_every) - wrapper[h] for h in STEP_HOOKS}
        out[name] = {
            "step_hooks_us": sum(per_hook.values()),
            "step_hooks_mean_us": clock.mean_step_us() - sum(wrapper.values()),
            "step_hooks_mean_after_start_us": clock.mean_step_us(QUIET_FROM) - sum(wrapper.values()),
            "step_hooks_mean_from_20_us": clock.mean_step_us(FROM_BATCH) - sum(wrapper.values()),
            "start_ms": clock.start_ms(QUIET_FROM) - clocks[NOOP].start_ms(QUIET_FROM),
            "per_hook_us": per_hook,
            "one_off_ms": {h: sum(clock.calls[h]) * 1e3 for h in ONE_OFF_HOOKS if clock.calls[h]},
        }
    return out


def summarize_hooks(accounts: list[dict[str, Any]], log_settings: list[int]) -> list[dict[str, Any]]:
    rows = []
    for log_every in log_settings:
        mine = [a for a in accounts if a["log_every"] == log_every]
        if not mine:
            continue
        row: dict[str, Any] = {
            "log_every": log_every,
            "runs": len(mine),
            "steps": mine[0].get("steps"),
            "dispatch_us": statistics.median(a["dispatch_us_per_callback_step"] for a in mine),
            "wrapper_us": statistics.median(a["wrapper_us_per_step"] for a in mine),
            "bare_step_us": statistics.median(a["bare_step_us_estimate"] for a in mine),
        }
        for name in (n for n in HOOK_NAMES if n in mine[0]):
            # per run: 1 + (this callback's hooks + Lightning's dispatch to it) / the bare step of the same fit
            ratios = [1 + (a[name]["step_hooks_us"] + a["dispatch_us_per_callback_step"]) / a["bare_step_us_estimate"] for a in mine]
            row[name] = {
                "accounted_ratio": statistics.median(ratios),
                "step_hooks_us": statistics.median(a[name]["step_hooks_us"] for a in mine),
                "step_hooks_mean_us": statistics.median(a[name]["step_hooks_mean_us"] for a in mine),
                "step_hooks_mean_after_start_us": statistics.median(a[name]["step_hooks_mean_after_start_us"] for a in mine),
                "step_hooks_mean_from_20_us": statistics.median(a[name]["step_hooks_mean_from_20_us"] for a in mine),
                "start_ms": statistics.median(a[name]["start_ms"] for a in mine),
                "per_hook_us": {h: statistics.median(a[name]["per_hook_us"][h] for a in mine) for h in STEP_HOOKS},
                "one_off_ms": {h: statistics.median(a[name]["one_off_ms"].get(h, 0.0) for a in mine) for h in ONE_OFF_HOOKS},
            }
        if MONITOR_NO_HOST in mine[0]:  # paired within each fit: the same steps, the same load
            row["host_channel"] = {
                "step_hooks_us": statistics.median(a[MONITOR]["step_hooks_us"] - a[MONITOR_NO_HOST]["step_hooks_us"] for a in mine),
                "step_hooks_mean_us": statistics.median(a[MONITOR]["step_hooks_mean_us"] - a[MONITOR_NO_HOST]["step_hooks_mean_us"] for a in mine),
                "share_of_monitor": statistics.median(
                    (a[MONITOR]["step_hooks_mean_us"] - a[MONITOR_NO_HOST]["step_hooks_mean_us"]) / a[MONITOR]["step_hooks_mean_us"]
                    if a[MONITOR]["step_hooks_mean_us"] > 0 else float("nan") for a in mine),
            }
        rows.append(row)
    return rows


def format_hooks(rows: list[dict[str, Any]]) -> str:
    lines = [
        f"| log every | callback | in its step hooks, µs/step: robust (mean; from step {FROM_BATCH}; from step {QUIET_FROM}) | per hook, µs/step (robust) | one-off hooks, ms; steps before {QUIET_FROM}, ms | ≈ ratio vs bare (hooks + dispatch) |",
        "|---:|---|---:|---|---|---:|",
    ]
    for r in rows:
        lines.append(f"| {r['log_every']} | Lightning's dispatch of the step hooks to one more callback (bare step ≈ {r['bare_step_us']:.0f} µs) | {r['dispatch_us']:.1f} | | | |")
        for name in (n for n in HOOK_NAMES if n in r):
            h = r[name]
            per_hook = ", ".join(f"{k.removeprefix('on_')} {v:.1f}" for k, v in h["per_hook_us"].items() if abs(v) >= 0.5)
            one_off = ", ".join([f"{k} {v:.0f}" for k, v in h["one_off_ms"].items() if v >= 0.5] + [f"steps 0-{QUIET_FROM - 1} {h['start_ms']:.1f}"])
            lines.append(f"| {r['log_every']} | {name} | {h['step_hooks_us']:.1f} ({h['step_hooks_mean_us']:.0f}; {h['step_hooks_mean_from_20_us']:.0f}; "
                         f"{h['step_hooks_mean_after_start_us']:.0f}) "
                         f"| {per_hook} | {one_off} | {h['accounted_ratio']:.3f} |")
        host = r.get("host_channel")
        if host is not None:
            lines.append(f"| {r['log_every']} | the host channel: {MONITOR} less {MONITOR_NO_HOST}, paired per fit | "
                         f"{host['step_hooks_us']:.1f} ({host['step_hooks_mean_us']:.0f}) | {100 * host['share_of_monitor']:.0f}% of "
                         f"{MONITOR}'s mean | | |")
    return "\n".join(lines)


# ---------------------------------------------------------------------------- 4. micro-benchmarks
def _time_calls(fn: Callable[[], Any], n: int, before: Callable[[], Any] | None = None) -> dict[str, float]:
    """Per-call wall time of ``fn``; ``before`` (untimed) runs ahead of every call."""
    samples = []
    clock = time.perf_counter
    for _ in range(n):
        if before is not None:
            before()
        t0 = clock()
        fn()
        samples.append(clock() - t0)
    return {"median_us": quantile(samples, 0.5) * 1e6, "p90_us": quantile(samples, 0.9) * 1e6}


def micro_benchmarks(args: argparse.Namespace) -> list[dict[str, Any]]:
    """Per-call cost of the backend's reads, back to back and right after a burst of compute."""
    device = torch.device(args.device)
    backend = select_backend(device)
    calls: dict[str, Callable[[], Any]] = {
        f"{type(backend).__name__}.baseline()": backend.baseline,
        f"{type(backend).__name__}.interval()": backend.interval,
        "host_rss_reader()()": host_rss_reader(),
    }
    if isinstance(backend, CpuBackend):  # the pieces, through private names that may move: skipped when absent
        load_mallinfo2 = getattr(_devices, "_load_mallinfo2", None)
        mallinfo2 = load_mallinfo2() if load_mallinfo2 is not None else None
        if mallinfo2 is not None:
            calls["… of which glibc mallinfo2()"] = mallinfo2
        who = getattr(_devices, "_RUSAGE_THREAD", resource.RUSAGE_SELF)
        calls["… of which getrusage(RUSAGE_THREAD)"] = lambda: resource.getrusage(who)
        clear_fd = getattr(backend, "_clear_fd", None)
        if clear_fd is not None:
            calls["… of which write '5' to /proc/self/clear_refs"] = lambda: os.write(clear_fd, b"5")
    calls["time.perf_counter() (reference)"] = time.perf_counter

    a = torch.randn(args.micro_matmul, args.micro_matmul, device=device)

    def burst() -> None:
        a @ a
        if device.type == "cuda":
            torch.cuda.synchronize()

    results = []
    for name, fn in calls.items():
        for _ in range(50):
            fn()
        idle = _time_calls(fn, args.micro_calls)
        after = _time_calls(fn, max(args.micro_calls // 5, 50), before=burst)
        results.append({"call": name, "idle_median_us": idle["median_us"], "idle_p90_us": idle["p90_us"], "after_median_us": after["median_us"], "after_p90_us": after["p90_us"]})
    backend.close()
    return results


def format_micro(results: list[dict[str, Any]], matmul: int) -> str:
    lines = [f"| call | back to back: median µs (p90) | right after a {matmul}×{matmul} matmul: median µs (p90) |", "|---|---:|---:|"]
    for r in results:
        lines.append(f"| {r['call']} | {r['idle_median_us']:.1f} ({r['idle_p90_us']:.1f}) | {r['after_median_us']:.1f} ({r['after_p90_us']:.1f}) |")
    return "\n".join(lines)


# ---------------------------------------------------------------------------- verdicts
def _three_way(lo: float | None, hi: float | None, limit: float) -> str:
    """'met' when the median's whole 95% interval is at or below ``limit``, 'MISSED' when all of it is
    above, else unresolved (the typical cost is what the target is about; the IQR, one repeat's
    noise, is printed beside it)."""
    if lo is None or hi is None:
        return "unresolved (too few repeats for a 95% interval: 6 or more are needed)"
    if hi <= limit:
        return "met"
    if lo > limit:
        return "MISSED"
    return "unresolved (the median's 95% interval spans the limit: too noisy)"


def judge(runs: list[dict[str, Any]], fit_rows: list[dict[str, Any]], ab_rows: list[dict[str, Any]], hook_rows: list[dict[str, Any]]) -> list[str]:
    """The issue's targets, answered by each measurement that can: 'met', 'MISSED' or 'unresolved'."""

    def find(rows: list[dict[str, Any]], variant: str, log_every: int) -> dict[str, Any] | None:
        return next((r for r in rows if r["variant"] == variant and r["log_every"] == log_every), None)

    lines = []
    for label, rows, ratio_key, delta_key in (
        ("interleaved fits", fit_rows, "ratio_robust", "delta_us_robust"),
        ("A/B blocks", ab_rows, "ratio_pairs", "delta_us_pairs"),
    ):
        if rows and min(r.get("repeats", r.get("pairs", 0)) for r in rows) < 3:
            lines.append(f"[{label}] too few repeats (or A/B pairs) to judge: at least 3 are needed for an IQR")
            continue
        mm = find(rows, MONITOR, TARGET_LOG_EVERY)
        if mm is not None:
            r = mm[ratio_key]
            lines.append(
                f"[{label}] {MONITOR} at log_every_n_steps={TARGET_LOG_EVERY}: ratio {r['median']:.3f}"
                + (f", 95% interval [{r['ci_lo']:.3f}–{r['ci_hi']:.3f}]" if r.get("ci_lo") is not None else "")
                + f", IQR [{r['q25']:.3f}–{r['q75']:.3f}] ≤ {TARGET_RATIO}: {_three_way(r.get('ci_lo'), r.get('ci_hi'), TARGET_RATIO)}; "
                f"{mm[delta_key]:+.0f} µs/step (limit {TARGET_US_PER_STEP:.0f})"
            )
        for log_every in sorted({r["log_every"] for r in rows}):
            mm, ds = find(rows, MONITOR, log_every), find(rows, DEVICE_STATS, log_every)
            if mm is None or ds is None:
                continue
            if rows is fit_rows:  # same-repeat pairs
                key = "step_us_robust"
                by = {(r["variant"], r["repeat"]): r[key] for r in runs if r["log_every"] == log_every}
                diffs = [by[(MONITOR, k)] - by[(DEVICE_STATS, k)] for (v, k) in by if v == MONITOR and (DEVICE_STATS, k) in by]
                # cheaper or not: the median difference's 95% confidence interval (sign test), not the
                # IQR, which is one repeat's noise; both are printed
                ci = median_ci(diffs)
                if ci is None:
                    outcome = "unresolved (too few repeats for a 95% interval: 6 or more are needed)"
                else:
                    outcome = "met" if ci[1] < 0 else "MISSED" if ci[0] > 0 else "unresolved (the median difference's 95% interval spans zero)"
                detail = (
                    f"{MONITOR} − {DEVICE_STATS} per repeat: median {statistics.median(diffs):+.1f} µs/step"
                    + (f", 95% interval [{ci[0]:+.1f}, {ci[1]:+.1f}]" if ci else "")
                    + f", IQR [{quantile(diffs, 0.25):+.1f}, {quantile(diffs, 0.75):+.1f}], lower in {sum(d < 0 for d in diffs)} of {len(diffs)}"
                ) if diffs else "no pairs"
            else:
                a, b = mm[ratio_key], ds[ratio_key]
                if a.get("ci_lo") is None or b.get("ci_lo") is None:  # separate fits, not pairs: the two medians' intervals
                    outcome = "unresolved (too few pairs for a 95% interval)"
                else:
                    outcome = "met" if a["ci_hi"] < b["ci_lo"] else "MISSED" if a["ci_lo"] > b["ci_hi"] else "unresolved (the medians' 95% intervals overlap: too noisy)"
                detail = f"ratios {a['median']:.3f} vs {b['median']:.3f}"
            lines.append(f"[{label}] {MONITOR} below {DEVICE_STATS} at log_every_n_steps={log_every}: {outcome}; {detail}")
    for r in hook_rows:
        mm, ds = r[MONITOR], r[DEVICE_STATS]
        cost = mm["step_hooks_us"] + r["dispatch_us"]
        if r["log_every"] == TARGET_LOG_EVERY:
            lines.append(
                f"[hooks + dispatch] {MONITOR} at log_every_n_steps={TARGET_LOG_EVERY}: ≈ ratio {mm['accounted_ratio']:.3f} "
                f"≤ {TARGET_RATIO}: {'met' if mm['accounted_ratio'] <= TARGET_RATIO else 'MISSED'}; {cost:.0f} µs/step "
                f"≤ {TARGET_US_PER_STEP:.0f} at this machine's speed (bare step ≈ {r['bare_step_us']:.0f} µs): {'met' if cost <= TARGET_US_PER_STEP else 'MISSED'}"
            )
        lines.append(
            f"[hooks + dispatch] {MONITOR} below {DEVICE_STATS} at log_every_n_steps={r['log_every']}: "
            f"{'met' if mm['step_hooks_us'] < ds['step_hooks_us'] else 'MISSED'}; {cost:.0f} vs {ds['step_hooks_us'] + r['dispatch_us']:.0f} µs/step"
        )
        lines.append(
            f"[hooks, mean of every step] {MONITOR} below {DEVICE_STATS} at log_every_n_steps={r['log_every']}: "
            f"from step {FROM_BATCH} (issue 45: the first steps included) "
            f"{'met' if mm['step_hooks_mean_from_20_us'] < ds['step_hooks_mean_from_20_us'] else 'MISSED'} "
            f"({mm['step_hooks_mean_from_20_us']:.0f} vs {ds['step_hooks_mean_from_20_us']:.0f} µs/step); "
            f"from step {QUIET_FROM} {'met' if mm['step_hooks_mean_after_start_us'] < ds['step_hooks_mean_after_start_us'] else 'MISSED'} "
            f"({mm['step_hooks_mean_after_start_us']:.0f} vs {ds['step_hooks_mean_after_start_us']:.0f} µs/step); over the whole fit "
            f"{'met' if mm['step_hooks_mean_us'] < ds['step_hooks_mean_us'] else 'not met'} ({mm['step_hooks_mean_us']:.0f} vs "
            f"{ds['step_hooks_mean_us']:.0f}: the monitor's start-up, {mm['start_ms']:.1f} ms once per run in steps 0-{QUIET_FROM - 1}, "
            f"the dense reads that find a leak from step 0, spread over this fit's {r.get('steps', '?')} steps)"
        )
    return lines


# ---------------------------------------------------------------------------- driver
def _source_state() -> str | None:
    """The commit measured, and whether memcallbacks/ had uncommitted changes."""
    import subprocess

    root = Path(__file__).resolve().parent.parent
    try:
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=root, capture_output=True, text=True, timeout=10).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "memcallbacks"], cwd=root, capture_output=True, text=True, timeout=10).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return None
    return f"{head}{' + uncommitted changes in memcallbacks/' if dirty else ''}" if head else None


def environment(args: argparse.Namespace) -> dict[str, Any]:
    env = {
        **base_environment(lightning=pl.__version__),
        "device": args.device,
        "logger": args.logger,
        "load_average": load_average(),
        "source": _source_state(),
    }
    if args.device == "cuda":
        env["gpu"] = torch.cuda.get_device_name()
    return env


def main(argv: list[str] | argparse.Namespace | None = None) -> int:
    args = argv if isinstance(argv, argparse.Namespace) else parse_args(argv)
    torch.set_num_threads(args.threads)
    try:
        torch.set_num_interop_threads(1)
    except RuntimeError:
        pass
    warnings.filterwarnings("ignore")
    for name in ("lightning", "lightning.pytorch", "lightning.fabric", "pytorch_lightning"):
        logging.getLogger(name).setLevel(logging.ERROR)
    env = environment(args)
    print("environment:", json.dumps(env))
    print(f"model: MLP {args.d_in}->{args.hidden}->{args.hidden}->10, batch {args.batch_size} ({'the same tensors every step' if args.reuse_batches else 'fresh tensors every step'}), AdamW, logger {args.logger}; "
          f"{args.skip_steps} untimed steps per fit; interleaved: {args.repeats} repeats of {args.steps} steps; "
          f"A/B: {args.ab_pairs} pairs of {args.block}-step blocks; hooks: {args.hook_repeats} fits per log setting"
          + (f" (with {MONITOR_NO_HOST})" if args.host else ""), flush=True)
    began = time.perf_counter()
    results = ResultFile(args.json, environment=env, args=vars(args))  # rewritten after every fit
    batches = make_data(args)
    ab: list[dict[str, Any]] = []
    accounts: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="memcallbacks-bench-") as workdir:
        # warm-up: imports, first-fit costs, matplotlib's font cache; discarded
        warm = argparse.Namespace(**{**vars(args), "steps": max(args.log_every)})
        for variant in args.variants:
            run_fit(variant, max(args.log_every), warm, batches, workdir)

        def progress(repeat: int, bare: list[dict[str, Any]]) -> None:
            print(f"interleaved repeat {repeat + 1}/{args.repeats} ({time.perf_counter() - began:.0f} s): bare step "
                  + ", ".join(f"{r['step_us_mean']:.0f} µs at log_every={r['log_every']}" for r in bare), flush=True)

        order = random.Random(args.seed)
        def measured(variant: str, log_every: int) -> dict[str, Any]:
            row = run_fit(variant, log_every, args, batches, workdir)
            results.append("interleaved_runs", row)  # the repeat number is added afterwards
            return row

        runs = interleaved_runs(measured, args.variants, args.log_every, args.repeats, order, progress)
        results.update(interleaved_runs=runs)
        t_fits = time.perf_counter()

        if args.ab_pairs:
            jobs = [(v, n) for v in AB_VARIANTS for n in args.log_every]
            order.shuffle(jobs)
            for k, (variant, log_every) in enumerate(jobs):
                ab.append(run_ab(variant, log_every, args, batches, workdir, seed=args.seed * 1000 + k))
                results.update(ab=ab)
            ab.sort(key=lambda r: (r["log_every"], AB_VARIANTS.index(r["variant"])))
            print(f"A/B fits done ({time.perf_counter() - began:.0f} s)", flush=True)
        t_ab = time.perf_counter()

        for repeat in range(args.hook_repeats):
            for log_every in args.log_every:
                accounts.append(hook_accounting(log_every, args, batches, workdir, rotation=repeat))
                results.update(hooks={"runs": accounts})
        t_hooks = time.perf_counter()

    fit_rows = summarize_fits(runs, args.log_every, args.variants) if runs else []
    hook_rows = summarize_hooks(accounts, args.log_every) if accounts else []
    if fit_rows:
        print("\n1. interleaved fits (ratio: this variant's step time / the bare fit's of the same repeat; "
              "robust: each class of step at its median):\n")
        print(format_fits(fit_rows))
    if ab:
        print("\n2. A/B blocks inside one fit (the callback swapped in and out every block; ratio: with / without):\n")
        print(format_ab(ab))
    if hook_rows:
        print("\n3. time inside each callback's step hooks (all side by side in one fit, wrapper cost subtracted), "
              "amortized over every step; Lightning's dispatch comes on top for any callback:\n")
        print(format_hooks(hook_rows))
    micro: list[dict[str, Any]] = []
    if not args.no_micro:
        micro = micro_benchmarks(args)
        print(f"\n4. per-call cost of the {args.device} backend's reads:\n")
        print(format_micro(micro, args.micro_matmul))
    verdicts = judge(runs, fit_rows, ab, hook_rows)
    if verdicts:
        print("\ntargets:")
        for line in verdicts:
            print("  " + line)
    end = time.perf_counter()
    timings = {"interleaved_s": t_fits - began, "ab_s": t_ab - t_fits, "hooks_s": t_hooks - t_ab, "micro_s": end - t_hooks, "total_s": end - began}
    print("\nwall time: " + ", ".join(f"{k} {v:.0f}" for k, v in timings.items())
          + f"; load average at end: {load_average() or '?'}")
    if args.json:
        results.payload.pop("interleaved_runs", None)  # the finished file has them under "interleaved"
        results.finish(timings=timings, verdicts=verdicts, interleaved={"runs": runs, "summary": fit_rows}, ab=ab,
                       hooks={"runs": accounts, "summary": hook_rows}, micro=micro)
        print(f"saved {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main(ARGS))
