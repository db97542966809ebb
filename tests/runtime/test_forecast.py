"""When memory runs out (``memcallbacks/_runtime/forecast.py``): the growth findings' forecast against this
machine's real limits, said again when it moves, withdrawn when the growth settles; the logged key;
the host channel's findings; no forecast on a clean run.

The detectors are fed synthetic baselines (as tests/leaks does) or a real plain loop leaks; the limits
are the machine's own (MemAvailable here, a cgroup or RLIMIT_AS where one applies)."""

from __future__ import annotations

import logging
import math
from pathlib import Path
from typing import Any, Iterator

import pytest
import torch
from torch import nn

from memcallbacks import Monitor, MonitorConfig
from memcallbacks._base.config import settings_of
from memcallbacks._runtime.finding_sink import FindingSink
from memcallbacks._runtime.forecast import Forecast
from memcallbacks._runtime.sampling import MemoryEngine
from memcallbacks._runtime.schedule import Schedule
from memcallbacks.host.growth import HostGrowth, HostReading
from memcallbacks.leaks.growth import GrowthDetector

MIB = 1 << 20
BASE = 1 << 30
LOGGER = "memcallbacks.test_forecast"


@pytest.fixture
def forecast() -> Iterator[Forecast]:
    config = settings_of(MonitorConfig())
    engine = MemoryEngine(config)
    engine.start("cpu")
    yield Forecast(engine, Schedule(config), owner="Monitor", logger=logging.getLogger(LOGGER))
    engine.stop()


def forecast_lines(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == LOGGER]


def check_arithmetic(runs_out: dict[str, Any]) -> None:
    """The forecast is the room at its read, less the step's transient, over the rate."""
    left = math.floor((runs_out["room_bytes"] - runs_out["transient_bytes"]) / runs_out["rate_bytes_per_step"])
    assert runs_out["step"] == runs_out["at_step"] + max(0, left), runs_out
    assert runs_out["room_bytes"] == min(runs_out["rooms"].values())


def test_a_growth_that_accelerates_moves_the_forecast_and_says_so(forecast: Forecast, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING, logger=LOGGER)
    detector = GrowthDetector()
    detector.forecast = forecast.device
    level, seen = BASE, []
    for step in range(120):
        level += MIB if step < 50 else 8 * MIB  # 1 MiB/step, then 8 MiB/step
        finding = detector.update(step, level)
        if finding is not None:
            seen.append(finding)
    first, last = seen[0], seen[-1]
    assert first.step < 30 and first.details["runs_out"] is not None
    slow, fast = first.details["runs_out"], last.details["runs_out"]
    check_arithmetic(slow)
    check_arithmetic(fast)
    assert slow["rate_bytes_per_step"] == pytest.approx(MIB, rel=0.05)
    assert fast["rate_bytes_per_step"] == pytest.approx(8 * MIB, rel=0.05)
    assert fast["steps_left"] < slow["steps_left"] / 4  # the end came closer
    assert "Memory runs out at about step" in first.message and f"{slow['step']:,}" in first.message
    # the raising warning carries the first forecast; the move is said once more, not at every update
    lines = forecast_lines(caplog)
    moved = [line for line in lines if "forecast (it said step" in line]
    assert 1 <= len(moved) <= 3, lines
    assert f"it said step {slow['step']:,}" in moved[0] and "8.0 MiB/step" in moved[-1]
    assert forecast.steps_out == fast["step"]


def test_a_growth_that_settles_withdraws_its_forecast(forecast: Forecast, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING, logger=LOGGER)
    detector = GrowthDetector()
    detector.forecast = forecast.device
    sink = FindingSink("Monitor", logging.getLogger(LOGGER), lambda: 0)  # what the run logs of its findings
    level, findings = BASE, []
    for step in range(160):
        level += 512 * 1024 if step < 40 else 0  # a cache that fills for 40 steps, then stays
        finding = detector.update(step, level)
        if finding is not None:
            findings.append(finding)
            sink.add(finding)
    assert findings[0].state == "open" and findings[0].details["runs_out"] is not None
    settled = findings[-1]
    assert settled.state == "settled" and settled.details["runs_out"] is None
    assert "runs out" not in settled.message
    assert math.isnan(forecast.steps_out) and not forecast.open
    # the raising warning said the forecast: the withdrawal is said once, with the step it had said, in the line
    # that says the growth settled (one cause, one line)
    said = findings[0].details["runs_out"]["step"]
    assert settled.details["runs_out_withdrawn"] == said
    withdrawn = [line for line in forecast_lines(caplog) if "withdrawn" in line or "settled at" in line]
    assert len(withdrawn) == 1, withdrawn
    assert withdrawn[0].endswith(f"not a leak unless it grows again; the forecast that memory runs out at about step {said:,} is withdrawn."), withdrawn


