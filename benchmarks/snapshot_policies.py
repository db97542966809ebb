"""Step-time cost of each ``auto_snapshot`` recording policy, against a bare loop and the monitor alone.

A plain PyTorch loop trains a small Transformer encoder (hundreds of allocations per step, which is
what allocator-history recording pays for). Variants, interleaved in shuffled order every round:

- ``bare``: no monitor;
- ``monitor``: ``Monitor`` without auto snapshots;
- ``off`` / ``armed`` / ``always``: ``auto_snapshot=True`` with that ``snapshot.policy``. No
  threshold is crossed, so ``armed`` never starts recording: its cost is the trigger checks alone;
  ``always`` records the allocator's history (Python stacks, ring buffer) on every allocation;
- ``armed (recording)``: ``armed`` after a trigger armed it, i.e. while it records: the cost a run
  pays between the first warning sign and the dump.

Each block times ``--steps`` steps (one ``synchronize`` at each end) after ``--warmup`` steps; each
variant's per-step time is divided by the bare block of the same round. Also reported: the one-off
cost of a dump (``_dump_snapshot`` of the ring buffer) and of rendering its offline summary.

    python benchmarks/snapshot_policies.py                  # CUDA when available, else a CPU smoke run
    python benchmarks/snapshot_policies.py --quick --json out.json

Results and how to read them: docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import json
import platform
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--device", default=None, help="default: cuda when available, else cpu")
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--quick", action="store_true", help="3 rounds of 20 steps, a smaller model")
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)
    if args.device is None:
        import torch  # here, not above: --help answers before torch loads

        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    return args


if __name__ == "__main__":
    # --help and argument errors answer here, before torch loads (seconds)
    ARGS = parse_args()

import torch  # noqa: E402
from torch import nn  # noqa: E402

import memcallbacks  # noqa: E402
from memcallbacks import Monitor  # noqa: E402
import memcallbacks.snapshot as _snapshot  # noqa: E402

VARIANTS = ["bare", "monitor", "off", "armed", "always", "armed (recording)"]


def make_model(device: torch.device, quick: bool) -> tuple[nn.Module, torch.Tensor]:
    if device.type == "cuda":
        d_model, layers, batch, seq = (512, 4, 8, 128) if quick else (1024, 6, 16, 256)
    else:
        d_model, layers, batch, seq = (64, 2, 4, 32)
    torch.manual_seed(0)
    layer = nn.TransformerEncoderLayer(d_model, nhead=8, dim_feedforward=4 * d_model, batch_first=True, dropout=0.1)
    model = nn.TransformerEncoder(layer, num_layers=layers, enable_nested_tensor=False).to(device)
    data = torch.randn(batch, seq, d_model, device=device)
    return model, data


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def train_steps(model: nn.Module, optimizer: torch.optim.Optimizer, data: torch.Tensor, n: int) -> None:
    for _ in range(n):
        out = model(data)
        loss = out.float().pow(2).mean()
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)


def allocations_per_step(model: nn.Module, optimizer: torch.optim.Optimizer, data: torch.Tensor, device: torch.device) -> int | None:
    if device.type != "cuda":
        return None
    sync(device)
    before = torch.cuda.memory_stats(device)["allocation.all.allocated"]
    train_steps(model, optimizer, data, 5)
    sync(device)
    return (torch.cuda.memory_stats(device)["allocation.all.allocated"] - before) // 5


def run_block(variant: str, model: nn.Module, optimizer: torch.optim.Optimizer, data: torch.Tensor, args: argparse.Namespace, workdir: str) -> float:
    """Seconds per step for one block of ``variant``."""
    device = data.device
    monitor = None
    if variant != "bare":
        kwargs: dict[str, Any] = {"log_every_n_steps": 50, "plot": False, "output_dir": workdir}
        if variant != "monitor":
            policy = "armed" if variant.startswith("armed") else variant
            kwargs.update(auto_snapshot=True, snapshot={"policy": policy, "capacity_fraction": 0.99})
        monitor = Monitor(model, optimizer, **kwargs)
        if variant == "armed (recording)" and device.type == "cuda":
            monitor._session.snap._record()  # what a step above 80% of the threshold does
    try:
        train_steps(model, optimizer, data, args.warmup)
        sync(device)
        t0 = time.perf_counter()
        train_steps(model, optimizer, data, args.steps)
        sync(device)
        return (time.perf_counter() - t0) / args.steps
    finally:
        if monitor is not None:
            monitor.close(gather=False)


def dump_cost(model: nn.Module, optimizer: torch.optim.Optimizer, data: torch.Tensor, args: argparse.Namespace, workdir: str) -> dict[str, float] | None:
    """Record ``--steps`` steps, then time one dump of the ring buffer and one render of it."""
    if data.device.type != "cuda":
        return None
    _snapshot.start_recording(100_000)
    try:
        train_steps(model, optimizer, data, args.steps)
        sync(data.device)
        t0 = time.perf_counter()
        path = _snapshot.dump_snapshot(Path(workdir) / "bench.pickle", trigger="benchmark")
        t1 = time.perf_counter()
    finally:
        _snapshot.stop_recording()
    snap = _snapshot.load_snapshot(path)
    t2 = time.perf_counter()
    _snapshot.render_snapshot(snap, Path(workdir) / "bench.html")
    t3 = time.perf_counter()
    entries = sum(len(t) for t in snap["device_traces"])
    return {"dump_s": t1 - t0, "render_s": t3 - t2, "entries": entries, "bytes": Path(path).stat().st_size}


def summarize(blocks: list[dict[str, Any]]) -> list[dict[str, Any]]:
    rows = []
    for variant in VARIANTS:
        ratios, per_step = [], []
        for r in sorted({b["round"] for b in blocks}):
            bare = next(b["s_per_step"] for b in blocks if b["round"] == r and b["variant"] == "bare")
            mine = [b["s_per_step"] for b in blocks if b["round"] == r and b["variant"] == variant]
            if mine:
                ratios.append(mine[0] / bare)
                per_step.append(mine[0])
        if not ratios:
            continue
        q = statistics.quantiles(ratios, n=4) if len(ratios) >= 2 else [ratios[0]] * 3
        rows.append({
            "variant": variant, "median_ratio": statistics.median(ratios), "q1": q[0], "q3": q[2],
            "median_ms_per_step": statistics.median(per_step) * 1e3, "rounds": len(ratios),
        })
    return rows


def main(argv: list[str] | argparse.Namespace | None = None) -> None:
    args = argv if isinstance(argv, argparse.Namespace) else parse_args(argv)
    if args.quick:
        args.rounds, args.steps = 3, 20
    device = torch.device(args.device)
    model, data = make_model(device, args.quick)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    train_steps(model, optimizer, data, 3)  # optimizer state, cuBLAS handles, autotuning
    allocs = allocations_per_step(model, optimizer, data, device)

    blocks: list[dict[str, Any]] = []
    rng = random.Random(0)
    variants = VARIANTS if device.type == "cuda" else [v for v in VARIANTS if v != "armed (recording)"]
    with tempfile.TemporaryDirectory() as workdir:
        for r in range(args.rounds):
            order = list(variants)
            rng.shuffle(order)
            for variant in order:
                blocks.append({"round": r, "variant": variant, "s_per_step": run_block(variant, model, optimizer, data, args, workdir)})
        dump = dump_cost(model, optimizer, data, args, workdir)

    rows = summarize(blocks)
    env = {
        "python": platform.python_version(), "torch": torch.__version__, "memcallbacks": memcallbacks.__version__,
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor() or "cpu",
        "allocations_per_step": allocs, "rounds": args.rounds, "steps": args.steps,
    }
    print(f"# auto_snapshot policy cost on {env['device']} (torch {env['torch']}); {allocs or '?'} allocations/step")
    print()
    print("| variant | step time / bare (median) | IQR | ms/step (median) |")
    print("|---|---|---|---|")
    for row in rows:
        print(f"| {row['variant']} | {row['median_ratio']:.3f} | {row['q1']:.3f}-{row['q3']:.3f} | {row['median_ms_per_step']:.2f} |")
    if dump:
        print()
        print(f"one dump of {dump['entries']} trace entries: {dump['dump_s'] * 1e3:.0f} ms, {dump['bytes'] / 2**20:.1f} MiB; "
              f"offline render: {dump['render_s']:.2f} s")
    if args.json:
        Path(args.json).write_text(json.dumps({"env": env, "summary": rows, "blocks": blocks, "dump": dump}, indent=1))


if __name__ == "__main__":
    sys.exit(main(ARGS))
