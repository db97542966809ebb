"""The overhead budget on a nanoGPT-style loop: bare wall time against a monitored run, and what the
monitor says it cost.

The loop is modelled on nanoGPT's ``train.py`` (not copied): a small GPT-like model whose forward
returns ``(logits, loss)``, gradient accumulation with ``loss = loss / k`` (which rebinds ``loss``,
so the model's own loss tensor dies while its graph lives on through the divided one), the next
batch fetched between forward and backward, and ``logits`` left alive until the next forward.
A plain :class:`memcallbacks.Monitor` watches it at default settings, wired as a nanoGPT user would
(two lines: construct with the model and optimizer, ``close()`` at the end).

Usage::

    python benchmarks/nanogpt_budget.py                 # 3 interleaved runs of 300 steps
    python benchmarks/nanogpt_budget.py --quick         # 2 runs of 120 steps
    python benchmarks/nanogpt_budget.py --control       # two bare loops: the method's error
    python benchmarks/nanogpt_budget.py --json out.json

Each run trains the bare loop and the monitored loop in this process, one optimizer step each in
turn, every step timed (:func:`interleaved`); the ratio of their summed step times sits next to the
monitor's own time (report.json's ``summary.cadence.own_time_s``, by part) over the bare loop's time,
and its budget. Results: docs/benchmarks.md, "nanoGPT-style loop: the budget".

The tests import :func:`train` from here (``tests/runtime/test_budget_promise.py``).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import sys
import tempfile
import time
from typing import Any

import torch
from torch import nn
from torch.nn import functional as F


class Block(nn.Module):
    def __init__(self, n_embd: int, n_head: int, block_size: int) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(n_embd)
        self.attn = nn.Linear(n_embd, 3 * n_embd)
        self.proj = nn.Linear(n_embd, n_embd)
        self.ln_2 = nn.LayerNorm(n_embd)
        self.mlp = nn.Sequential(nn.Linear(n_embd, 4 * n_embd), nn.GELU(), nn.Linear(4 * n_embd, n_embd))
        self.n_head = n_head

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = self.attn(self.ln_1(x)).split(c, dim=2)
        q, k, v = (z.view(b, t, self.n_head, c // self.n_head).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(y.transpose(1, 2).contiguous().view(b, t, c))
        return x + self.mlp(self.ln_2(x))


class TinyGPT(nn.Module):
    """A GPT-like model (token and position embeddings, pre-norm blocks, tied head) returning ``(logits, loss)``."""

    def __init__(self, vocab_size: int = 65, block_size: int = 32, n_layer: int = 2, n_head: int = 2, n_embd: int = 64) -> None:
        super().__init__()
        self.wte = nn.Embedding(vocab_size, n_embd)
        self.wpe = nn.Embedding(block_size, n_embd)
        self.blocks = nn.ModuleList(Block(n_embd, n_head, block_size) for _ in range(n_layer))
        self.ln_f = nn.LayerNorm(n_embd)
        self.lm_head = nn.Linear(n_embd, vocab_size, bias=False)
        self.lm_head.weight = self.wte.weight

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
        t = idx.shape[1]
        x = self.wte(idx) + self.wpe(torch.arange(t, device=idx.device))
        for block in self.blocks:
            x = block(x)
        logits = self.lm_head(self.ln_f(x))
        loss = None if targets is None else F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1))
        return logits, loss


def make_data(n_tokens: int = 20_000, vocab_size: int = 65, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(vocab_size, (n_tokens,), generator=g)


def get_batch(data: torch.Tensor, batch_size: int, block_size: int, g: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    ix = torch.randint(len(data) - block_size - 1, (batch_size,), generator=g)
    x = torch.stack([data[i : i + block_size] for i in ix.tolist()])
    y = torch.stack([data[i + 1 : i + 1 + block_size] for i in ix.tolist()])
    return x, y


def setup(seed: int, block_size: int, monitor_kwargs: dict[str, Any] | None) -> tuple[nn.Module, torch.optim.Optimizer, torch.Tensor, torch.Generator, Any]:
    """Model, optimizer, data and batch generator of one loop, seeded; with ``monitor_kwargs`` (not
    None) a plain ``Monitor(model, optimizer, **monitor_kwargs)`` at defaults otherwise."""
    torch.manual_seed(seed)
    g = torch.Generator().manual_seed(seed)
    data = make_data(seed=seed)
    model = TinyGPT(block_size=block_size)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    monitor = None
    if monitor_kwargs is not None:
        from memcallbacks import Monitor

        monitor = Monitor(model, optimizer, **monitor_kwargs)
    return model, optimizer, data, g, monitor


def step(model: nn.Module, optimizer: torch.optim.Optimizer, data: torch.Tensor, g: torch.Generator,
         batch: tuple[torch.Tensor, torch.Tensor], accumulation: int, batch_size: int, block_size: int) -> tuple[Any, ...]:
    """One optimizer step of the loop, as nanoGPT's ``train.py`` writes it; returns the next batch and
    the last micro-step's ``logits`` and ``loss``, which the caller keeps until the next step's forward."""
    X, Y = batch
    for _micro in range(accumulation):
        logits, loss = model(X, Y)
        loss = loss / accumulation  # rebinds `loss`: the model's own loss tensor dies, its graph lives on
        X, Y = get_batch(data, batch_size, block_size, g)  # the next batch, fetched between forward and backward
        loss.backward()
    nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return (X, Y), logits, loss


def train(
    steps: int,
    *,
    monitored: bool,
    accumulation: int = 4,
    batch_size: int = 8,
    block_size: int = 32,
    output_dir: str | None = None,
    monitor_kwargs: dict[str, Any] | None = None,
    seed: int = 0,
) -> dict[str, Any]:
    """Run ``steps`` optimizer steps of the nanoGPT-style loop; the wall time of the steps, and the
    monitor's cadence summary (report.json's ``summary.cadence``) when ``monitored``."""
    model, optimizer, data, g, monitor = setup(seed, block_size, {"output_dir": output_dir, **(monitor_kwargs or {})} if monitored else None)
    batch = get_batch(data, batch_size, block_size, g)
    c0 = time.process_time()
    t0 = time.perf_counter()
    for _ in range(steps):
        batch, logits, loss = step(model, optimizer, data, g, batch, accumulation, batch_size, block_size)
        lossf = loss.item() * accumulation  # noqa: F841 (nanoGPT logs it)
    wall = time.perf_counter() - t0
    cpu = time.process_time() - c0
    result: dict[str, Any] = {"wall_s": wall, "cpu_s": cpu, "steps": steps}
    if monitor is not None:
        monitor.close()
        report = monitor.report()
        result["cadence"] = report["summary"]["cadence"]
        result["findings"] = [f["kind"] for f in report["findings"]]
        result["monitor"] = monitor
    del logits, loss
    return result


def interleaved(steps: int, output_dir: str, *, accumulation: int = 4, batch_size: int = 8, block_size: int = 32,
                monitored: bool = True, seed: int = 0) -> dict[str, Any]:
    """The bare loop and the monitored loop in one process, one optimizer step each in turn (ABBA
    order), each step timed: the machine's drift, which moved whole runs by 10-30% between pairs on
    the shared box, falls on both alike (two bare loops measured so: 1.001). ``monitored=False``
    is that control. Returns the per-step times and the monitor's cadence summary."""
    clock = time.perf_counter
    loops = []
    for watch in (False, monitored):
        model, optimizer, data, g, monitor = setup(seed, block_size, {"output_dir": output_dir} if watch else None)
        loops.append({"parts": (model, optimizer, data, g), "monitor": monitor, "times": [],
                      "batch": get_batch(data, batch_size, block_size, g), "kept": None})
    for i in range(steps):
        for loop in (loops if i % 2 == 0 else loops[::-1]):
            t0 = clock()
            batch, logits, loss = step(*loop["parts"], loop["batch"], accumulation, batch_size, block_size)
            loss.item()
            loop["times"].append(clock() - t0)
            loop["batch"], loop["kept"] = batch, (logits, loss)  # logits alive until the next forward
            del logits, loss
    out: dict[str, Any] = {"bare_s": loops[0]["times"], "monitored_s": loops[1]["times"]}
    monitor = loops[1]["monitor"]
    if monitor is not None:
        monitor.close()
        out["cadence"] = monitor.report()["summary"]["cadence"]
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--runs", type=int, default=3, help="interleaved runs (each a fresh pair of loops)")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--quick", action="store_true", help="2 runs of 120 steps")
    parser.add_argument("--control", action="store_true", help="two bare loops: the method's own error (expect 1.00)")
    parser.add_argument("--heap-objects", type=int, default=300_000,
                        help="extra small objects kept alive, as a real script's heap (nanoGPT's: imports, data, tokenizer)")
    parser.add_argument("--json", help="also write every run's numbers here")
    args = parser.parse_args(argv)
    if args.quick:
        args.steps, args.runs = 120, 2
    torch.set_num_threads(args.threads)
    heap = [(i, str(i)) for i in range(args.heap_objects)]  # noqa: F841 (kept alive: a big heap makes heap scans cost what they cost in real scripts)
    runs: list[dict[str, Any]] = []
    ok = True
    with tempfile.TemporaryDirectory() as tmp:
        train(20, monitored=False)  # warm-up
        for run in range(args.runs):
            gc.collect()
            r = interleaved(args.steps, os.path.join(tmp, f"run{run}"), monitored=not args.control)
            bare, mon = sum(r["bare_s"]), sum(r["monitored_s"])
            excess_us = (mon - bare) / args.steps * 1e6
            line = f"run {run}: bare {bare:.3f} s, monitored {mon:.3f} s: ratio {mon / bare:.4f}, {excess_us:+.0f} µs/step"
            row = {"bare_s": bare, "monitored_s": mon, "ratio": mon / bare, "excess_us_per_step": excess_us}
            c = r.get("cadence")
            if c is not None:
                # the monitor's step time here includes the other loop's step (they alternate): its own
                # time is set against the bare loop's time instead
                own = c["own_time_s"] / bare
                row.update(own_fraction=own, own_us_per_step=c["own_time_s"] / args.steps * 1e6, cadence=c)
                line += (f"; own time {c['own_time_s'] / args.steps * 1e6:.0f} µs/step = {100 * own:.2f}% of the bare step "
                         f"(budget {100 * c['overhead_budget']:g}%), by part {c['own_time_by_part_s']}")
                # agreement: the excess the bare loop measures is within the own time plus one budget
                ok = ok and mon / bare - 1 <= own + c["overhead_budget"]
            runs.append(row)
            print(line, flush=True)
    ratios = sorted(r["ratio"] for r in runs)
    print(f"\nmedian ratio {ratios[len(ratios) // 2]:.4f} over {len(runs)} interleaved runs of {args.steps} steps")
    if not args.control:
        owns = sorted(r["own_fraction"] for r in runs)
        print(f"median own time {100 * owns[len(owns) // 2]:.2f}% of the bare step; agreement (excess within own time "
              f"plus one budget, every run): {'ok' if ok else 'NOT ok'}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"runs": runs}, f, indent=1, default=str)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
