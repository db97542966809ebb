"""The host growth test on real Python-object leaks in real (small) CPU training loops.

Each run is a process of its own (tests/scripts/host_leak.py says why). Targets from issue 23:
a 256 KiB/step leak of Python objects found within 40 steps, 64 KiB/step within 300; caches that
fill and then stop leave no open finding."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from memcallbacks._base.units import KiB, MiB
from memcallbacks.host import HostGrowth, HostReading

SCRIPT = Path(__file__).parents[1] / "scripts" / "host_leak.py"


def run(scenario: str, steps: int) -> dict:
    proc = subprocess.run([sys.executable, str(SCRIPT), scenario, str(steps)], capture_output=True, text=True, timeout=240,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_256_kib_per_step_of_python_objects_is_found_within_40_steps():
    out = run("spec:512", 44)  # 512 dataclass objects a step: ~250 KiB by tracemalloc
    assert out["found"] is not None and out["found"] <= 40, out
    finding = out["findings"]["host_growth"]
    assert finding["kind"] == "host_growth" and finding["details"]["open"] is True
    assert 128 * KiB <= finding["details"]["rate_bytes_per_step"] <= 1024 * KiB, finding
    assert "lru_cache(maxsize=...)" in finding["message"]
    assert "host_growth:native" not in out["findings"], out["findings"]  # Python objects explain the climb


@pytest.mark.parametrize("scenario", ["spec:134", "floats:560"])
def test_64_kib_per_step_is_found_within_300_steps(scenario):
    out = run(scenario, 300)
    assert out["found"] is not None and out["found"] < 300, out
    assert out["open"] == ["host_growth"], out


def test_warm_up_then_flat_caches_leave_no_open_finding():
    out = run("warm", 320)
    assert out["open"] == [], out
    # figures for the per-rank gather are there and sane
    assert out["figures"]["host_private_bytes"] > 10 * MiB
    assert out["reads"] == 320


def test_a_cache_that_fills_then_stops_is_found_then_settled():
    out = run("fill", 260)  # a bounded lru_cache filling at ~250 KiB/step from step 10 to 70
    assert out["found"] is not None and out["found"] < 70, out  # while it fills it is growth
    assert out["open"] == [], out  # once full and flat, the finding is settled
    settled = [e for e in out["events"] if e["open"] is False]
    # settled only after a plateau at least as long as the growth it saw (docs/findings.md, "The lifecycle"): the
    # cache filled from step 10 to 70; the growth test's first window starts a few steps after its warm-up (16-22)
    assert settled and 70 + 50 <= settled[0]["step"] <= 260, out["events"]
    details = out["findings"]["host_growth"]["details"]
    assert details["settled_at_step"] == settled[0]["step"]
    assert details["flat_steps"] >= details["grew_steps"] >= 45, details
    assert 66 <= details["last_rise_step"] <= 90, details  # the last rise is the cache's last fill, not a later creep


def test_a_climb_that_stops_is_settled_and_a_new_climb_reopens_it():
    # the rule's arithmetic on a synthetic series (no process memory involved): 4 MiB/step for 40 steps, flat, then again
    growth = HostGrowth()
    seen = []
    for step in range(260):
        rising = min(step, 40) + max(0, step - 200)
        f = growth.update(HostReading(step, 0, 200 * MiB + rising * 4 * MiB, 1000 + rising * 65536))
        if f is not None:
            seen.append((step, f.details.get("open")))
    opened = [s for s, o in seen if o]
    settled = [s for s, o in seen if o is False]
    assert opened and opened[0] < 40, seen
    assert settled and 72 <= settled[0] < 120, seen
    assert any(s > 200 for s in opened), seen  # growing again re-opens it
    assert [f.key for f in growth.open_findings] == ["host_growth"]


def test_bad_parameters_name_the_parameter_and_the_fix():
    with pytest.raises(ValueError, match=r"bytes_per_block=0"):
        HostGrowth(bytes_per_block=0)
