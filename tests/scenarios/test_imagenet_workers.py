"""An ImageNet-style script at defaults: what the monitor costs its DataLoader workers, read from outside.

``tests/scripts/imagenet_style.py`` (an ImageFolder of JPEGs decoded with PIL, 4 training and 4 evaluation
workers, an evaluation inside ``monitor.evaluate()`` after every epoch, 3 epochs) runs bare and with a
default ``Monitor`` side by side, each in a process of its own; this process reads every worker's USS
(``/proc/<pid>/smaps_rollup``) every 0.2 s. With the monitor, each worker's peak USS is within 8 MiB of the
same worker's without it (workers paired in the order they start; per-epoch evaluation workers live a batch
each, so there each worker's peak is compared with the bare run's largest and the medians with each other), and
the run has no problem finding.

``--armed``: the parent's collector is a few thousand objects short of a full collection when the workers
start, as timm's ``train.py`` leaves it (12,000 short there, of which the monitor's own objects took 5,400),
and each worker builds a small table at its start. A bare run's workers then each collect the heap they
inherited and copy it (the jump from ~15 to ~120 MiB a worker reported on timm); a monitored run's start
their collector afresh (``memcallbacks.host.forked``) and do not.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from helpers import open_problems
from PIL import Image
from torch import nn
from torch.utils.data import DataLoader, Dataset
from worker_procs import children, cmdline

from memcallbacks import Monitor
from memcallbacks.host.readers import smaps_rollup

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "imagenet_style.py"
MIB = 2**20
pytestmark = pytest.mark.skipif(not os.path.exists("/proc/self/smaps_rollup"), reason="needs Linux smaps_rollup")


@pytest.fixture(scope="module")
def images(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("imagefolder")


def _faults(pid: int) -> int | None:
    """The process's page faults so far (``/proc/<pid>/stat`` minflt + majflt: microseconds, against ~10-30 ms for
    its ``smaps_rollup``): a page becomes private to a worker through a fault in it."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            data = f.read()
        fields = data[data.rindex(b")") + 2:].split()
        return int(fields[7]) + int(fields[9])
    except (OSError, ValueError, IndexError):
        return None


TICK_S, EVERY_S, PAGE = 0.2, 3.0, 4096
"""Every 0.2 s each worker's faults are counted; its USS is read when they could have made 1 MiB or a sixteenth of
its last USS private since its last read, and every 3 s (a page the parent writes after the fork can become
private to a worker without a fault in it): the peaks of reading every 0.2 s, at a fraction of the CPU (16
workers' ``smaps_rollup`` every 0.2 s took about a core on 2 shared ones)."""