def test_a_withdrawal_gives_back_the_forecast_a_line_said(forecast: Forecast, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING, logger=LOGGER)
    first = forecast.device(20, 2 * MIB, False)  # a finding raised without a forecast, which now has one
    assert first is not None
    assert any(f"growth finding's forecast: Memory runs out at about step {first['step']:,}" in line and "at this rate (2.0 MiB/step)" in line
               for line in forecast_lines(caplog))
    # withdrawn: the detector's settled finding carries it, and its settled line says it (no line of the forecast's own)
    withdrawn = forecast.device(60, 0.0, False)
    assert withdrawn is not None and withdrawn["step"] == first["step"]
    assert not any("withdrawn" in line for line in forecast_lines(caplog))
    assert math.isnan(forecast.steps_out) and forecast.device(61, 0.0, False) is None  # nothing stands: nothing to withdraw


def host_reading(step: int, private: int, blocks: int | None) -> HostReading:
    return HostReading(step, private + 64 * MIB, private, blocks)


def test_a_host_growth_forecast_counts_the_resident_rate(forecast: Forecast) -> None:
    """A host channel finding (a GPU run's host leak) is forecast against the host's limits, at the private
    resident memory's rate; settled, withdrawn."""
    growth = HostGrowth(device_is_host=False)
    growth.forecast = forecast.host
    found = []
    for step in range(200):
        private = 500 * MIB + min(step, 60) * 2 * MIB  # 2 MiB/step of Python objects for 60 steps, then flat
        blocks = (4_000_000 + min(step, 60) * 32_768) if step % 4 == 0 else None  # 64 B a block: 2 MiB/step
        finding = growth.update(host_reading(step, private, blocks))
        if finding is not None:
            found.append(finding)
    raised = next(f for f in found if f.state == "open")
    runs_out = raised.details["runs_out"]
    assert runs_out is not None and runs_out["limit_source"] in ("memory_available", "cgroup", "rlimit_as")
    assert runs_out["rate_bytes_per_step"] == pytest.approx(2 * MIB, rel=0.1)
    check_arithmetic(runs_out)
    assert "Memory runs out at about step" in raised.message
    assert found[-1].state == "settled" and found[-1].details["runs_out"] is None
    assert isinstance(found[-1].details.get("runs_out_withdrawn"), int)  # the step it had said, for the settled line
    assert not forecast.open and math.isnan(forecast.steps_out)


def test_under_rlimit_as_the_address_space_rate_counts_where_it_is_faster() -> None:
    """The address space can grow faster than the resident memory (freed blocks stay mapped): against RLIMIT_AS the
    faster rate counts, and the sentence says whose rate it is; other limits keep the growth's rate."""
    from memcallbacks._base.limits import Room, runs_out, runs_out_text

    rooms = [Room("memory_available", 20_000 * MIB, 400 * MIB), Room("rlimit_as", 1400 * MIB, 800 * MIB)]
    plain = runs_out(9, 2 * MIB, rooms)
    assert (plain["limit_source"], plain["steps_left"], plain["rate_of"]) == ("rlimit_as", 300, ""), plain
    fast = runs_out(9, 2 * MIB, rooms, rates={"rlimit_as": 12 * MIB})
    assert (fast["limit_source"], fast["steps_left"], fast["rate_bytes_per_step"], fast["rate_of"]) == ("rlimit_as", 50, 12 * MIB, "address space")
    assert "at this rate (12.0 MiB/step of address space)" in runs_out_text(fast), runs_out_text(fast)
    slower = runs_out(9, 2 * MIB, rooms, rates={"rlimit_as": MIB})  # slower than the growth: the growth's counts
    assert slower == plain
    # the limit reached first, not the one with the least room: 600 MiB of address space at 12 MiB a step is gone
    # before 500 MiB of a cgroup at 2
    both = runs_out(0, 2 * MIB, [Room("cgroup", 1000 * MIB, 500 * MIB), Room("rlimit_as", 1400 * MIB, 800 * MIB)],
                    rates={"rlimit_as": 12 * MIB})
    assert (both["limit_source"], both["steps_left"]) == ("rlimit_as", 50), both


def test_the_forecast_measures_the_address_space_rate_over_its_reads(forecast: Forecast, monkeypatch: pytest.MonkeyPatch) -> None:
    """The forecast's reads of the host limits give the address space's own rate (first read to latest)."""
    from memcallbacks._base import limits
    from memcallbacks._runtime import forecast as forecast_module

    def rooms(self: Any) -> list[limits.Room]:
        step = reads[0]
        reads[0] += 8
        return [limits.Room("memory_available", 20_000 * MIB, 400 * MIB), limits.Room("rlimit_as", 2000 * MIB, (800 + 12 * step) * MIB)]

    reads = [0]
    monkeypatch.setattr(limits.HostLimits, "rooms", rooms)
    monkeypatch.setattr(forecast_module, "REREAD_S", 0.0)
    first = forecast.host("host_growth", 0, 2 * MIB, True)
    assert first["rate_of"] == "" and first["steps_left"] == 600  # one read: the growth's rate
    later = forecast.host("host_growth", 8, 2 * MIB, False)
    assert later["rate_of"] == "address space" and later["rate_bytes_per_step"] == 12 * MIB, later
    assert later["steps_left"] == (2000 - 800 - 96) * MIB // (12 * MIB), later


