"""At DEFAULT settings, the step at which each adapter reports a leak of each rate (issue 11, item 4).

Each run is a real CPU training run of a small MLP (256 -> 512 -> 1, batch 128, a few ms per step) under
each adapter (Lightning with and without a logger, the plain ``Monitor`` with and without ``log_fn``,
Accelerate, the Transformers ``Trainer``), with one planted leak from step 0: a written tensor of
``rate`` bytes appended to a list every step. The monitor is built with no arguments beyond where
to write its files. The step counted is the growth finding's ``first_step`` (the warm-up counts
against the monitor).

``--start N`` plants the leak at step N instead (a leak that begins after the first steps, when
the monitor reads memory only every few steps on a short CPU step); the step counted is then the
number of steps from the leak's start to the finding.

Every run is its own Python process, as a user's training run is: in one process, the heap a
previous run's leak freed would be refilled by the next run's leak before the resident set moves.

Run alone (``python benchmarks/detection_adapters.py [--quick] [--start N]``) or as part of ``detection.py``.
"""

from __future__ import annotations

import argparse
import json
import logging
import subprocess
import sys
import tempfile
import time
import warnings
from pathlib import Path
from typing import Any, Callable


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="skip the 64 KiB/step rate (the longest runs)")
    parser.add_argument("--start", type=int, default=0, help="the step at which the leak begins (default 0)")
    parser.add_argument("--one", nargs=3, metavar=("ADAPTER", "RATE", "STEPS"), help=argparse.SUPPRESS)  # one run (a child process)
    return parser.parse_args(argv)


if __name__ == "__main__":
    # --help and argument errors answer here, before torch loads (seconds)
    ARGS = parse_args()

import torch  # noqa: E402
from torch import nn  # noqa: E402

KiB, MiB = 1024, 1024 * 1024
DIM, BATCH = 256, 128
# the targets: (rate, found within this many steps of the leak's start)
TARGETS = [(4 * MiB, 12), (1 * MiB, 20), (256 * KiB, 35), (64 * KiB, 300)]


def _mlp() -> nn.Module:
    return nn.Sequential(nn.Linear(DIM, 512), nn.ReLU(), nn.Linear(512, 1))