def run_side_by_side(tmp_path: Path, images: Path, runs: dict[str, list[str]], timeout_s: float = 420,
                     read: bool = True) -> dict[str, Any]:
    """Start every run at once; until all end, read each one's DataLoader workers' USS (its children running the
    same command line at every read: the monitor's writer process is not one, even where a read caught it between its
    fork and its exec; see :data:`TICK_S`). Per run: its result.json and
    its workers' peak USS in the order they started (none where ``read`` is off)."""
    procs, peaks, order, last = {}, {}, {}, {}
    for name, extra in runs.items():
        out = tmp_path / name
        cmd = [sys.executable, str(SCRIPT), str(out), "--data", str(images), *extra]
        procs[name] = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        peaks[name], order[name] = {}, []
    deadline = time.monotonic() + timeout_s
    while any(p.poll() is None for p in procs.values()) and time.monotonic() < deadline:
        now = time.monotonic()
        for name, proc in procs.items():
            if not read or proc.poll() is not None:
                continue
            parent = cmdline(proc.pid)
            for child in children(proc.pid):
                line = cmdline(child)
                if not line:  # gone, or a zombie (its command line is empty): its peak stays
                    continue
                if line != parent:  # not a worker: the monitor's writer, also one caught between its fork and exec
                    if peaks[name].pop(child, None) is not None:  # (a full run once read it as a 227.7 MiB "worker")
                        order[name].remove(child)
                    continue
                faults = _faults(child)
                seen = last.get(child)
                if faults is None or (seen is not None and (faults - seen[0]) * PAGE < max(MIB, seen[2] // 16)
                                      and now - seen[1] < EVERY_S):
                    continue
                uss = (smaps_rollup(child) or {}).get("uss")
                if uss is not None:
                    last[child] = (faults, now, uss)
                    if child not in peaks[name]:
                        order[name].append(child)
                    peaks[name][child] = max(uss, peaks[name].get(child, 0))
        time.sleep(TICK_S)
    results = {}
    for name, proc in procs.items():
        if proc.poll() is None:
            proc.kill()
        output = proc.communicate()[0]
        assert proc.returncode == 0, f"{name}: {output[-3000:]}"
        result = json.loads((tmp_path / name / "result.json").read_text())
        report = tmp_path / name / "memcallbacks" / "report.json"
        result["report"] = json.loads(report.read_text()) if report.exists() else None
        result["peaks"] = [peaks[name][pid] for pid in order[name]]
        result["output"] = output
        results[name] = result
    return results


def _mib(values: list[int]) -> list[float]:
    return [round(v / MIB, 1) for v in values]


@pytest.mark.parametrize("persistent", [True, False], ids=["persistent", "per-epoch"])
def test_the_monitor_costs_its_workers_no_memory(tmp_path: Path, images: Path, persistent: bool) -> None:
    flags = ["--persistent"] if persistent else []
    runs = run_side_by_side(tmp_path, images, {"bare": flags, "monitored": [*flags, "--monitor"]})
    bare, monitored = runs["bare"]["peaks"], runs["monitored"]["peaks"]
    seen = f"with the monitor {_mib(monitored)} MiB, without {_mib(bare)} MiB"
    # per-epoch evaluation workers live a batch each: a 0.2 s sampler may miss some, so pairs only where all were seen
    assert len(bare) >= 8 and len(monitored) >= 8, seen
    assert max(monitored) <= max(bare) + 8 * MIB and statistics.median(monitored) <= statistics.median(bare) + 8 * MIB, seen
    if len(bare) == len(monitored):
        assert all(m <= b + 8 * MIB for b, m in zip(bare, monitored)), seen
    report = runs["monitored"]["report"]
    assert open_problems(report) == [], [f["message"] for f in open_problems(report)]
    assert report["host"]["workers"]["uss_reads"] >= 4, report["host"]["workers"]  # the workers were watched


@pytest.mark.skipif(sys.version_info >= (3, 14), reason="arms CPython 3.8-3.13's rule for a full collection")
def test_workers_do_not_collect_the_heap_a_monitored_parent_left_close_to_a_collection(tmp_path: Path, images: Path) -> None:
    small = ["--persistent", "--armed", "--epochs", "1", "--workers", "2"]  # the collection is at each worker's start
    runs = run_side_by_side(tmp_path, images, {"bare": small, "monitored": [*small, "--monitor"]})
    bare, monitored = runs["bare"]["peaks"], runs["monitored"]["peaks"]
    # the test is armed: a bare worker collects the heap it inherited and copies it
    assert statistics.median(bare) >= max(monitored) + 32 * MIB, (_mib(bare), _mib(monitored))
    report = runs["monitored"]["report"]
    assert open_problems(report) == [], [f["message"] for f in open_problems(report)]


def test_a_cache_filled_inside_the_workers_is_still_found(tmp_path: Path, images: Path) -> None:
    runs = run_side_by_side(tmp_path, images, {"cache": ["--persistent", "--cache", "--monitor"]}, read=False)
    found = [f for f in runs["cache"]["report"]["findings"] if f["kind"] == "worker_growth"]
    assert found, runs["cache"]["output"][-2000:]
    f = found[0]
    assert f["details"]["cause"] == "inside_workers", f["details"]
    assert "ImageFolderJpeg" in f["message"] or any(w["dataset"] == "ImageFolderJpeg" for w in f["details"]["workers"])
    assert f["details"]["cache_attributes"] == ["ImageFolderJpeg.decoded"], f["details"]
    assert "`ImageFolderJpeg.decoded` is empty" in f["message"], f["message"]


class Jpegs(Dataset):
    """The user's shape (issue 44.0): small JPEGs decoded with PIL into float tensors; ``cache``: each one kept in
    ``self.decoded``, filled in ``__getitem__`` (in each worker, over the first epoch of persistent workers)."""

    def __init__(self, root: Path, cache: bool) -> None:
        self.paths = sorted(str(p) for p in root.glob("*.jpg"))
        self.cache = cache
        self.decoded: dict[int, torch.Tensor] = {}

    def __len__(self) -> int:
        return len(self.paths)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, int]:
        if i in self.decoded:
            return self.decoded[i], i % 2
        with Image.open(self.paths[i]) as img:
            image = torch.from_numpy(np.asarray(img.convert("RGB"), dtype=np.float32) / 255).permute(2, 0, 1).contiguous()
        if self.cache:
            self.decoded[i] = image  # 108 KiB an item: 400 of them, 21.6 MiB a worker an epoch
        return image, i % 2


@pytest.fixture(scope="module")
def jpegs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("jpegs")
    rng = np.random.default_rng(0)
    for i in range(400):
        Image.fromarray(rng.integers(0, 255, (96, 96, 3), dtype=np.uint8)).save(root / f"{i}.jpg", quality=90)
    return root


@pytest.mark.parametrize("cache", [True, False], ids=["cache", "clean"])
def test_a_pil_decode_cache_in_persistent_workers_is_found_at_defaults_in_fast_steps(tmp_path: Path, jpegs: Path,
                                                                                    cache: bool) -> None:
    """Steps of a few ms, the monitor's quiet stretches 50 steps long: the workers' faults are still counted every
    few steps, and the cache (a kept share of ~0.5: each batch is faulted into shared memory too) is found by the
    Dataset's container empty in the parent, in the first epoch, before it fills (75 steps: 3 epochs of 25)."""
    loader = DataLoader(Jpegs(jpegs, cache), batch_size=16, shuffle=True, num_workers=2, persistent_workers=True)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.ReLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(8, 2))
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-2)
    monitor = Monitor(model, optimizer, output_dir=str(tmp_path / "mem"), plot=False)
    try:
        for _ in range(3):
            for x, y in monitor.track(loader):
                nn.functional.cross_entropy(model(x), y).backward()
                optimizer.step()
                optimizer.zero_grad()
    finally:
        monitor.close()
        iterator = loader._iterator
        if iterator is not None:
            iterator._shutdown_workers()
    report = json.loads((tmp_path / "mem" / "report.json").read_text())
    found = [f for f in report["findings"] if f["kind"] == "worker_growth"]
    workers = report["host"]["workers"]
    if not cache:
        assert found == [] and open_problems(report) == [], [f["message"] for f in report["findings"]]
        assert workers["uss_reads"] >= 4, workers  # the workers were watched
        return
    assert found, (workers, [f["message"] for f in report["findings"]])
    f = found[0]
    assert f["first_step"] <= 50, f  # in 75 steps, the cache still filling (each worker's holds 3/4 of it by the end)
    assert f["details"]["cause"] == "inside_workers", f["details"]
    assert f["details"]["cache_attributes"] == ["Jpegs.decoded"], f["details"]
    assert {w["dataset"] for w in f["details"]["workers"]} == {"Jpegs"}, f["details"]
    assert "`Jpegs.decoded` is empty" in f["message"], f["message"]
