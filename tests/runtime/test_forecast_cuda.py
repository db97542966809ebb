"""When device memory runs out, on CUDA: a plain loop keeps 16 MiB of device tensors a step under a per-process
memory fraction of 2 GiB; the growth finding's forecast names the device's capacity and, 20 steps or more
before ``torch.OutOfMemoryError``, a step within 20% of the one that failed.

Written against torch's sources (``c10/cuda/CUDACachingAllocator.cpp``): with a fraction set, a ``cudaMalloc``
that would take the allocator's reserved bytes past ``fraction x total`` fails after its cached blocks are
released, so the room is the capacity less what is allocated; ``torch.cuda.mem_get_info``'s free bytes bound
it where other processes hold the device. Run by ``scripts/gpu_check.sh`` (the ``cuda`` marker)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from helpers import CUDA_LIMIT
from memcallbacks import Monitor

pytestmark = [pytest.mark.cuda, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]
LEAK = 16 << 20


def test_a_device_leak_is_forecast_against_the_device_capacity(cuda_limited: None, tmp_path: Path) -> None:
    model = nn.Sequential(nn.Linear(1024, 1024), nn.ReLU(), nn.Linear(1024, 1)).cuda()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    kept: list[torch.Tensor] = []
    forecasts: list[tuple[int, dict[str, Any]]] = []  # (step, the growth finding's forecast then)
    reached = -1
    with pytest.raises(torch.OutOfMemoryError):
        with Monitor(model, optimizer, output_dir=str(tmp_path), plot=False) as monitor:
            for step, x in enumerate(monitor.track(torch.randn(64, 1024, device="cuda") for _ in range(10_000))):
                reached = step
                model(x).pow(2).mean().backward()
                optimizer.step()
                optimizer.zero_grad()
                kept.append(torch.ones(LEAK // 4, device="cuda"))
                growth = [f for f in monitor.findings if f.kind == "growth" and f.details.get("runs_out")]
                if growth:
                    forecasts.append((step, growth[0].details["runs_out"]))
    del kept
    ahead = [(step, f) for step, f in forecasts if step <= reached - 20]
    assert ahead, (reached, forecasts[-3:])
    for step, forecast in ahead:
        assert forecast["limit_source"] == "device" and forecast["limit_bytes"] == pytest.approx(CUDA_LIMIT, rel=0.01), forecast
        assert abs(forecast["step"] - reached) <= 0.2 * reached, (step, forecast, reached)
    assert ahead[0][1]["rate_bytes_per_step"] == pytest.approx(LEAK, rel=0.05)