def _leak(rate: int) -> torch.Tensor:
    return torch.ones(rate // 4)  # written: its pages are really in use


def _first_growth(findings: list[Any]) -> int | None:
    for f in findings:
        if f.kind == "growth":
            return f.first_step if f.first_step is not None else f.step
    return None


START = 0  # the step at which the leak begins (--start)


def _first_growth_after(findings: list[Any]) -> int | None:
    step = _first_growth(findings)
    return None if step is None else step - START


def run_lightning(rate: int, steps: int, workdir: Path, logger: bool) -> int | None:
    import lightning.pytorch as L
    from lightning.pytorch.loggers import CSVLogger

    from memcallbacks import MemoryMonitor

    kept: list[torch.Tensor] = []

    class Leaky(L.Callback):
        def on_train_batch_end(self, trainer: Any, *args: Any) -> None:
            if trainer.global_step > START:
                kept.append(_leak(rate))

    class Net(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = _mlp()

        def training_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
            return self.net(batch).pow(2).mean()

        def configure_optimizers(self) -> Any:
            return torch.optim.AdamW(self.parameters(), lr=1e-3)

    mon = MemoryMonitor(output_dir=str(workdir / "mem"), plot=False)
    trainer = L.Trainer(accelerator="cpu", devices=1, max_steps=steps, default_root_dir=str(workdir),
                        logger=CSVLogger(str(workdir), name="csv") if logger else False, callbacks=[mon, Leaky()],
                        enable_progress_bar=False, enable_model_summary=False, enable_checkpointing=False)
    trainer.fit(Net(), torch.utils.data.DataLoader(torch.randn(steps * BATCH, DIM), batch_size=BATCH))
    return _first_growth_after(mon.findings)


def _plain_loop(monitor: Any, model: nn.Module, optimizer: Any, steps: int, rate: int, backward: Callable[[Any], None]) -> None:
    kept: list[torch.Tensor] = []
    for step, x in enumerate(monitor.track(list(torch.randn(steps, BATCH, DIM)))):
        backward(model(x).pow(2).mean())
        optimizer.step()
        optimizer.zero_grad()
        if step >= START:
            kept.append(_leak(rate))
    monitor.close()


def run_plain(rate: int, steps: int, workdir: Path, log_fn: bool) -> int | None:
    from memcallbacks import Monitor

    model = _mlp()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    monitor = Monitor(model, optimizer, (lambda metrics, step: None) if log_fn else None, output_dir=str(workdir / "mem"), plot=False)
    _plain_loop(monitor, model, optimizer, steps, rate, lambda loss: loss.backward())
    return _first_growth_after(monitor.findings)


def run_accelerate(rate: int, steps: int, workdir: Path) -> int | None:
    import accelerate

    from memcallbacks.accelerate import AccelerateMemoryMonitor

    accelerator = accelerate.Accelerator(cpu=True, project_dir=str(workdir))
    model = _mlp()
    model, optimizer = accelerator.prepare(model, torch.optim.AdamW(model.parameters(), lr=1e-3))
    monitor = AccelerateMemoryMonitor(accelerator, plot=False)
    try:
        _plain_loop(monitor, model, optimizer, steps, rate, accelerator.backward)
    finally:
        accelerator.end_training()
    return _first_growth_after(monitor.findings)


def run_transformers(rate: int, steps: int, workdir: Path) -> int | None:
    from transformers import Trainer, TrainerCallback, TrainingArguments

    from memcallbacks.transformers import MemoryMonitorCallback

    kept: list[torch.Tensor] = []

    class Leaky(TrainerCallback):
        def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            if state.global_step > START:
                kept.append(_leak(rate))

    class Net(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.net = _mlp()

        def forward(self, x: torch.Tensor) -> dict[str, torch.Tensor]:
            return {"loss": self.net(x).pow(2).mean()}

    args = TrainingArguments(output_dir=str(workdir / "out"), use_cpu=True, report_to=[], max_steps=steps, per_device_train_batch_size=BATCH,
                             save_strategy="no", disable_tqdm=True, dataloader_num_workers=0, learning_rate=1e-3, optim="adamw_torch")
    monitor = MemoryMonitorCallback(output_dir=str(workdir / "mem"), plot=False)
    data = [{"x": row} for row in torch.randn(steps * BATCH, DIM)]
    Trainer(model=Net(), args=args, train_dataset=data, callbacks=[monitor, Leaky()]).train()
    return _first_growth_after(monitor.findings)


ADAPTERS: dict[str, Callable[[int, int, Path], int | None]] = {
    "Lightning, CSVLogger": lambda r, n, d: run_lightning(r, n, d, logger=True),
    "Lightning, logger=False": lambda r, n, d: run_lightning(r, n, d, logger=False),
    "plain Monitor, log_fn": lambda r, n, d: run_plain(r, n, d, log_fn=True),
    "plain Monitor, no log_fn": lambda r, n, d: run_plain(r, n, d, log_fn=False),
    "Accelerate": run_accelerate,
    "Transformers Trainer": run_transformers,
}


def _label(rate: int) -> str:
    return f"{rate // MiB} MiB" if rate >= MiB else f"{rate // KiB} KiB"


def _run_alone(name: str, rate: int, steps: int) -> int | None:
    """One run in a fresh interpreter (this file with ``--one``): the step it found the leak at."""
    command = [sys.executable, str(Path(__file__).resolve()), "--one", name, str(rate), str(steps), "--start", str(START)]
    done = subprocess.run(command, capture_output=True, text=True, check=True)
    return json.loads(done.stdout.strip().splitlines()[-1])["step"]


def bench_adapters(quick: bool = False) -> list[dict[str, Any]]:
    """One run per (adapter, rate), each in its own process; prints the table and returns its rows."""
    targets = TARGETS[:3] if quick else TARGETS
    print(f"\n## Steps from the leak's start to its finding at DEFAULT settings, per adapter (leak from step {START}; target in brackets)")
    print("| adapter | " + " | ".join(f"{_label(r)}/step (≤ {w})" for r, w in targets) + " |")
    print("|---|" + "---|" * len(targets))
    rows = []
    for name in ADAPTERS:
        cells = []
        for rate, within in targets:
            t0 = time.perf_counter()
            step = _run_alone(name, rate, START + within + 40)
            seconds = time.perf_counter() - t0
            rows.append({"adapter": name, "rate": rate, "within": within, "step": step, "seconds": round(seconds, 1)})
            ok = step is not None and step <= within
            cells.append(f"{'not found' if step is None else step} {'✓' if ok else '✗'}")
        print(f"| {name} | " + " | ".join(cells) + " |", flush=True)
    return rows


def main(argv: list[str] | argparse.Namespace | None = None) -> None:
    args = argv if isinstance(argv, argparse.Namespace) else parse_args(argv)
    global START
    START = args.start
    if args.one is None:
        bench_adapters(args.quick)
        return
    warnings.simplefilter("ignore")
    import lightning.pytorch  # noqa: F401  (imported first: importing it resets its loggers' levels)

    for name in ("lightning", "lightning.pytorch", "lightning.fabric", "memcallbacks"):
        logging.getLogger(name).setLevel(logging.ERROR)
    torch.set_num_threads(1)
    name, rate, steps = args.one
    with tempfile.TemporaryDirectory(prefix="memcallbacks-detect-") as tmp:
        step = ADAPTERS[name](int(rate), int(steps), Path(tmp))
    print(json.dumps({"step": step}))


if __name__ == "__main__":
    main(ARGS)