# ---------------------------------------------------------------------- a real plain loop: the logged key
def leaky_loop(tmp_path: Path, leak: int, steps: int = 60) -> tuple[Monitor, list[tuple[int, dict[str, float]]]]:
    logged: list[tuple[int, dict[str, float]]] = []
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    kept = []
    monitor = Monitor(model, optimizer, lambda metrics, step: logged.append((step, dict(metrics))), output_dir=str(tmp_path),
                      log_every_n_steps=10, console_summary=False, plot=False)
    for x in monitor.track(torch.randn(32, 64) for _ in range(steps)):
        model(x).pow(2).mean().backward()
        optimizer.step()
        optimizer.zero_grad()
        if leak:
            kept.append(torch.ones(leak // 4))
    monitor.close()
    return monitor, logged


def test_the_steps_left_are_logged_while_a_growth_is_open(tmp_path: Path) -> None:
    monitor, logged = leaky_loop(tmp_path, 2 * MIB)
    growth = next(f for f in monitor.findings if f.kind == "growth")
    runs_out = growth.details["runs_out"]
    assert growth.state == "open" and runs_out is not None
    left = {step: m["memory/runs_out_in_steps"] for step, m in logged if "memory/runs_out_in_steps" in m}
    assert sorted(left) == [s for s, _ in logged if s >= growth.first_step], logged  # every logged step since the finding
    for step, value in left.items():
        assert value > 0 and value == pytest.approx(runs_out["step"] - step, rel=0.2), (step, value, runs_out)
    report = (tmp_path / "report.json").read_text()
    assert '"runs_out": {' in report  # report.json carries it through the finding
    assert "Memory runs out at about step" in monitor.format_report()


def test_a_clean_run_forecasts_nothing(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO)
    monitor, logged = leaky_loop(tmp_path, 0)
    assert logged and not any("memory/runs_out_in_steps" in m for _, m in logged)
    assert not any("runs out" in r.getMessage() for r in caplog.records)
    assert not monitor.findings


def test_a_clean_lightning_fit_at_defaults_logs_no_forecast(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """Lightning at defaults with its TensorBoard logger: the key is in the default list, and absent."""
    import lightning.pytorch as L

    from helpers import BoringModel, random_loader, tensorboard_scalars, trainer_kwargs
    from memcallbacks import MemoryMonitor

    caplog.set_level(logging.INFO)
    monitor = MemoryMonitor()
    trainer = L.Trainer(**trainer_kwargs(tmp_path, logger=True, max_steps=60, log_every_n_steps=20, callbacks=[monitor]))
    trainer.fit(BoringModel(), random_loader(batches=60))
    scalars = tensorboard_scalars(tmp_path / "lightning_logs")
    assert "memory/findings" in scalars and "memory/runs_out_in_steps" not in scalars, sorted(scalars)
    assert not any("runs out" in r.getMessage() for r in caplog.records)
    assert not [f for f in monitor.findings if f.kind == "growth"]


RANKS = '''
import json, math, os, sys
import torch.distributed as dist
import torch.multiprocessing as mp
from memcallbacks import MonitorConfig
from memcallbacks._base.config import settings_of
from memcallbacks._runtime.sampling import MemoryEngine


def run(rank, out, port):
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    try:
        engine = MemoryEngine(settings_of(MonitorConfig()))
        engine.start("cpu", rank=rank, world_size=2)
        both = engine.log_values(None, {"memory/runs_out_in_steps": 100.0 if rank == 0 else 30.0, "memory/findings": float(rank)})
        one = engine.log_values(None, {"memory/runs_out_in_steps": math.nan if rank == 0 else 40.0, "memory/findings": 0.0})
        none = engine.log_values(None, {"memory/runs_out_in_steps": math.nan, "memory/findings": 0.0})
        engine.stop()
        with open(os.path.join(out, f"rank{rank}.json"), "w") as f:
            json.dump({"both": both, "one": one, "none": none}, f)
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    mp.spawn(run, args=(sys.argv[1], int(sys.argv[2])), nprocs=2)
'''


def test_the_steps_left_meet_as_the_minimum_over_ranks(tmp_path: Path) -> None:
    """Two gloo ranks: the rank that runs out first is the one logged; a rank with no forecast does not count."""
    import json
    import os
    import subprocess
    import sys

    from helpers import free_port

    script = tmp_path / "ranks.py"
    script.write_text(RANKS)
    root = Path(__file__).resolve().parents[2]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(root) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    proc = subprocess.run([sys.executable, str(script), str(tmp_path), str(free_port())], env=env, capture_output=True,
                          text=True, timeout=240)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    for rank in range(2):
        got = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert got["both"]["memory/runs_out_in_steps"] == 30.0 and got["both"]["memory/findings"] == 1.0, got
        assert got["one"]["memory/runs_out_in_steps"] == 40.0, got
        assert "memory/runs_out_in_steps" not in got["none"], got
