"""Pre-flight in the monitor on CPU: the first batch's step predicted before it runs, then compared with every measured step.

    python examples/preflight_monitor_cpu.py

Trains a small MLP for 8 steps with ``Monitor(..., preflight=True)`` and prints the pre-flight's
lines of the report: per phase, the predicted rise above the step start against the largest
measured one (CPU peaks are RSS high-water marks; ``AdvancedOptions(cpu_mmap_threshold=...)`` gives freed tensors back
to the OS so the RSS follows tensor lifetimes). Then the same loop with ``capacity_bytes`` set
below the predicted peak: the warning comes before the first forward runs.
"""

from __future__ import annotations

import logging

import torch
from torch import nn
from torch.nn import functional as F

from memcallbacks import AdvancedOptions, Monitor

logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")


def train(steps: int = 8, **monitor_kwargs: object) -> Monitor:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(256, 1024), nn.GELU(), nn.Linear(1024, 1024), nn.GELU(), nn.Linear(1024, 10))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    data = [(torch.randn(2048, 256), torch.randint(0, 10, (2048,))) for _ in range(steps)]
    monitor = Monitor(model, optimizer, preflight=True, write_files=False, sample_every_n_steps=1,
                      advanced=AdvancedOptions(cpu_mmap_threshold="1 MiB"), **monitor_kwargs)
    for x, y in monitor.track(data):
        F.cross_entropy(model(x), y).backward()
        optimizer.step()
        optimizer.zero_grad()
    monitor.close()
    return monitor


if __name__ == "__main__":
    report = train().format_report().splitlines()
    start = next(i for i, line in enumerate(report) if "pre-flight" in line)
    print("\n".join(report[start : start + 5]))
    print("\nwith capacity_bytes=40 MiB:")
    train(steps=2, capacity_bytes=40 << 20)
